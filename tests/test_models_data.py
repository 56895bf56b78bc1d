"""Tests for labkit.models and labkit.data: determinism, the awkward parameters, learnability."""

import math

import pytest
import torch

from labkit.data import batches, markov_entropy, markov_tokens, regression
from labkit.models import GPT, GPTConfig, ToyModel, num_params, toy_loss


@pytest.fixture(autouse=True)
def one_thread():
    # These tensors are tiny: extra intra-op threads cost more than they save,
    # and on a busy machine they make the training tests many times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), f"{name} differs between two builds with the same seed"


# ---------------------------------------------------------------- GPT


def test_gpt_weights_depend_on_seed_only():
    torch.manual_seed(1)
    a = GPT(GPTConfig(), seed=0)
    torch.manual_seed(12345)
    torch.rand(1000)  # move the global stream somewhere else entirely
    b = GPT(GPTConfig(), seed=0)
    assert_same_state(a, b)

    c = GPT(GPTConfig(), seed=1)
    assert not torch.equal(a.wte.weight, c.wte.weight), "seed=1 gave the same embedding as seed=0"


def test_gpt_build_leaves_global_rng_alone():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    GPT(GPTConfig(), seed=3)
    ToyModel(seed=3)
    assert torch.equal(before, torch.get_rng_state()), "building a model advanced the global RNG"


def test_gpt_init_values():
    model = GPT(GPTConfig(), seed=0)
    std = model.blocks[0].mlp.c_fc.weight.std().item()
    assert abs(std - 0.02) < 0.003, f"Linear weight std {std:.4f}, want about 0.02"
    assert torch.all(model.blocks[0].attn.c_attn.bias == 0), "biases should start at zero"
    assert torch.all(model.ln_f.weight == 1) and torch.all(model.ln_f.bias == 0)


def expected_param_count(cfg):
    d, v = cfg.n_embd, cfg.vocab_size
    layer_norm = 2 * d
    block = (
        layer_norm
        + (d * 3 * d + 3 * d)  # c_attn
        + (d * d + d)  # attn.c_proj
        + layer_norm
        + (d * 4 * d + 4 * d)  # c_fc
        + (4 * d * d + d)  # mlp.c_proj
    )
    head = 0 if cfg.tie_weights else v * d
    return v * d + cfg.block_size * d + cfg.n_layer * block + layer_norm + head


def test_gpt_tied_head_is_one_parameter_counted_once():
    tied = GPT(GPTConfig(), seed=0)
    assert tied.lm_head.weight is tied.wte.weight, "lm_head should hold the very Parameter of wte"
    assert num_params(tied) == expected_param_count(tied.config) == 27008, num_params(tied)

    untied = GPT(GPTConfig(tie_weights=False), seed=0)
    assert untied.lm_head.weight is not untied.wte.weight
    assert num_params(untied) == expected_param_count(untied.config) == 27008 + 32 * 32


def test_gpt_tied_weight_gets_gradient_from_both_uses():
    model = GPT(GPTConfig(), seed=0)
    idx = torch.zeros(1, 4, dtype=torch.long)  # only token 0 is embedded
    _, loss = model(idx, torch.zeros_like(idx))
    loss.backward()
    grad = model.wte.weight.grad
    # Rows of tokens that never occur get gradient only through the output head.
    assert grad[5].abs().sum() > 0, "head's gradient did not reach the shared weight"


def test_gpt_forward_shapes_and_causality():
    cfg = GPTConfig()
    model = GPT(cfg, seed=0)
    idx = torch.randint(0, cfg.vocab_size, (3, cfg.block_size), generator=torch.Generator().manual_seed(0))
    logits, loss = model(idx)
    assert logits.shape == (3, cfg.block_size, cfg.vocab_size) and loss is None

    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % cfg.vocab_size  # alter only the future
    logits2, _ = model(changed)
    assert torch.equal(logits[:, :10], logits2[:, :10]), "earlier positions saw later tokens"
    assert not torch.allclose(logits[:, 10:], logits2[:, 10:])


def test_gpt_learns_markov_chain():
    cfg = GPTConfig()
    x, y = markov_tokens(1024 + 256, cfg.block_size, cfg.vocab_size, seed=0)
    x_train, y_train, x_val, y_val = x[:1024], y[:1024], x[1024:], y[1024:]
    floor = markov_entropy(cfg.vocab_size, seed=0)

    model = GPT(cfg, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with torch.no_grad():
        start = model(x_val, y_val)[1].item()
    steps = 0
    for epoch in range(4):  # 32 batches an epoch
        for xb, yb in batches(x_train, y_train, 32, seed=epoch):
            _, loss = model(xb, yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
            if steps == 100:
                break
    with torch.no_grad():
        end = model(x_val, y_val)[1].item()

    assert abs(start - math.log(cfg.vocab_size)) < 0.25, f"untrained loss {start:.3f}, want about log(V)"
    assert end < math.log(cfg.vocab_size) - 1.5, f"loss only fell from {start:.3f} to {end:.3f}"
    assert end < floor + 0.3, f"loss {end:.3f} is not near the entropy floor {floor:.3f}"
    assert end > floor - 0.05, f"held-out loss {end:.3f} beat the floor {floor:.3f}: floor is wrong"


# ---------------------------------------------------------------- ToyModel


# ---------------------------------------------------------------- the MoE GPT (chapter 10)

MOE = GPTConfig(n_embd=16, n_experts=4, moe_k=2)


def test_gpt_moe_flag_off_changes_nothing():
    """The flag's default leaves the dense model as it was: same modules, same weights, and a
    dense config that spells the MoE fields out builds the very same model."""
    plain, spelled = GPT(GPTConfig(), seed=0), GPT(GPTConfig(n_experts=0, moe_k=3, moe_aux_weight=1.0), seed=0)
    assert_same_state(plain, spelled)
    assert all(type(b.mlp).__name__ == "MLP" for b in plain.blocks)
    assert num_params(plain) == expected_param_count(GPTConfig())


def test_gpt_moe_blocks_and_init():
    model = GPT(MOE, seed=0)
    h, e = MOE.n_embd, MOE.n_experts
    for block in model.blocks:
        assert block.mlp.gate.shape == (e, h) and block.mlp.w1.shape == (e, h, 4 * h)
        assert block.mlp.w2.shape == (e, 4 * h, h)
        std = block.mlp.w1.std().item()
        assert abs(std - 0.02) < 0.003, f"expert weight std {std:.4f}, want about 0.02"
    dense_mlp, moe_mlp = 8 * h * h + 5 * h, e * h + e * 8 * h * h  # c_fc + c_proj; gate + w1 + w2
    assert num_params(model) == expected_param_count(MOE) + MOE.n_layer * (moe_mlp - dense_mlp)
    assert_same_state(model, GPT(MOE, seed=0))
    with pytest.raises(ValueError):
        GPT(GPTConfig(n_experts=2, moe_k=3))
    with pytest.raises(ValueError):
        GPT(GPTConfig(n_experts=2, moe_capacity_factor=0.0))


def moe_by_loops(x, mlp, capacity_factor):
    """Each token through its k experts, one at a time; capacity by counting."""
    tokens = x.reshape(-1, x.shape[-1])
    e_count, k = mlp.gate.shape[0], mlp.k
    probs = torch.softmax(tokens @ mlp.gate.t(), dim=-1)
    taken, y = [0] * e_count, torch.zeros_like(tokens)
    capacity = math.ceil(capacity_factor * k * len(tokens) / e_count) if capacity_factor else len(tokens) * k
    choices = []
    for t in range(len(tokens)):
        top = torch.sort(probs[t], descending=True, stable=True)
        weights = top.values[:k] / top.values[:k].sum()
        for j in range(k):
            e = top.indices[j].item()
            choices.append(e)
            if taken[e] < capacity:
                taken[e] += 1
                y[t] += weights[j] * (torch.nn.functional.gelu(tokens[t] @ mlp.w1[e]) @ mlp.w2[e])
    f = torch.bincount(torch.tensor(choices), minlength=e_count).double() / len(choices)
    return y.reshape(x.shape), e_count * (f * probs.mean(0)).sum()


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_gpt_moe_mlp_matches_loops_and_adds_aux(capacity_factor):
    config = GPTConfig(n_embd=16, n_experts=4, moe_k=2, moe_capacity_factor=capacity_factor)
    model = GPT(config, seed=1).double()
    mlp = model.blocks[0].mlp
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    y = mlp(x)
    want_y, want_aux = moe_by_loops(x, mlp, capacity_factor)
    torch.testing.assert_close(y, want_y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mlp.aux, want_aux, rtol=1e-12, atol=1e-12)
    if capacity_factor:  # some choices really are dropped
        assert len(mlp.kept_experts) < 2 * 10
    idx = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    logits, loss = model(idx, idx)
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten())
    aux = sum(block.mlp.aux for block in model.blocks)
    torch.testing.assert_close(loss, ce + config.moe_aux_weight * aux, rtol=1e-12, atol=1e-12)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters()), "every parameter, the gate too, gets a gradient"


def test_toy_model_awkward_parameters():
    model = ToyModel(seed=0)
    params = dict(model.named_parameters())
    assert set(params) == {"shared", "bias_in", "bias_out", "frozen.weight", "frozen.bias", "unused"}, set(params)
    # No separate output weight: the output projection can only be `shared`, transposed.
    assert model.shared.shape == (16, 8)
    assert not model.frozen.weight.requires_grad and not model.frozen.bias.requires_grad
    assert model.unused.requires_grad
    assert "scale" in dict(model.named_buffers()) and "scale" not in params
    assert "scale" in model.state_dict()

    x, y = regression(32, 8, 8, seed=0)
    toy_loss(model, x, y).backward()
    assert model.unused.grad is None, "unused parameter got a gradient"
    assert model.frozen.weight.grad is None and model.frozen.bias.grad is None
    for name in ("shared", "bias_in", "bias_out"):
        assert params[name].grad is not None and params[name].grad.abs().sum() > 0, name


def test_toy_model_shared_weight_used_twice():
    model = ToyModel(seed=0)
    x, y = regression(32, 8, 8, seed=0)
    toy_loss(model, x, y).backward()
    # Cut the input use off: what is left is the output use's share alone.
    # The full gradient must differ from it, so both uses contribute.
    full = model.shared.grad.clone()
    model.zero_grad()
    h = torch.tanh(x @ model.shared.detach().t() + model.bias_in)
    h = torch.tanh(model.frozen(h)) * model.scale
    torch.nn.functional.mse_loss(h @ model.shared + model.bias_out, y).backward()
    assert not torch.allclose(full, model.shared.grad), "shared weight only feeds one place"
    assert torch.allclose(model(x), h @ model.shared + model.bias_out), "forward is not the documented formula"


def test_toy_model_weights_depend_on_seed_only():
    torch.manual_seed(7)
    a = ToyModel(seed=0)
    torch.manual_seed(8)
    b = ToyModel(seed=0)
    assert_same_state(a, b)
    assert not torch.equal(a.shared, ToyModel(seed=1).shared)


def test_toy_model_learns_regression():
    x, y = regression(256, 8, 8, seed=0)
    model = ToyModel(seed=0)
    frozen_before = model.frozen.weight.clone()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = toy_loss(model, x, y).item()
    for _ in range(200):
        loss = toy_loss(model, x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    end = toy_loss(model, x, y).item()
    assert end < 0.2 * start, f"ToyModel loss only fell from {start:.4f} to {end:.4f}"
    assert torch.equal(frozen_before, model.frozen.weight), "the frozen layer changed"


# ---------------------------------------------------------------- data


def test_markov_tokens_shape_shift_and_determinism():
    x, y = markov_tokens(8, 16, 32, seed=0)
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1]), "y is not x shifted by one"
    assert 0 <= x.min() and x.max() < 32
    x2, y2 = markov_tokens(8, 16, 32, seed=0)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, markov_tokens(8, 16, 32, seed=1)[0])


def test_markov_entropy_matches_samples():
    vocab = 32
    entropy = markov_entropy(vocab, seed=0)
    assert entropy < 0.5 * math.log(vocab), f"chain entropy {entropy:.3f} is not far below log(V)"

    x, y = markov_tokens(4096, 16, vocab, seed=0)
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    counts.index_put_((x.flatten(), y.flatten()), torch.ones(x.numel(), dtype=torch.float64), accumulate=True)
    joint = counts / counts.sum()
    conditional = counts / counts.sum(dim=1, keepdim=True)
    seen = counts > 0
    empirical = -(joint[seen] * conditional[seen].log()).sum().item()
    assert abs(empirical - entropy) < 0.05, f"samples have entropy {empirical:.3f}, markov_entropy says {entropy:.3f}"

    # Sequences start in the stationary distribution: first and last tokens look alike.
    first = torch.bincount(x[:, 0], minlength=vocab) / len(x)
    last = torch.bincount(y[:, -1], minlength=vocab) / len(y)
    gap = (first - last).abs().sum().item()
    assert gap < 0.2, f"first- and last-token frequencies differ by {gap:.3f} (L1): not a stationary start"


def test_regression_shapes_and_determinism():
    x, y = regression(100, 8, 4, seed=0)
    assert x.shape == (100, 8) and y.shape == (100, 4) and x.dtype == torch.float32
    assert y.abs().max() < 1.1, "y should be tanh of the teacher plus small noise"
    x2, y2 = regression(100, 8, 4, seed=0)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(y, regression(100, 8, 4, seed=1)[1])


def test_batches_cover_each_sample_once_in_seeded_order():
    x = torch.arange(10).unsqueeze(1).float()  # each row names itself
    y = 100 + torch.arange(10)
    epoch = batches(x, y, batch_size=4, seed=0)
    assert [len(xb) for xb, _ in epoch] == [4, 4, 2]
    rows = torch.cat([xb[:, 0] for xb, _ in epoch]).long()
    assert sorted(rows.tolist()) == list(range(10)), f"epoch visited {rows.tolist()}"
    assert not torch.equal(rows, torch.arange(10)), "order was not shuffled"
    for xb, yb in epoch:
        assert torch.equal(yb, 100 + xb[:, 0].long()), "x and y rows came apart"

    again = torch.cat([xb[:, 0] for xb, _ in batches(x, y, 4, seed=0)]).long()
    other = torch.cat([xb[:, 0] for xb, _ in batches(x, y, 4, seed=1)]).long()
    assert torch.equal(rows, again), "same seed, different order"
    assert not torch.equal(rows, other), "different seed, same order"
