"""Graded tests for chapter 07: sequence and context parallelism (labkit/sp.py).

Numbers, in float64, on every rank at N = 1, 2, 3 and 4: the Megatron-SP block's output
shard, input gradient, gathered weight gradients and LayerNorm gradients equal the
unsharded block's; ring attention (contiguous and zig-zag rows, causal and not) and
Ulysses give full attention's output and q, k, v gradients for this rank's rows; the online
softmax equals softmax attention in one process, one block of scores at a time.

The technique, from the trace of every launch: the whole communication signature of each
phase (kind, count, group, peer and bytes of every op, derived below from the shapes, and
nothing else; ``labkit.comm.assert_ops``), checked before the numbers so that a wrong op is
named as such:
* Megatron-SP, per block: forward 2 all-gathers and 2 reduce-scatters of the whole
  sequence's activations B·T·H (before and after attention and the MLP), backward the same
  four in reverse roles; then one all-reduce per LayerNorm weight and row-layer bias.
* Ring attention: forward N-1 exchanges of this rank's K and V block (and its positions,
  if sent), each to the next and from the previous rank of the group (global ranks);
  backward N-1 exchanges of K, V (positions) and the dK, dV so far, and one last hop of dK,
  dV to their owner. Each forward exchange is in flight while the attention of the block
  in hand is computed (``assert_overlap`` on the timeline), unless the causal mask hides
  that block entirely. No collective at all.
* Ulysses: 4 all-to-alls forward (q, k, v, out) and 4 backward, of one local shard each.
Subgroups: each launch that runs on subgroups (every Megatron launch; ring attention's
causal zig-zag one; Ulysses' causal one) runs the technique on the world, then on the
partitions of ``PARTITIONS``: at world size 4 both axes of a 2x2 grid, [0, 1] | [2, 3] and
[0, 2] | [1, 3]; at world size 3, [0, 2] beside rank 1 alone in its own group (a bystander:
it runs a group of one and communicates with nobody). So ops on the wrong group, to a
group rank taken for a global one, or to a neighbour computed as if every group were a
contiguous block of ranks, are seen. The group-taking functions, all graded that way:
    gather_sequence / reduce_scatter_sequence / sequence_parallel_block / reduce_layernorm_grads
        (sp.megatron), split_sequence (given, used by it)
    ring_attention(..., group) and the given start_exchange / ring_neighbours (sp.ring_attention)
    all_to_all / ulysses_attention(..., group) (sp.ulysses)
Overlap (event order on the timeline): every forward exchange of ring attention is posted
before the attention of the block in hand and waited on after it (world and subgroups).
Memory: what ring attention keeps for backward per rank is 1/N of the unsharded one's
(labkit.memory). Zig-zag gives every rank chunks r and 2N-1-r, the same causal work.
Drawn configurations (a new seed each run, printed; ``LABKIT_SEED`` replays, ``LABKIT_LONG=1``
draws more), inside the launches above: Megatron-SP's gather/reduce-scatter and block on drawn
B, T, H, dtypes, strided inputs, heads, bias or not and frozen replicated parameters, each with
a random incoming gradient per rank (``drawn_megatron``); zig-zag on drawn N, T, dims and dtypes,
the permutation and its inverse against their definition, in one process and inside a launch
of another size (``drawn_zigzag``); ring attention, Ulysses and the online softmax likewise.
"""

import math
import random
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from labkit.check import assert_close
from labkit.comm import COMPUTE_OPS, CommTracer, Op, assert_ops, assert_overlap
from labkit.course.grading import run_graded, task
from tests.grading import configs

WORLD_SIZES = [1, 2, 3, 4]
B, HEADS, D = 2, 12, 4          # heads divide by 1..4 (Ulysses)
ROWS = 6                        # rows per rank: T = 6 N, and 2N chunks of 3 for zig-zag
# Partitions of the world the technique also runs on, after the world (see the docstring).
PARTITIONS = {4: [[[0, 1], [2, 3]], [[0, 2], [1, 3]]], 3: [[[0, 2], [1]]]}
LONG = configs.LONG
DRAWS = 16 if LONG else 2  # drawn configurations per launch (drawn_ring, drawn_ulysses, ...)


def drawn_tolerance(dtype) -> dict:
    """labkit.check's bounds; x10 for float32 (softmax over blocks merged in another order)."""
    from labkit.check import tolerance
    rtol, atol = tolerance(dtype)
    return dict(rtol=10 * rtol, atol=10 * atol) if dtype == torch.float32 else dict(rtol=rtol, atol=atol)


def drawn_attention(rng, n: int, heads_multiple: int, zigzag: bool):
    """q, k, v [B, heads, T, d] (float64 or float32), a random upstream gradient, the causal flag;
    T = rows per rank x N (even rows for zig-zag), heads a multiple of ``heads_multiple``."""
    B_, heads, d = rng.randint(1, 2), heads_multiple * rng.randint(1, 2), rng.randint(1, 5)
    rows = 2 * rng.randint(1, 3) if zigzag else rng.randint(1, 5)
    dtype, causal = rng.choice([torch.float64, torch.float32]), rng.random() < 0.5
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    q, k, v, up = (torch.randn(B_, heads, rows * n, d, generator=gen, dtype=torch.float64).to(dtype) for _ in range(4))
    return q, k, v, up, causal, f"B={B_}, heads={heads}, T={rows * n}, d={d}, {dtype}, causal={causal}"


def drawn_grads(fn, inputs, up):
    """fn(*inputs) and the inputs' gradients for the incoming gradient ``up``, in one process."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(up)
    return out.detach(), [t.grad for t in leaves]


# The computation of attention itself (a timeline's "compute" steps that overlap counts).
ATTENTION_OPS = frozenset({"mm", "bmm", "baddbmm", "addmm", "matmul"} | {op for op in COMPUTE_OPS if "attention" in op})


def seeded(*shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def groups_to_check(subgroups: bool = True):
    """(group, its global ranks) to run the technique on: every rank; then (when
    ``subgroups``) the group this rank belongs to in each partition of ``PARTITIONS``."""
    world = dist.get_world_size()
    yield None, list(range(world))
    for partition in PARTITIONS.get(world, []) if subgroups else []:
        made = [dist.new_group(ranks) for ranks in partition]  # every rank creates every group
        index = next(i for i, ranks in enumerate(partition) if dist.get_rank() in ranks)
        yield made[index], partition[index]


def where(members) -> str:
    """'rank 2 of 4' or 'rank 2 (group rank 0) in group [2, 3]'."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if len(members) == world:
        return f"rank {rank} of {world}"
    return f"rank {rank} (group rank {members.index(rank)}) in group {members}"


def expect_ops(trace, variants, what: str, n: int) -> None:
    """The whole trace is one of ``variants`` (lists of Op); the first variant's mismatch is
    reported. At N = 1 skipping the communication (a no-op there) is accepted too."""
    if n == 1 and not trace.events:
        return
    errors = []
    for expected in variants:
        try:
            assert_ops(trace, expected, what)
            return
        except AssertionError as error:
            errors.append(error)
    raise errors[0]


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

# Replicated parameters that see only this rank's tokens: one all-reduce each after backward.
REPLICATED = ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "attn.c_proj.bias", "mlp.c_proj.bias")


def megatron_on_rank(seed: int = 0, draws: int = 0):
    torch.set_num_threads(1)
    configs = list(groups_to_check())
    for i, (group, members) in enumerate(configs):
        # the last configuration (the world at 2 ranks, a subgroup at 3 and 4) with a frozen
        # LayerNorm bias: it has no gradient, so nothing to reduce for it
        megatron_check(group, members, frozen=("ln_2.bias",) if i == len(configs) - 1 else ())
    drawn_megatron(seed, draws, configs)


def drawn_megatron(seed: int, draws: int, groups) -> None:
    """Drawn configurations over a drawn group of the launch: gather_sequence and
    reduce_scatter_sequence on drawn B, T (a multiple of N), H, dtype and a strided (not
    contiguous) input, each with a random incoming gradient per rank, against the rank-order
    definitions; then the sequence-parallel block with drawn heads, width, bias or not and
    frozen replicated parameters, against the unsharded block. The caller's input and incoming
    gradient come back unchanged; every draw is a new call with other shapes in this process."""
    from labkit.models import GPT, GPTConfig
    from labkit.sp import gather_sequence, reduce_layernorm_grads, reduce_scatter_sequence, sequence_parallel_block
    from labkit.tp import unshard
    rng = random.Random(seed)
    for draw in range(draws):
        group, members = groups[rng.randrange(len(groups))]
        n, me = len(members), members.index(dist.get_rank())
        b, rows, h = rng.randint(1, 3), rng.randint(1, 3), rng.randint(1, 5)
        T, dtype, strided = n * rows, rng.choice([torch.float64, torch.float32]), rng.random() < 0.5
        tol = drawn_tolerance(dtype)
        gen = torch.Generator().manual_seed(rng.randrange(2**31))

        def drawn(*shape):  # the same values on every rank (one generator, drawn in the same order)
            return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

        def as_input(t):  # the values of t, contiguous or in a transposed layout (a strided view)
            t = t.transpose(1, 2).contiguous().transpose(1, 2) if strided else t.clone()
            return t.requires_grad_()

        mine = slice(me * rows, (me + 1) * rows)
        at = f"sp.megatron: drawn configuration {draw} of seed {seed}, {where(members)}, B={b}, T={T}, H={h}, " \
             f"{dtype}{', a strided input' if strided else ''}"
        # gather_sequence: rank r's shard is rows r of the whole; the gradient of my shard is the
        # sum over ranks of their incoming gradients at my rows
        whole, ups = drawn(b, T, h), [drawn(b, T, h) for _ in members]
        x = as_input(whole[:, mine])
        incoming = ups[me].clone()
        y = gather_sequence(x, group)
        assert_close(y, whole, f"{at}: gather_sequence output", **tol)
        y.backward(incoming)
        assert torch.equal(incoming, ups[me]), f"{at}: gather_sequence's backward changed the incoming gradient"
        assert torch.equal(x.detach(), whole[:, mine]), f"{at}: gather_sequence changed its input"
        assert_close(x.grad, sum(u[:, mine] for u in ups), f"{at}: gather_sequence input gradient "
                     f"(the sum over ranks of a random incoming gradient, at this rank's rows)", **tol)
        # reduce_scatter_sequence: the sum of every rank's partial [B, T, H], my rows; the
        # gradient of my partial is every rank's incoming gradient, in rank order along T
        partials, ups = [drawn(b, T, h) for _ in members], [drawn(b, rows, h) for _ in members]
        x = as_input(partials[me])
        incoming = ups[me].clone()
        y = reduce_scatter_sequence(x, group)
        assert_close(y, sum(partials)[:, mine], f"{at}: reduce_scatter_sequence output", **tol)
        y.backward(incoming)
        assert torch.equal(incoming, ups[me]), f"{at}: reduce_scatter_sequence's backward changed the incoming gradient"
        assert torch.equal(x.detach(), partials[me]), f"{at}: reduce_scatter_sequence changed its input"
        assert_close(x.grad, torch.cat(ups, 1), f"{at}: reduce_scatter_sequence input gradient "
                     f"(every rank's random incoming gradient, gathered along T)", **tol)
        # the block: heads a multiple of N, any head size, bias or not, some replicated parameters frozen
        # bias alternates from a drawn start: every launch of 2 or more draws has a block with and one
        # without (a wrong implementation that names the bias parameters breaks only without)
        heads, bias = n * rng.randint(1, 2), (draw + seed) % 2 == 0
        config = GPTConfig(vocab_size=8, block_size=T, n_layer=1, n_head=heads, n_embd=heads * rng.randint(1, 3),
                           bias=bias)
        reference, block = (GPT(config).to(dtype).blocks[0] for _ in range(2))
        replicated = [name for name in REPLICATED if bias or name.endswith("weight")]  # no biases without bias
        frozen = [name for name in replicated if rng.random() < 0.3]
        at = f"sp.megatron: drawn configuration {draw} of seed {seed}, {where(members)}, the block with B={b}, T={T}, " \
             f"heads={heads}, H={config.n_embd}, bias={bias}, {dtype}, frozen {frozen}"
        x_full, up = drawn(b, T, config.n_embd), drawn(b, T, config.n_embd)
        sp_block = sequence_parallel_block(block, group)
        for name in frozen:  # frozen on the built block (chapter 05's layers make new bias parameters)
            reference.get_parameter(name).requires_grad_(False)
            sp_block.get_parameter(name).requires_grad_(False)
        leaf = x_full.clone().requires_grad_()
        expected = reference(leaf)
        expected.backward(up)
        x = as_input(x_full[:, mine])
        incoming = up[:, mine].clone()
        y = sp_block(x)
        assert_close(y, expected[:, mine].detach(), f"{at}: output (this rank's tokens)", **tol)
        y.backward(incoming)
        assert torch.equal(incoming, up[:, mine]), f"{at}: backward changed the incoming gradient"
        assert torch.equal(x.detach(), x_full[:, mine]), f"{at}: the block changed its input"
        assert_close(x.grad, leaf.grad[:, mine], f"{at}: input gradient (a random incoming gradient)", **tol)
        reduce_layernorm_grads([sp_block], group)
        for name in replicated:
            got, want = sp_block.get_parameter(name).grad, reference.get_parameter(name).grad
            if name in frozen:
                assert got is None, f"{at}: {name} is frozen but has a gradient"
                continue
            assert_close(got, want, f"{at}: {name} gradient after reduce_layernorm_grads", **tol)
        for name, dim, parts in (("attn.c_attn.weight", 0, 3), ("mlp.c_fc.weight", 0, 1),
                                 ("attn.c_proj.weight", 1, 1), ("mlp.c_proj.weight", 1, 1)):
            local = sp_block.get_parameter(name).grad
            pieces = [torch.empty_like(local) for _ in range(n)]
            dist.all_gather(pieces, local.contiguous(), group=group)
            assert_close(unshard(pieces, dim, parts), reference.get_parameter(name).grad,
                         f"{at}: {name} gradient, gathered", **tol)


def megatron_check(group, members, frozen=()):
    from labkit.models import GPT, GPTConfig
    from labkit.sp import reduce_layernorm_grads, sequence_parallel_block, split_sequence
    from labkit.tp import unshard
    n, rank = len(members), members.index(dist.get_rank())
    at = f"sp.megatron: {where(members)}" + (f", {', '.join(frozen)} frozen" if frozen else "")
    config = GPTConfig(vocab_size=32, block_size=8 * n, n_layer=1, n_head=12, n_embd=24)
    reference, block = GPT(config).double().blocks[0], GPT(config).double().blocks[0]
    for name in frozen:
        reference.get_parameter(name).requires_grad_(False)
        block.get_parameter(name).requires_grad_(False)
    T = 2 * n
    x_full = seeded(B, T, 24, seed=1).requires_grad_()
    upstream = seeded(B, T, 24, seed=2)
    reference(x_full).backward(upstream)
    sp_block = sequence_parallel_block(block, group)
    x = split_sequence(x_full.detach(), group).requires_grad_()
    # Each TP region (attention, MLP) gathers the whole sequence before its column layer and
    # reduce-scatters the whole sequence's partial sums after its row layer: B·T·H elements.
    sequence = B * T * config.n_embd * x_full.element_size()
    region = [Op("all_gather", sequence, members), Op("reduce_scatter", sequence, members)]
    with CommTracer() as fwd:
        y = sp_block(x)
    expect_ops(fwd, [2 * region], f"{at}: forward (per TP region: an all-gather before, a reduce-scatter after, "
                                  f"each of B·T·H = {B}·{T}·{config.n_embd} elements)", n)
    rows = slice(rank * T // n, (rank + 1) * T // n)
    assert_close(y, reference(x_full.detach())[:, rows].detach(), f"{at}: output (this rank's tokens)")
    with CommTracer() as bwd:
        y.backward(upstream[:, rows])
    expect_ops(bwd, [2 * region], f"{at}: backward (per TP region: the reduce-scatter's gradient is an all-gather, "
                                  f"the all-gather's a reduce-scatter, each of B·T·H elements)", n)
    assert_close(x.grad, x_full.grad[:, rows], f"{at}: input gradient (this rank's tokens)")
    with CommTracer() as ln:
        reduce_layernorm_grads([sp_block], group)
    sums = [Op("all_reduce", reference.get_parameter(name).numel() * x_full.element_size(), members)
            for name in REPLICATED if name not in frozen]
    expect_ops(ln, [sums], f"{at}: reduce_layernorm_grads (one all-reduce per LayerNorm weight and row-layer "
                           f"bias, each of H = {config.n_embd} elements)", n)
    for name in REPLICATED:
        if name in frozen:
            assert sp_block.get_parameter(name).grad is None, f"{at}: {name} is frozen but has a gradient"
            continue
        assert_close(sp_block.get_parameter(name).grad, reference.get_parameter(name).grad,
                     f"{at}: {name} gradient after reduce_layernorm_grads")
    for name, dim, parts in (("attn.c_attn.weight", 0, 3), ("mlp.c_fc.weight", 0, 1),
                             ("attn.c_proj.weight", 1, 1), ("mlp.c_proj.weight", 1, 1)):
        local = sp_block.get_parameter(name).grad
        pieces = [torch.empty_like(local) for _ in range(n)]
        dist.all_gather(pieces, local.contiguous(), group=group)
        assert_close(unshard(pieces, dim, parts), reference.get_parameter(name).grad, f"{at}: {name} gradient, gathered")


@task("sp.megatron", points=2)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_megatron_sequence_parallel_block(world_size):
    run_graded("sp.megatron", megatron_on_rank, world_size, configs.announce(), DRAWS)


def bad_shapes_on_rank(seed: int = 0, draws: int = 0):
    from labkit.sp import split_sequence, ulysses_attention, zigzag_positions
    n = dist.get_world_size()
    for make, words in ((lambda: split_sequence(torch.zeros(1, 4 * n + 1, 3)), "sequence length"),
                        (lambda: zigzag_positions(3 * n, 0, n), "sequence length"),  # 3N: not 2N chunks
                        (lambda: ulysses_attention(*(torch.zeros(1, 6, 4 * n, 2) for _ in range(3))), "heads")):
        with CommTracer() as tracer:
            with pytest.raises(ValueError, match=words):
                make()
        assert not tracer.events, f"sp: communicated before refusing a bad shape ({words}): {tracer.summary()}"
    drawn_zigzag(seed, 5 * draws, f"rank {dist.get_rank()} of {n}")  # N and rank are arguments, not the launch's
    return zigzag_positions(4 * n, n - 1, n).tolist()


@task("sp.zigzag", points=1)
def test_bad_shapes_are_refused_before_any_communication():
    positions = run_graded("sp.zigzag", bad_shapes_on_rank, 4, configs.announce(), DRAWS)[0]
    assert positions == [6, 7, 8, 9], f"sp.zigzag: rank 3 of 4 holds {positions} of 16 tokens; expected [6, 7, 8, 9]"


# ----------------------------------------------------------------------------- online softmax


class Footprint(TorchFunctionMode):
    """The largest tensor any torch function made, and the number of keys each of PyTorch's
    attention functions was given: what tells a block-by-block computation from one over
    all keys. (A function mode, not a dispatch mode: entering one of those imports dynamo,
    a second of the grader's time here.)"""

    def __init__(self):
        super().__init__()
        self.largest = (0, "", ())
        self.kernels = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        key = args[1] if len(args) > 1 else kwargs.get("key")
        if "attention" in name and isinstance(key, torch.Tensor):
            self.kernels.append((name, key.shape[-2]))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest[0]:
                self.largest = (t.numel(), name, tuple(t.shape))
        return out


@task("sp.online_softmax", points=2)
def test_blockwise_attention_equals_softmax_attention():
    from labkit.sp import attention_block, blockwise_attention, causal_mask, merge_blocks
    T = 13
    q, k, v = (seeded(B, HEADS, T, D, seed=i) for i in range(3))
    for causal in (False, True):
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        for block_size in (1, 4, 5, 13):
            what = f"sp.online_softmax: blockwise_attention(block_size={block_size}, causal={causal})"
            with Footprint() as seen:
                out = blockwise_attention(q, k, v, block_size, causal)
            assert_close(out, expected, what)
            if block_size >= T:
                continue
            for op, keys in seen.kernels:
                assert keys <= block_size, \
                    (f"{what}: called PyTorch's attention ({op}) on {keys} keys at once; the online softmax "
                     f"attends to one block of at most {block_size} keys at a time and merges the blocks")
            # one block of scores [B, heads, T, block_size], or a tensor the size of q, k, v or out
            allowed = B * HEADS * T * max(block_size, D)
            numel, op, shape = seen.largest
            assert numel <= allowed, \
                (f"{what}: {op} made a tensor of shape {list(shape)}, more than one block of scores "
                 f"[{B}, {HEADS}, {T}, {block_size}] at a time: compute and merge the key blocks one by one")
    positions = torch.arange(T)
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
    rng = random.Random(configs.announce())
    for draw in range(20 * DRAWS):  # drawn: 2-5-D tensors, Tq != Tk without a mask, any block size, float32
        lead = tuple(rng.randint(1, 3) for _ in range(rng.randint(0, 3)))
        causal, tk, d = rng.random() < 0.5, rng.randint(1, 9), rng.randint(1, 4)
        tq = tk if causal else rng.randint(1, 9)
        dtype, block_size = rng.choice([torch.float64, torch.float32]), rng.randint(1, tk)
        gen = torch.Generator().manual_seed(rng.randrange(2**31))
        q, up = (torch.randn(*lead, tq, d, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2))
        k, v = (torch.randn(*lead, tk, d, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2))
        what = f"sp.online_softmax: drawn {draw}: q {tuple(q.shape)}, k {tuple(k.shape)}, {dtype}, causal={causal}, " \
               f"block_size={block_size}"
        sdpa = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal)  # noqa: E731
        ours = lambda a, b, c: blockwise_attention(a, b, c, block_size, causal)  # noqa: E731
        (out, grads), (expected, expected_grads) = drawn_grads(ours, (q, k, v), up), drawn_grads(sdpa, (q, k, v), up)
        assert_close(out, expected, f"{what}: output", **drawn_tolerance(dtype))
        for name, got, want in zip("qkv", grads, expected_grads):
            assert_close(got, want, f"{what}: d{name} (a random incoming gradient)", **drawn_tolerance(dtype))


# ----------------------------------------------------------------------------- ring attention


def ring_on_rank(causal: bool, zigzag: bool, subgroups: bool = False, seed: int = 0, draws: int = 0):
    torch.set_num_threads(1)
    groups = list(groups_to_check(subgroups))
    for group, members in groups:
        ring_check(causal, zigzag, group, members)
    drawn_ring(seed, draws, groups)


def drawn_ring(seed: int, draws: int, groups) -> None:
    """Ring attention on drawn shapes, dtypes, causal or not, contiguous or zig-zag rows, over a
    drawn group; a random incoming gradient; the positions (integers) get no gradient; the
    caller's q, k, v and incoming gradient come back unchanged."""
    from labkit.sp import ring_attention
    rng = random.Random(seed)
    for draw in range(draws):
        group, members = groups[rng.randrange(len(groups))]
        n, me = len(members), members.index(dist.get_rank())
        zigzag = rng.random() < 0.5
        q, k, v, up, causal, shape = drawn_attention(rng, n, 1, zigzag)
        T = q.shape[2]
        rows = torch.tensor(zigzag_rows(T, me, n) if zigzag else list(range(me * T // n, (me + 1) * T // n)))
        out, grads = drawn_grads(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal), (q, k, v), up)
        at = f"sp.ring_attention: drawn configuration {draw} of seed {seed}, {where(members)}, {shape}, " \
             f"{'zig-zag' if zigzag else 'contiguous'} rows"
        mine = [t.index_select(2, rows).requires_grad_() for t in (q, k, v)]
        before = [t.detach().clone() for t in mine]
        y = ring_attention(*mine, rows, causal, group)
        assert_close(y, out.index_select(2, rows), f"{at}: output", **drawn_tolerance(q.dtype))
        incoming = up.index_select(2, rows)
        y.backward(incoming)
        assert torch.equal(incoming, up.index_select(2, rows)), f"{at}: backward changed the incoming gradient"
        for name, t, snapshot, full in zip("qkv", mine, before, grads):
            assert torch.equal(t.detach(), snapshot), f"{at}: ring attention changed its input {name}"
            assert_close(t.grad, full.index_select(2, rows), f"{at}: d{name}", **drawn_tolerance(q.dtype))


def ring_check(causal, zigzag, group, members):
    from labkit.sp import ring_attention
    n, me = len(members), members.index(dist.get_rank())
    T = ROWS * n
    q, k, v, out, upstream = full_attention(causal, T)
    rows_of = [zigzag_rows(T, r, n) if zigzag else list(range(r * ROWS, (r + 1) * ROWS)) for r in range(n)]
    rows = torch.tensor(rows_of[me])
    mine = [t.detach().index_select(2, rows).clone().requires_grad_() for t in (q, k, v)]
    at = f"sp.ring_attention: {where(members)}, causal={causal}, {'zig-zag' if zigzag else 'contiguous'} rows"
    with CommTracer() as fwd:
        y = ring_attention(*mine, rows, causal, group)
    # One K (or V, dK, dV) block: B·heads·T/N·d elements; positions: T/N indices.
    kv = mine[1].numel() * mine[1].element_size()
    pos = rows.numel() * rows.element_size()
    nxt, prv = members[(me + 1) % n], members[(me - 1) % n]

    def exchanges(count, sizes):  # count exchanges, each sending ``sizes`` on and receiving as many
        return count * ([Op("send", s, members, nxt) for s in sizes] + [Op("recv", s, members, prv) for s in sizes])

    blocks = ([kv, kv, pos], [kv, kv])  # K, V with their positions, or without
    expect_ops(fwd, [exchanges(n - 1, b) for b in blocks],
               f"{at}: forward (N-1 = {n - 1} exchanges of this rank's K, V block, {kv} B each, and its "
               f"positions, {pos} B: sent to the next rank {nxt}, received from the previous rank {prv})", n)
    if n > 1:
        # Exchange j passes on the block of rank me - j: it must be in flight while that block's
        # attention runs, unless the causal mask hides the whole block from this rank's rows.
        per_step = len(fwd.events) // (n - 1)
        attention_only = SimpleNamespace(events=fwd.events, timeline=[
            s for s in fwd.timeline if s.what != "compute" or s.op in ATTENTION_OPS])
        for step in range(n - 1):
            owner = (me - step) % n
            if causal and min(rows_of[owner]) > max(rows_of[me]):
                continue
            assert_overlap(attention_only, f"{at}: forward step {step} (the K/V block of rank {members[owner]} in "
                                            f"hand, the exchange passing it on must overlap its attention)",
                           events=list(range(step * per_step, (step + 1) * per_step)))
    assert_close(y, out.index_select(2, rows), f"{at}: output")
    with CommTracer() as bwd:
        y.backward(upstream.index_select(2, rows))
    expect_ops(bwd, [exchanges(n - 1, b + [kv, kv]) + exchanges(n > 1, [kv, kv]) for b in blocks],
               f"{at}: backward (N-1 = {n - 1} exchanges of K, V, positions and the dK, dV so far, then one "
               f"more hop of dK, dV to their owner; next rank {nxt}, previous rank {prv})", n)
    for name, mine_t, full in zip("qkv", mine, (q, k, v)):
        assert_close(mine_t.grad, full.grad.index_select(2, rows), f"{at}: d{name}")


@task("sp.ring_attention", points=3)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ring_attention(world_size):
    for causal in (False, True):
        run_graded("sp.ring_attention", ring_on_rank, world_size, causal, False)
    run_graded("sp.ring_attention", ring_on_rank, world_size, True, True, True, configs.announce(), DRAWS)


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
                (f"sp.zigzag: rank {rank} of {n}, T={T}: zigzag_positions gives {zigzag_positions(T, rank, n).tolist()}; "
                 f"expected chunks {rank} and {2 * n - 1 - rank} of {2 * n}: {zigzag_rows(T, rank, n)}")
        x = seeded(2, T, 3, seed=n)
        shards = [zigzag_shard(x, 1, rank, n) for rank in range(n)]
        for r, s in enumerate(shards):
            assert torch.equal(s, x[:, zigzag_rows(T, r, n)]), \
                f"sp.zigzag: zigzag_shard(x, 1, {r}, {n}) is not rows {zigzag_rows(T, r, n)} of x (T={T})"
        assert torch.equal(zigzag_unshard(shards, 1), x), f"sp.zigzag: zigzag_unshard does not invert zigzag_shard (N={n})"
        # causal work per rank: the (query, key) pairs it must compute, over the whole ring
        work = [int(sum(p + 1 for p in zigzag_positions(T, r, n).tolist())) for r in range(n)]
        assert len(set(work)) == 1, f"sp.zigzag: causal work per rank {work} is not balanced (N={n})"
    drawn_zigzag(configs.announce(), 10 * DRAWS, "one process")


ZIGZAG_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.int64, torch.bool]


def drawn_zigzag(seed: int, draws: int, where_: str) -> None:
    """Drawn N (1-8), chunk length, a 1-4-D tensor of a drawn dtype (ids and masks too) and dim
    (negative as well): every rank's positions are chunks r and 2N-1-r (``zigzag_rows``), all
    ranks' together a permutation of 0..T-1; each shard is those rows of x, in x's dtype; the
    unshard puts shard r's row i back at position i of rank r's positions (the inverse
    permutation, built here with index_copy), for the dim asked."""
    from labkit.sp import zigzag_positions, zigzag_shard, zigzag_unshard
    rng = random.Random(seed)
    for draw in range(draws):
        n, chunk, dims = rng.randint(1, 8), rng.randint(1, 3), rng.randint(1, 4)
        T, dim = 2 * n * chunk, rng.randrange(-dims, dims)
        shape = [rng.randint(1, 3) for _ in range(dims)]
        shape[dim] = T
        dtype = rng.choice(ZIGZAG_DTYPES)
        gen = torch.Generator().manual_seed(rng.randrange(2**31))
        x = torch.randint(-50, 50, shape, generator=gen).to(dtype)
        at = f"sp.zigzag: drawn configuration {draw} of seed {seed} ({where_}): N={n}, T={T}, x {tuple(shape)} " \
             f"{dtype}, dim={dim}"
        every = []
        for r in range(n):
            positions = zigzag_positions(T, r, n)
            assert not positions.is_floating_point() and positions.tolist() == zigzag_rows(T, r, n), \
                f"{at}: zigzag_positions(T, {r}, {n}) = {positions}; expected chunks {r} and {2 * n - 1 - r}: " \
                f"{zigzag_rows(T, r, n)}"
            every += positions.tolist()
        assert sorted(every) == list(range(T)), f"{at}: the ranks' positions together are not a permutation of 0..T-1"
        shards = [zigzag_shard(x, dim, r, n) for r in range(n)]
        expected = torch.zeros_like(x)
        for r, shard in enumerate(shards):
            rows = torch.tensor(zigzag_rows(T, r, n))
            assert shard.dtype == x.dtype and torch.equal(shard, x.index_select(dim, rows)), \
                f"{at}: zigzag_shard(x, {dim}, {r}, {n}) is not rows {rows.tolist()} of x along dim {dim}, in {dtype}"
            expected.index_copy_(dim, rows, shard)  # row i of shard r back to position rows[i]
        kept = [shard.clone() for shard in shards]
        whole = zigzag_unshard(shards, dim)
        assert all(torch.equal(a, b) for a, b in zip(shards, kept)), f"{at}: zigzag_unshard changed its shards"
        assert whole.dtype == x.dtype and torch.equal(whole, expected) and torch.equal(whole, x), \
            f"{at}: zigzag_unshard(shards, {dim}) is not the inverse permutation of the shards (in {dtype})"


# ----------------------------------------------------------------------------- Ulysses


def ulysses_on_rank(causal: bool, subgroups: bool = False, seed: int = 0, draws: int = 0):
    torch.set_num_threads(1)
    groups = list(groups_to_check(subgroups))
    for group, members in groups:
        ulysses_check(causal, group, members)
        for i, (shape, scatter_dim, gather_dim) in enumerate(FIXED_ALL_TO_ALL):
            check_all_to_all(shape, scatter_dim, gather_dim, torch.float64, 30 + i, group, members,
                             f"sp.ulysses: {where(members)}")
    drawn_ulysses(seed, draws, groups)


def drawn_ulysses(seed: int, draws: int, groups) -> None:
    """all_to_all with drawn dims (any scatter and gather dim of a 2-4-D tensor, the same dim
    too) against the rank-order exchange, with a random incoming gradient; then Ulysses on drawn
    shapes (heads a multiple of N), dtypes, causal or not."""
    from labkit.sp import ulysses_attention
    rng = random.Random(seed)
    for draw in range(draws):
        group, members = groups[rng.randrange(len(groups))]
        n, me = len(members), members.index(dist.get_rank())
        dims = rng.randint(2, 4)
        scatter_dim, gather_dim = rng.randrange(dims), rng.randrange(dims)
        shape = [rng.randint(1, 3) for _ in range(dims)]
        dtype = rng.choice([torch.float64, torch.float32])
        at = f"sp.ulysses: drawn configuration {draw} of seed {seed}, {where(members)}"
        check_all_to_all(shape, scatter_dim, gather_dim, dtype, rng.randrange(2**31), group, members, at)
        q, k, v, up, causal, shape = drawn_attention(rng, n, n, False)
        rows = slice(me * q.shape[2] // n, (me + 1) * q.shape[2] // n)
        out, grads = drawn_grads(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal), (q, k, v), up)
        at = f"sp.ulysses: drawn configuration {draw} of seed {seed}, {where(members)}, {shape}"
        mine = [t[:, :, rows].clone().requires_grad_() for t in (q, k, v)]
        y = ulysses_attention(*mine, causal, group)
        assert_close(y, out[:, :, rows], f"{at}: output", **drawn_tolerance(q.dtype))
        y.backward(up[:, :, rows].clone())
        for name, t, full in zip("qkv", mine, grads):
            assert_close(t.grad, full[:, :, rows], f"{at}: d{name}", **drawn_tolerance(q.dtype))


# all_to_all on dims other than Ulysses' own (1, 2) and (2, 1), on every world size without a
# draw: an exchange that assumes them (scatters along 1 or 2 whatever it is asked) fails here.
FIXED_ALL_TO_ALL = [((2, 3, 1), 0, 2), ((1, 2, 3, 2), 3, 1), ((3, 2), 1, 1), ((2, 1, 2, 3), 1, 3)]


def check_all_to_all(shape, scatter_dim, gather_dim, dtype, seed, group, members, at) -> None:
    """all_to_all of a ``shape`` tensor (its ``scatter_dim`` made N times longer) against the
    rank-order exchange, forward and with a random incoming gradient backward."""
    from labkit.sp import all_to_all
    n, me = len(members), members.index(dist.get_rank())
    shape = list(shape)
    shape[scatter_dim] *= n
    gen = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) for _ in members]
    at = f"{at}: all_to_all of a {dtype} {tuple(shape)}, scatter_dim={scatter_dim}, gather_dim={gather_dim}"
    # rank me receives piece me of every rank's input, in rank order, along gather_dim
    expected = torch.cat([x.chunk(n, scatter_dim)[me] for x in inputs], gather_dim)
    x = inputs[me].clone().requires_grad_()
    y = all_to_all(x, scatter_dim, gather_dim, group)
    assert_close(y, expected, f"{at}: output")
    ups = [torch.randn(expected.shape, generator=gen, dtype=torch.float64).to(dtype) for _ in members]
    y.backward(ups[me].clone())
    # the gradient of my piece j (sent to rank j) is rank j's incoming gradient at my slot
    grad = torch.cat([u.chunk(n, gather_dim)[me] for u in ups], scatter_dim)
    assert_close(x.grad, grad, f"{at}: gradient (the reverse exchange of a random incoming gradient)")


def ulysses_check(causal, group, members):
    from labkit.sp import ulysses_attention
    n, me = len(members), members.index(dist.get_rank())
    T = ROWS * n
    q, k, v, out, upstream = full_attention(causal, T, seed=20)
    rows = slice(me * ROWS, (me + 1) * ROWS)
    mine = [t.detach()[:, :, rows].clone().requires_grad_() for t in (q, k, v)]
    at = f"sp.ulysses: {where(members)}, causal={causal}"
    # Each all-to-all moves one local activation, B·heads·T/N·d elements: sequence shard
    # to head shard (q, k, v) or back (out); backward, their gradients the other way.
    shard = mine[0].numel() * mine[0].element_size()
    four = [Op("all_to_all", shard, members)] * 4
    with CommTracer() as fwd:
        y = ulysses_attention(*mine, causal, group)
    expect_ops(fwd, [four], f"{at}: forward (4 all-to-alls, q, k, v and the output, of one shard, {shard} B, each)", n)
    assert_close(y, out[:, :, rows], f"{at}: output")
    with CommTracer() as bwd:
        y.backward(upstream[:, :, rows])
    expect_ops(bwd, [four], f"{at}: backward (4 all-to-alls, the gradients of the output, q, k and v, "
                            f"of one shard, {shard} B, each)", n)
    for name, mine_t, full in zip("qkv", mine, (q, k, v)):
        assert_close(mine_t.grad, full.grad[:, :, rows], f"{at}: d{name}")


@task("sp.ulysses", points=2)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ulysses_attention(world_size):
    run_graded("sp.ulysses", ulysses_on_rank, world_size, False)
    run_graded("sp.ulysses", ulysses_on_rank, world_size, True, True, configs.announce(), DRAWS)
