"""Graded tests for chapter 12: memory (recomputation, selective recomputation, offloading, accumulation).

Recomputation, selective recomputation and offloading are single-process techniques: they
are checked on every rank of a launch at world sizes 1 and 2 (1 a diagnostic), each rank on
its own data, as chapter 10 grades its router. Each is checked, in float64 with dropout on,
over 5 AdamW steps against the same model (same weights, same seeds) without the technique
and, for full recomputation, against ``torch.utils.checkpoint`` (non-reentrant): the loss at
every step and every gradient. Memory is measured here (``saved_tensors_hooks`` with weak
references to the storages, ``SavedPeak``; hooks wrapped around the pool), never taken from
numbers the code under test reports. Then, per task:

* checkpoint: k = 1, 2, 3 and k > the number of blocks (block 0 alone); the order of block
  forwards traced (every block once in forward; in backward exactly the wrapped blocks, last
  first, once each); the RNG seeded once over 3 steps: losses, gradients and the global RNG
  state after each backward equal to no checkpointing's (a recompute that advances, consumes
  or resets the global stream fails); CPU autocast in bf16 and fp16 (forward inside, backward
  outside) over 3 steps: every Linear recomputed in the forward's dtype, gradients equal to no
  checkpointing's and (bf16) torch's; ``Checkpoint.apply`` with tensor arguments that require a
  gradient and one that does not, non-tensor arguments and two outputs (both used, or one);
  saved bytes per block in forward (4 s b h for a wrapped block, s b (72 h + 12 a s + 16) for a
  kept one, x element size / 4) and the peak over forward and backward, measured, equal to
  max(end of forward, the blocks before j + block j rebuilt whole) at k = 1..4 over 3 shapes;
* selective: per block s b (72 h + 16) x element size / 4 saved bytes at several s, b, h, a, and
  the measured peak of backward at most one attention core (12 a s^2 b in fp32) above it;
* offload: one pool over 5 steps, watched from outside: every tensor handed to ``pack`` freed
  once forward is done (weak references: a pool that keeps the device tensor fails), each layer
  copied back through ``_to_device`` once per step, after backward entered the block above it
  and before it enters the layer's own block (never two ahead), at most two layers of copies
  alive at once, none after backward; the pool's own books (host bytes, events) as well;
* optimizer_offload: fp32, bf16 and fp16 models, AdamW with non-default betas, eps and weight
  decay against torch.optim.AdamW on fp32 copies fed the same gradients over 5 steps, with a
  frozen parameter (not taken), an unused one (never a gradient) and one with a gradient on even
  steps only (its own step count drives its bias corrections, as torch's); fp32 master and
  moments on the host (12 bytes per trainable parameter); parameters equal to their master cast;
  then (issue 39) on an emulated device (``Link``: device tensors that raise when mixed with
  host ones, every host-device copy measured) with bf16, fp16 and fp32 parameters at once:
  the bytes down and up measured each step (each gradient and each parameter once, in its
  dtype), ``moved_bytes`` grown by exactly that;
* accumulate: at world sizes 3 and 4 (1 a diagnostic), over every rank and over rank pairs
  ({0,1}/{2,3}; {0,2}/{1}), m = 1, 2, 3 micro-batches, equal and unequal in size, 3 steps each,
  a frozen and an unused parameter: gradients equal to one batch of each rank's micro-batches
  (the mean over its tokens), averaged over the group's ranks; the loss returned; nothing
  communicated before the last micro-batch, then one all-reduce per gradient over the group;
  then (issue 42) micro-batches of 8, 5 and 3 tokens right-padded with ignore_index (-100 and -1),
  one wholly padded: weights by the counted targets, not y.numel().
"""

import random

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from labkit.check import assert_close
from labkit.comm import CommTracer, Op, assert_ops
from labkit.course.grading import run_graded, task
from labkit.memory import SavedBytes, SavedPeak
from labkit.models import GPTConfig
from labkit.oracles import builtin_checkpoint
from tests.grading import configs

DROPOUT, STEPS, STREAM_STEPS = 0.2, 5, 3
CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16)
SHAPES = [(8, 2, 16, 2), (12, 3, 16, 4), (6, 1, 32, 2)]  # (s, b, h, a) for the byte counts


LONG = configs.LONG  # a developer's long mode: many more drawn configurations


def examples(ci: int, long: int) -> int:
    return long if LONG else ci


def drawn(seed: int, case: int) -> random.Random:
    """Case ``case``'s own sampler, the same on every rank (not the global ``random``)."""
    return random.Random(seed * 1_000_003 + case)


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


def train_stream(model, rank, steps=STREAM_STEPS):
    """AdamW steps with dropout on and the RNG seeded ONCE: every step draws from where the one
    before left the global stream. (losses, grads per step, the global RNG state after each
    step's backward)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(500 + rank)
    losses, grads, states = [], [], []
    for step in range(steps):
        x, y = tokens(rank, step)
        loss = model(x, y)[1]
        opt.zero_grad()
        loss.backward()
        states.append(torch.get_rng_state())
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return losses, grads, states


def assert_same_training(got, want, what):
    for step, (loss, ref) in enumerate(zip(got[0], want[0])):
        assert_close(loss, ref, f"{what}, step {step}: loss")
        for i, (g, r) in enumerate(zip(got[1][step], want[1][step])):
            assert_close(g, r, f"{what}, step {step}: gradient of parameter {i}")


# ----------------------------------------------------------------------------- checkpoint

def checkpoint_on_rank(cases=()) -> None:
    from labkit.recompute import checkpoint_every, memory_gpt
    rank = dist.get_rank()
    for bad in (0, -1):
        with pytest.raises(ValueError):
            checkpoint_every(memory_gpt(CONFIG), bad)
    plain = train(memory_gpt(CONFIG, DROPOUT, seed=rank).double(), rank)
    quiet = memory_gpt(CONFIG, 0.0, seed=rank).double()
    x, y = tokens(rank, 0)
    torch.manual_seed(77)
    assert (quiet(x, y)[1] - plain[0][0]).abs() > 1e-6, "test set-up: dropout must change the loss"
    plain_stream = train_stream(memory_gpt(CONFIG, DROPOUT, seed=rank).double(), rank)
    for k in (1, 2, 3, CONFIG.n_layer + 1):  # k > the number of blocks: block 0 alone
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
        if k in (1, 3):  # (equal to no checkpointing at every k; torch's checkpoint at two of them)
            theirs = memory_gpt(CONFIG, DROPOUT, seed=rank).double()
            for i in want:
                theirs.blocks[i] = builtin_checkpoint(theirs.blocks[i])
            assert_same_training(ours, train(theirs, rank), what + " vs torch.utils.checkpoint (non-reentrant)")
            # the RNG stream, seeded once: the recompute draws the forward's masks again on a fork
            # of the stream, so each step leaves the global stream where no checkpointing leaves it
            model = memory_gpt(CONFIG, DROPOUT, seed=rank).double()
            checkpoint_every(model, k)
            stream = train_stream(model, rank)
            for step in range(STREAM_STEPS):
                assert torch.equal(stream[2][step], plain_stream[2][step]), (
                    f"{what}, step {step} (RNG seeded once, {STREAM_STEPS} steps): the global RNG stream after "
                    "backward is not where training without checkpointing leaves it; the recompute must draw on a "
                    "fork of the stream (torch.random.fork_rng), neither advancing nor resetting it")
            assert_same_training(stream, plain_stream, what + f", RNG seeded once over {STREAM_STEPS} steps")
    checkpoint_autocast(rank)
    checkpoint_api(rank)
    checkpoint_memory(rank)
    checkpoint_drawn(rank, cases)


def checkpoint_autocast(rank) -> None:
    """CPU autocast in forward, backward outside it (as one trains with it): the recompute must
    run in the forward's precision, so gradients equal no checkpointing's and torch's."""
    from labkit.recompute import checkpoint_every, memory_gpt
    for dtype in (torch.bfloat16, torch.float16):
        what = f"recompute.checkpoint: rank {rank}, CPU autocast to {dtype}"

        def forward(m, x, y):
            with torch.autocast("cpu", dtype=dtype):
                return m(x, y)[1]

        plain = train(memory_gpt(CONFIG, DROPOUT, seed=rank), rank, forward=forward, steps=3)
        model = memory_gpt(CONFIG, DROPOUT, seed=rank)
        checkpoint_every(model, 1)
        seen, phase = [], ["forward"]
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                module.register_forward_hook(lambda mod, args, out, name=name: seen.append((phase[0], name, out.dtype)))

        def on_step(step):
            phase[0] = "forward"

        def forward_then_recompute(m, x, y):
            loss = forward(m, x, y)
            phase[0] = "recompute"
            return loss

        ours = train(model, rank, forward=forward_then_recompute, steps=3, on_step=on_step)
        recomputed = [(name, d) for p, name, d in seen if p == "recompute"]
        assert recomputed, f"{what}: no block's Linear ran in backward (nothing recomputed)"
        wrong = sorted({(name, str(d)) for name, d in recomputed if d != dtype})
        assert not wrong, (f"{what}: the recompute in backward ran these Linear layers in another precision "
                           f"than the forward ({dtype}): {wrong[:4]}; restore the forward's autocast state")
        assert_same_training(ours, plain, what + " vs no checkpointing")
        if dtype == torch.bfloat16:
            theirs = memory_gpt(CONFIG, DROPOUT, seed=rank)
            for i in range(CONFIG.n_layer):
                theirs.blocks[i] = builtin_checkpoint(theirs.blocks[i])
            assert_same_training(ours, train(theirs, rank, forward=forward, steps=3),
                                 what + " vs torch.utils.checkpoint (non-reentrant)")


def checkpoint_api(rank) -> None:
    """Checkpoint.apply on its own: tensor arguments that require a gradient and ones that do not,
    non-tensor arguments, two outputs (both used, or one), dropout inside; against fn itself."""
    import torch.nn.functional as F
    from labkit.recompute import Checkpoint
    gen = torch.Generator().manual_seed(rank)
    lin = nn.Linear(6, 6).double()

    def fn(x, mask, scale, y, p):
        h = F.dropout(lin(x) * mask, p) * scale
        return h + y, (h * y).tanh()

    x0, y0 = (torch.randn(4, 6, dtype=torch.float64, generator=gen) for _ in range(2))
    mask = (torch.rand(4, 6, generator=gen) > 0.3).double()
    w1, w2 = (torch.randn(4, 6, dtype=torch.float64, generator=gen) for _ in range(2))
    for use in ("both outputs", "the second output only"):
        results = []
        for run in (fn, lambda *args: Checkpoint.apply(fn, *args)):
            lin.zero_grad()
            x, y = x0.clone().requires_grad_(True), y0.clone().requires_grad_(True)
            torch.manual_seed(40 + rank)
            out1, out2 = run(x, mask, 0.5, y, 0.3)
            loss = (out2 * w2).sum() + ((out1 * w1).sum() if use == "both outputs" else 0)
            loss.backward()
            results.append(([out1.detach(), out2.detach(), x.grad, y.grad, lin.weight.grad.clone(),
                             lin.bias.grad.clone()], torch.get_rng_state(), mask.grad))
        what = f"recompute.checkpoint: rank {rank}, Checkpoint.apply(fn, x, mask, 0.5, y, 0.3), loss of {use}"
        names = ["first output", "second output", "x.grad", "y.grad", "weight.grad", "bias.grad"]
        for name, got, want in zip(names, results[1][0], results[0][0]):
            assert got is not None, f"{what}: {name} is None"
            assert_close(got, want, f"{what}: {name} vs fn without checkpointing")
        assert results[1][2] is None, f"{what}: the mask (requires no gradient) got a gradient"
        assert torch.equal(results[1][1], results[0][1]), f"{what}: the global RNG stream is not where fn leaves it"
    # integer tensors (token ids, positions) through a checkpointed function: no gradient for them, no
    # error; a random incoming gradient; then a second call with other shapes (nothing kept from the first)
    emb, pos = nn.Embedding(11, 6).double(), nn.Embedding(9, 6).double()

    def embed(x, ids, positions, scale):
        h = emb(ids) + pos(positions) + x
        return (lin(h) * scale).tanh()

    for b, t in ((2, 5), (3, 9), (1, 1)):
        ids = torch.randint(0, 11, (b, t), generator=gen)
        positions = torch.arange(t).expand(b, t)
        x = torch.randn(b, t, 6, dtype=torch.float64, generator=gen)
        g = torch.randn(b, t, 6, dtype=torch.float64, generator=gen)
        got = []
        for run in (embed, lambda *args: Checkpoint.apply(embed, *args)):
            for m in (emb, pos, lin):
                m.zero_grad()
            xi = x.clone().requires_grad_(True)
            out = run(xi, ids, positions, 0.7)
            out.backward(g)
            got.append([out.detach(), xi.grad, emb.weight.grad.clone(), pos.weight.grad.clone(), lin.weight.grad.clone()])
        what = (f"recompute.checkpoint: rank {rank}, Checkpoint.apply(fn, x, ids (int64), positions (int64), 0.7) on "
                f"[{b}, {t}] tokens, a random incoming gradient")
        for name, mine, want in zip(("output", "x.grad", "token embedding grad", "position embedding grad",
                                     "linear weight grad"), got[1], got[0]):
            assert mine is not None, f"{what}: {name} is None"
            assert_close(mine, want, f"{what}: {name} vs fn without checkpointing")
        assert ids.grad is None and positions.grad is None and not ids.requires_grad, \
            f"{what}: integer arguments get no gradient"
    # the inputs are kept through save_for_backward only, so saved-tensor hooks (offloading) see them:
    # under hooks that move what is saved, the caller's intermediate input is freed after forward
    x = x0.clone().requires_grad_(True) * 2  # an intermediate: only the caller holds it
    kept = StorageWeakRef(x.untyped_storage())
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        out1, out2 = Checkpoint.apply(fn, x, mask, 0.5, y0, 0.3)
    del x
    assert kept.expired(), (f"recompute.checkpoint: rank {rank}, Checkpoint.apply under saved-tensor hooks that move "
                            "what is saved: the input is still alive after forward; keep tensors only through "
                            "ctx.save_for_backward (not as ctx attributes), so offloading can move them")
    (out1.sum() + out2.sum()).backward()
    out = Checkpoint.apply(lambda t: t * 2, torch.ones(3))
    assert not out.requires_grad and torch.equal(out, torch.full((3,), 2.0)), (
        f"recompute.checkpoint: rank {rank}, no argument requires a gradient: got {out}")
    # fn's outputs come back as fn returns them: a one-element tuple stays a tuple (also when no
    # argument requires a gradient); an int argument (a repeat count) is a constant like a float
    for t in (torch.ones(3), torch.ones(3, requires_grad=True)):
        out = Checkpoint.apply(lambda u: (u * 2,), t)
        assert isinstance(out, tuple) and len(out) == 1 and torch.equal(out[0].detach(), torch.full((3,), 2.0)), (
            f"recompute.checkpoint: rank {rank}, fn returns a one-element tuple (requires_grad={t.requires_grad}): "
            f"Checkpoint.apply must return it as fn does, got {type(out).__name__} {out}")
    t = torch.ones(3, dtype=torch.float64, requires_grad=True)
    out = Checkpoint.apply(lambda u, times: u * times, t, 3)
    out.backward(torch.ones(3, dtype=torch.float64))
    assert torch.equal(out.detach(), torch.full((3,), 3.0, dtype=torch.float64)) and \
        torch.equal(t.grad, torch.full((3,), 3.0, dtype=torch.float64)), (
        f"recompute.checkpoint: rank {rank}, Checkpoint.apply(fn, x, 3) with an int argument: output {out}, "
        f"x.grad {t.grad}; want 3 x and 3 (an int is a constant, like a float)")


def checkpoint_memory(rank) -> None:
    """Measured with saved_tensors_hooks over forward AND backward: the peak of saved bytes. A
    wrapped block keeps its input (4 s b h in fp32); in backward it is rebuilt, one at a time, and
    holds its whole s b (72 h + 12 a s + 16) while the blocks before it still hold theirs."""
    from labkit.recompute import checkpoint_every, memory_gpt
    for s, b, h, a in SHAPES:
        config = GPTConfig(vocab_size=32, block_size=s, n_layer=3, n_head=a, n_embd=h)
        kept, given = kept_bytes(s, b, h, a), s * b * h * 8
        # bytes saved per block in forward, k = 2: the wrapped ones keep their input only
        model = memory_gpt(config, DROPOUT, seed=rank).double()
        checkpoint_every(model, 2)
        x = torch.randn(b, s, h, dtype=torch.float64, requires_grad=True)
        for i, block in enumerate(model.blocks):
            with SavedBytes(model) as saved:
                x = block(x)
            want = given if i % 2 == 0 else kept
            assert saved.bytes == want, (
                f"recompute.checkpoint: rank {rank}, s={s} b={b} h={h} a={a}, block {i} "
                f"({'wrapped' if i % 2 == 0 else 'kept'}): saves {saved.bytes} B, want {want} B")
        for k in (1, 2, 3, 4):
            model = memory_gpt(config, DROPOUT, seed=rank).double()
            checkpoint_every(model, k)
            held = [given if i % k == 0 else kept for i in range(3)]
            want = max(sum(held), max(sum(held[:j]) + kept for j in range(3) if j % k == 0))
            peak = SavedPeak(model)
            x = torch.randn(b, s, h, dtype=torch.float64, requires_grad=True)
            with peak.hooks():
                out = x
                for block in model.blocks:
                    out = block(out)
                out.sum().backward()
            assert peak.peak == want, (
                f"recompute.checkpoint: rank {rank}, every {k}-th of 3 blocks, s={s} b={b} h={h} a={a}: peak of "
                f"saved bytes over forward and backward measured {peak.peak} B, want {want} B = max(end of forward "
                f"{sum(held)}, while block j is rebuilt: the blocks before it + its whole {kept})")


class Scale(nn.Module):
    """A block that saves exactly its input (x * w, w a parameter): A = I, Chen's setting."""

    def __init__(self, h):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, h, dtype=torch.float64))

    def forward(self, x):
        return x * self.w


class Stack(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def segments_on_rank(cases=()) -> None:
    from labkit.recompute import checkpoint_segments, memory_gpt
    rank = dist.get_rank()
    for bad in (0, -2):
        with pytest.raises(ValueError):
            checkpoint_segments(memory_gpt(CONFIG), bad)
    plain = train(memory_gpt(CONFIG, DROPOUT, seed=rank).double(), rank)
    plain_stream = train_stream(memory_gpt(CONFIG, DROPOUT, seed=rank).double(), rank)
    L = CONFIG.n_layer
    for k in (1, 2, 3, L, L + 1):
        what = f"recompute.segments: rank {rank}, segments of {k} of {L} blocks"
        want = [list(range(i, min(i + k, L))) for i in range(0, L, k)]
        model = memory_gpt(CONFIG, DROPOUT, seed=rank).double()
        blocks = list(model.blocks)
        got = checkpoint_segments(model, k)
        assert [list(run) for run in got] == want, f"{what}: segments {got}, want {want}"
        events, phase = [], ["forward"]
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda mod, args, i=i: events.append((phase[0], i)))
        x, y = tokens(rank, 0)
        loss = model(x, y)[1]
        phase[0] = "backward"
        loss.backward()
        expected = [("forward", i) for i in range(L)] + [("backward", i) for run in reversed(want) for i in run]
        assert events == expected, (f"{what}: block forwards traced {events}, want {expected} (in backward each "
                                    "segment rebuilt whole, in order, the last segment first)")
        model = memory_gpt(CONFIG, DROPOUT, seed=rank).double()
        checkpoint_segments(model, k)
        assert_same_training(train(model, rank), plain, what + " vs no checkpointing (dropout on)")
        if k == 2:
            model = memory_gpt(CONFIG, DROPOUT, seed=rank).double()
            checkpoint_segments(model, k)
            stream = train_stream(model, rank)
            for step in range(STREAM_STEPS):
                assert torch.equal(stream[2][step], plain_stream[2][step]), (
                    f"{what}, step {step} (RNG seeded once): the global RNG stream after backward is not where "
                    "training without checkpointing leaves it")
            assert_same_training(stream, plain_stream, what + f", RNG seeded once over {STREAM_STEPS} steps")
    # the peak of saved bytes, measured over forward and backward, vs the formula
    def measured_peak(model, x):
        peak = SavedPeak(model)
        with peak.hooks():
            out = model(x)
            out.sum().backward()
        return peak.peak

    def formula(L, k, given, block):
        runs = [min(k, L - i) for i in range(0, L, k)]
        return max(len(runs) * given, max(j * given + n * block for j, n in enumerate(runs)))

    for s, b, h, a in SHAPES[:2]:
        config = GPTConfig(vocab_size=32, block_size=s, n_layer=4, n_head=a, n_embd=h)
        given, block = s * b * h * 8, kept_bytes(s, b, h, a)
        for k in (1, 2, 3, 4):
            model = memory_gpt(config, DROPOUT, seed=rank).double()
            checkpoint_segments(model, k)
            stack = Stack(list(model.blocks))
            got = measured_peak(stack, torch.randn(b, s, h, dtype=torch.float64, requires_grad=True))
            want = formula(4, k, given, block)
            assert got == want, (
                f"recompute.segments: rank {rank}, 4 MemoryBlocks in segments of {k}, s={s} b={b} h={h} a={a}: peak "
                f"of saved bytes measured {got} B, want {want} B = max(ceil(L/k) inputs, j inputs + the k blocks of "
                f"segment j rebuilt, {block} B each)")
    # sqrt(L): 16 blocks that each save their input (A = I): the measured peak is least at k = 4
    h, layers = 64, 16
    peaks = {}
    for k in range(1, layers + 1):
        stack = Stack([Scale(h) for _ in range(layers)])
        checkpoint_segments(stack, k)
        peaks[k] = measured_peak(stack, torch.randn(2, h, dtype=torch.float64, requires_grad=True))
        want = formula(layers, k, 2 * h * 8, 2 * h * 8)
        assert peaks[k] == want, (f"recompute.segments: rank {rank}, {layers} blocks saving their input, segments of "
                                  f"{k}: peak measured {peaks[k]} B, want {want} B")
    best = [k for k in peaks if peaks[k] == min(peaks.values())]
    assert 4 in best and peaks[4] * 2 < peaks[1], (
        f"recompute.segments: rank {rank}: the least peak at k = {best}, want k = sqrt(16) = 4 among them (its "
        f"neighbours tie: a short last segment is rebuilt cheaply) and under half of k = 1's: {peaks}")
    segments_drawn(rank, cases)


# ----------------------------------------------------------------------------- selective

def selective_on_rank(cases=()) -> None:
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
        # without dropout too: nothing random to replay, yet the scores and softmax are still not kept
        model0 = memory_gpt(config, 0.0, selective=True, seed=rank).double()
        x0 = torch.randn(b, s, h, dtype=torch.float64, requires_grad=True)
        with SavedBytes(model0) as saved:
            model0.blocks[0](x0)
        want = drawn_saved_bytes(s, b, h, a, True, False)
        assert saved.bytes == want, (
            f"{what}, s={s} b={b} h={h} a={a}, dropout 0: a block saves {saved.bytes} B, want {want} B (selective "
            f"recomputation drops the scores and softmax with or without dropout)")
        # the peak over forward and backward, measured: every block's share at the end of forward,
        # and in backward at most one attention core (12 a s^2 b in fp32) rebuilt on top of it
        model = memory_gpt(config, DROPOUT, selective=True, seed=rank).double()
        peak = SavedPeak(model)
        x = torch.randn(b, s, h, dtype=torch.float64, requires_grad=True)
        with peak.hooks():
            out = x
            for block in model.blocks:
                out = block(out)
            end_of_forward = peak.live_bytes()
            out.sum().backward()
        per_block, core = kept_bytes(s, b, h, a, selective=True), 3 * a * s * s * b * 8
        assert end_of_forward == 2 * per_block and peak.peak <= 2 * per_block + core, (
            f"{what}, s={s} b={b} h={h} a={a}, 2 blocks: saved bytes measured {end_of_forward} B at the end of "
            f"forward (want 2 x {per_block}) and {peak.peak} B at the peak of backward (want at most "
            f"{2 * per_block + core}: one attention core rebuilt at a time)")
    selective_drawn(rank, cases)


# ----------------------------------------------------------------------------- offload

class WatchedPool:
    """Watches an OffloadPool from outside (wrapping the methods it must go through: ``pack``,
    ``_to_host``, ``_to_device``): weak references to every tensor autograd handed it (they must
    die once forward is done: the device memory is freed) and to every copy brought back (they
    must die once backward is past their layer), and a log of those copies interleaved with
    backward entering each block (a gradient hook on the block's output)."""

    def __init__(self, pool, model):
        self.pool, self.log, self.handed, self.copies = pool, [], [], []
        self.layer_of, self.current = {}, [None]
        pack, to_host, to_device = pool.pack, pool._to_host, pool._to_device

        def watched_pack(index, t):
            self.current[0] = index
            handle = pack(index, t)
            if not (isinstance(handle, tuple) and handle and handle[0] == "kept"):
                self.handed.append((index, StorageWeakRef(t.untyped_storage())))
            return handle

        def watched_to_host(t):
            host = to_host(t)
            self.layer_of[host.untyped_storage()._cdata] = (self.current[0], StorageWeakRef(host.untyped_storage()))
            return host

        def watched_to_device(t, device):
            layer, _ = self.layer_of.get(t.untyped_storage()._cdata, (None, None))
            copy = to_device(t, device)
            self.copies.append((layer, StorageWeakRef(copy.untyped_storage()), copy.untyped_storage().nbytes()))
            self.log.append(("copy", layer, self.live_copy_bytes()))
            return copy

        pool.pack, pool._to_host, pool._to_device = watched_pack, watched_to_host, watched_to_device
        for i, block in enumerate(model.blocks):
            block.register_forward_hook(lambda mod, args, out, i=i: self._watch_output(out, i))

    def _watch_output(self, out, i):
        if out.requires_grad:
            out.register_hook(lambda grad: self.log.append(("enter", i, 0)))

    def live_copy_bytes(self) -> int:
        return sum(n for _, ref, n in self.copies if not ref.expired())

    def new_step(self):
        self.log, self.handed, self.copies = [], [], []


def offload_on_rank(cases=()) -> None:
    from labkit.recompute import OffloadPool, memory_gpt, offloaded_forward
    rank = dist.get_rank()
    what = f"recompute.offload: rank {rank}"
    layers, (s, b, h, a) = CONFIG.n_layer, (8, 3, CONFIG.n_embd, CONFIG.n_head)
    layer_bytes = kept_bytes(s, b, h, a)
    plain = train(memory_gpt(CONFIG, DROPOUT, seed=rank).double(), rank)
    model = memory_gpt(CONFIG, DROPOUT, seed=rank).double()
    pool = OffloadPool(model, device="cpu")  # one pool for every step
    watch = WatchedPool(pool, model)

    def forward(model, x, y):
        watch.new_step()
        pool.events.clear()
        loss = offloaded_forward(model, pool, x, y)[1]
        step = len(losses)
        alive = sorted({i for i, ref in watch.handed if not ref.expired()})
        assert watch.handed, (f"{what}, step {step}: nothing offloaded: the pool handed every saved tensor back "
                              "to autograd as it was (kept)")
        assert not alive, (
            f"{what}, step {step}: after forward, tensors autograd saved in layers {alive} are still alive on the "
            f"device ({len(watch.handed)} handed to the pool): offloading must drop every reference to them")
        assert pool.host_bytes == layers * layer_bytes and pool.device_bytes == 0, (
            f"{what}, step {step}: after forward the host holds {pool.host_bytes} B and the device "
            f"{pool.device_bytes} B of saved activations; want {layers} layers x {layer_bytes} B on the host, 0 on the device")
        offloads = [e for e in pool.events if e[0] == "offload"]
        per_layer = [sum(e[2] for e in offloads if e[1] == i) for i in range(layers)]
        assert per_layer == [layer_bytes] * layers, f"{what}, step {step}: bytes offloaded per layer {per_layer}, want {layer_bytes} each"
        losses.append(loss)
        return loss

    def after_backward(step):
        log = watch.log
        enters = {i: n for n, (kind, i, _) in enumerate(log) if kind == "enter"}
        assert sorted(enters) == list(range(layers)), f"{what}, step {step}: test set-up, blocks entered {log}"
        for j in range(layers):
            at = [n for n, (kind, i, _) in enumerate(log) if kind == "copy" and i == j]
            assert at, f"{what}, step {step}: layer {j} never copied back to the device through _to_device ({log})"
            assert at == list(range(at[0], at[0] + len(at))), (
                f"{what}, step {step}: layer {j}'s copies are not brought back together ({log})")
            if j < layers - 1:
                assert enters[j + 1] < at[0] and at[-1] < enters[j], (
                    f"{what}, step {step}: layer {j} copied back at log positions {at[0]}..{at[-1]}, backward entered "
                    f"block {j + 1} at {enters[j + 1]} and block {j} at {enters[j]}: want it fetched ahead of "
                    f"need (after block {j + 1} is entered, before block {j} is), never two layers ahead. Log: {log}")
        assert sum(1 for e in log if e[0] == "copy") == len(watch.handed), (
            f"{what}, step {step}: {sum(1 for e in log if e[0] == 'copy')} copies back for {len(watch.handed)} "
            "tensors offloaded: each layer must come back once")
        most = max(n for kind, _, n in log if kind == "copy")
        assert most <= 2 * layer_bytes, (f"{what}, step {step}: {most} B of copies alive on the device at once, "
                                         f"measured; at most two layers ({2 * layer_bytes} B)")
        alive = sorted({layer for layer, ref, _ in watch.copies if not ref.expired()})
        assert not alive, f"{what}, step {step}: after backward the copies of layers {alive} are still alive"
        back = [e for e in pool.events if e[0] != "offload"]
        want = [("fetch", layers - 1, layer_bytes)] + [("prefetch", i, layer_bytes) for i in reversed(range(layers - 1))]
        assert back == want, f"{what}, step {step}: the pool's events for backward {back}, want {want}"
        assert pool.host_bytes == 0, f"{what}, step {step}: {pool.host_bytes} B left on the host after backward"

    losses = []
    got = train(model, rank, forward=forward, on_step=after_backward)
    assert_same_training(got, plain, what + f" vs no offloading (one pool over {STEPS} steps)")
    offload_drawn(rank, [OFFLOAD_FIXED, *cases])


# One pool over two steps of other shapes (fewer rows, then shorter rows), on every seed.
OFFLOAD_FIXED = dict(layers=2, heads=2, width=4, seq=5, batch=2, seq2=3, batch2=1, dropout=0.0, scale=-0.5,
                     k=1, number=-1, replay="")


# ----------------------------------------------------------------------------- accumulate

def accumulate_on_rank(seed: int) -> None:
    from labkit.models import GPT
    from labkit.recompute import accumulate
    rank, n = dist.get_rank(), dist.get_world_size()
    config = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    with pytest.raises(ValueError):
        accumulate(GPT(config), [], lambda m, x, y: m(x, y)[1])
    # groups: every rank; then rank pairs ({0, 1} and {2, 3} at N = 4; {0, 2} and {1} alone at N = 3)
    layouts = [("every rank", None, list(range(n)))]
    if n >= 3:
        pairs = [[0, 1], [2, 3]] if n == 4 else [[0, 2], [1]]
        groups = [dist.new_group(ranks) for ranks in pairs]
        mine = next(i for i, ranks in enumerate(pairs) if rank in ranks)
        layouts.append((f"the pair {pairs[mine]}", groups[mine], pairs[mine]))
    # micro-batch sizes (rows of 8 tokens) per rank: m = 1, 2, 3, equal and unequal
    sizes_of = [lambda r: [3], lambda r: [2, 2], lambda r: [1, 3 + r % 2, 2]]
    for where, group, members in layouts:
        for sizes in sizes_of if group is None else sizes_of[2:]:
            model, ref = GPT(config, seed=5).double(), GPT(config, seed=5).double()
            for m in (model, ref):  # a frozen parameter and one the forward never uses: neither has a gradient
                m.wpe.weight.requires_grad_(False)
                m.unused = nn.Parameter(torch.zeros(3, dtype=torch.float64))
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
            ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
            for step in range(3):
                batches = {r: [tokens(r, 10 * step + j, batch=size) for j, size in enumerate(sizes(r))] for r in range(n)}
                micro = len(batches[rank])
                what = (f"recompute.accumulate: rank {rank} of {n}, over {where}, step {step}, micro-batches of "
                        f"{[x.shape[0] for x, _ in batches[rank]]} rows")
                seen = []

                def loss_fn(m, x, y):
                    seen.append(len(tracer.events))  # communication so far, before this micro-batch
                    return m(x, y)[1]

                opt.zero_grad()
                with CommTracer() as tracer:
                    got = accumulate(model, batches[rank], loss_fn, group=group)
                assert seen == [0] * micro, (f"{what}: ops traced before each micro-batch {seen}; nothing may move "
                                             "before the last backward")
                params = [p for p in model.parameters() if p.requires_grad and p is not model.unused]
                want = [Op("all_reduce", p.numel() * 8, group=members) for p in params] if len(members) > 1 else []
                assert_ops(tracer, want, what + " (after the last micro-batch: one all-reduce per parameter "
                                                "gradient over the group, none for frozen or unused parameters)")
                assert model.unused.grad is None and model.wpe.weight.grad is None, (
                    f"{what}: the frozen or the unused parameter got a gradient")
                # the reference: each rank's micro-batches as one batch (a mean over its tokens), ranks averaged
                ref_opt.zero_grad()
                own = [ref(torch.cat([x for x, _ in batches[r]]), torch.cat([y for _, y in batches[r]]))[1]
                       for r in members]
                (sum(own) / len(members)).backward()
                assert isinstance(got, torch.Tensor) and not got.requires_grad, (
                    f"{what}: the loss returned must be detached (it would hold every micro-batch's graph)")
                assert_close(got, own[members.index(rank)].detach(),
                             f"{what}: the loss returned vs the mean over this rank's tokens")
                for i, (p, r) in enumerate(zip(model.parameters(), ref.parameters())):
                    if r.grad is not None:
                        assert_close(p.grad, r.grad, f"{what}: gradient of parameter {i} vs one batch of each "
                                                     "rank's micro-batches (mean over its tokens), ranks averaged")
                opt.step()
                ref_opt.step()
    accumulate_padded(rank, n, seed)


ACC_SHAPES = [(2, 8, 3), (3, 5, 4), (2, 3, 3)]   # (rows, sequence length, most padded positions) per micro-batch


def padded_batches(rank: int, step: int, ignore_index: int):
    """Rank ``rank``'s micro-batches at ``step``: ``ACC_SHAPES``, each row's targets ending in
    0 ... pad positions of ``ignore_index`` (right-padded sequences of other lengths); at step 1
    rank 0's last micro-batch is padding only (it weighs 0)."""
    out = []
    for j, (rows, seq, pad) in enumerate(ACC_SHAPES):
        gen = torch.Generator().manual_seed(9000 + 100 * rank + 10 * step + j)
        x, y = tokens(rank, 20 * step + j, batch=rows, seq=seq)
        y = y.clone()
        for row in range(rows):
            cut = int(torch.randint(0, pad + 1, (), generator=gen))
            if cut:
                y[row, seq - cut:] = ignore_index
        out.append((x, y))
    if rank == 0 and step == 1:
        out[-1] = (out[-1][0], torch.full_like(out[-1][1], ignore_index))
    return out


def drawn_batches(seed: int, case: int, rank: int, ignore_index: int):
    """Drawn case ``case``'s micro-batches of rank ``rank``: 1-4 of them, each 1-3 rows of 1-8
    tokens (its own length), each row right-padded by a drawn number of ``ignore_index``
    targets (a whole micro-batch may be padding, never all of a rank's)."""
    draw = random.Random((seed * 1_000_003 + case) * 31 + rank)
    out = []
    for j in range(draw.randint(1, 4)):
        rows, seq = draw.randint(1, 3), draw.randint(1, 8)
        x, y = tokens(rank, 1000 + 10 * case + j, batch=rows, seq=seq)
        y = y.clone()
        for row in range(rows):
            cut = draw.randint(0, seq)
            if cut:
                y[row, seq - cut:] = ignore_index
        out.append((x, y))
    if all((y == ignore_index).all() for _, y in out):
        out[0][1][0, 0] = 3  # at least one counted target on every rank
    return out


def accumulate_padded(rank: int, n: int, seed: int) -> None:
    """Issue 42: padded targets. Micro-batches of different sequence lengths (8, 5, 3 tokens),
    right-padded with ``ignore_index`` (-100, and -1 with a loss that ignores -1), one of them
    wholly padded on rank 0 (it weighs 0), 2 steps over every rank: the gradient is that of the
    sum of every counted target's loss over this rank's micro-batches divided by their count
    (not by y.numel(), which counts the padding), averaged over the ranks; the loss returned.
    Then configurations drawn with the run's seed: 1-4 micro-batches per rank of drawn rows,
    lengths and padding, ignore_index -100, -1 or 0 (a class id)."""
    import torch.nn.functional as F
    from labkit.models import GPT
    from labkit.recompute import accumulate
    config = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)

    cases = [(ignore_index, step, None) for ignore_index in (-100, -1) for step in range(2)]
    cases += [(random.Random(seed + i).choice((-100, -1, 0)), None, i) for i in range(examples(2, 30))]
    model, ref = GPT(config, seed=6).double(), GPT(config, seed=6).double()
    for ignore_index, step, case in cases:
        def loss_fn(m, x, y, reduction="mean"):
            return F.cross_entropy(m(x)[0].flatten(0, 1), y.flatten(), ignore_index=ignore_index, reduction=reduction)

        def batches_of(r):
            return padded_batches(r, step, ignore_index) if case is None else drawn_batches(seed, case, r, ignore_index)

        batches = batches_of(rank)
        counted = [int((y != ignore_index).sum()) for _, y in batches]
        what = (f"recompute.accumulate: rank {rank} of {n}, ignore_index={ignore_index}, "
                f"{f'step {step}' if case is None else f'drawn case {case} (LABKIT_SEED={seed})'}, micro-batches "
                f"{[tuple(x.shape) for x, _ in batches]} with {counted} counted targets (the rest padding)")
        if case is None:
            assert sum(y.numel() for _, y in batches) > sum(counted), "test set-up: some targets should be padding"
        model.zero_grad()
        got = accumulate(model, batches, loss_fn, ignore_index=ignore_index)
        # the reference: per rank, the summed loss of its counted targets / their count; ranks averaged
        ref.zero_grad()
        means = []
        for r in range(n):
            theirs = batches_of(r)
            count = sum(int((y != ignore_index).sum()) for _, y in theirs)
            means.append(sum(loss_fn(ref, x, y, "sum") for x, y in theirs) / count)
        (sum(means) / n).backward()
        assert_close(got, means[rank].detach(), f"{what}: the loss returned vs the mean over this rank's counted targets")
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            assert_close(p.grad, r.grad, f"{what}: gradient of {name} vs the mean over each rank's counted "
                                         "targets (weights c_i / C with c_i the targets not ignored), ranks averaged")


# ----------------------------------------------------------------------------- optimizer offload

def optimizer_offload_on_rank(seed: int) -> None:
    from labkit.memory import tensor_bytes
    from labkit.models import GPT
    from labkit.recompute import OffloadedAdamW
    rank = dist.get_rank()
    config = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    with pytest.raises(ValueError):
        OffloadedAdamW([nn.Parameter(torch.zeros(2), requires_grad=False)])
    hyper = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        model = GPT(config, seed=rank).to(dtype)
        model.wpe.weight.requires_grad_(False)                         # frozen: not the optimizer's
        model.sometimes = nn.Parameter(torch.ones(4, dtype=dtype))     # a gradient on even steps only
        model.unused = nn.Parameter(torch.ones(2, dtype=dtype))        # never a gradient
        params = [p for p in model.parameters() if p.requires_grad]
        psi = sum(p.numel() for p in params)
        opt = OffloadedAdamW(model.parameters(), **hyper)
        what = f"recompute.optimizer_offload: rank {rank}, {dtype} model"
        assert len(opt.master) == len(params), f"{what}: {len(opt.master)} masters for {len(params)} trainable parameters"
        host = opt.master + opt.exp_avg + opt.exp_avg_sq
        assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in host), (
            f"{what}: master weights and both moments must be fp32 tensors on the host, got "
            f"{sorted({(t.device.type, str(t.dtype)) for t in host})}")
        assert not any(t.requires_grad or t.grad_fn is not None for t in host), (
            f"{what}: the host tensors must be plain copies, outside autograd (copied from p.detach()): "
            "one of them requires a gradient or holds a graph")
        assert tensor_bytes(host) == 12 * psi, f"{what}: host holds {tensor_bytes(host)} B, want 12 x {psi} (fp32 master + 2 moments)"
        assert all(t.is_pinned() == torch.cuda.is_available() for t in opt.master), f"{what}: host master pinned iff CUDA"
        ref_master = [p.detach().float().clone().requires_grad_(True) for p in params]
        ref_opt = torch.optim.AdamW(ref_master, **hyper)
        moved = 0
        for step in range(STEPS):
            x, y = tokens(rank, step)
            opt.zero_grad()
            loss = model(x, y)[1]
            if step % 2 == 0:
                loss = loss + (model.sometimes.float() ** 2).sum() * 0.1
            loss.backward()
            grads = [None if p.grad is None else p.grad.float() for p in params]
            moved += sum(2 * p.grad.nbytes for p in params if p.grad is not None)
            opt.step()
            for w, g in zip(ref_master, grads):
                w.grad = g
            ref_opt.step()
            assert opt.moved_bytes == moved, (
                f"{what}, step {step}: {opt.moved_bytes} B over the link so far, want {moved} "
                f"(each gradient down and each parameter up in the model's dtype, for parameters with a gradient)")
            for i, (p, w, ref) in enumerate(zip(params, opt.master, ref_master)):
                assert_close(w, ref.detach(), f"{what}, step {step}: fp32 master of parameter {i} vs torch.optim.AdamW "
                                              f"{hyper} (each parameter's own step count)")
                assert p.dtype == dtype and torch.equal(p.detach(), w.to(dtype)), (
                    f"{what}, step {step}: parameter {i} on the device must be its updated master cast to {dtype}")
    optimizer_offload_link(rank, seed)


# ----------------------------------------------------------------------------- an emulated device and its link

class OnDevice(torch.Tensor):
    """A CPU tensor that says it lives on the accelerator (device ``meta`` here: a device type
    that needs no driver). Only ``Link`` runs operations on it."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(), dtype=inner.dtype,
                                                device=torch.device("meta"), requires_grad=inner.requires_grad)
        t.inner = inner
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError("OnDevice: an operation outside Link")

    def __repr__(self):
        return f"OnDevice({self.inner!r})"


def _is_device(t) -> bool:
    return isinstance(t, OnDevice)


class Link(TorchDispatchMode):
    """Runs every operation as a GPU would place it, and measures the traffic between host and
    device: an operation on device tensors gives device tensors; one that mixes device and host
    tensors (other than 0-d host scalars) raises, as CUDA does; ``copy_`` and ``.to(...)`` across
    the link are logged as ("d2h" | "h2d", bytes). The bytes of a copy that also casts are those
    of the dtype the transfer carries, as ATen's CUDA copy does (aten/src/ATen/native/cuda/Copy.cu):
    a copy to the device converts on the host first (the destination's dtype crosses), a
    blocking copy to the host converts after the transfer (the source's dtype crosses), a
    non-blocking one converts on the device first (the destination's dtype)."""

    def __init__(self):
        super().__init__()
        self.log: list[tuple[str, int]] = []

    def bytes(self, direction: str) -> int:
        return sum(n for d, n in self.log if d == direction)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_leaves, tree_map
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        inner = lambda a: a.inner if _is_device(a) else a
        to_device = kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "meta"
        if name == "_to_copy":
            src = args[0]
            target = to_device if kwargs.get("device") is not None else _is_device(src)
            out = func(inner(src), **dict(kwargs, device=torch.device("cpu")))
            if target != _is_device(src):
                carried = out if target or kwargs.get("non_blocking") else src
                self.log.append(("h2d" if target else "d2h", out.numel() * carried.element_size()))
            return OnDevice(out) if target else out
        if name == "copy_":
            dst, src = args[0], args[1]
            if _is_device(dst) != _is_device(src) and not (src.dim() == 0 and not _is_device(src)):
                blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
                carried = src if not _is_device(dst) and blocking else dst
                self.log.append(("h2d" if _is_device(dst) else "d2h", dst.numel() * carried.element_size()))
            func(inner(dst), inner(src), *args[2:], **kwargs)
            return dst
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on = {_is_device(t) for t in tensors if _is_device(t) or t.dim() > 0}
        if len(on) > 1:
            raise RuntimeError(f"Link: {name} mixes device and host tensors (a GPU raises: expected all tensors on "
                               "the same device)")
        if kwargs.get("device") is not None:
            kwargs = dict(kwargs, device=torch.device("cpu"))
        out = func(*tree_map(inner, args), **tree_map(inner, kwargs))
        if on != {True} and not to_device:
            return out
        if func._schema.is_mutable and args and _is_device(args[0]):
            return args[0]
        return tree_map(lambda t: OnDevice(t) if isinstance(t, torch.Tensor) else t, out)


def optimizer_offload_link(rank: int, seed: int) -> None:
    """``OffloadedAdamW`` on an emulated device (``Link``): parameters of three dtypes at once
    (bf16, fp16, fp32: 2 + 2 + 4 bytes) in two param groups (the second with its own lr, betas
    and no weight decay), a frozen one, one without a gradient at step 2, random gradients, 3
    steps; a parameter in two groups and an unknown option refused. The traffic is measured, not read from ``moved_bytes``: each step, down
    exactly each gradient in its dtype, up exactly each parameter in its dtype (an update run on
    the device, its fp32 state sent up and back, moves 4 bytes a parameter more each way and
    fails); ``moved_bytes`` grows by the measured bytes; the master and moments stay host
    tensors; master vs torch.optim.AdamW, parameters = master cast. Then drawn cases (the run's
    seed): 1-6 parameters of those dtypes and drawn shapes, perhaps one frozen, in 1-3 groups
    each overriding drawn options, gradients missing at drawn steps, 2-4 steps."""
    hyper = dict(lr=3e-2, betas=(0.85, 0.97), eps=1e-7, weight_decay=0.05)
    shapes = [((4, 3), torch.bfloat16), ((5,), torch.float16), ((2, 2), torch.float32), ((3,), torch.bfloat16)]
    second = dict(lr=1e-2, weight_decay=0.0, betas=(0.9, 0.99))
    offload_on_link(f"recompute.optimizer_offload: rank {rank}, an emulated device, parameters in bf16, fp16 and "
                    f"fp32, two param groups (defaults {hyper}; then {second})", hyper, shapes, frozen=3,
                    groups=[([0, 1], {}), ([2], second)], missing={(1, 1)}, steps=3,
                    gen=torch.Generator().manual_seed(300 + rank), refusals=True)
    rng = configs.stream(seed, f"recompute.optimizer_offload:{rank}")
    for case in range(configs.budget(ci=4, long=40)):
        count = rng.randint(1, 6)
        shapes = [(tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 2))),
                   rng.choice((torch.bfloat16, torch.float16, torch.float32))) for _ in range(count)]
        frozen = rng.randrange(count) if count > 1 and rng.random() < 0.3 else None
        trained = [i for i in range(count) if i != frozen]
        order = rng.sample(range(len(trained)), len(trained))
        cuts = sorted(rng.sample(range(1, len(trained)), min(rng.randint(0, 2), len(trained) - 1)))
        groups = []
        for a, b in zip([0, *cuts], [*cuts, len(trained)]):
            options = dict(lr=round(rng.uniform(1e-3, 5e-2), 4), betas=(round(rng.uniform(0.5, 0.95), 3),
                           round(rng.uniform(0.9, 0.999), 4)), eps=10 ** rng.uniform(-8, -5),
                           weight_decay=rng.choice((0.0, round(rng.uniform(0, 0.2), 3))))
            groups.append((sorted(order[a:b]), {k: v for k, v in options.items() if rng.random() < 0.6}))
        steps = rng.randint(2, 4)
        missing = {(t, i) for t in range(steps) for i in range(len(trained)) if rng.random() < 0.2}
        defaults = dict(lr=round(rng.uniform(1e-3, 5e-2), 4), betas=(0.9, 0.999), eps=1e-8,
                        weight_decay=round(rng.uniform(0, 0.1), 3))
        offload_on_link(f"recompute.optimizer_offload: rank {rank}, drawn case {case}: {shapes}, frozen {frozen}, "
                        f"groups {groups}, defaults {defaults}, no gradient at (step, i) {sorted(missing)} "
                        f"{configs.replay('recompute.optimizer_offload')}", defaults, shapes, frozen, groups,
                        missing, steps, torch.Generator().manual_seed(rng.randrange(10 ** 6)))


def offload_on_link(what: str, hyper: dict, shapes: list, frozen, groups: list, missing: set, steps: int,
                    gen: torch.Generator, refusals: bool = False) -> None:
    """``steps`` steps of ``OffloadedAdamW`` over parameters of ``shapes`` ((shape, dtype)) on the
    emulated device, parameter ``frozen`` not trainable, the trainable ones in ``groups`` ((their
    indices among the trainable, options)); no gradient for (step, i) in ``missing``."""
    from labkit.recompute import OffloadedAdamW
    with Link() as link:
        params = [nn.Parameter(OnDevice(torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)))
                  for shape, dtype in shapes]
        if frozen is not None:
            params[frozen].requires_grad_(False)  # frozen: not the optimizer's
        trained = [p for i, p in enumerate(params) if i != frozen]
        dtypes = [p.dtype for p in trained]
        ref_master = [p.inner.detach().float().clone().requires_grad_(True) for p in trained]
        ref_opt = torch.optim.AdamW([{"params": [ref_master[i] for i in idx], **opts} for idx, opts in groups], **hyper)
        if refusals:
            for bad in ([{"params": params[:2]}, {"params": params[1:3]}], [{"params": params[:2], "momentum": 0.9}]):
                with pytest.raises(ValueError):
                    OffloadedAdamW(bad, **hyper)
        opt = OffloadedAdamW([{"params": [trained[i] for i in idx], **opts} for idx, opts in groups], **hyper)
        order = [i for idx, _ in groups for i in idx]   # the optimizer's parameter order
        host = opt.master + opt.exp_avg + opt.exp_avg_sq
        assert not any(_is_device(t) for t in host), f"{what}: the master and the moments must live on the host"
        for step in range(steps):
            grads = [None if (step, i) in missing else
                     torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) for i, p in enumerate(trained)]
            for p, g in zip(trained, grads):
                p.grad = None if g is None else OnDevice(g.clone())
            link.log.clear()
            before = opt.moved_bytes
            opt.step()
            down = sum(g.numel() * g.element_size() for g in grads if g is not None)
            up = sum(p.numel() * p.element_size() for p, g in zip(trained, grads) if g is not None)
            where = f"{what}, step {step + 1}"
            assert (link.bytes("d2h"), link.bytes("h2d")) == (down, up), (
                f"{where}: measured {link.bytes('d2h')} B down and {link.bytes('h2d')} B up the link, want {down} down "
                f"(each gradient in its dtype) and {up} up (each parameter in its dtype, cast on the host); "
                f"copies: {link.log}")
            assert opt.moved_bytes - before == down + up, (
                f"{where}: moved_bytes grew by {opt.moved_bytes - before}, the link carried {down + up} B")
            assert not any(_is_device(t) for t in opt.master + opt.exp_avg + opt.exp_avg_sq), \
                f"{where}: the master and the moments must stay on the host"
            for w, g in zip(ref_master, grads):
                w.grad = None if g is None else g.float()
            ref_opt.step()
            for slot, i in enumerate(order):
                p, w, ref = trained[i], opt.master[slot], ref_master[i]
                assert_close(w, ref.detach(), f"{where}: fp32 master of parameter {i} ({p.dtype}) vs torch.optim.AdamW")
                assert _is_device(p) and p.dtype == dtypes[i] and torch.equal(p.inner, w.to(p.dtype)), (
                    f"{where}: parameter {i} must stay on the device in {dtypes[i]}, equal to its master cast")


# ----------------------------------------------------------------------------- drawn configurations
#
# Issue 39, item 2: besides the fixed cases above, each launch of checkpoint, segments, selective and
# offload runs K configurations drawn in the test process from the run's seed (tests/grading/configs.py:
# printed, ``LABKIT_SEED=S`` replays, ``LABKIT_LONG=1`` draws more): the model's depth L, heads, width,
# sequence length and batch (another shape at the second step: nothing kept from the first call), the
# dropout probability (0 included: then nothing is drawn), k from 1 to L + 2 (k = 1, k = L, k > L and
# k not dividing L all reachable), and a random scale of the loss (the incoming gradient is not 1). The
# RNG is seeded once per case, so the global stream after each backward must equal the plain model's.
# ``Checkpoint.apply`` alone gets drawn argument lists: float tensors with and without a gradient, int64
# ids, float and int non-tensor arguments in a drawn order, 1 to 3 outputs (a lone tensor or a tuple),
# some of them unused, random incoming gradients.

DROPOUTS = (0.0, 0.0, 0.1, 0.3, 0.5)


def draw_model(rng: random.Random, most_layers: int = 5) -> dict:
    a = rng.choice((1, 2, 4))
    s = rng.randint(1, 8)
    batch, seq2, batch2 = rng.randint(1, 3), rng.randint(1, s), rng.randint(1, 3)
    if (batch2, seq2) == (batch, s):  # the second step always another shape
        batch2 = batch % 3 + 1
    return dict(layers=rng.randint(1, most_layers), heads=a, width=a * rng.choice((2, 4)), seq=s,
                batch=batch, seq2=seq2, batch2=batch2,
                dropout=rng.choice(DROPOUTS), scale=rng.choice((1.0, -0.5, 2.5, rng.uniform(-3, 3))))


def draw_cases(task_id: str, world_size: int, apply_cases: bool = False) -> list[dict]:
    """K drawn configurations for one launch of ``task_id`` (the same on every rank)."""
    rng = configs.rng(f"{task_id}:{world_size}")
    cases = []
    for i in range(configs.budget(ci=3, long=30)):
        case = draw_model(rng, most_layers=3 if task_id == "recompute.offload" else 6)
        case.update(k=rng.randint(1, case["layers"] + 2), number=i,
                    replay=configs.replay(f"{task_id}, world size {world_size}, drawn case {i}"))
        if i < 2:  # every run reaches both corners: dropout off in case 0, on in case 1
            case["dropout"] = 0.0 if i == 0 else rng.choice(DROPOUTS[2:])
        if apply_cases:
            case["apply"] = draw_apply(rng, every_kind=i == 0, lone_tuple=i == 1)
        cases.append(case)
    return cases


def draw_apply(rng: random.Random, every_kind: bool = False, lone_tuple: bool = False) -> dict:
    """A drawn argument list for Checkpoint.apply: (name, kind) in a drawn order. ``every_kind``
    keeps every kind of argument (int64 ids, an int, floats); ``lone_tuple``: fn returns a 1-tuple."""
    args = [("x", "grad"), ("y", rng.choice(("grad", "nograd"))), ("mask", "nograd"), ("ids", "int"),
            ("scale", "float"), ("reps", "intarg"), ("p", "float")]
    args = [arg for arg in args if every_kind or arg[0] in ("x", "p") or rng.random() < 0.7]
    rng.shuffle(args)
    outputs = 1 if lone_tuple else rng.randint(1, 3)
    used = sorted(rng.sample(range(outputs), rng.randint(1, outputs)))
    return dict(args=args, outputs=outputs, used=used, tuple_out=outputs > 1 or lone_tuple or rng.random() < 0.5,
                p=rng.choice((0.0, 0.3)), scale=rng.uniform(-2, 2), reps=rng.randint(0, 2),
                b=rng.randint(1, 3), t=rng.randint(1, 5), b2=rng.randint(1, 3), t2=rng.randint(1, 5))


def drawn_config(case: dict) -> GPTConfig:
    return GPTConfig(vocab_size=32, block_size=case["seq"], n_layer=case["layers"], n_head=case["heads"],
                     n_embd=case["width"])


def drawn_what(task_id: str, rank: int, case: dict) -> str:
    name = "a fixed case" if case["number"] < 0 else f"drawn case {case['number']}"
    return (f"{task_id}: rank {rank}, {name} (L={case['layers']} blocks, k={case['k']}, "
            f"h={case['width']}, a={case['heads']}, [b, s] = [{case['batch']}, {case['seq']}] then "
            f"[{case['batch2']}, {case['seq2']}], dropout {case['dropout']}, loss x {case['scale']:.3g}) "
            f"{case['replay']}")


def drawn_training(model, rank: int, case: dict, forward=None):
    """2 AdamW steps, the RNG seeded once, shapes [b, s] then [b2, s2], backward of loss x scale:
    (losses, grads per step, the global RNG state after each backward)."""
    forward = forward or (lambda m, x, y: m(x, y)[1])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(900 + 10 * case["number"] + rank)
    losses, grads, states = [], [], []
    for step, (b, s) in enumerate(((case["batch"], case["seq"]), (case["batch2"], case["seq2"]))):
        x, y = tokens(rank, 40 + step, batch=b, seq=s)
        loss = forward(model, x, y)
        opt.zero_grad()
        (loss * case["scale"]).backward()
        states.append(torch.get_rng_state())
        losses.append(loss.detach())
        grads.append([p.grad.clone() if p.grad is not None else None for p in model.parameters()])
        opt.step()
    return losses, grads, states


def assert_same_drawn(got, want, what) -> None:
    for step in range(len(want[0])):
        assert_close(got[0][step], want[0][step], f"{what}, step {step}: loss")
        for i, (g, r) in enumerate(zip(got[1][step], want[1][step])):
            assert (g is None) == (r is None), f"{what}, step {step}: parameter {i} has gradient {g}, want {r}"
            if r is not None:
                assert_close(g, r, f"{what}, step {step}: gradient of parameter {i}")
        assert torch.equal(got[2][step], want[2][step]), (
            f"{what}, step {step}: the global RNG stream after backward is not where the plain model leaves it "
            "(the recompute must redraw the forward's masks on a fork of the stream)")


def checkpoint_drawn(rank: int, cases: list[dict]) -> None:
    from labkit.recompute import checkpoint_every, memory_gpt
    for case in cases:
        what = drawn_what("recompute.checkpoint", rank, case)
        config, L, k = drawn_config(case), case["layers"], case["k"]
        plain = drawn_training(memory_gpt(config, case["dropout"], seed=rank).double(), rank, case)
        model = memory_gpt(config, case["dropout"], seed=rank).double()
        want = [i for i in range(L) if i % k == 0]
        got = checkpoint_every(model, k)
        assert list(got) == want, f"{what}: wraps blocks {list(got)}, want {want} (0, k, 2k, ...)"
        assert_same_drawn(drawn_training(model, rank, case), plain, what + " vs no checkpointing")
        apply_drawn(rank, case)


def apply_drawn(rank: int, case: dict) -> None:
    """Checkpoint.apply(fn, *drawn args) against fn itself, twice (the second call other shapes)."""
    import torch.nn.functional as F
    from labkit.recompute import Checkpoint
    spec = case["apply"]
    names = [name for name, _ in spec["args"]]
    gen = torch.Generator().manual_seed(7000 + 10 * case["number"] + rank)
    lin, emb = nn.Linear(6, 6).double(), nn.Embedding(11, 6).double()
    with torch.no_grad():
        for param in (*lin.parameters(), emb.weight):
            param.copy_(torch.randn(param.shape, dtype=torch.float64, generator=gen))

    def fn(*args):
        got = dict(zip(names, args))
        h = lin(got["x"])
        if "ids" in got:
            h = h + emb(got["ids"])
        h = F.dropout(h, got["p"]) * got.get("scale", 1.0)
        if "mask" in got:
            h = h * got["mask"]
        for _ in range(got.get("reps", 1)):
            h = h.tanh() + (got["y"] if "y" in got else 0)
        outs = (h, h * h.sum(-1, keepdim=True), F.dropout(h, got["p"]).sum(-1))[:spec["outputs"]]
        return outs if spec["tuple_out"] else outs[0]

    kinds = dict(spec["args"])
    for call, (b, t) in enumerate(((spec["b"], spec["t"]), (spec["b2"], spec["t2"]))):
        values = {"x": torch.randn(b, t, 6, dtype=torch.float64, generator=gen),
                  "y": torch.randn(b, t, 6, dtype=torch.float64, generator=gen),
                  "mask": (torch.rand(b, t, 6, generator=gen) > 0.3).double(),
                  "ids": torch.randint(0, 11, (b, t), generator=gen),
                  "scale": spec["scale"], "reps": spec["reps"], "p": spec["p"]}
        incoming = [torch.randn(b, t, 6, dtype=torch.float64, generator=gen) for _ in range(2)] + [
            torch.randn(b, t, dtype=torch.float64, generator=gen)]
        results = []
        for run in (fn, lambda *args: Checkpoint.apply(fn, *args)):
            lin.zero_grad()
            emb.zero_grad()
            args = [values[name].clone().requires_grad_(kinds[name] == "grad")
                    if isinstance(values[name], torch.Tensor) else values[name] for name in names]
            torch.manual_seed(4000 + call + rank)
            outs = run(*args)
            shape_of_result = type(outs).__name__
            outs = outs if isinstance(outs, tuple) else (outs,)
            torch.autograd.backward([outs[i] for i in spec["used"]], [incoming[i] for i in spec["used"]])
            grads = [a.grad for a in args if isinstance(a, torch.Tensor)]
            results.append(([o.detach() for o in outs], grads, [lin.weight.grad, lin.bias.grad, emb.weight.grad],
                             torch.get_rng_state(), shape_of_result))
        what = (f"recompute.checkpoint: rank {rank}, drawn Checkpoint.apply(fn, {', '.join(f'{n} ({kinds[n]})' for n in names)}) "
                f"on [{b}, {t}] (call {call + 1}), {spec['outputs']} output(s) ({'tuple' if spec['tuple_out'] else 'tensor'}), "
                f"backward of outputs {spec['used']} with random incoming gradients, dropout {spec['p']} {case['replay']}")
        (want_outs, want_grads, want_params, want_rng, want_kind), (outs, grads, params, rng_state, kind) = results
        assert kind == want_kind and len(outs) == len(want_outs), (
            f"{what}: returns a {kind} of {len(outs)} output(s), fn a {want_kind} of {len(want_outs)}")
        for i, (o, w) in enumerate(zip(outs, want_outs)):
            assert_close(o, w, f"{what}: output {i}")
        tensor_names = [n for n in names if isinstance(values[n], torch.Tensor)]
        for name, g, w in zip(tensor_names, grads, want_grads):
            if w is None:
                assert g is None, f"{what}: {name} ({kinds[name]}) got a gradient"
            else:
                assert g is not None, f"{what}: {name}.grad is None"
                assert_close(g, w, f"{what}: {name}.grad vs fn without checkpointing")
        for name, g, w in zip(("lin.weight", "lin.bias", "emb.weight"), params, want_params):
            assert (g is None) == (w is None), f"{what}: {name}.grad is {g}, want {w}"
            if w is not None:
                assert_close(g, w, f"{what}: {name}.grad vs fn without checkpointing")
        assert torch.equal(rng_state, want_rng), f"{what}: the global RNG stream is not where fn leaves it"


def segments_drawn(rank: int, cases: list[dict]) -> None:
    from labkit.recompute import checkpoint_segments, memory_gpt
    for case in cases:
        what = drawn_what("recompute.segments", rank, case)
        config, L, k = drawn_config(case), case["layers"], case["k"]
        plain = drawn_training(memory_gpt(config, case["dropout"], seed=rank).double(), rank, case)
        model = memory_gpt(config, case["dropout"], seed=rank).double()
        blocks = list(model.blocks)
        want = [list(range(i, min(i + k, L))) for i in range(0, L, k)]
        got = checkpoint_segments(model, k)
        assert [list(run) for run in got] == want, f"{what}: segments {got}, want {want}"
        events, phase = [], ["forward"]
        hooks = [block.register_forward_pre_hook(lambda mod, args, i=i: events.append((phase[0], i)))
                 for i, block in enumerate(blocks)]
        x, y = tokens(rank, 0, batch=case["batch"], seq=case["seq"])
        loss = model(x, y)[1]
        phase[0] = "backward"
        (loss * case["scale"]).backward()
        for hook in hooks:
            hook.remove()
        expected = [("forward", i) for i in range(L)] + [("backward", i) for run in reversed(want) for i in run]
        assert events == expected, f"{what}: block forwards traced {events}, want {expected}"
        model = memory_gpt(config, case["dropout"], seed=rank).double()
        checkpoint_segments(model, k)
        assert_same_drawn(drawn_training(model, rank, case), plain, what + " vs no checkpointing")


def drawn_saved_bytes(s, b, h, a, selective, dropout, element=8) -> int:
    """The chapter's count (see ``kept_bytes``) with dropout off too: without it no masks are saved,
    s b (64 h + 4 a s + 16), selective s b (64 h + 16); x element size / 4."""
    per_sbh = 72 if dropout else 64
    per_as = 0 if selective else (12 if dropout else 4)
    return s * b * (per_sbh * h + per_as * a * s + 16) * element // 4


def selective_drawn(rank: int, cases: list[dict]) -> None:
    from labkit.recompute import memory_gpt
    for case in cases:
        what = drawn_what("recompute.selective", rank, case)
        config = drawn_config(case)
        plain = drawn_training(memory_gpt(config, case["dropout"], seed=rank).double(), rank, case)
        model = memory_gpt(config, case["dropout"], selective=True, seed=rank).double()
        assert_same_drawn(drawn_training(model, rank, case), plain, what + " vs keeping the attention core")
        s, b, h, a = case["seq"], case["batch"], case["width"], case["heads"]
        x = torch.randn(b, s, h, dtype=torch.float64, requires_grad=True)
        want = drawn_saved_bytes(s, b, h, a, True, case["dropout"] > 0)
        for i, block in enumerate(model.blocks):
            with SavedBytes(model) as saved:
                x = block(x)
            assert saved.bytes == want, f"{what}, block {i}: saves {saved.bytes} B, want {want} B (s b (64 h + 16) x 2, + 8 s b h x 2 of masks with dropout)"


def handed_bytes(model, rank: int, b: int, s: int) -> list[int]:
    """Per block, the bytes of every tensor autograd saves (parameters left out), measured with
    saved_tensors_hooks on a twin model: what a pool is handed in each layer (a tensor saved twice
    counts twice, as the pool copies it twice). The RNG is left as it was."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    per_block = []
    x, _ = tokens(rank, 0, batch=b, seq=s)
    with torch.random.fork_rng():
        h = model.wte(x) + model.wpe(torch.arange(s))
        for block in model.blocks:
            handed = []
            with torch.autograd.graph.saved_tensors_hooks(
                    lambda t: handed.append(0 if t.untyped_storage()._cdata in params else t.nbytes) or t,
                    lambda t: t):
                h = block(h)
            per_block.append(sum(handed))
    return per_block


def offload_drawn(rank: int, cases: list[dict]) -> None:
    from labkit.recompute import OffloadPool, memory_gpt, offloaded_forward
    for case in cases:
        what = drawn_what("recompute.offload", rank, case)
        config, L = drawn_config(case), case["layers"]
        plain = drawn_training(memory_gpt(config, case["dropout"], seed=rank).double(), rank, case)
        model = memory_gpt(config, case["dropout"], seed=rank).double()
        pool = OffloadPool(model, device="cpu")
        shapes = iter(((case["batch"], case["seq"]), (case["batch2"], case["seq2"])))
        books = []

        def forward(m, x, y):
            pool.events.clear()
            loss = offloaded_forward(m, pool, x, y)[1]
            b, s = x.shape
            books.append((b, s, pool.host_bytes, pool.device_bytes))
            return loss

        got = drawn_training(model, rank, case, forward=forward)
        assert_same_drawn(got, plain, what + " vs no offloading (one pool, two steps)")
        for step, (b, s, host, device) in enumerate(books):
            layer = handed_bytes(memory_gpt(config, case["dropout"], seed=rank).double(), rank, b, s)
            assert host == sum(layer) and device == 0, (
                f"{what}, step {step} ([b, s] = [{b}, {s}]): after forward the host holds {host} B and the device "
                f"{device} B; want every tensor autograd saved in the blocks ({layer} B per layer, measured) on "
                "the host, 0 on the device")
        back = [e for e in pool.events if e[0] != "offload"]
        want = [("fetch", L - 1, layer[-1])] + [("prefetch", i, layer[i]) for i in reversed(range(L - 1))]
        assert back == want, f"{what}, last step: the pool's events for backward {back}, want {want}"
        assert pool.host_bytes == 0, f"{what}: {pool.host_bytes} B left on the host after backward"


@task("recompute.checkpoint", points=3)
@pytest.mark.parametrize("world_size", [1, 2])
def test_checkpoint(world_size):
    run_graded("recompute.checkpoint", checkpoint_on_rank, world_size, draw_cases("recompute.checkpoint", world_size, apply_cases=True), timeout=180)


@task("recompute.segments", points=2)
@pytest.mark.parametrize("world_size", [1, 2])
def test_segments(world_size):
    run_graded("recompute.segments", segments_on_rank, world_size, draw_cases("recompute.segments", world_size), timeout=120)


@task("recompute.selective", points=2)
@pytest.mark.parametrize("world_size", [1, 2])
def test_selective(world_size):
    run_graded("recompute.selective", selective_on_rank, world_size, draw_cases("recompute.selective", world_size), timeout=120)


@task("recompute.offload", points=2)
@pytest.mark.parametrize("world_size", [1, 2])
def test_offload(world_size):
    run_graded("recompute.offload", offload_on_rank, world_size, draw_cases("recompute.offload", world_size), timeout=120)


@task("recompute.accumulate", points=2)
@pytest.mark.parametrize("world_size", [1, 4, 3])
def test_accumulate(world_size):
    run_graded("recompute.accumulate", accumulate_on_rank, world_size, configs.announce(), timeout=120)


@task("recompute.optimizer_offload", points=2)
@pytest.mark.parametrize("world_size", [1, 2])
def test_optimizer_offload(world_size):
    run_graded("recompute.optimizer_offload", optimizer_offload_on_rank, world_size, configs.announce(), timeout=120)


# ----------------------------------------------------------------------------- chunked cross-entropy
#
# recompute.chunked_ce, checked on every rank (its own data) at world sizes 1 and 2: loss and the
# gradients of hidden, weight and bias against F.cross_entropy(h @ W.T + b) on fp32 copies of the
# inputs, for chunk sizes 1, 7 (not dividing the 20 tokens), 20 and 31; fp32, bf16 and fp16 inputs
# (loss fp32, gradients in each input's dtype, within that dtype's tolerance of the fp32 reference);
# bias None and given; ignore_index -100, 2 (a class id) and 50 (beyond V), with one chunk of 7
# whose targets are all ignored; every target ignored (nan loss, zero gradients, as torch);
# logits near 1e4 in fp32 (a naive exp overflows); the live [rows, V] tensors measured over
# forward + backward (PeakMemory restricted to them): at most 4 chunks' worth, where the plain loss
# holds all N rows; 3 AdamW steps of a tiny LM head against the plain loss.

CE_N, CE_H, CE_V = 20, 6, 11


class LogitsPeak:
    """Peak bytes of live [rows, V] tensors (rows != h, so the weight's transpose is not one)."""

    def __init__(self, v: int, h: int):
        from labkit.memory import PeakMemory

        class Only(PeakMemory):
            def _track(self, t):
                if t.dim() == 2 and t.shape[-1] == v and t.shape[0] != h:
                    super()._track(t)

        self.mode = Only(device="cpu")

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)

    @property
    def peak(self) -> int:
        return self.mode.peak_bytes


def ce_data(rank, n, h, v, dtype, ignore_index, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(100 * rank + seed)
    hidden = (torch.randn(n, h, generator=gen) * scale).to(dtype)
    weight = (torch.randn(v, h, generator=gen) * scale).to(dtype)
    bias = torch.randn(v, generator=gen).to(dtype)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[3] = ignore_index
    targets[7:14] = ignore_index  # the second chunk of 7: every target ignored
    return hidden, weight, bias, targets


def ce_compare(fn, hidden, weight, bias, targets, chunk, ignore_index, what, grad_scale=1.7):
    """The loss and the gradients of ``fn`` vs ``F.cross_entropy`` in fp32; backward gets an
    incoming gradient that is not 1 (a loss scaled before backward by ``grad_scale``), so a
    backward that ignores its ``grad`` fails."""
    import torch.nn.functional as F
    inputs = [t.detach().clone().requires_grad_(True) for t in (hidden, weight) + (() if bias is None else (bias,))]
    loss = fn(inputs[0], inputs[1], targets, chunk, bias=inputs[2] if bias is not None else None,
              ignore_index=ignore_index)
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.dtype == torch.float32, (
        f"{what}: the loss must be an fp32 scalar (computed in fp32), got "
        f"{getattr(loss, 'dtype', type(loss))} {tuple(getattr(loss, 'shape', ()))}")
    (loss * grad_scale).backward()
    what = f"{what}, loss x {grad_scale:.4g} before backward"
    ref_in = [t.detach().float().requires_grad_(True) for t in inputs]
    logits = ref_in[0] @ ref_in[1].T + (ref_in[2] if bias is not None else 0)
    ref = F.cross_entropy(logits, targets, ignore_index=ignore_index)
    (ref * grad_scale).backward()
    if torch.isnan(ref):
        assert torch.isnan(loss), f"{what}: every target ignored: torch's loss is nan (0/0), got {loss.item()}"
    else:
        assert_close(loss.detach(), ref.detach(), f"{what}: loss vs F.cross_entropy(h @ W.T + b) in fp32")
    for name, t, r in zip(("hidden", "weight", "bias"), inputs, ref_in):
        assert t.grad is not None and t.grad.dtype == t.dtype, (
            f"{what}: the gradient of {name} must come back in its dtype {t.dtype}, got "
            f"{None if t.grad is None else t.grad.dtype}")
        assert_close(t.grad, r.grad.to(t.dtype), f"{what}: gradient of {name} vs F.cross_entropy's")
    return loss.detach()


def chunked_ce_on_rank(seed: int) -> None:
    import torch.nn.functional as F
    from labkit.recompute import chunked_cross_entropy as cce
    rank = dist.get_rank()
    task_ = f"recompute.chunked_ce: rank {rank}"
    h, w, b, t = ce_data(rank, CE_N, CE_H, CE_V, torch.float32, -100)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError):
            cce(h, w, t, bad)
    for args in ((h, w[:, :-1], t), (h, w, t[:-1]), (h[0], w, t[:1])):
        with pytest.raises(ValueError):
            cce(*args, 4)
    with pytest.raises(ValueError):
        cce(h, w, t, 4, bias=b[:-1])
    # correctness over every configuration
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for ignore_index in (-100, 2, 50):
            h, w, b, t = ce_data(rank, CE_N, CE_H, CE_V, dtype, ignore_index)
            for chunk in (1, 7, CE_N, CE_N + 11):
                for bias in (None, b):
                    what = (f"{task_}, {dtype}, ignore_index={ignore_index}, chunk_size={chunk}, "
                            f"bias={'None' if bias is None else 'given'}")
                    ce_compare(cce, h, w, bias, t, chunk, ignore_index, what)
    # configurations drawn from the documented space (a new seed each run, printed; LABKIT_LONG=1: more)
    for i in range(examples(6, 60)):
        draw = drawn(seed, i)
        n, hd, v = draw.randint(1, 40), draw.randint(1, 12), draw.randint(2, 70)
        dtype = draw.choice((torch.float32, torch.bfloat16, torch.float16))
        ignore_index = draw.choice((-100, -1, 0, v - 1))
        chunk = draw.choice((1, draw.randint(1, n), n, n + draw.randint(1, 9)))
        gen = torch.Generator().manual_seed(draw.randrange(2 ** 31))
        hidden = torch.randn(n, hd, generator=gen).to(dtype)
        weight = torch.randn(v, hd, generator=gen).to(dtype)
        bias = torch.randn(v, generator=gen).to(dtype) if draw.random() < 0.5 else None
        targets = torch.randint(0, v, (n,), generator=gen)
        targets[torch.rand(n, generator=gen) < draw.random()] = ignore_index
        what = (f"{task_}, drawn case {i} (LABKIT_SEED={seed}): N={n}, h={hd}, V={v}, {dtype}, "
                f"ignore_index={ignore_index}, chunk_size={chunk}, bias={'None' if bias is None else 'given'}")
        ce_compare(cce, hidden, weight, bias, targets, chunk, ignore_index, what, grad_scale=draw.uniform(-3.0, 3.0))
    # every target ignored: nan loss and zero gradients, as torch
    h, w, b, t = ce_data(rank, CE_N, CE_H, CE_V, torch.float32, -100)
    ce_compare(cce, h, w, b, torch.full_like(t, -100), 7, -100, f"{task_}, every target ignored")
    # logits near 1e4: exp overflows fp32 unless the row's max is subtracted
    h, w, b, t = ce_data(rank, CE_N, CE_H, CE_V, torch.float32, -100, seed=1, scale=45.0)
    assert (h @ w.T).abs().max() > 1e4, "test set-up: logits must exceed 1e4"
    loss = ce_compare(cce, h, w, b, t, 7, -100, f"{task_}, fp32 logits near 1e4 (naive exp overflows)")
    assert torch.isfinite(loss), f"{task_}: loss {loss.item()} with large logits: the max must be subtracted"
    # memory: live [rows, V] tensors over forward + backward, measured
    n, hd, v, chunk = 64, 12, 50, 8
    h, w, b, t = ce_data(rank, n, hd, v, torch.float32, -100, seed=2)
    peaks = {}
    for name, fn in (("chunked", lambda h_, w_, b_: cce(h_, w_, t, chunk, bias=b_)),
                     ("plain", lambda h_, w_, b_: F.cross_entropy(h_ @ w_.T + b_, t))):
        leaves = [x.detach().clone().requires_grad_(True) for x in (h, w, b)]
        with LogitsPeak(v, hd) as mem:
            fn(*leaves).backward()
        peaks[name] = mem.peak
    one = chunk * v * 4
    assert peaks["plain"] >= n * v * 4, f"test set-up: the plain loss's peak {peaks['plain']} B < N V 4 = {n * v * 4} B"
    assert one <= peaks["chunked"] <= 4 * one, (
        f"{task_}: the [rows, V] tensors alive at once over forward and backward peaked at {peaks['chunked']} B, "
        f"want between one chunk's logits ({one} B = {chunk} x {v} x 4) and 4 of them; the plain loss's "
        f"peak is {peaks['plain']} B (N = {n} rows): logits kept for backward, or computed whole?")
    # 3 AdamW steps of a tiny LM head against the plain loss
    torch.manual_seed(rank)
    emb, head = nn.Embedding(CE_V, CE_H), nn.Linear(CE_H, CE_V)
    ref_emb, ref_head = nn.Embedding(CE_V, CE_H), nn.Linear(CE_H, CE_V)
    ref_emb.load_state_dict(emb.state_dict())
    ref_head.load_state_dict(head.state_dict())
    hyper = dict(lr=5e-2, weight_decay=0.1)
    opt = torch.optim.AdamW([*emb.parameters(), *head.parameters()], **hyper)
    ref_opt = torch.optim.AdamW([*ref_emb.parameters(), *ref_head.parameters()], **hyper)
    for step in range(3):
        x, y = tokens(rank, step, batch=3, seq=CE_N // 2)
        x, y = x.reshape(-1) % CE_V, y.reshape(-1) % CE_V
        y[::5] = -100
        loss = cce(torch.tanh(emb(x)), head.weight, y, 7, bias=head.bias)
        ref = F.cross_entropy(ref_head(torch.tanh(ref_emb(x))), y)
        assert_close(loss.detach(), ref.detach(), f"{task_}, AdamW step {step}: loss vs the plain loss")
        opt.zero_grad()
        ref_opt.zero_grad()
        loss.backward()
        ref.backward()
        opt.step()
        ref_opt.step()
        for i, (p, r) in enumerate(zip([*emb.parameters(), *head.parameters()],
                                       [*ref_emb.parameters(), *ref_head.parameters()])):
            assert_close(p.detach(), r.detach(), f"{task_}, AdamW step {step}: parameter {i} vs the plain loss's")


@task("recompute.chunked_ce", points=2)
@pytest.mark.parametrize("world_size", [1, 2])
def test_chunked_ce(world_size):
    run_graded("recompute.chunked_ce", chunked_ce_on_rank, world_size, configs.announce(), timeout=120)
