"""Graded tests for chapter 05: tensor parallelism (labkit/tp.py).

Every check runs on every rank at tensor-parallel degrees 1-4, in float64, against the
unsharded module in one process: outputs, input gradients, and the weight gradients
gathered from every rank's slice; each is repeated, in the same launch, over subgroups
(``tp_groups``): at world size 4 both axes of a 2x2 grid, {0, 1} | {2, 3} and {0, 2} | {1, 3};
at 3 the pair {0, 2} beside rank 1 alone in its own group (a bystander), so that a part that
ignores its group (works over every rank) or takes its slice by global rank fails. The
group-taking functions, each graded that way: copy_to_parallel / reduce_from_parallel (tp.f_g),
ColumnParallelLinear (tp.column), RowParallelLinear (tp.row), ParallelMLP (tp.mlp),
ParallelSelfAttention (tp.attention), the vocabulary-parallel embedding and loss (tp.vocab),
tensor_parallel and full_state_dict (tp.model: over this rank's last subgroup). No task of
this chapter claims overlap. The whole tensor-parallel GPT trains 5 AdamW steps next to the single-process GPT
(tied and untied head), and next to the same GPT parallelised with PyTorch's
``parallelize_module``.

The tracer certifies the technique: every forward and every backward is compared with the
chapter's whole communication signature (``labkit.comm.assert_ops``: each op's kind,
count, group and bytes, and nothing else), derived here from the shapes (numel x 8 bytes):
f is silent forward and all-reduces the input's gradient backward, g the mirror image; a
column layer all-gathers its output only with gather_output, a row layer all-reduces its
partial products (and all-gathers the input's gradient only when it took its own slice of
a whole input); an MLP or attention block issues exactly one all-reduce of B*T*H numbers
forward (g) and one backward (f), nothing in between; the vocabulary-parallel embedding
one all-reduce forward, the loss three of B*T numbers and never the B*T*V logits; the GPT
1 + 2L forward (+ the loss's 3) and 1 + 2L backward; ``full_state_dict`` one all-gather
per split tensor, nothing for the replicated ones. The GPT's shape divides by 3 and 4.
"""

import math
import random

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.check import assert_close
from labkit.comm import CommTracer, Op, assert_ops
from labkit.course.grading import run_graded, task
from tests.grading import configs

WORLD_SIZES = [1, 2, 3, 4]
B, T = 3, 8
STEPS = 5
DTYPE = torch.float64  # every tensor of these tests but the drawn configurations'
LONG = configs.LONG
DRAWS = 24 if LONG else 4  # each run sees every dtype, input rank and option (they cycle, from a drawn start)  # drawn configurations per launch (see "drawn configurations" below)


def config(**changes):
    from labkit.models import GPTConfig
    shape = dict(vocab_size=48, block_size=T, n_layer=2, n_head=12, n_embd=48)
    return GPTConfig(**(shape | changes))


def setup():
    torch.set_num_threads(1)  # tiny models: a second thread per rank only competes for the cores
    return dist.get_world_size(), dist.get_rank()


def seeded(*shape, seed, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=DTYPE).requires_grad_(requires_grad)


class Group:
    """A tensor-parallel group a check runs over: its handle (None: the world) and its ranks."""

    def __init__(self, handle, ranks):
        self.handle, self.ranks = handle, tuple(ranks)
        self.n, self.rank = len(self.ranks), self.ranks.index(dist.get_rank())

    def __str__(self):
        return "" if self.handle is None else f" (TP over the group {self.ranks})"


PARTITIONS = {4: [[[0, 1], [2, 3]], [[0, 2], [1, 3]]], 3: [[[0, 2], [1]]]}


def tp_groups() -> list[Group]:
    """The groups each check runs over: the world, then this rank's group in each partition of
    ``PARTITIONS``: at world size 4 both axes of a 2x2 grid ({0, 1} | {2, 3} and {0, 2} | {1, 3}),
    at 3 the pair {0, 2} beside rank 1 alone (a bystander: a group of one, no communication).
    A layer must run over the group it was given, not over every rank, and find its slice from
    its rank in the group (not the global rank, nor the global rank modulo the group's size)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    groups = [Group(None, range(n))]
    for partition in PARTITIONS.get(n, []):
        made = [dist.new_group(ranks) for ranks in partition]  # every rank makes every group
        index = next(i for i, ranks in enumerate(partition) if rank in ranks)
        groups.append(Group(made[index], partition[index]))
    return groups


def gathered(local: torch.Tensor, dim: int, parts: int = 1, group: Group | None = None) -> torch.Tensor:
    """The full tensor from every rank's slice (test-side: does not use the learner's code)."""
    from labkit.tp import unshard
    group = group or Group(None, range(dist.get_world_size()))
    pieces = [torch.empty_like(local) for _ in range(group.n)]
    dist.all_gather(pieces, local.detach().contiguous(), group=group.handle)
    return unshard(pieces, dim, parts)


def check(task_id, what, actual, expected):
    assert_close(actual, expected, f"{task_id}: rank {dist.get_rank()} of {dist.get_world_size()}: {what}")


def nbytes(*shape) -> int:
    """Bytes of a float64 tensor of ``shape``: what one op of the signature moves."""
    return math.prod(shape) * DTYPE.itemsize


def signature(task_id, tracer, expected, what):
    """The whole traced communication of ``what`` is ``expected`` (a list of ``Op``, each on
    its group). Ops on a one-rank group carry no communication and are left out on both
    sides (world size 1 may skip them)."""
    events = [e for e in tracer.events if len(e.group) > 1]
    assert_ops(events, [op for op in expected if len(op[2]) > 1],
               f"{task_id}: rank {dist.get_rank()} of {dist.get_world_size()}: {what}")


# ----------------------------------------------------------------------------- drawn configurations
# Each task's launch also runs ``draws`` configurations drawn from a seed (the same on every rank):
# shapes with 0-3 leading dims and widths that are multiples of N only where the layer splits them,
# float64/float32 (and for f/g bf16/fp16 too), bias on or off, the layer's option, the group (the
# world or a subgroup), a random incoming gradient times a random scale; the caller's incoming
# gradients must come back unchanged.


def drawn_tolerance(dtype) -> dict:
    """labkit.check's bounds; x10 for float32: the drawn sums run over up to 36 terms in another order."""
    from labkit.check import tolerance
    rtol, atol = tolerance(dtype)
    return dict(rtol=10 * rtol, atol=10 * atol) if dtype == torch.float32 else dict(rtol=rtol, atol=atol)


LOW = (torch.bfloat16, torch.float16)
ALL_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def drawn(shape, dtype, gen, scale=1.0, most=8):
    """Random values; in bf16/fp16 small integers in [-most, most] (their sums are exact in any order)."""
    if dtype in LOW:
        return torch.randint(-most, most + 1, shape, generator=gen).to(dtype)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def drawn_check(task_id, what, actual, expected, dtype=None):
    from labkit.check import assert_close
    assert_close(actual, expected, f"{task_id}: rank {dist.get_rank()} of {dist.get_world_size()}: {what}",
                 **drawn_tolerance(dtype or expected.dtype))


def unchanged(task_id, what, tensor, snapshot):
    assert torch.equal(tensor, snapshot), (
        f"{task_id}: rank {dist.get_rank()}: {what} was changed by the call (an incoming gradient or an "
        "input belongs to the caller: compute into a new tensor)")


def seeded_copy(module, gen):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) / math.sqrt(p.shape[-1]))
    return module


def integer_copy(module, gen):
    """Weights in {-1, 0, 1}: a bf16/fp16 linear layer on small integers computes every product and
    sum exactly (below 256, bf16's last exact integer), so a split sum equals the whole one."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randint(-1, 2, p.shape, generator=gen).double())
    return module


def low_block_tolerance(dtype, reference: torch.Tensor) -> dict:
    """A bf16/fp16 block (gelu, softmax: not exact on integers): labkit.check's rtol for the dtype,
    and an atol of that rtol x the reference's largest magnitude, since a row-parallel c_proj rounds
    each rank's partial product to the dtype before the all-reduce adds them (one rounding per
    rank, relative to the partials, not to a sum that may cancel)."""
    from labkit.check import tolerance
    rtol, _ = tolerance(dtype)
    return dict(rtol=rtol, atol=rtol * max(float(reference.detach().abs().max()), 1.0))


def drawn_f_g(seed: int, draws: int, groups) -> None:
    from labkit.tp import copy_to_parallel, reduce_from_parallel
    rng = random.Random(seed)
    start = rng.randrange(4)
    for draw in range(draws):
        group = groups[rng.randrange(len(groups))]
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        dtype = [torch.float64, torch.float32, torch.bfloat16, torch.float16][(draw + start) % 4]
        gen = torch.Generator().manual_seed(rng.randrange(2**31))
        ups = [drawn(shape, dtype, gen) for _ in range(group.n)]
        parts = [drawn(shape, dtype, gen) for _ in range(group.n)]
        x, up_g = drawn(shape, dtype, gen).requires_grad_(), drawn(shape, dtype, gen)
        what = f"drawn configuration {draw} of seed {seed}: shape {shape}, {dtype}{group}"
        total = lambda ts: sum(t.double() for t in ts).to(dtype)  # noqa: E731
        up = ups[group.rank].clone()
        y = copy_to_parallel(x, group.handle)
        drawn_check("tp.f_g", f"{what}: f forward", y, x.detach())
        y.backward(up)
        unchanged("tp.f_g", f"{what}: the gradient passed to f's backward", up, ups[group.rank])
        drawn_check("tp.f_g", f"{what}: f backward (the group's incoming gradients summed)", x.grad, total(ups))
        mine = parts[group.rank].clone().requires_grad_()
        z = reduce_from_parallel(mine, group.handle)
        unchanged("tp.f_g", f"{what}: g's input", mine.detach(), parts[group.rank])
        drawn_check("tp.f_g", f"{what}: g forward (the group's partial results summed)", z, total(parts))
        up = up_g.clone()
        z.backward(up)
        unchanged("tp.f_g", f"{what}: the gradient passed to g's backward", up, up_g)
        drawn_check("tp.f_g", f"{what}: g backward (the identity)", mine.grad, up_g)


def drawn_linear(kind: str, seed: int, draws: int, groups) -> None:
    """ColumnParallelLinear (kind "column") or RowParallelLinear ("row") on drawn configurations."""
    from labkit.tp import ColumnParallelLinear, RowParallelLinear
    task_id = f"tp.{kind}"
    rng = random.Random(seed)
    start = rng.randrange(4)
    dtype_start = [random.Random(f"{seed}:dtype").randrange(4)]
    for draw in range(draws):
        group = groups[rng.randrange(len(groups))]
        n, rank = group.n, group.rank
        lead = tuple(rng.randint(1, 3) for _ in range((draw + start) % 4))  # none: a 1-D input
        fin, fout = (rng.randint(1, 9), n * rng.randint(1, 4)) if kind == "column" else (n * rng.randint(1, 4), rng.randint(1, 9))
        bias, option, scale = (draw + start) // 2 % 2 == 0, rng.random() < 0.5, rng.choice([0.5, 4.0])
        # every dtype each run (they cycle from their own drawn start, apart from the input's rank);
        # bf16/fp16: integer weights, inputs and gradients, sums below 256: exact in any order
        dtype = ALL_DTYPES[(draw + dtype_start[0]) % 4]
        gen = torch.Generator().manual_seed(rng.randrange(2**31))
        with torch.random.fork_rng(devices=[]):
            full = (integer_copy if dtype in LOW else seeded_copy)(nn.Linear(fin, fout, bias=bias), gen).to(dtype)
        if dtype in LOW:
            scale = scale / 2  # 0.25 or 2: powers of two, exact
        x_ref = drawn(lead + (fin,), dtype, gen, most=2).requires_grad_()
        grad_y = drawn(lead + (fout,), dtype, gen, most=2)
        y_ref = full(x_ref)
        y_ref.backward(grad_y * scale)
        name = "gather_output" if kind == "column" else "input_is_parallel"
        what = f"drawn configuration {draw} of seed {seed}: {fin} -> {fout}, input {lead + (fin,)}, {dtype}, " \
               f"bias={bias}, {name}={option}, loss x {scale}{group}"
        if kind == "column":
            layer = ColumnParallelLinear.from_linear(full, group.handle, gather_output=option)
            x = x_ref.detach().clone().requires_grad_()
            local_y = y_ref if option else y_ref.chunk(n, -1)[rank]
            incoming = grad_y if option else grad_y.chunk(n, -1)[rank]
        else:
            layer = RowParallelLinear.from_linear(full, group.handle, input_is_parallel=option)
            x = (x_ref.detach().chunk(n, -1)[rank] if option else x_ref.detach()).clone().requires_grad_()
            local_y, incoming = y_ref, grad_y
        snapshot = x.detach().clone()
        y = layer(x)
        unchanged(task_id, f"{what}: the input", x.detach(), snapshot)
        drawn_check(task_id, f"{what}: output", y, local_y.detach())
        up = (incoming * scale).clone()
        y.backward(up)
        unchanged(task_id, f"{what}: the incoming gradient", up, incoming * scale)
        x_grad = x_ref.grad.chunk(n, -1)[rank] if kind == "row" and option else x_ref.grad
        drawn_check(task_id, f"{what}: input gradient", x.grad, x_grad)
        dim = 0 if kind == "column" else 1
        drawn_check(task_id, f"{what}: weight gradient, gathered", gathered(layer.weight.grad, dim, group=group),
                    full.weight.grad)
        if bias:
            got = gathered(layer.bias.grad, 0, group=group) if kind == "column" else layer.bias.grad
            drawn_check(task_id, f"{what}: bias gradient", got, full.bias.grad)
        else:
            assert layer.bias is None, f"{task_id}: {what}: a layer without bias has a bias"


def drawn_block(kind: str, seed: int, draws: int, groups) -> None:
    """ParallelMLP / ParallelSelfAttention of drawn GPT shapes (heads a multiple of N, any head
    size, bias on or off, any B and T), float64/float32, random incoming gradients."""
    from labkit.models import GPT
    from labkit.tp import ParallelMLP, ParallelSelfAttention
    task_id = f"tp.{kind}"
    rng = random.Random(seed)
    low_start = random.Random(f"{seed}:low").randrange(2)
    for draw in range(draws):
        group = groups[rng.randrange(len(groups))]
        n = group.n
        heads, head_dim = n * rng.randint(1, 2), rng.randint(1, 3)
        cfg = config(n_head=heads, n_embd=heads * head_dim, bias=rng.random() < 0.5, block_size=8)
        dtype = rng.choice([torch.float64, torch.float32])
        if draw < 2:  # bf16 and fp16 every run (issue 39: the parallel layers in low precision)
            dtype = LOW[(draw + low_start) % 2]
        gen = torch.Generator().manual_seed(rng.randrange(2**31))
        block = seeded_copy(GPT(cfg).blocks[0], gen).to(dtype)
        ref = block.mlp if kind == "mlp" else block.attn
        shape = (rng.randint(1, 3), rng.randint(1, 6), cfg.n_embd)
        x_ref, grad_y = drawn(shape, dtype, gen).requires_grad_(), drawn(shape, dtype, gen, scale=3.0)
        ref(x_ref).backward(grad_y)
        part = ParallelMLP(ref, group.handle) if kind == "mlp" else ParallelSelfAttention(ref, group.handle)
        x = x_ref.detach().clone().requires_grad_()
        what = f"drawn configuration {draw} of seed {seed}: {cfg.n_head} heads of {head_dim}, bias={cfg.bias}, " \
               f"input {shape}, {dtype}{group}"
        y = part(x)

        def compare(name, actual, expected):
            if dtype in LOW:
                from labkit.check import assert_close
                assert_close(actual, expected, f"{task_id}: rank {dist.get_rank()} of {dist.get_world_size()}: "
                             f"{what}: {name}", **low_block_tolerance(dtype, expected))
            else:
                drawn_check(task_id, f"{what}: {name}", actual, expected)

        assert y.dtype == dtype, f"{task_id}: {what}: output in {y.dtype}, want {dtype} (the input's)"
        compare("output", y, ref(x_ref.detach()).detach())
        up = grad_y.clone()
        y.backward(up)
        unchanged(task_id, f"{what}: the incoming gradient", up, grad_y)
        compare("input gradient", x.grad, x_ref.grad)
        for name in ("c_fc", "c_proj") if kind == "mlp" else ("c_attn", "c_proj"):
            mine, theirs = getattr(part, name), getattr(ref, name)
            dim, parts = (1, 1) if name == "c_proj" else (0, 3 if name == "c_attn" else 1)
            assert mine.weight.dtype == dtype and mine.weight.grad.dtype == dtype, (
                f"{task_id}: {what}: {name}'s weight shard is {mine.weight.dtype} (gradient "
                f"{mine.weight.grad.dtype}), want {dtype}")
            compare(f"{name}.weight gradient, gathered", gathered(mine.weight.grad, dim, parts, group),
                    theirs.weight.grad)
            if cfg.bias:
                bias = mine.bias.grad if name == "c_proj" else gathered(mine.bias.grad, 0, parts, group)
                compare(f"{name}.bias gradient", bias, theirs.bias.grad)


def drawn_vocab(seed: int, draws: int, groups) -> None:
    """The vocabulary-parallel embedding on ids of any shape, and the per-token loss
    (VocabParallelCrossEntropy.apply) with a random incoming gradient per token."""
    from labkit.tp import VocabParallelCrossEntropy, VocabParallelEmbedding
    rng = random.Random(seed)
    start = rng.randrange(6)
    for draw in range(draws):
        group = groups[rng.randrange(len(groups))]
        n, rank = group.n, group.rank
        V, dim = n * rng.randint(1, 6), rng.randint(1, 5)
        dtype = [torch.float64, torch.float32][(draw + start) % 2]
        lead = tuple(rng.randint(1, 4) for _ in range(1 + (draw + start) % 3))
        gen = torch.Generator().manual_seed(rng.randrange(2**31))
        what = f"drawn configuration {draw} of seed {seed}: V={V}, ids {lead}, {dtype}{group}"
        with torch.random.fork_rng(devices=[]):
            table = seeded_copy(nn.Embedding(V, dim), gen).to(dtype)
        ids = torch.randint(0, V, lead, generator=gen)
        grad_rows = drawn(lead + (dim,), dtype, gen)
        table(ids).backward(grad_rows)
        emb = VocabParallelEmbedding.from_embedding(table, group.handle)
        ids_before = ids.clone()
        rows = emb(ids)
        unchanged("tp.vocab", f"{what}: the token ids", ids, ids_before)
        drawn_check("tp.vocab", f"{what}: embedding lookup", rows, table(ids).detach())
        rows.backward(grad_rows)
        drawn_check("tp.vocab", f"{what}: embedding weight gradient, gathered",
                    gathered(emb.weight.grad, 0, group=group), table.weight.grad)
        logits_ref = (drawn(lead + (V,), dtype, gen, scale=3.0) + rng.choice([0.0, 500.0])).requires_grad_()
        targets = torch.randint(0, V, lead, generator=gen)
        grad_loss = drawn(lead, dtype, gen)  # one incoming gradient per token: a weighted loss
        expected = F.cross_entropy(logits_ref.reshape(-1, V), targets.reshape(-1), reduction="none").view(lead)
        expected.backward(grad_loss)
        local = logits_ref.detach().chunk(n, -1)[rank].clone().requires_grad_()
        loss = VocabParallelCrossEntropy.apply(local, targets, group.handle)
        drawn_check("tp.vocab", f"{what}: per-token loss", loss, expected.detach())
        up = grad_loss.clone()
        loss.backward(up)
        unchanged("tp.vocab", f"{what}: the incoming gradient of the per-token loss", up, grad_loss)
        drawn_check("tp.vocab", f"{what}: gradient of this rank's logits, per-token incoming gradient",
                    local.grad, logits_ref.grad.chunk(n, -1)[rank])


def drawn_optimizer(model, kind: str):
    """Two param groups: matrices (lr, weight decay), biases/LayerNorms/1-D (another lr, no decay)."""
    matrices = [p for p in model.parameters() if p.dim() > 1]
    vectors = [p for p in model.parameters() if p.dim() <= 1]
    if kind == "adamw":  # eps 1e-6: the key bias's true gradient is 0 (softmax ignores a shift), and
        # AdamW with eps 1e-8 turns its rounding noise (1e-17) into steps of +-lr
        return torch.optim.AdamW([dict(params=matrices, lr=1e-2, weight_decay=0.1),
                                  dict(params=vectors, lr=3e-2, weight_decay=0.0)], eps=1e-6)
    return torch.optim.SGD([dict(params=matrices, lr=0.05, momentum=0.9, weight_decay=1e-2),
                            dict(params=vectors, lr=0.2, momentum=0.5, weight_decay=0.0)], lr=0.1)


def drawn_gpt(seed: int, draws: int, groups) -> None:
    """tensor_parallel on drawn GPTs (layers, heads, head size, vocabulary, bias, tied or not),
    3 steps on batches of drawn B and T <= block_size, a stateful optimizer with two param groups,
    the loss scaled plus a random incoming gradient on this rank's logits; the loss and
    full_state_dict (weights, and gradients at step 0) against the single-process GPT."""
    from labkit.models import GPT
    from labkit.tp import full_state_dict, tensor_parallel
    rng = random.Random(seed)
    for draw in range(draws):
        group = groups[rng.randrange(len(groups))]
        n, rank = group.n, group.rank
        heads = n * rng.randint(1, 2)
        cfg = config(n_layer=rng.randint(1, 2), n_head=heads, n_embd=heads * rng.randint(1, 3),
                     vocab_size=n * rng.randint(2, 5), block_size=rng.randint(2, 6), bias=rng.random() < 0.5,
                     tie_weights=rng.random() < 0.5)
        kind, scale = rng.choice(["adamw", "sgd"]), rng.choice([0.5, 3.0])
        gen = torch.Generator().manual_seed(rng.randrange(2**31))
        ref = GPT(cfg).double()
        model = tensor_parallel(GPT(cfg).double(), group.handle)
        opts = drawn_optimizer(ref, kind), drawn_optimizer(model, kind)
        what = f"drawn configuration {draw} of seed {seed}: {cfg}, {kind}, loss x {scale}{group}"
        for step in range(3):
            shape = (rng.randint(1, 3), rng.randint(1, cfg.block_size))
            x, y = (torch.randint(0, cfg.vocab_size, shape, generator=gen) for _ in range(2))
            grad_logits = drawn(shape + (cfg.vocab_size,), torch.float64, gen)
            logits_ref, loss_ref = ref(x, y)
            (loss_ref * scale + (logits_ref * grad_logits).sum()).backward()
            logits, loss = model(x, y)
            drawn_check("tp.model", f"{what}, step {step}: loss", loss.detach(), loss_ref.detach())
            drawn_check("tp.model", f"{what}, step {step}: this rank's logits", logits.detach(),
                        logits_ref.detach().chunk(n, -1)[rank])
            (loss * scale + (logits * grad_logits.chunk(n, -1)[rank]).sum()).backward()
            if step == 0:
                grads = full_state_dict(model, group.handle, grads=True)
                for name, p in ref.named_parameters():
                    drawn_check("tp.model", f"{what}, step 0: gradient of {name}, gathered", grads[name], p.grad)
            for o in opts:
                o.step()
                o.zero_grad()
            state = full_state_dict(model, group.handle)
            for name, value in ref.state_dict().items():
                drawn_check("tp.model", f"{what}: {name} after step {step}", state[name], value)


# ----------------------------------------------------------------------------- f and g


def f_g_on_rank(seed: int, draws: int):
    setup()
    groups = tp_groups()
    for group in groups:
        f_g_over(group)
    drawn_f_g(seed, draws, groups)


def f_g_over(group: Group):
    from labkit.tp import copy_to_parallel, reduce_from_parallel
    n, rank = group.n, group.rank
    x = seeded(B, T, 6, seed=1, requires_grad=True)
    upstream = [seeded(B, T, 6, seed=10 + group.ranks[r]) for r in range(n)]
    grad = Op("all_reduce", nbytes(B, T, 6), group.ranks)  # one all-reduce (sum) of the whole [B, T, 6] tensor
    with CommTracer() as fwd:
        y = copy_to_parallel(x, group.handle)
    check("tp.f_g", f"f forward is the identity{group}", y, x.detach())
    signature("tp.f_g", fwd, [], f"f forward{group} (the identity: no communication)")
    with CommTracer() as bwd:
        y.backward(upstream[rank])
    check("tp.f_g", f"f backward sums the group's gradients{group}", x.grad, sum(upstream))
    signature("tp.f_g", bwd, [grad], f"f backward{group} (one all-reduce of the gradient over the group)")

    parts = [seeded(B, T, 6, seed=20 + group.ranks[r]) for r in range(n)]
    mine = parts[rank].clone().requires_grad_()
    with CommTracer() as fwd:
        z = reduce_from_parallel(mine, group.handle)
    check("tp.f_g", f"g forward sums the group's partial results{group}", z, sum(parts))
    signature("tp.f_g", fwd, [grad], f"g forward{group} (one all-reduce of the partial results over the group)")
    with CommTracer() as bwd:
        z.backward(upstream[0])  # the same on every rank, as after a g: averaging it changes nothing
    check("tp.f_g", f"g backward is the identity{group}", mine.grad, upstream[0])
    signature("tp.f_g", bwd, [], f"g backward{group} (the identity: no communication)")


@task("tp.f_g", points=1)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_f_and_g(world_size):
    run_graded("tp.f_g", f_g_on_rank, world_size, configs.announce(), DRAWS)


# ----------------------------------------------------------------------------- linear layers


def column_on_rank(seed: int, draws: int):
    from labkit.tp import ColumnParallelLinear
    setup()
    groups = tp_groups()
    drawn_linear("column", seed, draws, groups)
    full = nn.Linear(12, 24).double()
    with torch.no_grad():
        full.weight.copy_(seeded(24, 12, seed=2))
        full.bias.copy_(seeded(24, seed=3))
    x_ref, x = seeded(B, T, 12, seed=4, requires_grad=True), seeded(B, T, 12, seed=4, requires_grad=True)
    weights = seeded(B, T, 24, seed=5)  # loss = sum(y * weights): every output counts
    y_ref = full(x_ref)
    (y_ref * weights).sum().backward()
    for group in groups:
        n, rank = group.n, group.rank
        for gather_output in (False, True):
            layer = ColumnParallelLinear.from_linear(full, group.handle, gather_output=gather_output)
            x.grad = None
            with CommTracer() as fwd:
                y = layer(x)
            what = f"gather_output={gather_output}{group}"
            if gather_output:
                check("tp.column", f"{what}: output", y, y_ref.detach())
                loss = (y * weights).sum()
            else:
                check("tp.column", f"{what}: this rank's output columns", y, y_ref.detach().chunk(n, -1)[rank])
                loss = (y * weights.chunk(n, -1)[rank]).sum()
            # forward: no communication, or with gather_output the all-gather of the [B, T, 24]
            # output; backward: f's all-reduce of the input's gradient [B, T, 12], nothing else.
            signature("tp.column", fwd, [Op("all_gather", nbytes(B, T, 24), group.ranks)] if gather_output else [],
                      f"{what}: forward" + (" (one all-gather of the output over the group)" if gather_output else
                                            " (the input is whole on every rank: no communication)"))
            with CommTracer() as bwd:
                loss.backward()
            check("tp.column", f"{what}: input gradient", x.grad, x_ref.grad)
            signature("tp.column", bwd, [Op("all_reduce", nbytes(B, T, 12), group.ranks)],
                      f"{what}: backward (f: one all-reduce of the input's gradient over the group)")
            check("tp.column", f"{what}: weight gradient, gathered", gathered(layer.weight.grad, 0, group=group),
                  full.weight.grad)
            check("tp.column", f"{what}: bias gradient, gathered", gathered(layer.bias.grad, 0, group=group),
                  full.bias.grad)


def row_on_rank(seed: int, draws: int):
    from labkit.tp import RowParallelLinear
    setup()
    groups = tp_groups()
    drawn_linear("row", seed, draws, groups)
    full = nn.Linear(24, 12).double()
    with torch.no_grad():
        full.weight.copy_(seeded(12, 24, seed=6))
        full.bias.copy_(seeded(12, seed=7))
    x_ref = seeded(B, T, 24, seed=8, requires_grad=True)
    weights = seeded(B, T, 12, seed=9)
    y_ref = full(x_ref)
    (y_ref * weights).sum().backward()
    for group in groups:
        n, rank = group.n, group.rank
        for input_is_parallel in (True, False):
            layer = RowParallelLinear.from_linear(full, group.handle, input_is_parallel=input_is_parallel)
            x = seeded(B, T, 24, seed=8)
            x = (x.chunk(n, -1)[rank].clone() if input_is_parallel else x).requires_grad_()
            with CommTracer() as fwd:
                y = layer(x)
            what = f"input_is_parallel={input_is_parallel}{group}"
            check("tp.row", f"{what}: output", y, y_ref.detach())
            # forward: g's all-reduce of the partial products [B, T, 12] (taking a slice of a
            # whole input costs nothing); backward: nothing, or, for a whole input, the
            # all-gather of its gradient [B, T, 24].
            signature("tp.row", fwd, [Op("all_reduce", nbytes(B, T, 12), group.ranks)],
                      f"{what}: forward (g: one all-reduce of the partial products over the group)")
            with CommTracer() as bwd:
                (y * weights).sum().backward()
            expected = x_ref.grad.chunk(n, -1)[rank] if input_is_parallel else x_ref.grad
            check("tp.row", f"{what}: input gradient", x.grad, expected)
            signature("tp.row", bwd, [] if input_is_parallel else [Op("all_gather", nbytes(B, T, 24), group.ranks)],
                      f"{what}: backward" + (" (g's backward is the identity: no communication)" if input_is_parallel
                                             else " (one all-gather of the input's gradient over the group)"))
            check("tp.row", f"{what}: weight gradient, gathered", gathered(layer.weight.grad, 1, group=group),
                  full.weight.grad)
            check("tp.row", f"{what}: bias gradient (replicated)", layer.bias.grad, full.bias.grad)


@task("tp.column", points=1)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_column_parallel_linear(world_size):
    run_graded("tp.column", column_on_rank, world_size, configs.announce(), DRAWS)


@task("tp.row", points=1)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_row_parallel_linear(world_size):
    run_graded("tp.row", row_on_rank, world_size, configs.announce(), DRAWS)


# ----------------------------------------------------------------------------- blocks


def block_part_on_rank(kind: str, seed: int, draws: int):
    """MLP or attention of the GPT, parallel vs whole: outputs, gradients, traffic."""
    from labkit.models import GPT
    from labkit.tp import ParallelMLP, ParallelSelfAttention
    setup()
    groups = tp_groups()
    drawn_block(kind, seed, draws, groups)
    task_id = f"tp.{kind}"
    ref_block = GPT(config()).double().blocks[0]
    ref = ref_block.mlp if kind == "mlp" else ref_block.attn
    x_ref = seeded(B, T, 48, seed=11, requires_grad=True)
    weights = seeded(B, T, 48, seed=12)
    (ref(x_ref) * weights).sum().backward()
    y_ref = ref(x_ref.detach()).detach()
    layers = ("c_fc", "c_proj") if kind == "mlp" else ("c_attn", "c_proj")
    for group in groups:
        n = group.n
        block = GPT(config()).double().blocks[0]
        part = ParallelMLP(block.mlp, group.handle) if kind == "mlp" else ParallelSelfAttention(block.attn, group.handle)
        x = seeded(B, T, 48, seed=11, requires_grad=True)
        what = ("MLP" if kind == "mlp" else "attention") + str(group)
        # One all-reduce of the block's [B, T, H] output forward (g) and one of its input's
        # gradient backward (f), over the group; nothing between the two layers, and no
        # gathering of heads.
        with CommTracer() as fwd:
            y = part(x)
        check(task_id, f"{what}: output", y, y_ref)
        signature(task_id, fwd, [Op("all_reduce", nbytes(B, T, 48), group.ranks)],
                  f"{what}: forward (exactly one all-reduce of B*T*H, g after c_proj; nothing between "
                  f"{layers[0]} and c_proj)")
        with CommTracer() as bwd:
            (y * weights).sum().backward()
        check(task_id, f"{what}: input gradient", x.grad, x_ref.grad)
        signature(task_id, bwd, [Op("all_reduce", nbytes(B, T, 48), group.ranks)],
                  f"{what}: backward (exactly one all-reduce of B*T*H, f before {layers[0]})")
        for name in layers:
            mine, theirs = getattr(part, name), getattr(ref, name)
            dim, parts = (1, 1) if name == "c_proj" else (0, 3 if name == "c_attn" else 1)
            check(task_id, f"{what}: {name}.weight gradient, gathered",
                  gathered(mine.weight.grad, dim, parts, group), theirs.weight.grad)
            bias = mine.bias.grad if name == "c_proj" else gathered(mine.bias.grad, 0, parts, group)
            check(task_id, f"{what}: {name}.bias gradient", bias, theirs.bias.grad)
        unsharded = sum(p.numel() for p in ref.parameters())
        replicated = ref.c_proj.bias.numel()
        held = sum(p.numel() for p in part.parameters())
        assert held == (unsharded - replicated) // n + replicated, \
            f"{task_id}: rank {dist.get_rank()}: {what}: holds {held} parameters; expected 1/{n} of the split ones"


@task("tp.mlp", points=1)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_parallel_mlp(world_size):
    run_graded("tp.mlp", block_part_on_rank, world_size, "mlp", configs.announce(), DRAWS)


@task("tp.attention", points=1.5)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_parallel_attention(world_size):
    run_graded("tp.attention", block_part_on_rank, world_size, "attention", configs.announce(), DRAWS)


# ----------------------------------------------------------------------------- vocabulary


def boundary_tokens(V: int, count: int, seed: int) -> torch.Tensor:
    """[B, T] token ids that hold, at every degree 1-4, the first and last token of every
    rank's slice of the vocabulary (where an off-by-one mask goes wrong), then random ones."""
    edges = sorted({k * V // n + d for n in WORLD_SIZES for k in range(n + 1) for d in (-1, 0)} & set(range(V)))
    rest = torch.randint(0, V, (count - len(edges),), generator=torch.Generator().manual_seed(seed))
    return torch.cat([torch.tensor(edges), rest])[torch.randperm(count, generator=torch.Generator().manual_seed(seed))]


def vocab_on_rank(seed: int, draws: int):
    from labkit.tp import VocabParallelEmbedding, vocab_parallel_cross_entropy
    setup()
    groups = tp_groups()
    drawn_vocab(seed, draws, groups)
    V = 48
    table = nn.Embedding(V, 16).double()
    with torch.no_grad():
        table.weight.copy_(seeded(V, 16, seed=13))
    idx = boundary_tokens(V, B * T, seed=14).view(B, T)
    weights = seeded(B, T, 16, seed=15)
    rows_ref = table(idx)
    (rows_ref * weights).sum().backward()
    # Logits around 1000: exp() overflows unless the global max is subtracted first.
    logits_ref = (seeded(B, T, V, seed=16) + 1000).requires_grad_()
    targets = boundary_tokens(V, B * T, seed=17).view(B, T)
    expected = F.cross_entropy(logits_ref.flatten(0, 1), targets.flatten())
    expected.backward()
    for group in groups:
        n, rank = group.n, group.rank
        emb = VocabParallelEmbedding.from_embedding(table, group.handle)
        with CommTracer() as fwd:
            rows = emb(idx)
        check("tp.vocab", f"embedding lookup{group} (tokens at every slice's first and last id)", rows,
              rows_ref.detach())
        signature("tp.vocab", fwd, [Op("all_reduce", nbytes(B, T, 16), group.ranks)],
                  f"embedding forward{group} (g: one all-reduce of the [B, T, 16] lookups over the group)")
        with CommTracer() as bwd:
            (rows * weights).sum().backward()
        signature("tp.vocab", bwd, [], f"embedding backward{group} (g's backward: no communication)")
        check("tp.vocab", f"embedding weight gradient{group}, gathered", gathered(emb.weight.grad, 0, group=group),
              table.weight.grad)

        local = logits_ref.detach().chunk(n, -1)[rank].clone().requires_grad_()
        with CommTracer() as fwd:
            loss = vocab_parallel_cross_entropy(local, targets, group.handle)
        check("tp.vocab", f"vocabulary-parallel cross-entropy{group} (logits near 1000, targets at every "
              "slice's edges)", loss.detach(), expected.detach())
        # Three all-reduces of one number per token (the max, the sum of exponentials, the
        # target's logit); never the [B, T, V] logits; backward needs no communication.
        signature("tp.vocab", fwd, [Op("all_reduce", nbytes(B, T), group.ranks)] * 3,
                  f"loss forward{group} (three all-reduces of B*T numbers: max, sum of exp, target logit)")
        with CommTracer() as bwd:
            loss.backward()
        check("tp.vocab", f"gradient of this rank's logits{group}", local.grad, logits_ref.grad.chunk(n, -1)[rank])
        signature("tp.vocab", bwd, [], f"loss backward{group} (softmax - one-hot, from local values: no communication)")


@task("tp.vocab", points=1.5)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_vocab_parallel_embedding_and_loss(world_size):
    run_graded("tp.vocab", vocab_on_rank, world_size, configs.announce(), DRAWS)


# ----------------------------------------------------------------------------- the model


def tokens(step: int):
    from labkit.data import markov_tokens
    x, y = markov_tokens(B * STEPS, T, 48, seed=5)
    return x[step * B:(step + 1) * B], y[step * B:(step + 1) * B]


# Which parameters tensor parallelism splits (chapter 05): the vocabulary tables, c_attn and
# c_fc by output rows (weight and bias), both c_proj weights by input columns. The rest
# (LayerNorms, wpe, the c_proj biases) stays whole on every rank.
SPLIT = ("wte.weight", "lm_head.weight", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
         "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight")


def full_state_dict_signature(ref, tied: bool, tracer, what: str, ranks=None) -> None:
    """One all-gather of the full tensor per split entry of the state dict, over the group,
    nothing for the replicated ones. A tied head is the embedding's table: gathered once or
    once per key."""
    split = [(name, nbytes(*value.shape)) for name, value in ref.state_dict().items() if name.endswith(SPLIT)]
    expected = [Op("all_gather", size, ranks) for _, size in split]
    try:
        signature("tp.model", tracer, expected, what)
    except AssertionError:
        if not tied:
            raise
        once = [Op("all_gather", size, ranks) for name, size in split if name != "lm_head.weight"]
        signature("tp.model", tracer, once, what + " (the tied head gathered once)")


def step_signature(gpt_config, ranks=None) -> tuple[list, list]:
    """The ops of a forward and of a backward of the TP GPT on a [B, T] batch, over the group.
    Forward: the embedding's g, g after each block's attention and MLP, the loss's three
    reductions of B*T numbers; backward: the head's f, f before each attention and MLP."""
    L, H = gpt_config.n_layer, gpt_config.n_embd
    forward = [Op("all_reduce", nbytes(B, T, H), ranks)] * (1 + 2 * L) + [Op("all_reduce", nbytes(B, T), ranks)] * 3
    return forward, [Op("all_reduce", nbytes(B, T, H), ranks)] * (1 + 2 * L)


def gpt_on_rank(tie: bool, seed: int = 0, draws: int = 0):
    """The TP GPT vs the single-process GPT: loss every step, gradients of step 0, weights
    after 5 AdamW steps (gathered with the learner's full_state_dict), the traffic of a step;
    then ``draws`` drawn GPTs (drawn_gpt)."""
    from labkit.models import GPT
    from labkit.tp import full_state_dict, tensor_parallel
    n, rank = setup()
    if draws:
        drawn_gpt(seed, draws, tp_groups())
    ref = GPT(config(tie_weights=tie)).double()
    with CommTracer() as built:
        model = tensor_parallel(GPT(config(tie_weights=tie)).double())
    signature("tp.model", built, [], f"tie_weights={tie}: tensor_parallel (every rank slices the same "
              "weights: no communication)")
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    forward, backward = step_signature(ref.config)
    losses = []
    for step in range(STEPS):
        x, y = tokens(step)
        loss_ref = ref(x, y)[1]
        loss_ref.backward()
        with CommTracer() as fwd:
            logits, loss = model(x, y)
        with CommTracer() as bwd:
            loss.backward()
        what = f"tie_weights={tie}, step {step}"
        check("tp.model", f"{what}: loss", loss.detach(), loss_ref.detach())
        signature("tp.model", fwd, forward, f"{what}: forward (1 + 2L all-reduces of B*T*H, then the loss's 3 of B*T)")
        signature("tp.model", bwd, backward, f"{what}: backward (1 + 2L all-reduces of B*T*H)")
        assert logits.shape == (B, T, 48 // n), f"tp.model: logits of rank {rank} are {tuple(logits.shape)}; expected this rank's vocabulary slice"
        if step == 0:
            with CommTracer() as gather:
                grads = full_state_dict(model, grads=True)
            for name, p in ref.named_parameters():
                check("tp.model", f"{what}: gradient of {name}, gathered", grads[name], p.grad)
            full_state_dict_signature(ref, tie, gather, f"{what}: full_state_dict(grads=True)")
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
        losses.append(loss.item())
    # After zero_grad (set_to_none) no parameter has a gradient: grads=True gathers nothing.
    with CommTracer() as gather:
        grads = full_state_dict(model, grads=True)
    assert grads == {}, (f"tp.model: tie_weights={tie}: full_state_dict(grads=True) with no gradient anywhere "
                         f"returned {sorted(grads)}; a parameter without a gradient has no entry")
    signature("tp.model", gather, [], f"tie_weights={tie}: full_state_dict(grads=True) with no gradients "
              "(nothing to gather: no communication)")
    with CommTracer() as gather:
        state = full_state_dict(model)
    expected = ref.state_dict()
    assert set(state) == set(expected), f"tp.model: full_state_dict keys differ: {set(state) ^ set(expected)}"
    for name, value in expected.items():
        check("tp.model", f"tie_weights={tie}: {name} after {STEPS} steps", state[name], value)
    full_state_dict_signature(ref, tie, gather, f"tie_weights={tie}: full_state_dict")
    return losses


def bad_shapes_on_rank():
    from labkit.models import GPT
    from labkit.tp import ColumnParallelLinear, RowParallelLinear, full_state_dict, tensor_parallel
    n = setup()[0]
    cases = [(lambda: tensor_parallel(GPT(config(n_head=6, n_embd=48))), "n_head"),
             (lambda: tensor_parallel(GPT(config(vocab_size=50))), "vocab_size"),
             (lambda: ColumnParallelLinear(8, 10), "out_features"),
             (lambda: RowParallelLinear(10, 8), "in_features")]
    for make, word in cases:
        with CommTracer() as tracer:
            try:
                make()
            except ValueError as error:
                assert word in str(error) and str(n) in str(error), f"tp.model: the error does not name {word}: {error}"
            else:
                raise AssertionError(f"tp.model: a shape with {word} not divisible by {n} was accepted")
        assert not tracer.events, f"tp.model: communicated before refusing a bad {word}: {tracer.summary()}"
    # ... and the shape that does divide is accepted, and computes the single process's loss,
    # also over a group of 2 of the 4 ranks: every part of the model runs over the group given.
    x, y = tokens(0)
    ref = GPT(config()).double()
    expected = ref(x, y)[1]
    expected.backward()
    check("tp.model", "loss of a valid shape", tensor_parallel(GPT(config()).double())(x, y)[1].detach(),
          expected.detach())
    group = tp_groups()[-1]
    model = tensor_parallel(GPT(config()).double(), group.handle)
    with CommTracer() as fwd:
        loss = model(x, y)[1]
    with CommTracer() as bwd:
        loss.backward()
    check("tp.model", f"loss{group}", loss.detach(), expected.detach())
    forward, backward = step_signature(ref.config, group.ranks)
    signature("tp.model", fwd, forward, f"forward{group} (1 + 2L all-reduces of B*T*H, then the loss's 3 of B*T)")
    signature("tp.model", bwd, backward, f"backward{group} (1 + 2L all-reduces of B*T*H)")
    with CommTracer() as gather:
        grads = full_state_dict(model, group.handle, grads=True)
    for name, p in ref.named_parameters():
        check("tp.model", f"gradient of {name}{group}, gathered", grads[name], p.grad)
    full_state_dict_signature(ref, True, gather, f"full_state_dict(grads=True){group}", group.ranks)


@task("tp.model", points=2)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_tensor_parallel_gpt_trains_like_the_single_process_gpt(world_size):
    run_graded("tp.model", gpt_on_rank, world_size, True, configs.announce(), DRAWS)


@task("tp.model", points=2)
def test_bad_shapes_are_refused_before_any_communication():
    run_graded("tp.model", bad_shapes_on_rank, 4)


def builtin_on_rank():
    """The same (untied) GPT parallelised by torch's parallelize_module; its loss curve."""
    from labkit.models import GPT
    from labkit.oracles import builtin_tensor_parallel, device_mesh, loss_parallel
    setup()
    model = builtin_tensor_parallel(GPT(config(tie_weights=False)).double(), device_mesh())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        with loss_parallel():
            loss = model(*tokens(step))[1]
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item())
    return losses


@task("tp.model", points=2)
@pytest.mark.parametrize("world_size", [2, 4])
def test_untied_head_matches_single_process_and_parallelize_module(world_size):
    ours = run_graded("tp.model", gpt_on_rank, world_size, False)[0]
    builtin = run_graded("tp.model", builtin_on_rank, world_size)[0]
    assert_close(torch.tensor(ours, dtype=torch.float64), torch.tensor(builtin, dtype=torch.float64),
                 f"tp.model: world size {world_size}: your loss curve vs parallelize_module's")
