"""Tests for labkit.memory: static accounting (params, grads, optimizer state) and PeakMemory.

Every expected value is rebuilt here from shapes and element sizes (numel * element_size),
never read back from labkit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from labkit.memory import (PeakMemory, grad_bytes, memory_report, optimizer_state_bytes, param_bytes,
                           tensor_bytes)
from labkit.models import GPT, GPTConfig, ToyModel, toy_loss


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def unique_params(model: nn.Module) -> list[torch.Tensor]:
    """Every Parameter object once, found without relying on parameters()' own de-duplication."""
    seen, out = set(), []
    for _, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def gpt_param_count(cfg: GPTConfig) -> int:
    """Closed form for labkit.models.GPT with biases: embeddings, blocks, final norm, head."""
    E, V, T, L = cfg.n_embd, cfg.vocab_size, cfg.block_size, cfg.n_layer
    per_block = (2 * E                    # ln_1
                 + E * 3 * E + 3 * E      # c_attn
                 + E * E + E              # attn.c_proj
                 + 2 * E                  # ln_2
                 + E * 4 * E + 4 * E      # c_fc
                 + 4 * E * E + E)         # mlp.c_proj
    head = 0 if cfg.tie_weights else V * E
    return V * E + T * E + L * per_block + 2 * E + head


def toy_step(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
    toy_loss(model, x, y).backward()


def gpt_step(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    idx = torch.randint(cfg.vocab_size, (2, cfg.block_size), generator=gen)
    _, loss = model(idx, idx)
    loss.backward()


# ----------------------------------------------------------------------------- param_bytes


def test_param_bytes_counts_a_tied_weight_once():
    tied, untied = GPT(GPTConfig(tie_weights=True)), GPT(GPTConfig(tie_weights=False))
    assert tied.lm_head.weight is tied.wte.weight, "GPT(tie_weights=True) should share one Parameter"
    cfg = tied.config
    f32 = torch.empty((), dtype=torch.float32).element_size()

    want = nbytes(unique_params(tied))
    assert want == gpt_param_count(cfg) * f32, "the closed-form parameter count disagrees with the model"
    assert param_bytes(tied) == want, f"param_bytes(tied GPT) = {param_bytes(tied)}, want {want}"
    with_duplicates = nbytes(p for _, p in tied.named_parameters(remove_duplicate=False))
    assert with_duplicates - want == cfg.vocab_size * cfg.n_embd * f32, "the tie should be the only duplicate"

    want_untied = gpt_param_count(untied.config) * f32
    assert param_bytes(untied) == want_untied == nbytes(unique_params(untied))
    assert param_bytes(untied) - param_bytes(tied) == cfg.vocab_size * cfg.n_embd * f32, (
        "untying lm_head should add exactly one vocab x n_embd matrix")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_param_bytes_toy_model(dtype):
    model = ToyModel(d_in=8, d_hidden=16, d_out=8).to(dtype)
    size = torch.empty((), dtype=dtype).element_size()
    # shared [16, 8], bias_in [16], frozen W [16, 16] + b [16], bias_out [8], unused [16]
    numel = 16 * 8 + 16 + 16 * 16 + 16 + 8 + 16
    assert nbytes(unique_params(model)) == numel * size
    assert param_bytes(model) == numel * size, (
        f"param_bytes(ToyModel {dtype}) = {param_bytes(model)}, want {numel} values x {size} B "
        f"(frozen and unused parameters count, the 'scale' buffer does not)")


def test_tensor_bytes_counts_each_storage_once():
    x, y = torch.zeros(10, 3, dtype=torch.float64), torch.zeros(7, dtype=torch.int16)
    want = x.numel() * x.element_size() + y.numel() * y.element_size()
    assert tensor_bytes([x, x.view(-1), x[2:5], {"again": x.t()}, (y, [y])]) == want
    assert tensor_bytes([]) == 0 and tensor_bytes(None) == 0


# ----------------------------------------------------------------------------- grad_bytes


def test_grad_bytes_toy_model():
    model = ToyModel()
    assert grad_bytes(model) == 0, "no backward yet: no gradient should exist"
    toy_step(model)
    assert model.frozen.weight.grad is None and model.frozen.bias.grad is None, "frozen params got a grad"
    assert model.unused.grad is None, "the unused param got a grad"
    trainable_used = [model.shared, model.bias_in, model.bias_out]
    want = nbytes(trainable_used)
    assert grad_bytes(model) == want, (
        f"grad_bytes after backward = {grad_bytes(model)}, want {want}: shared, bias_in, bias_out only")
    toy_step(model, seed=1)  # accumulating into existing grads allocates nothing new
    assert grad_bytes(model) == want
    model.zero_grad(set_to_none=True)
    assert grad_bytes(model) == 0, "grads were set to None"


def test_grad_bytes_gpt_tied():
    model = GPT(GPTConfig(tie_weights=True))
    assert grad_bytes(model) == 0
    gpt_step(model)
    # every GPT parameter is trainable and used; the tied one has a single .grad
    assert all(p.grad is not None for p in unique_params(model))
    assert grad_bytes(model) == nbytes(unique_params(model)) == param_bytes(model)


# ----------------------------------------------------------------------------- optimizer state


def independent_state_bytes(optimizer) -> int:
    return sum(t.nbytes for state in optimizer.state.values() for t in state.values()
               if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("make_model, step", [(ToyModel, toy_step), (lambda: GPT(GPTConfig()), gpt_step)],
                         ids=["toy", "gpt-tied"])
@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.AdamW])
def test_adam_state_bytes(make_model, step, opt_cls):
    model = make_model()
    opt = opt_cls(model.parameters(), lr=1e-3)
    assert optimizer_state_bytes(opt) == 0, "no step yet: no state"
    step(model)
    opt.step()

    with_grads = [p for p in unique_params(model) if p.grad is not None]
    assert {id(p) for p in opt.state} == {id(p) for p in with_grads}, \
        "Adam should hold state exactly for the parameters that had a gradient"
    step_counter = opt.state[with_grads[0]]["step"]
    assert isinstance(step_counter, torch.Tensor), "torch stores Adam's step as a tensor"
    step_size = step_counter.numel() * step_counter.element_size()
    want = 2 * nbytes(with_grads) + len(with_grads) * step_size  # exp_avg, exp_avg_sq, step
    assert independent_state_bytes(opt) == want, "the expected Adam state layout does not match torch's"
    assert optimizer_state_bytes(opt) == want, (
        f"optimizer_state_bytes({opt_cls.__name__}) = {optimizer_state_bytes(opt)}, want "
        f"2 x {nbytes(with_grads)} (moments) + {len(with_grads)} x {step_size} (step counters) = {want}")

    step(model, seed=1)
    opt.step()
    assert optimizer_state_bytes(opt) == want, "a second step should not grow the state"


def test_sgd_state_bytes():
    model = ToyModel()
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    toy_step(model)
    plain.step()
    assert optimizer_state_bytes(plain) == 0, "SGD without momentum keeps no state"

    momentum = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    momentum.step()
    with_grads = [p for p in unique_params(model) if p.grad is not None]
    assert optimizer_state_bytes(momentum) == nbytes(with_grads) == independent_state_bytes(momentum), \
        "SGD with momentum keeps one buffer per parameter with a gradient"


def test_memory_report_adds_up():
    model = ToyModel()
    opt = torch.optim.Adam(model.parameters())
    toy_step(model)
    opt.step()
    report = memory_report(model, opt)
    assert (report.params, report.grads, report.optimizer_state) == (
        param_bytes(model), grad_bytes(model), optimizer_state_bytes(opt))
    assert report.total == report.params + report.grads + report.optimizer_state
    assert memory_report(model).optimizer_state == 0


# ----------------------------------------------------------------------------- PeakMemory


def linear_and_input():
    gen = torch.Generator().manual_seed(0)
    lin = nn.Linear(16, 8)
    x = torch.randn(4, 16, generator=gen)
    return lin, x


def test_peak_of_an_empty_block_is_what_was_passed_in():
    lin, x = linear_and_input()
    with PeakMemory(lin, x) as mem:
        pass
    assert mem.peak_bytes == nbytes(lin.parameters()) + nbytes([x])

    # model with grads, buffers and Adam state: everything reachable counts, once
    model = ToyModel()
    opt = torch.optim.Adam(model.parameters())
    toy_step(model)
    opt.step()
    with PeakMemory(model, opt) as mem:
        pass
    want = (nbytes(unique_params(model)) + nbytes(model.buffers())
            + nbytes(p.grad for p in unique_params(model) if p.grad is not None)
            + independent_state_bytes(opt))
    assert mem.peak_bytes == want, f"peak {mem.peak_bytes}, want params + buffers + grads + Adam state = {want}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_peak_rises_by_exactly_one_known_allocation(dtype):
    lin, x = linear_and_input()
    base = nbytes(lin.parameters()) + nbytes([x])
    n = 1000
    size = n * torch.empty((), dtype=dtype).element_size()

    with PeakMemory(lin, x) as mem:
        t = torch.empty(n, dtype=dtype)
        del t
    assert mem.peak_bytes == base + size, f"peak {mem.peak_bytes}, want {base} passed in + {size} allocated"

    with PeakMemory(lin, x) as mem:  # one after the other: the first is freed before the second
        a = torch.ones(n, dtype=dtype)
        del a
        b = torch.zeros(n, dtype=dtype)
        del b
    assert mem.peak_bytes == base + size, f"peak {mem.peak_bytes}: a freed tensor was still counted"

    with PeakMemory(lin, x) as mem:  # both alive at once
        a = torch.ones(n, dtype=dtype)
        b = torch.zeros(2 * n, dtype=dtype)
        del a, b
    assert mem.peak_bytes == base + 3 * size, f"peak {mem.peak_bytes}, want {base + 3 * size}"


def test_peak_does_not_double_count_views():
    lin, x = linear_and_input()
    base = nbytes(lin.parameters()) + nbytes([x])
    n = 1200
    with PeakMemory(lin, x) as mem:
        t = torch.empty(n)
        views = [t.view(30, 40), t[::2], t.unsqueeze(0), t.view(30, 40).t(), t[100:200], t.as_strided((10,), (3,))]
        param_views = [lin.weight.t(), lin.weight[0], x.view(-1), x[1:], lin.bias.unsqueeze(1)]
        del t, views, param_views
    assert mem.peak_bytes == base + n * 4, (
        f"peak {mem.peak_bytes}, want {base} + {n * 4}: views share their base's storage")

    with PeakMemory(x, x.view(-1), x[:2], [x.t()]) as mem:  # one storage passed four times
        pass
    assert mem.peak_bytes == nbytes([x])


def test_peak_of_forward_backward_covers_params_grads_and_output():
    lin, x = linear_and_input()
    with PeakMemory(lin, x) as mem:
        out = lin(x)
        out.sum().backward()
    params = nbytes(lin.parameters())
    grads = nbytes(p.grad for p in lin.parameters())
    assert grads == params, "every Linear parameter is trainable and used: one grad each"
    activation = out.numel() * out.element_size()  # [4, 8] float32
    floor = params + nbytes([x]) + grads + activation
    assert mem.peak_bytes >= floor, (
        f"peak {mem.peak_bytes} < params {params} + input {nbytes([x])} + grads {grads} + output {activation}: "
        f"all of them are alive together at the end of backward")


def test_storages_resized_in_place_are_counted_at_their_current_size():
    # FSDP frees unsharded parameters with storage().resize_(0) and regrows them later.
    grown = torch.empty(0)
    with PeakMemory() as mem:
        grown.resize_(1000)
        doubled = grown + 1
    assert mem.peak_bytes == 2 * 1000 * grown.element_size()
    held = torch.ones(1000)
    with PeakMemory(held) as mem:
        held.untyped_storage().resize_(0)
        small = torch.ones(10)
    assert mem.live_bytes() == small.nbytes, "a storage resized to 0 still counted"
    assert mem.peak_bytes == 1000 * 4  # the peak was before the free
    del doubled


def test_meta_tensors_are_counted_per_storage_not_per_address():
    with torch.device("meta"):
        layer = torch.nn.Linear(1000, 1000)
    assert param_bytes(layer) == (1000 * 1000 + 1000) * 4


def zero_redundancy_state_bytes():
    from labkit.oracles import builtin_zero
    model = nn.Linear(16, 16)
    opt = builtin_zero(model.parameters(), torch.optim.AdamW)
    model(torch.ones(2, 16)).sum().backward()
    opt.step()
    inner = sum(t.nbytes for s in opt.optim.state.values() for t in s.values())
    return optimizer_state_bytes(opt), inner


def test_wrapped_optimizer_state_is_counted_through_the_inner_optimizer():
    # ZeroRedundancyOptimizer keeps this rank's shard of the state in .optim.
    import labkit
    for counted, inner in labkit.launch(zero_redundancy_state_bytes, 2):
        assert counted == inner > 0


def test_saved_peak_follows_saved_tensors_through_backward():
    """SavedPeak: x -> x * w -> tanh saves x (mul's other operand) and tanh's output: 2 storages at the
    end of forward, none after backward; w, a parameter, is left out; a view counts with its base."""
    from labkit.memory import SavedPeak
    lin = nn.Linear(8, 8, bias=False)
    w = lin.weight
    x = torch.randn(4, 8, requires_grad=True)
    peak = SavedPeak(lin)
    with peak.hooks():
        y = (x @ w.t()).tanh()
        y2 = y[:, :4].exp()  # exp saves its output (a new storage); the view y[:, :4] is not saved
        at_end = peak.live_bytes()
        (y.sum() + y2.sum()).backward()
    assert at_end == x.nbytes + y.nbytes + y2.nbytes, at_end
    assert peak.peak == at_end
    del y, y2
    assert peak.live_bytes() == x.nbytes  # the test still holds x; the graph's saved outputs are gone
