"""Graded tests for chapter 07: sequence and context parallelism (labkit/sp.py).

Numbers, in float64, on every rank at N = 1, 2, 3 and 4: the Megatron-SP block's output
shard, input gradient, gathered weight gradients and LayerNorm gradients equal the
unsharded block's; ring attention (contiguous and zig-zag rows, causal and not) and
Ulysses give full attention's output and q, k, v gradients for this rank's rows; the online
softmax equals softmax attention in one process.

Behaviour, traced: Megatron-SP issues all-gathers and reduce-scatters where TP issued
all-reduces, with the same bytes on the wire; ring attention uses only point-to-point
messages, N-1 exchanges forward, posted before the block they overlap is computed, and the
bytes the formula gives; Ulysses issues 4 all-to-alls each way of one shard each. Memory:
what ring attention keeps for backward per rank is 1/N of the unsharded one's (labkit.memory).
Zig-zag gives every rank the same causal work; contiguous shards do not.
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from labkit.check import assert_close
from labkit.comm import CommTracer
from labkit.course.grading import run_graded, task

WORLD_SIZES = [1, 2, 3, 4]
B, HEADS, D = 2, 12, 4          # heads divide by 1..4 (Ulysses)
ROWS = 6                        # rows per rank: T = 6 N, and 2N chunks of 3 for zig-zag


def seeded(*shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def check(task_id, what, actual, expected):
    assert_close(actual, expected, f"{task_id}: rank {dist.get_rank()} of {dist.get_world_size()}: {what}")


def zigzag_rows(T, rank, n):
    """Test-side zig-zag positions (independent of the learner's sp.zigzag)."""
    chunk = T // (2 * n)
    return list(range(rank * chunk, (rank + 1) * chunk)) + list(range((2 * n - 1 - rank) * chunk, (2 * n - rank) * chunk))


def full_attention(causal, T, seed=0):
    q, k, v = (seeded(B, HEADS, T, D, seed=seed + i).requires_grad_() for i in range(3))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    upstream = seeded(B, HEADS, T, D, seed=seed + 9)
    out.backward(upstream)
    return q, k, v, out.detach(), upstream


# ----------------------------------------------------------------------------- Megatron-SP


def megatron_on_rank():
    from labkit.models import GPT, GPTConfig
    from labkit.sp import reduce_layernorm_grads, sequence_parallel_block, split_sequence
    from labkit.tp import ParallelMLP, ParallelSelfAttention, unshard
    torch.set_num_threads(1)
    n, rank = dist.get_world_size(), dist.get_rank()
    config = GPTConfig(vocab_size=32, block_size=8 * n, n_layer=1, n_head=12, n_embd=24)
    reference, block = GPT(config).double().blocks[0], GPT(config).double().blocks[0]
    T = 2 * n
    x_full = seeded(B, T, 24, seed=1).requires_grad_()
    upstream = seeded(B, T, 24, seed=2)
    reference(x_full).backward(upstream)
    sp_block = sequence_parallel_block(block)
    x = split_sequence(x_full.detach()).requires_grad_()
    with CommTracer() as fwd:
        y = sp_block(x)
    rows = slice(rank * T // n, (rank + 1) * T // n)
    check("sp.megatron", "output (this rank's tokens)", y, reference(x_full.detach())[:, rows].detach())
    with CommTracer() as bwd:
        y.backward(upstream[:, rows])
    check("sp.megatron", "input gradient (this rank's tokens)", x.grad, x_full.grad[:, rows])
    reduce_layernorm_grads([sp_block])
    for name in ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "attn.c_proj.bias", "mlp.c_proj.bias"):
        check("sp.megatron", f"{name} gradient after reduce_layernorm_grads",
              sp_block.get_parameter(name).grad, reference.get_parameter(name).grad)
    for name, dim, parts in (("attn.c_attn.weight", 0, 3), ("mlp.c_fc.weight", 0, 1),
                             ("attn.c_proj.weight", 1, 1), ("mlp.c_proj.weight", 1, 1)):
        local = sp_block.get_parameter(name).grad
        pieces = [torch.empty_like(local) for _ in range(n)]
        dist.all_gather(pieces, local.contiguous())
        check("sp.megatron", f"{name} gradient, gathered", unshard(pieces, dim, parts), reference.get_parameter(name).grad)
    if n > 1:
        kinds = fwd.kinds() | bwd.kinds()
        assert "all_reduce" not in kinds and {"all_gather", "reduce_scatter"} <= kinds, \
            f"sp.megatron: expected all-gathers and reduce-scatters instead of TP's all-reduces; traced {fwd.summary()} / {bwd.summary()}"
        # TP's block: 2 all-reduces of B*T*H each way; SP must put the same bytes on the wire.
        tp_block = torch.nn.Module()
        tp_block.attn = ParallelSelfAttention(GPT(config).double().blocks[0].attn)
        tp_block.mlp = ParallelMLP(GPT(config).double().blocks[0].mlp)
        with CommTracer() as tp_trace:
            h = x_full.detach().requires_grad_()
            out = h + tp_block.attn(h)
            (out + tp_block.mlp(out)).backward(upstream)
        sp_wire = fwd.sent_bytes() + bwd.sent_bytes()
        assert math.isclose(sp_wire, tp_trace.sent_bytes(), rel_tol=1e-9), \
            f"sp.megatron: SP sent {sp_wire:.0f} bytes per block step, TP {tp_trace.sent_bytes():.0f}; they must be equal"


@task("sp.megatron", points=2)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_megatron_sequence_parallel_block(world_size):
    run_graded("sp.megatron", megatron_on_rank, world_size)


def bad_shapes_on_rank():
    from labkit.sp import split_sequence, ulysses_attention, zigzag_positions
    n = dist.get_world_size()
    for make, words in ((lambda: split_sequence(torch.zeros(1, 4 * n + 1, 3)), "sequence length"),
                        (lambda: zigzag_positions(3 * n, 0, n), "sequence length"),  # 3N: not 2N chunks
                        (lambda: ulysses_attention(*(torch.zeros(1, 6, 4 * n, 2) for _ in range(3))), "heads")):
        with CommTracer() as tracer:
            with pytest.raises(ValueError, match=words):
                make()
        assert not tracer.events, f"sp: communicated before refusing a bad shape ({words}): {tracer.summary()}"
    return zigzag_positions(4 * n, n - 1, n).tolist()


@task("sp.zigzag", points=1)
def test_bad_shapes_are_refused_before_any_communication():
    positions = run_graded("sp.zigzag", bad_shapes_on_rank, 4)[0]
    assert positions == [6, 7, 8, 9], f"sp.zigzag: rank 3 of 4 holds {positions} of 16 tokens; expected [6, 7, 8, 9]"


# ----------------------------------------------------------------------------- online softmax


@task("sp.online_softmax", points=2)
def test_blockwise_attention_equals_softmax_attention():
    from labkit.sp import attention_block, blockwise_attention, causal_mask, merge_blocks
    q, k, v = (seeded(B, HEADS, 13, D, seed=i) for i in range(3))
    for causal in (False, True):
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        for block_size in (1, 4, 5, 13):
            assert_close(blockwise_attention(q, k, v, block_size, causal), expected,
                         f"sp.online_softmax: blockwise_attention(block_size={block_size}, causal={causal})")
    positions = torch.arange(13)
    mask = causal_mask(positions, positions)
    a = attention_block(q, k[..., :6, :], v[..., :6, :], mask[:, :6])
    b = attention_block(q, k[..., 6:, :], v[..., 6:, :], mask[:, 6:])
    out, lse = merge_blocks(*a, *b)
    assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True),
                 "sp.online_softmax: merge_blocks of two causal blocks")
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(D)
    assert_close(lse, torch.logsumexp(scores.masked_fill(~mask, float("-inf")), -1),
                 "sp.online_softmax: merged log-sum-exp")
    assert torch.isinf(b[1][..., :6]).all() and not b[0][..., :6, :].abs().sum(), \
        "sp.online_softmax: a query that sees none of a block must get lse = -inf and output 0"


# ----------------------------------------------------------------------------- ring attention


class OpLog(TorchDispatchMode):
    """The order of sends and attention matmuls issued on this rank."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._opname
        if name in ("send", "bmm", "matmul", "mm"):
            self.ops.append("send" if name == "send" else "matmul")
        return func(*args, **(kwargs or {}))


def ring_on_rank(causal: bool, zigzag: bool):
    from labkit.memory import PeakMemory
    from labkit.sp import ring_attention
    torch.set_num_threads(1)
    n, rank = dist.get_world_size(), dist.get_rank()
    T = ROWS * n
    q, k, v, out, upstream = full_attention(causal, T)
    rows = torch.tensor(zigzag_rows(T, rank, n) if zigzag else list(range(rank * ROWS, (rank + 1) * ROWS)))
    mine = [t.detach().index_select(2, rows).clone().requires_grad_() for t in (q, k, v)]
    what = f"causal={causal}, {'zig-zag' if zigzag else 'contiguous'} rows"
    with CommTracer() as fwd, OpLog() as log:
        y = ring_attention(*mine, rows, causal)
    with PeakMemory(*mine) as kept:  # what the forward keeps for backward, per rank
        y2 = ring_attention(*mine, rows, causal)
        saved = kept.live_bytes()
    del y2
    check("sp.ring_attention", f"{what}: output", y, out.index_select(2, rows))
    with CommTracer() as bwd:
        y.backward(upstream.index_select(2, rows))
    for name, mine_t, full in zip("qkv", mine, (q, k, v)):
        check("sp.ring_attention", f"{what}: d{name}", mine_t.grad, full.grad.index_select(2, rows))
    shard = mine[1].nbytes  # one K (or V) shard
    pos = rows.nbytes
    assert fwd.kinds() <= {"send", "recv"} and bwd.kinds() <= {"send", "recv"}, \
        f"sp.ring_attention: only point-to-point messages; traced {fwd.summary()} / {bwd.summary()}"
    sent_fwd = sum(e.bytes for e in fwd.events if e.kind == "send")
    sent_bwd = sum(e.bytes for e in bwd.events if e.kind == "send")
    expected_fwd = (n - 1) * (2 * shard + pos)                                  # K, V, positions
    expected_bwd = (n - 1) * (4 * shard + pos) + (2 * shard if n > 1 else 0)    # + dK, dV; one hop home
    assert (sent_fwd, sent_bwd) == (expected_fwd, expected_bwd), \
        (f"sp.ring_attention: {what}: sent {sent_fwd} bytes forward, {sent_bwd} backward; "
         f"the ring sends (N-1)(2|K|+|pos|) = {expected_fwd} and (N-1)(4|K|+|pos|) + 2|K| = {expected_bwd}")
    if n > 1:
        assert log.ops.index("send") < log.ops.index("matmul"), \
            "sp.ring_attention: post the exchange of the next K/V block before computing on the current one"
    return saved


@task("sp.ring_attention", points=3)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ring_attention(world_size):
    for causal in (False, True):
        run_graded("sp.ring_attention", ring_on_rank, world_size, causal, False)
    run_graded("sp.ring_attention", ring_on_rank, world_size, True, True)


def ring_memory_on_rank(total_rows: int):
    from labkit.memory import PeakMemory
    from labkit.sp import ring_attention
    torch.set_num_threads(1)
    n, rank = dist.get_world_size(), dist.get_rank()
    rows = torch.arange(rank * total_rows // n, (rank + 1) * total_rows // n)
    mine = [seeded(B, HEADS, len(rows), D, seed=i).requires_grad_() for i in range(3)]
    with PeakMemory(*mine) as mem:
        out = ring_attention(*mine, rows, True)
        kept = mem.live_bytes()
    del out
    return kept


@task("sp.ring_attention", points=1)
def test_ring_attention_keeps_one_nth_of_the_activations():
    """Live bytes after forward (inputs and what backward needs) per rank, at N = 4 vs one
    rank holding the whole sequence: 1/N, within 5 % (the positions and lse are small)."""
    total = 64
    whole = run_graded("sp.ring_attention", ring_memory_on_rank, 1, total)[0]
    quarter = run_graded("sp.ring_attention", ring_memory_on_rank, 4, total)
    for rank, kept in enumerate(quarter):
        assert abs(kept / whole - 1 / 4) <= 0.05 / 4, \
            f"sp.ring_attention: rank {rank} of 4 keeps {kept} bytes, the unsharded ring {whole}: ratio {kept / whole:.3f}, expected 1/4"


# ----------------------------------------------------------------------------- zig-zag


@task("sp.zigzag", points=2)
def test_zigzag_split_and_its_inverse_balance_causal_work():
    from labkit.sp import zigzag_positions, zigzag_shard, zigzag_unshard
    for n in (1, 2, 3, 4):
        T = 4 * n
        for rank in range(n):
            assert zigzag_positions(T, rank, n).tolist() == zigzag_rows(T, rank, n), \
                f"sp.zigzag: rank {rank} of {n}, T={T}: {zigzag_positions(T, rank, n).tolist()}"
        x = seeded(2, T, 3, seed=n)
        shards = [zigzag_shard(x, 1, rank, n) for rank in range(n)]
        assert all(torch.equal(s, x[:, zigzag_rows(T, r, n)]) for r, s in enumerate(shards)), "sp.zigzag: zigzag_shard"
        assert torch.equal(zigzag_unshard(shards, 1), x), f"sp.zigzag: zigzag_unshard does not invert zigzag_shard (N={n})"
        # causal work per rank: the (query, key) pairs it must compute, over the whole ring
        work = [int(sum(p + 1 for p in zigzag_positions(T, r, n).tolist())) for r in range(n)]
        assert len(set(work)) == 1, f"sp.zigzag: causal work per rank {work} is not balanced (N={n})"


# ----------------------------------------------------------------------------- Ulysses


def ulysses_on_rank(causal: bool):
    from labkit.sp import ulysses_attention
    torch.set_num_threads(1)
    n, rank = dist.get_world_size(), dist.get_rank()
    T = ROWS * n
    q, k, v, out, upstream = full_attention(causal, T, seed=20)
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    mine = [t.detach()[:, :, rows].clone().requires_grad_() for t in (q, k, v)]
    with CommTracer() as fwd:
        y = ulysses_attention(*mine, causal)
    check("sp.ulysses", f"causal={causal}: output", y, out[:, :, rows])
    with CommTracer() as bwd:
        y.backward(upstream[:, :, rows])
    for name, mine_t, full in zip("qkv", mine, (q, k, v)):
        check("sp.ulysses", f"causal={causal}: d{name}", mine_t.grad, full.grad[:, :, rows])
    shard = mine[0].nbytes
    for trace, when in ((fwd, "forward"), (bwd, "backward")):
        sizes = [e.bytes for e in trace.events]
        assert trace.kinds() == {"all_to_all"} and sizes == [shard] * 4, \
            (f"sp.ulysses: {when}: expected 4 all-to-alls (q, k, v, then the output; or their gradients) "
             f"of one shard ({shard} bytes) each; traced {trace.summary()} with sizes {sizes}")


@task("sp.ulysses", points=2)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ulysses_attention(world_size):
    for causal in (False, True):
        run_graded("sp.ulysses", ulysses_on_rank, world_size, causal)
