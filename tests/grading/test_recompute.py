"""Graded tests for chapter 12: memory (recomputation, selective recomputation, offloading, accumulation).

Recomputation, selective recomputation and offloading are single-process techniques: they
are checked on every rank of a launch at world sizes 1 and 2 (1 a diagnostic), each rank on
its own data, as chapter 10 grades its router. Each is checked, in float64 with dropout on,
over 5 AdamW steps against the same model (same weights, same seeds) without the technique
and, for full recomputation, against ``torch.utils.checkpoint`` (non-reentrant): the loss at
every step and every gradient. Then what the technique is for:

* checkpoint: the order of block forwards traced (every block once in forward; in backward
  exactly the wrapped blocks, last first, once each) for k = 1, 2, 3; the bytes autograd saves
  per block, counted here with ``saved_tensors_hooks`` by storage, equal to the chapter's
  formula: 4 s b h for a wrapped block (its input), s b (72 h + 12 a s + 16) for a kept one
  (fp32-equivalent float64 counts are doubled: the test uses the element size);
* selective: per block s b (72 h + 16) x element size / 4 saved bytes at several s, b, h, a;
* offload: bytes on the host after forward = the layers' saved bytes, each layer's offload,
  fetch and prefetch events in order, at most two layers back on the device at once;
* optimizer_offload: a bf16 GPT whose fp32 master weights and AdamW moments live on the host
  (12 bytes per parameter), the masters after each of 5 steps against torch.optim.AdamW on fp32
  copies fed the same bf16 gradients, the bf16 parameters equal to their master cast, 4 bytes
  per parameter over the link per step;
* accumulate: at world sizes 1-3, the gradients of one big batch (every rank's micro-batches
  in one process) after each of 5 steps, and the whole communication: nothing before the last
  micro-batch's backward, then one all-reduce per parameter of its gradient's bytes.
"""

import pytest
import torch
import torch.distributed as dist

from labkit.check import assert_close
from labkit.comm import CommTracer, Op, assert_ops
from labkit.course.grading import run_graded, task
from labkit.memory import SavedBytes
from labkit.models import GPTConfig
from labkit.oracles import builtin_checkpoint

DROPOUT, STEPS = 0.2, 5
CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16)
SHAPES = [(8, 2, 16, 2), (12, 3, 16, 4), (6, 1, 32, 2)]  # (s, b, h, a) for the byte counts


def tokens(rank: int, step: int, batch: int = 3, seq: int = 8):
    gen = torch.Generator().manual_seed(1000 * rank + step)
    idx = torch.randint(0, CONFIG.vocab_size, (batch, seq + 1), generator=gen)
    return idx[:, :-1], idx[:, 1:]


def kept_bytes(s, b, h, a, element=8, selective=False):
    """The chapter's count for a block kept whole, in fp32 on CPU (dropout multiplies by a float
    noise tensor): s b (72 h + 12 a s + 16); selective drops the 12 a s; x element size / 4."""
    return s * b * (72 * h + (0 if selective else 12 * a * s) + 16) * element // 4


def train(model, rank, forward=None, steps=STEPS, on_step=None):
    """5 AdamW steps with dropout on, the RNG seeded per step: (losses, grads per step)."""
    forward = forward or (lambda m, x, y: m(x, y)[1])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for step in range(steps):
        x, y = tokens(rank, step)
        torch.manual_seed(77 + step)
        loss = forward(model, x, y)
        opt.zero_grad()
        loss.backward()
        if on_step:
            on_step(step)
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return losses, grads


def assert_same_training(got, want, what):
    for step, (loss, ref) in enumerate(zip(got[0], want[0])):
        assert_close(loss, ref, f"{what}, step {step}: loss")
        for i, (g, r) in enumerate(zip(got[1][step], want[1][step])):
            assert_close(g, r, f"{what}, step {step}: gradient of parameter {i}")


# ----------------------------------------------------------------------------- checkpoint

def checkpoint_on_rank() -> None:
    from labkit.recompute import checkpoint_every, memory_gpt
    rank = dist.get_rank()
    with pytest.raises(ValueError):
        checkpoint_every(memory_gpt(CONFIG), 0)
    plain = train(memory_gpt(CONFIG, DROPOUT, seed=rank).double(), rank)
    quiet = memory_gpt(CONFIG, 0.0, seed=rank).double()
    x, y = tokens(rank, 0)
    torch.manual_seed(77)
    assert (quiet(x, y)[1] - plain[0][0]).abs() > 1e-6, "test set-up: dropout must change the loss"
    for k in (1, 2, 3):
        what = f"recompute.checkpoint: rank {rank}, every {k}-th block"
        want = [i for i in range(CONFIG.n_layer) if i % k == 0]
        model = memory_gpt(CONFIG, DROPOUT, seed=rank).double()
        blocks = list(model.blocks)
        wrapped = checkpoint_every(model, k)
        assert list(wrapped) == want, f"{what}: wraps blocks {list(wrapped)}, want {want} (0, k, 2k, ...)"
        # the order of block forwards: every block in forward, the wrapped ones again in backward, last first
        events, phase = [], ["forward"]
        hooks = [block.register_forward_pre_hook(lambda mod, args, i=i: events.append((phase[0], i)))
                 for i, block in enumerate(blocks)]
        x, y = tokens(rank, 0)
        loss = model(x, y)[1]
        phase[0] = "backward"
        loss.backward()
        for hook in hooks:
            hook.remove()
        expected = [("forward", i) for i in range(CONFIG.n_layer)] + [("backward", i) for i in reversed(want)]
        assert events == expected, f"{what}: block forwards traced {events}, want {expected}"
        model = memory_gpt(CONFIG, DROPOUT, seed=rank).double()
        checkpoint_every(model, k)
        ours = train(model, rank)
        assert_same_training(ours, plain, what + " vs no checkpointing (dropout on)")
        theirs = memory_gpt(CONFIG, DROPOUT, seed=rank).double()
        for i in want:
            theirs.blocks[i] = builtin_checkpoint(theirs.blocks[i])
        assert_same_training(ours, train(theirs, rank), what + " vs torch.utils.checkpoint (non-reentrant)")
    # bytes saved per block: the wrapped ones keep their input only
    for s, b, h, a in SHAPES:
        config = GPTConfig(vocab_size=32, block_size=s, n_layer=3, n_head=a, n_embd=h)
        model = memory_gpt(config, DROPOUT, seed=rank).double()
        checkpoint_every(model, 2)
        x = torch.randn(b, s, h, dtype=torch.float64, requires_grad=True)
        for i, block in enumerate(model.blocks):
            with SavedBytes(model) as saved:
                x = block(x)
            want = s * b * h * 8 if i % 2 == 0 else kept_bytes(s, b, h, a)
            assert saved.bytes == want, (
                f"recompute.checkpoint: rank {rank}, s={s} b={b} h={h} a={a}, block {i} "
                f"({'wrapped' if i % 2 == 0 else 'kept'}): saves {saved.bytes} B, want {want} B")


# ----------------------------------------------------------------------------- selective

def selective_on_rank() -> None:
    from labkit.recompute import memory_gpt
    rank = dist.get_rank()
    what = f"recompute.selective: rank {rank}"
    plain = train(memory_gpt(CONFIG, DROPOUT, seed=rank).double(), rank)
    assert_same_training(train(memory_gpt(CONFIG, DROPOUT, selective=True, seed=rank).double(), rank),
                         plain, what + " vs keeping the attention core (dropout on)")
    for s, b, h, a in SHAPES:
        config = GPTConfig(vocab_size=32, block_size=s, n_layer=2, n_head=a, n_embd=h)
        model = memory_gpt(config, DROPOUT, selective=True, seed=rank).double()
        x = torch.randn(b, s, h, dtype=torch.float64, requires_grad=True)
        for i, block in enumerate(model.blocks):
            with SavedBytes(model) as saved:
                x = block(x)
            want = kept_bytes(s, b, h, a, selective=True)
            assert saved.bytes == want, (
                f"{what}, s={s} b={b} h={h} a={a}, block {i}: saves {saved.bytes} B, want s b (72 h + 16) x 2 "
                f"= {want} B (q, k, v kept; scores, softmax, dropout mask and dropped probabilities recomputed)")


# ----------------------------------------------------------------------------- offload

def offload_on_rank() -> None:
    from labkit.recompute import OffloadPool, memory_gpt, offloaded_forward
    rank = dist.get_rank()
    what = f"recompute.offload: rank {rank}"
    layers, (s, b, h, a) = CONFIG.n_layer, (8, 3, CONFIG.n_embd, CONFIG.n_head)
    layer_bytes = kept_bytes(s, b, h, a)
    plain = train(memory_gpt(CONFIG, DROPOUT, seed=rank).double(), rank)
    pools = []

    def forward(model, x, y):
        pools.append(OffloadPool(model))
        return offloaded_forward(model, pools[-1], x, y)[1]

    def after_forward_check(model, x, y):
        loss = forward(model, x, y)
        pool = pools[-1]
        assert pool.host_bytes == layers * layer_bytes and pool.device_bytes == 0, (
            f"{what}: after forward the host holds {pool.host_bytes} B and the device {pool.device_bytes} B "
            f"of saved activations; want {layers} layers x {layer_bytes} B on the host, 0 on the device")
        offloads = [e for e in pool.events if e[0] == "offload"]
        per_layer = [sum(e[2] for e in offloads if e[1] == i) for i in range(layers)]
        assert per_layer == [layer_bytes] * layers, f"{what}: bytes offloaded per layer {per_layer}, want {layer_bytes} each"
        return loss

    def after_backward(step):
        pool = pools[-1]
        back = [e for e in pool.events if e[0] != "offload"]
        want = [("fetch", layers - 1, layer_bytes)] + [("prefetch", i, layer_bytes) for i in reversed(range(layers - 1))]
        assert back == want, (f"{what}, step {step}: backward brought layers back as {back}; want the last "
                              f"layer fetched, then each earlier layer prefetched while the one after it runs: {want}")
        assert pool.peak_device_bytes == 2 * layer_bytes, (
            f"{what}, step {step}: at most two layers on the device at once ({2 * layer_bytes} B), "
            f"peak was {pool.peak_device_bytes} B")
        assert pool.host_bytes == 0, f"{what}, step {step}: {pool.host_bytes} B left on the host after backward"

    got = train(memory_gpt(CONFIG, DROPOUT, seed=rank).double(), rank, forward=after_forward_check,
                on_step=after_backward)
    assert_same_training(got, plain, what + " vs no offloading")


# ----------------------------------------------------------------------------- accumulate

def accumulate_on_rank() -> None:
    from labkit.models import GPT
    from labkit.recompute import accumulate
    rank, n = dist.get_rank(), dist.get_world_size()
    config = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    model, ref = GPT(config, seed=5).double(), GPT(config, seed=5).double()
    with pytest.raises(ValueError):
        accumulate(model, [], lambda m, x, y: m(x, y)[1])
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    micro = 3
    for step in range(STEPS):
        batches = {r: [tokens(r, 10 * step + j, batch=2) for j in range(micro)] for r in range(n)}
        seen = []

        def loss_fn(m, x, y):
            seen.append(len(tracer.events))  # communication so far, before this micro-batch
            return m(x, y)[1]

        opt.zero_grad()
        with CommTracer() as tracer:
            accumulate(model, batches[rank], loss_fn)
        what = f"recompute.accumulate: rank {rank} of {n}, step {step}, {micro} micro-batches"
        assert seen == [0] * micro, f"{what}: ops traced before each micro-batch {seen}; nothing may move before the last backward"
        params = list(model.parameters())
        want = [Op("all_reduce", p.numel() * 8) for p in params] if n > 1 else []
        assert_ops(tracer, want, what + " (after the last micro-batch: one all-reduce per parameter gradient)")
        ref_opt.zero_grad()
        total = sum(ref(x, y)[1] for r in range(n) for x, y in batches[r]) / (n * micro)
        total.backward()
        for i, (p, r) in enumerate(zip(params, ref.parameters())):
            assert_close(p.grad, r.grad, f"{what}: gradient of parameter {i} vs one batch of every rank's micro-batches")
        opt.step()
        ref_opt.step()


# ----------------------------------------------------------------------------- optimizer offload

def optimizer_offload_on_rank() -> None:
    from labkit.memory import tensor_bytes
    from labkit.models import GPT
    from labkit.recompute import OffloadedAdamW
    rank = dist.get_rank()
    config = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    model = GPT(config, seed=rank).to(torch.bfloat16)
    params = list(model.parameters())
    psi = sum(p.numel() for p in params)
    opt = OffloadedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    what = f"recompute.optimizer_offload: rank {rank}"
    host = opt.master + opt.exp_avg + opt.exp_avg_sq
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in host), (
        f"{what}: master weights and both moments must be fp32 tensors on the host, got "
        f"{sorted({(t.device.type, str(t.dtype)) for t in host})}")
    assert tensor_bytes(host) == 12 * psi, f"{what}: host holds {tensor_bytes(host)} B, want 12 x {psi} (fp32 master + 2 moments)"
    assert all(t.is_pinned() == torch.cuda.is_available() for t in opt.master), f"{what}: host master pinned iff CUDA"
    ref_master = [p.detach().float().clone().requires_grad_(True) for p in params]
    ref_opt = torch.optim.AdamW(ref_master, lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        x, y = tokens(rank, step)
        opt.zero_grad()
        model(x, y)[1].backward()
        grads = [p.grad.float() for p in params]
        opt.step()
        for w, g in zip(ref_master, grads):
            w.grad = g
        ref_opt.step()
        assert opt.moved_bytes == (step + 1) * 4 * psi, (
            f"{what}, step {step}: {opt.moved_bytes} B over the link so far, want (step + 1) x 4 x {psi} "
            "(bf16 gradients down, bf16 parameters up)")
        for i, (p, w, ref) in enumerate(zip(params, opt.master, ref_master)):
            assert_close(w, ref.detach(), f"{what}, step {step}: fp32 master of parameter {i} vs torch.optim.AdamW")
            assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), w.to(torch.bfloat16)), (
                f"{what}, step {step}: parameter {i} on the device must be its updated master cast to bf16")


@task("recompute.checkpoint", points=3)
@pytest.mark.parametrize("world_size", [1, 2])
def test_checkpoint(world_size):
    run_graded("recompute.checkpoint", checkpoint_on_rank, world_size, timeout=180)


@task("recompute.selective", points=2)
@pytest.mark.parametrize("world_size", [1, 2])
def test_selective(world_size):
    run_graded("recompute.selective", selective_on_rank, world_size, timeout=120)


@task("recompute.offload", points=2)
@pytest.mark.parametrize("world_size", [1, 2])
def test_offload(world_size):
    run_graded("recompute.offload", offload_on_rank, world_size, timeout=120)


@task("recompute.accumulate", points=2)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_accumulate(world_size):
    run_graded("recompute.accumulate", accumulate_on_rank, world_size, timeout=120)


@task("recompute.optimizer_offload", points=2)
@pytest.mark.parametrize("world_size", [1, 2])
def test_optimizer_offload(world_size):
    run_graded("recompute.optimizer_offload", optimizer_offload_on_rank, world_size, timeout=120)
