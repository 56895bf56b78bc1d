"""Graded tests for chapter 04: fully_shard from scratch (labkit/fsdp.py).

Every check runs on every rank at world sizes 1-4 (3 leaves uneven shards, so padding) on
the ToyModel (a tied weight used twice, a frozen layer, an unused parameter, a buffer),
sharded two ways (the frozen layer as a unit of its own, or everything in one unit), and
on the small GPT (tied wte/lm_head in the root unit, one unit per block). The
single-process reference trains the same model on the global batch; each rank trains on
its 1/N of it. Models run in float64, so the comparison after 5 AdamW steps holds to the
float64 tolerance of labkit.check (in float32, Adam turns last-bit differences of
near-zero gradients into visible steps). The GPT's losses are also compared with torch's
fully_shard.

The tracer checks the technique: the whole communication signature of each phase, every op
with its count, group and bytes, and nothing else (``labkit.comm.assert_ops``), derived from
the shapes (3Φ per step): per unit, in forward one all-gather of its padded shards
(N x R x rest x element size per parameter, a tied weight once); in backward one all-gather
again (none for a unit that keeps its parameters, ``reshard_after_forward=False``) and one
reduce-scatter of the padded gradients of its parameters that have one; with mixed precision
the all-gathers in ``param_dtype`` and the reduce-scatters in ``reduce_dtype``; a parameter
kept whole: one all-reduce of its gradient. ``fully_shard`` itself communicates nothing.
Memory: no full parameter outlives its unit's forward, and a unit is freed before its
gradients are reduce-scattered. Prefetch: each all-gather but the first of forward and of
backward is posted before the previous unit computes and waited on after it (the timeline
of post, compute and wait). fsdp.forward also runs drawn configurations (``draw_config``, the
run's seed): the output, the full parameters each module sees, none alive after forward.
fsdp.prefetch too: drawn models trained with every unit prefetching while the order of the
units changes once (a unit joins it), then a step in the same order traced for overlap.

Subgroups (``fully_shard(process_group=...)`` is the one group-taking API; the units keep it),
each in the same launch as the world, at 3 and 4 ranks (``subgroups``): at 4 the 2x2 grid's
two axes, pairs {0,1},{2,3} and {0,2},{1,3}; at 3 the pair {0,2} beside rank 1 alone in its
own group (a bystander: it shards over itself and communicates with nobody). The shards are
the group rank's rows, the traffic names the group's ranks only:
    fsdp.shard     fully_shard(process_group) cuts the group rank's shard, checked without communication
    fsdp.forward   all-gathers over the group (forward, and under no_grad)
    fsdp.backward  5 AdamW steps over each group vs the reference, full traffic signature
    fsdp.prefetch  the ToyModel over {0,2}/{1,3} (4 ranks) or {0,2}/{1} (3 ranks): overlap of
                   every prefetched all-gather (post before the previous unit computes, wait
                   after) and the prefetch order, as on the world
"""

import contextlib
import functools
import math
import random
import time
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

from labkit.check import assert_close, tolerance
from labkit.comm import CommTracer, Op, assert_ops, assert_overlap
from labkit.course.grading import run_graded, task
from tests.grading import configs

WORLD_SIZES = [1, 2, 3, 4]
BATCH = 12      # global batch: divides by 1, 2, 3 and 4, so every rank gets an equal share
STEPS = 5
LR = 1e-2       # AdamW with its default weight decay 0.01: a frozen or unused parameter
                # that wrongly got a (zero) gradient would still move
LONG = configs.LONG
DRAWS = 16 if LONG else 2  # drawn configurations per launch (drawn_on_rank)


# ----------------------------------------------------------------------------- on every rank


def one_thread() -> None:
    # These models are tiny: one thread per rank is the fastest, and with other programs
    # on the machine a second OpenMP thread mostly spins (world size 1 gets two by default).
    torch.set_num_threads(1)


def build(kind: str, **options):
    """(reference model, model sharded with the learner's fully_shard, names of the units).

    "toy": the ToyModel's frozen layer is a unit of its own (no gradient to reduce), the
    root unit holds the rest; "toy1": one unit holds everything, frozen and trainable
    parameters side by side; "gpt": one unit per block, the root holds wte/lm_head (tied),
    wpe and ln_f.
    """
    from labkit.fsdp import fully_shard
    from labkit.models import GPT, GPTConfig, ToyModel
    if kind == "gpt":
        ref, model = GPT(GPTConfig()).double(), GPT(GPTConfig()).double()
        units = [f"blocks.{i}" for i in range(len(model.blocks))]
    else:
        ref, model = ToyModel().double(), ToyModel().double()
        units = ["frozen"] if kind == "toy" else []
    for unit in units:
        fully_shard(model.get_submodule(unit), **options)
    fully_shard(model, **options)
    return ref, model, [""] + units  # "" is the root


@functools.cache
def dataset(kind: str):
    from labkit.data import markov_tokens, regression
    from labkit.models import GPTConfig
    if kind == "gpt":
        cfg = GPTConfig()
        return markov_tokens(BATCH * STEPS, cfg.block_size, cfg.vocab_size, seed=4)
    x, y = regression(BATCH * STEPS, 8, 8, seed=4)
    return x.double(), y.double()


def batch(kind: str, step: int):
    """The global batch of ``step`` (the same on every rank)."""
    x, y = dataset("gpt" if kind == "gpt" else "toy")
    return x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH]


def loss_of(kind: str, model, x, y):
    from labkit.models import toy_loss
    return model(x, y)[1] if kind == "gpt" else toy_loss(model, x, y)


def my_part(x, group=None):
    """This rank's share of a batch: its 1/N, N the ranks of ``group`` (default: all)."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    share = len(x) // n
    return x[rank * share:(rank + 1) * share]


PARTITIONS = {4: [[[0, 1], [2, 3]], [[0, 2], [1, 3]]], 3: [[[0, 2], [1]]]}


def subgroups() -> list:
    """[(group, its global ranks)] of this rank, one per partition of ``PARTITIONS`` (none below
    3 ranks), as the data-parallel groups of a mesh (chapter 08): at 4 both axes of a 2x2 grid,
    at 3 the pair {0,2} and a bystander {1}. Neither is a prefix of the world, so a group rank
    taken for a global one (or a global rank for a group one) goes wrong. Each group shards and
    trains a model on its own: its ranks split the global batch. Every rank creates every group."""
    mine = []
    for partition in PARTITIONS.get(dist.get_world_size(), []):
        made = [dist.new_group(ranks) for ranks in partition]
        index = next(i for i, ranks in enumerate(partition) if dist.get_rank() in ranks)
        mine.append((made[index], partition[index]))
    return mine


def expected_shard(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    rows = -(-full.shape[0] // world)
    shard = torch.zeros((rows, *full.shape[1:]), dtype=full.dtype)
    mine = full[rank * rows:(rank + 1) * rows]
    shard[:len(mine)] = mine
    return shard


def shard_bytes(ref, world: int) -> int:
    """Bytes of this rank's padded shards: what param_bytes of the sharded model must be."""
    return sum(expected_shard(p.detach(), 0, world).nbytes for p in ref.parameters())


def unit_of(name: str, units) -> str:
    """The innermost unit ("" = the root) that holds parameter ``name``."""
    return max((u for u in units if u == "" or name.startswith(u + ".")), key=len)


def unit_bytes(ref, units, world: int, itemsize=None, names=None, whole=()) -> dict[str, int]:
    """Per unit: the bytes of its parameters gathered whole, padded: N x R x (the other dims)
    x element size (``itemsize``: the dtype moved; default the parameter's), a tied weight once;
    only those in ``names`` if given, never the ones kept whole."""
    out = {u: 0 for u in units}
    for name, p in ref.named_parameters():
        if name in whole or (names is not None and name not in names):
            continue
        rows = -(-p.shape[0] // world)
        out[unit_of(name, units)] += world * rows * math.prod(p.shape[1:]) * (itemsize or p.element_size())
    return out


def fsdp_signature(ref, units, world: int, with_grad, kept=(), param_itemsize=None, reduce_itemsize=None,
                   whole=(), ranks=None) -> tuple[list, list]:
    """(forward ops, backward ops) of one training step, every op over ``ranks`` (default:
    all; ``world`` of them). Per unit:
    forward, one all-gather of its padded shards; backward, one all-gather again (unless the
    unit is in ``kept``) and one reduce-scatter of the padded gradients of its parameters with
    a gradient (``with_grad``; none if it has none). Each parameter in ``whole`` (kept whole,
    replicate_params) with a gradient: one all-reduce of it in backward, in its own dtype."""
    gathered = unit_bytes(ref, units, world, param_itemsize, whole=whole)
    reduced = unit_bytes(ref, units, world, reduce_itemsize, names=with_grad, whole=whole)
    forward = [Op("all_gather", b, ranks) for b in gathered.values() if b]
    backward = [Op("all_gather", b, ranks) for u, b in gathered.items() if b and u not in kept]
    backward += [Op("reduce_scatter", b, ranks) for b in reduced.values() if b]
    params = dict(ref.named_parameters())
    backward += [Op("all_reduce", params[name].numel() * params[name].element_size(), ranks)
                 for name in whole if name in with_grad]
    return forward, backward


def check_signature(events, what: str, forward, backward) -> None:
    """The traced ops outside backward are ``forward``'s, those during backward ``backward``'s."""
    assert_ops([e for e in events if not e.in_backward], forward,
               f"{what}: forward (per unit, one all-gather of its padded shards)")
    assert_ops([e for e in events if e.in_backward], backward,
               f"{what}: backward (per unit, an all-gather unless kept, a reduce-scatter of its gradients)")


def capture_gathered(model, seen: list):
    """Forward pre-hooks, added after the learner's: record what each module's parameters
    are while it runs (they must be the full tensors)."""
    names = {m: name for name, m in model.named_modules()}
    handles = []
    for module in model.modules():
        if module._parameters:
            def hook(m, args):
                for pname, t in m._parameters.items():
                    if t is not None:
                        seen.append((f"{names[m]}.{pname}".lstrip("."), t))
            handles.append(module.register_forward_pre_hook(hook))
    return handles


def check_shards(task_id: str, kind: str, ref, model, where: str, group=None) -> None:
    import torch.nn as nn
    from labkit.memory import param_bytes
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    mine = dict(model.named_parameters())
    theirs = dict(ref.named_parameters())
    assert list(mine) == list(theirs), (f"{task_id}: rank {rank}, {where}: model.parameters() are "
                                       f"{list(mine)}, expected one shard per parameter: {list(theirs)}")
    for name, p in mine.items():
        what = f"{task_id}: rank {rank} of {n}, {kind}, {where}, shard of {name}"
        assert isinstance(p, nn.Parameter), f"{what}: a {type(p).__name__}, expected an nn.Parameter"
        assert p.requires_grad == theirs[name].requires_grad, f"{what}: requires_grad is {p.requires_grad}"
        assert_close(p.detach(), expected_shard(theirs[name].detach(), rank, n), what)
    if kind == "gpt":
        assert model.lm_head.weight is model.wte.weight, (
            f"{task_id}: rank {rank}, {where}: lm_head.weight and wte.weight are no longer one Parameter")
    got, want = param_bytes(model), shard_bytes(ref, n)
    assert got == want, (f"{task_id}: rank {rank} of {n}, {kind}, {where}: the model holds {got} bytes "
                         f"of parameters; its padded shards are {want} (full model: {param_bytes(ref)})")


def check_state(task_id: str, kind: str, ref, model, step: int) -> None:
    from labkit.fsdp import full_state_dict
    rank, n = dist.get_rank(), dist.get_world_size()
    full = full_state_dict(model)
    for name, value in ref.state_dict().items():
        assert name in full, f"{task_id}: rank {rank}: full_state_dict has no {name}"
        assert_close(full[name], value, f"{task_id}: rank {rank} of {n}, {kind}, after step {step}, "
                                        f"{name} vs the single-process reference")


def shard_on_rank(seed: int, draws: int) -> None:
    # Uninitialised memory (torch.empty) reads as NaN here, so padding left unwritten shows.
    torch.use_deterministic_algorithms(True)
    try:
        check_sharding()
        check_drawn_shards(seed, draws)
    finally:
        torch.use_deterministic_algorithms(False)


def check_drawn_shards(seed: int, draws: int) -> None:
    """shard_param on drawn shapes (1-3 dims, 1-9 rows) of every dtype a parameter may have
    (and integers): the shard keeps the dtype; then fully_shard of drawn models whose units
    hold float64 or float32 parameters: every shard keeps its parameter's dtype."""
    from labkit.fsdp import fully_shard, shard_param
    rng = random.Random(seed)
    rank, n = dist.get_rank(), dist.get_world_size()
    for _ in range(8 * draws):
        shape = (rng.randint(1, 9), *(rng.randint(1, 4) for _ in range(rng.randint(0, 2))))
        dtype = rng.choice([torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64])
        full = (torch.arange(math.prod(shape)).reshape(shape) + 1).to(dtype)
        assert_close(shard_param(full, rank, n), expected_shard(full, rank, n),
                     f"fsdp.shard: shard_param of a {dtype} tensor of shape {shape} (seed {seed}), rank {rank} of {n}")
    for draw in range(draws):
        cfg = draw_config(rng, n)
        ref, model = DrawnNet(cfg), DrawnNet(cfg)
        for i in cfg["units"]:
            fully_shard(model.layers[i])
        fully_shard(model)
        check_shards("fsdp.shard", f"drawn model {cfg} (seed {seed})", ref, model, "after fully_shard")


def check_sharding() -> None:
    one_thread()
    from labkit.fsdp import fully_shard, shard_param
    from labkit.models import GPT, GPTConfig, ToyModel
    rank, n = dist.get_rank(), dist.get_world_size()
    for shape in [(7, 3), (1,), (5,), (8, 2, 2)]:  # rows below, at and above N; 3-D
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape) + 1
        shard = shard_param(full, rank, n)
        assert_close(shard, expected_shard(full, rank, n),
                     f"fsdp.shard: shard_param of a {shape} tensor, rank {rank} of {n}")
        assert shard.untyped_storage().data_ptr() != full.untyped_storage().data_ptr(), (
            "fsdp.shard: shard_param returned a view of the full tensor; copy, so the full one can be freed")
    for kind in ["toy", "toy1", "gpt"]:
        ref = GPT(GPTConfig()).double() if kind == "gpt" else ToyModel().double()
        model = GPT(GPTConfig()).double() if kind == "gpt" else ToyModel().double()
        originals = {name: weakref.ref(p) for name, p in model.named_parameters()}
        with CommTracer() as tracer:
            for sub in (model.blocks if kind == "gpt" else [model.frozen] if kind == "toy" else []):
                fully_shard(sub)
            fully_shard(model)
        assert_ops(tracer, [], f"fsdp.shard: rank {rank} of {n}, {kind}: fully_shard must not communicate "
                               "(every rank cuts its shard from the same initial parameters)")
        check_shards("fsdp.shard", kind, ref, model, "after fully_shard")
        # No gc.collect(): what is freed must go at once, by reference count (and collect() costs ~0.5 s)
        alive = [name for name, r in originals.items() if r() is not None]
        assert not alive, (f"fsdp.shard: rank {rank}: after fully_shard the original full parameters "
                           f"{alive} are still alive; keep only the shards")
        if kind != "gpt":
            assert_close(model.scale, ref.scale, "fsdp.shard: the buffer scale must stay as it was")
    for group, ranks in subgroups():  # the shard of the group rank, of a group of that size
        ref, model = ToyModel().double(), ToyModel().double()
        with CommTracer() as tracer:
            fully_shard(model.frozen, process_group=group)
            fully_shard(model, process_group=group)
        where = f"fully_shard(process_group=) over ranks {ranks} (group rank {ranks.index(rank)} of {len(ranks)})"
        assert_ops(tracer, [], f"fsdp.shard: rank {rank}, toy, {where}: fully_shard must not communicate")
        check_shards("fsdp.shard", "toy", ref, model, where, group)


def forward_on_rank(seed: int, draws: int) -> None:
    one_thread()
    forward_drawn(seed, draws)
    from labkit.fsdp import UNIT_ATTR, full_state_dict, units_of
    from labkit.memory import param_bytes
    runs = [("toy", None), ("toy1", None), ("gpt", None)]
    runs += [("toy", pair) for pair in subgroups()]  # the ToyModel sharded over subgroups: group= honoured
    for kind, (group, ranks) in ((kind, pair or (None, None)) for kind, pair in runs):
        rank, n = dist.get_rank(group), dist.get_world_size(group)
        ref, model, units = build(kind, prefetch=False, process_group=group)
        check_state("fsdp.forward", kind, ref, model, 0)  # full_state_dict gathers
        shards = list(model.parameters())
        full_ref = dict(ref.named_parameters(remove_duplicate=False))
        x, y = batch(kind, 0)
        x, y = my_part(x, group), my_part(y, group)
        label = kind if group is None else f"{kind} sharded over ranks {ranks}"
        seen = []
        handles = capture_gathered(model, seen)
        with CommTracer() as tracer:
            loss = loss_of(kind, model, x, y)
        for h in handles:
            h.remove()
        what = f"fsdp.forward: rank {dist.get_rank()} (rank {rank} of {n} in the unit's group), {label}"
        forward, _ = fsdp_signature(ref, units, n, with_grad=(), ranks=ranks)
        assert_ops(tracer, forward, f"{what}: forward (per unit, one all-gather of its padded shards)")
        assert_close(loss.detach(), loss_of(kind, ref, x, y).detach(), f"{what}: loss vs the single-process model")
        assert seen, f"{what}: no module ran"
        for name, t in seen:
            assert_close(t.detach(), full_ref[name].detach(), f"{what}: {name} while its module runs forward")
        # Freed: with the graph still alive (loss not backpropagated), no full parameter may be.
        storages = {name: StorageWeakRef(t.untyped_storage()) for name, t in seen}
        del seen, t
        # No gc.collect(): what is freed must go at once, by reference count (and collect() costs ~0.5 s)
        alive = sorted({name for name, ref_ in storages.items() if not ref_.expired()})
        assert not alive, (f"{what}: after forward the full {alive} are still alive; free them after the unit's "
                           "forward, and save notes instead of them for backward (saved-tensor hooks)")
        now = list(model.parameters())
        assert len(now) == len(shards) and all(a is b for a, b in zip(now, shards)), (
            f"{what}: after forward the modules must point at their shards again")
        assert param_bytes(model) == shard_bytes(ref, n), (
            f"{what}: after forward the modules must point at their shards again")
        with torch.no_grad():
            with CommTracer() as tracer:
                no_grad_loss = loss_of(kind, model, x, y)
            assert_close(no_grad_loss, loss_of(kind, ref, x, y), f"{what}: loss under torch.no_grad()")
        assert_ops(tracer, forward, f"{what}: forward under torch.no_grad() (per unit, one all-gather)")
        assert param_bytes(model) == shard_bytes(ref, n), f"{what}: under no_grad, forward must free too"
        # An all-gather already in flight (what a prefetch leaves): forward must finish and use it,
        # not issue a second one, and leave nothing pending.
        with torch.no_grad():
            with CommTracer() as tracer:
                for u in units:
                    unit = getattr(model.get_submodule(u), UNIT_ATTR)
                    if unit.params:
                        unit.start_all_gather()
                prefetched_loss = loss_of(kind, model, x, y)
            assert_close(prefetched_loss, loss_of(kind, ref, x, y),
                         f"{what}: loss under no_grad, every unit's all-gather started before forward")
        assert_ops(tracer, forward, f"{what}: forward with every all-gather already started (use the pending "
                   "one: per unit, one all-gather in all)")
        assert all(u.pending is None for u in units_of(model)), (
            f"{what}: an all-gather started before forward is still pending after it; all_gather must take it")
        del loss
    # reshard_after_forward=False: with grad enabled every unit keeps its full parameters after its
    # forward (backward needs no all-gather); under no_grad it frees them all the same.
    ref, model, units = build("toy", prefetch=False, reshard_after_forward=False)
    n = dist.get_world_size()
    x, y = batch("toy", 0)
    x, y = my_part(x), my_part(y)
    what = f"fsdp.forward: rank {dist.get_rank()} of {n}, toy, reshard_after_forward=False"
    full_bytes = n * shard_bytes(ref, n)  # the gathered buffers: N padded shards of every unit
    with torch.no_grad():
        assert_close(loss_of("toy", model, x, y), loss_of("toy", ref, x, y), f"{what}: loss under no_grad")
    assert param_bytes(model) == shard_bytes(ref, n), (
        f"{what}: under no_grad forward must free the full parameters even so: {param_bytes(model)} bytes "
        f"held, the shards are {shard_bytes(ref, n)}")
    loss = loss_of("toy", model, x, y)
    assert_close(loss.detach(), loss_of("toy", ref, x, y).detach(), f"{what}: loss")
    assert param_bytes(model) == full_bytes, (
        f"{what}: after forward (grad enabled) the modules must keep their full parameters: "
        f"{param_bytes(model)} bytes, the gathered (padded) full parameters are {full_bytes}")
    for name, p in model.named_parameters():
        assert_close(p.detach(), ref.get_parameter(name).detach(), f"{what}: {name} kept after forward")
    del loss


def forward_drawn(seed: int, draws: int) -> None:
    """fsdp.forward on ``draws`` configurations of ``draw_config`` (the same stream on every rank;
    every unit resharding after forward): the output against the single-process model, every
    parameter a module sees while it runs equal to the full one, none of the gathered tensors
    alive after forward (the graph still alive), the modules on their shards again."""
    from labkit.fsdp import fully_shard
    rng = random.Random(f"{seed}/fsdp.forward")
    groups = [(None, list(range(dist.get_world_size())))] + subgroups()
    for draw in range(draws):
        cfg = draw_config(rng, dist.get_world_size())
        group, ranks = groups[cfg["partition"]]
        rank, n = dist.get_rank(group), dist.get_world_size(group)
        what = (f"fsdp.forward: drawn configuration {draw} of seed {seed} ({cfg}), rank {dist.get_rank()} "
                f"(rank {rank} of {n} in ranks {ranks})")
        ref, model = DrawnNet(cfg), DrawnNet(cfg)
        for i in cfg["units"]:
            fully_shard(model.layers[i], process_group=group)
        if cfg["sometimes_unit"]:
            fully_shard(model.sometimes, process_group=group)
        fully_shard(model, process_group=group)
        shards = list(model.parameters())
        full_ref = dict(ref.named_parameters(remove_duplicate=False))
        low = min(cfg["dtypes"], key=lambda d: d.itemsize)
        tol = dict(zip(("rtol", "atol"), tolerance(low)))
        gen = torch.Generator().manual_seed(cfg["data_seed"])
        ids = torch.randint(0, cfg["vocab"], (cfg["rows"][rank], cfg["seq"]), generator=gen)
        use = cfg["use_sometimes"][0]
        seen = []
        handles = capture_gathered(model, seen)
        out = model(ids, use)
        for h in handles:
            h.remove()
        assert_close(out.detach(), ref(ids, use).detach(), f"{what}: output vs the single-process model", **tol)
        for name, t in seen:
            assert_close(t.detach(), full_ref[name].detach(), f"{what}: {name} while its module runs forward")
        storages = {name: StorageWeakRef(t.untyped_storage()) for name, t in seen}
        del seen, t
        alive = sorted({name for name, ref_ in storages.items() if not ref_.expired()})
        assert not alive, f"{what}: after forward the full {alive} are still alive; free them after the unit's forward"
        now = list(model.parameters())
        assert len(now) == len(shards) and all(a is b for a, b in zip(now, shards)), \
            f"{what}: after forward the modules must point at their shards again"
        del out


def train_and_check(task_id: str, kind: str, prefetch: bool, inspect=None, traced_step: int = 0,
                    pair=None, **options) -> list[float]:
    """5 AdamW steps of the sharded model next to the reference; checks after every step;
    ``inspect`` looks at the trace of step ``traced_step`` (prefetching in forward needs the
    order of a previous step). ``pair``: (group, ranks) of ``pair_group``, to shard over it
    instead of every rank. ``options``: more arguments of fully_shard
    (reshard_after_forward=False: every unit keeps its parameters from forward to backward)."""
    from labkit.memory import grad_bytes, param_bytes
    from labkit.fsdp import UNIT_ATTR, units_of
    group, ranks = pair or (None, list(range(dist.get_world_size())))
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    where = f"rank {rank} of {n}" if pair is None else f"rank {dist.get_rank()} (rank {rank} of {n} in ranks {ranks})"
    ref, model, units = build(kind, prefetch=prefetch, process_group=group, **options)
    kept = set(units) if options.get("reshard_after_forward") is False else set()
    # When a shard's gradient lands (AllGatherParams.backward returned), its unit must have
    # freed its full parameters already: a unit is freed as soon as its backward is done.
    held = []
    for name, shard in model.named_parameters():
        if shard.requires_grad:
            unit = getattr(model.get_submodule(unit_of(name, units)), UNIT_ATTR)
            shard.register_post_accumulate_grad_hook(
                lambda _, unit=unit, name=name: held.append(name) if unit.full is not None else None)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = batch(kind, step)
        xs, ys = my_part(x, group), my_part(y, group)
        what = f"{task_id}: {where}, {kind}, step {step}"
        tracer = CommTracer() if inspect and step == traced_step else None
        if tracer:
            started = {}  # when each unit's forward body began (these hooks run after the learner's)
            handles = [model.get_submodule(u).register_forward_pre_hook(
                lambda m, a, u=u: started.setdefault(u, time.perf_counter()) and None) for u in units]
            with tracer:
                loss = loss_of(kind, model, xs, ys)
                loss.backward()
            for h in handles:
                h.remove()
        else:
            loss = loss_of(kind, model, xs, ys)
            loss.backward()
        ref_loss = loss_of(kind, ref, x, y)
        ref_loss.backward()
        with torch.no_grad():
            assert_close(loss.detach(), loss_of(kind, ref, xs, ys), f"{what}: loss on this rank's batch")
        losses.append(loss.item())
        for name, p in model.named_parameters():
            expected = ref.get_parameter(name).grad
            if expected is None:
                assert p.grad is None, f"{what}: {name} has a gradient; the reference has none (frozen or unused)"
            else:
                assert p.grad is not None, f"{what}: {name} has no gradient after backward"
                assert_close(p.grad, expected_shard(expected, rank, n),
                             f"{what}: gradient of {name}'s shard (averaged over ranks)")
        assert all(u.full is None and u.pending is None for u in units_of(model)), (
            f"{what}: after backward, every unit must be resharded (no full parameters kept)")
        assert not held, (
            f"{what}: the gradients of {held} were reduce-scattered while their unit still held its full "
            "parameters; free (reshard) a unit as soon as its backward is done, before reducing")
        with_grad = {name for name, p in ref.named_parameters() if p.grad is not None}
        if tracer:
            inspect(tracer, started, what, kind, ref, units, with_grad, kept, ranks)
        opt.step()
        ref_opt.step()
        wanted = sum(expected_shard(p.grad, 0, n).nbytes for p in ref.parameters() if p.grad is not None)
        assert param_bytes(model) == shard_bytes(ref, n) and grad_bytes(model) == wanted, (
            f"{what}: per-rank parameter/gradient bytes {param_bytes(model)}/{grad_bytes(model)}; "
            f"the shards are {shard_bytes(ref, n)}/{wanted}")
        opt.zero_grad()
        ref_opt.zero_grad()
        check_state(task_id, kind, ref, model, step)
    return losses


def check_backward_traffic(tracer, started, what, kind, ref, units, with_grad, kept, ranks) -> None:
    forward, backward = fsdp_signature(ref, units, len(ranks), with_grad, kept, ranks=ranks)
    check_signature(tracer.events, what, forward, backward)


def backward_on_rank(seed: int, draws: int) -> list:
    one_thread()
    drawn_on_rank(seed, draws)
    losses = {}
    # toy1 keeps its parameters from forward to backward: no all-gather in backward
    for kind, options in [("toy", {}), ("toy1", dict(reshard_after_forward=False)), ("gpt", {})]:
        losses[kind] = train_and_check("fsdp.backward", kind, prefetch=False, inspect=check_backward_traffic,
                                       **options)
    for pair in subgroups():  # sharded over subgroups: group= honoured
        train_and_check("fsdp.backward", "toy", prefetch=False, inspect=check_backward_traffic, pair=pair)
    losses["builtin"] = builtin_losses()
    assert_close(torch.tensor(losses["gpt"]), torch.tensor(losses["builtin"]),
                 f"fsdp.backward: rank {dist.get_rank()}: GPT losses vs torch's fully_shard")
    return losses


def builtin_losses() -> list[float]:
    """The same GPT training with torch.distributed.fsdp.fully_shard."""
    from labkit.models import GPT, GPTConfig
    from labkit.oracles import builtin_fully_shard
    model = builtin_fully_shard(GPT(GPTConfig()).double())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = batch("gpt", step)
        loss = model(my_part(x), my_part(y))[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def check_prefetch_order(tracer, started, what, kind, ref, units, with_grad, kept, ranks) -> None:
    """Overlap, from the timeline: every all-gather but the first of forward and of backward
    (nothing runs before those) is posted before the previous unit computes and waited on
    after it. Then the order: forward, unit i+1's all-gather is issued before unit i's forward
    body starts; backward (GPT), the next block's re-gather before this block's reduce-scatter."""
    check_backward_traffic(tracer, started, what.replace("fsdp.prefetch", "fsdp.prefetch (traffic)"),
                           kind, ref, units, with_grad, kept, ranks)
    order = sorted(units, key=lambda u: started[u])  # forward order of the units
    backward_order = order[:1] + order[1:][::-1]       # the root first, then the others reversed
    for phase, unit_order, in_backward in (("forward", order, False), ("backward", backward_order, True)):
        gathers = [i for i, e in enumerate(tracer.events) if e.kind == "all_gather" and e.in_backward == in_backward]
        for k in range(1, len(gathers)):
            before, unit = unit_order[k - 1] or "root", unit_order[k] or "root"
            assert_overlap(tracer, f"{what}: {phase}, the all-gather of unit {unit} (prefetched when "
                                   f"{before}'s {phase} starts, waited on when {unit}'s does)", events=[gathers[k]])
    forward = [e for e in tracer.events if e.kind == "all_gather" and not e.in_backward]
    for i in range(len(order) - 1):
        assert forward[i + 1].time < started[order[i]], (
            f"{what}: the all-gather of unit {order[i + 1] or 'root'} was issued after unit "
            f"{order[i] or 'root'} began its forward; prefetch it when {order[i] or 'root'} starts")
    if len(units) > 2:  # GPT: backward runs root, blocks.L-1, ..., blocks.0
        backward = [e for e in tracer.events if e.in_backward]
        gathers = [i for i, e in enumerate(backward) if e.kind == "all_gather"]
        scatters = [i for i, e in enumerate(backward) if e.kind == "reduce_scatter"]
        blocks = order[1:][::-1]
        for k in range(len(blocks) - 1):
            assert gathers[k + 2] < scatters[k], (
                f"{what}: in backward, the all-gather of {blocks[k + 1]} was issued after the "
                f"reduce-scatter of {blocks[k]}; prefetch it when {blocks[k]}'s backward starts")


def prefetch_on_rank(seed: int, draws: int) -> None:
    one_thread()
    drawn_on_rank(seed, draws, "fsdp.prefetch")
    for kind in ["toy", "gpt"]:
        train_and_check("fsdp.prefetch", kind, prefetch=True, inspect=check_prefetch_order, traced_step=1)
    for pair in subgroups()[-1:]:  # the strided pairs ({0,2},{1,3} or {0,2},{1}): prefetch over a subgroup
        train_and_check("fsdp.prefetch", "toy", prefetch=True, inspect=check_prefetch_order, traced_step=1, pair=pair)
    accumulate_kept()


def accumulate_kept() -> None:
    """reshard_after_forward=False and two micro-batches per step (gradient accumulation): in the
    second forward and in backward the unit to prefetch already holds its full parameters, so no
    all-gather may be started for it (one would stay pending: nobody waits on it)."""
    from labkit.fsdp import units_of
    ref, model, units = build("toy", prefetch=True, reshard_after_forward=False)
    rank, n = dist.get_rank(), dist.get_world_size()
    x, y = batch("toy", 0)
    xs, ys = my_part(x), my_part(y)
    h = len(xs) // 2
    what = f"fsdp.prefetch: rank {rank} of {n}, toy, reshard_after_forward=False, two micro-batches"
    with CommTracer() as tracer:
        loss = loss_of("toy", model, xs[:h], ys[:h]) + loss_of("toy", model, xs[h:], ys[h:])
        loss.backward()
    share = len(x) // n
    ref_loss = sum(loss_of("toy", ref, x[r * share:r * share + h], y[r * share:r * share + h])
                   + loss_of("toy", ref, x[r * share + h:(r + 1) * share], y[r * share + h:(r + 1) * share])
                   for r in range(n)) / n
    ref_loss.backward()
    # Forward: every unit all-gathers once per forward (a kept unit too: the second forward's
    # autograd node needs its own). Backward: the second micro-batch's backward runs first and
    # frees each trainable unit when done, so the first's must re-gather it: one all-gather per
    # unit with trainable parameters, none for a unit that still holds its own.
    gathers = [e for e in tracer.events if e.kind == "all_gather"]
    with_params = sum(1 for u in units_of(model) if u.params)
    trainable = sum(1 for u in units_of(model) if any(s.requires_grad for s in u.shards))
    got = (sum(not e.in_backward for e in gathers), sum(e.in_backward for e in gathers))
    assert got == (2 * with_params, trainable), (
        f"{what}: {got[0]} all-gathers in forward, {got[1]} in backward; expected {2 * with_params} (one per unit "
        f"and forward) and {trainable} (a unit freed by the other micro-batch's backward): a unit that still holds "
        "its parameters must not be prefetched")
    assert all(u.pending is None and u.full is None for u in units_of(model)), (
        f"{what}: after backward a unit still has an all-gather pending or its full parameters")
    for name, p in model.named_parameters():
        expected = ref.get_parameter(name).grad
        if expected is None:
            assert p.grad is None, f"{what}: {name} has a gradient; the reference has none"
        else:
            assert_close(p.grad, expected_shard(expected, rank, n), f"{what}: gradient of {name}'s shard")


# ----------------------------------------------------------------------------- drawn configurations


class DrawnNet(torch.nn.Module):
    """A model drawn from ``cfg`` (see ``draw_config``): token ids (integers: no gradient) ->
    embedding [V, d] -> Linear layers of drawn widths (row counts below, at and above N, not
    multiples of N), some without bias, some in float32 beside float64 ones, one frozen ->
    ``sometimes`` (a layer used only on some steps) -> a head tied to the embedding."""

    def __init__(self, cfg):
        super().__init__()
        import torch.nn as nn
        gen = torch.Generator().manual_seed(cfg["seed"])
        widths = cfg["widths"]
        with torch.random.fork_rng(devices=[]):  # the layers' own init draws are overwritten below
            self.emb = nn.Embedding(cfg["vocab"], widths[0])
            self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias)
                                        for a, b, bias in zip(widths, widths[1:], cfg["bias"]))
            self.sometimes = nn.Linear(widths[-1], widths[-1], bias=False)
        self.unused = nn.Parameter(torch.zeros(3))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(max(p.shape[-1], 1)))
        self.double()
        for layer, dtype in zip(self.layers, cfg["dtypes"]):
            layer.to(dtype)
        if cfg["frozen"] is not None:
            self.layers[cfg["frozen"]].requires_grad_(False)

    def forward(self, ids, use_sometimes: bool):
        h = torch.tanh(self.emb(ids))  # computation in the root before the first unit (a lookup is not)
        for layer in self.layers:
            h = torch.tanh(layer(h.to(layer.weight.dtype))).double()
        if use_sometimes:
            h = h + self.sometimes(h)
        return torch.nn.functional.linear(h, self.emb.weight)  # tied: the embedding again


def draw_config(rng: random.Random, world: int) -> dict:
    """One configuration from the documented space of fully_shard: shapes (widths 1-9, so rows
    below, at and above N and uneven shards), bias or not per layer, float64/float32 per layer
    (a unit's parameters share one dtype: a float32 layer is always its own unit), which layers
    are units, reshard_after_forward and prefetch per unit, the group (the world or a
    subgroup), the optimizer (AdamW or momentum SGD, two param groups: no weight decay and
    another lr for biases and 1-D parameters), per-rank batch sizes and sequence lengths, a
    loss scale, which steps use ``sometimes``."""
    layers = rng.randint(1, 3)
    widths = [rng.randint(1, 9) for _ in range(layers)]
    widths = widths + [widths[0]]  # the tied head maps back to the embedding's width
    dtypes = [rng.choice([torch.float64, torch.float32]) for _ in range(layers)]
    units = [i for i in range(layers) if dtypes[i] != torch.float64 or rng.random() < 0.5]
    return dict(seed=rng.randrange(2**31), vocab=rng.randint(1, 11), widths=widths,
                bias=[rng.random() < 0.6 for _ in range(layers)], dtypes=dtypes, units=units,
                frozen=rng.choice([None, *range(layers)]),
                sometimes_unit=rng.random() < 0.5,
                reshard={u: rng.random() < 0.6 for u in ["", "sometimes", *map(str, units)]},
                prefetch=rng.random() < 0.5, partition=rng.randrange(1 + len(PARTITIONS.get(world, []))),
                optimizer=rng.choice(["adamw", "sgd"]), steps=3,
                rows=[rng.randint(1, 3) for _ in range(world)], seq=rng.randint(1, 4),
                scale=rng.choice([0.25, 3.0, rng.uniform(0.1, 10)]),
                use_sometimes=[first := rng.random() < 0.5, not first, rng.random() < 0.5],  # changes
                data_seed=rng.randrange(2**31))


def drawn_optimizer(model, kind: str):
    """Two param groups: weights (lr, weight decay) and biases/1-D parameters (another lr, no decay)."""
    matrices = [p for p in model.parameters() if p.dim() > 1]
    vectors = [p for p in model.parameters() if p.dim() <= 1]
    if kind == "adamw":
        return torch.optim.AdamW([dict(params=matrices, lr=1e-2, weight_decay=0.1),
                                  dict(params=vectors, lr=3e-2, weight_decay=0.0)])
    return torch.optim.SGD([dict(params=matrices, lr=0.05, momentum=0.9, weight_decay=1e-2),
                            dict(params=vectors, lr=0.2, momentum=0.5, weight_decay=0.0)], lr=0.1)


def drawn_on_rank(seed: int, draws: int, task_id: str = "fsdp.backward") -> None:
    """``draws`` configurations from ``seed`` (the same on every rank), each trained 3 steps
    next to the single-process model: shard gradients (dtype, value, None where the reference
    has none) after every step, and the full state after every optimizer step.

    ``task_id`` "fsdp.prefetch": every unit prefetches; the layer used only on some steps is used
    on the first step only or on the second and third, and on even draws it is a unit of its own
    that joins the order at the second step (so the forward order changes once, and the third
    step repeats the second's), and the third step's trace must show every all-gather but the
    first of forward and of backward overlapped with computation (``assert_overlap``)."""
    from labkit.fsdp import full_state_dict, fully_shard, units_of
    one_thread()
    rng = random.Random(seed if task_id == "fsdp.backward" else f"{seed}:{task_id}")
    groups = [(None, list(range(dist.get_world_size())))] + subgroups()
    root_first = rng.random() < 0.5
    for draw in range(draws):
        cfg = draw_config(rng, dist.get_world_size())
        # the layer used on some steps alone in its unit, or in the root's beside parameters used
        # every step, on alternate draws: a launch has both
        cfg["sometimes_unit"] = (draw % 2 == 0) != root_first
        if task_id == "fsdp.prefetch":  # the order changes once: on even draws a unit joins it
            first = cfg["use_sometimes"][0] and draw % 2 == 1
            cfg.update(prefetch=True, use_sometimes=[first, not first, not first],
                       sometimes_unit=cfg["sometimes_unit"] or draw % 2 == 0)
        group, ranks = groups[cfg["partition"]]
        rank, n = dist.get_rank(group), dist.get_world_size(group)
        what = f"{task_id}: drawn configuration {draw} of seed {seed} ({cfg}), rank {dist.get_rank()} " \
               f"(rank {rank} of {n} in ranks {ranks})"
        ref, model = DrawnNet(cfg), DrawnNet(cfg)
        options = lambda u: dict(process_group=group, prefetch=cfg["prefetch"],  # noqa: E731
                                 reshard_after_forward=cfg["reshard"][u])
        for i in cfg["units"]:
            fully_shard(model.layers[i], **options(str(i)))
        if cfg["sometimes_unit"]:
            fully_shard(model.sometimes, **options("sometimes"))
        fully_shard(model, **options(""))
        opt, ref_opt = drawn_optimizer(model, cfg["optimizer"]), drawn_optimizer(ref, cfg["optimizer"])
        # A float64 value computed through a float32 layer is as exact as float32: the model's
        # lowest precision sets the tolerance of every comparison (labkit.check's, per dtype),
        # x10 with float32: three optimizer steps (lr up to 0.2, loss scale up to 10) carry the
        # ranks' reordered float32 sums forward (measured: up to 2e-5 relative at step 2).
        low = min(cfg["dtypes"], key=lambda d: d.itemsize)
        tol = dict(zip(("rtol", "atol"), (10 * t for t in tolerance(low)) if low == torch.float32 else tolerance(low)))
        gen = torch.Generator().manual_seed(cfg["data_seed"])
        rows = [cfg["rows"][r] for r in range(n)]  # this group's ranks' batch sizes (uneven)
        for step in range(cfg["steps"]):
            ids = torch.randint(0, cfg["vocab"], (sum(rows), cfg["seq"]), generator=gen)
            grad_out = torch.randn(sum(rows), cfg["seq"], cfg["vocab"], generator=gen, dtype=torch.float64)
            use = cfg["use_sometimes"][step]
            start = sum(rows[:rank])
            mine = slice(start, start + rows[rank])
            traced = task_id == "fsdp.prefetch" and step == 2
            with CommTracer() if traced else contextlib.nullcontext() as tracer:
                out = model(ids[mine], use)
                assert out.dtype == torch.float64 and out.shape == (rows[rank], cfg["seq"], cfg["vocab"]), \
                    f"{what}, step {step}: output {out.dtype} {tuple(out.shape)}"
                out.backward(grad_out[mine] * cfg["scale"])  # a random incoming gradient, scaled
            if traced:
                for phase, in_backward in (("forward", False), ("backward", True)):
                    gathers = [i for i, e in enumerate(tracer.events) if e.kind == "all_gather" and e.in_backward == in_backward]
                    assert_overlap(tracer, f"{what}, step {step} (the units ran in the previous step's order): {phase}, "
                                           "an all-gather after the first (prefetch it when the unit before starts, "
                                           "wait when its own unit does)", events=gathers[1:])
            # FSDP averages over the group: the reference sums every rank's share, divided by N.
            ref(ids, use).backward(grad_out * cfg["scale"] / n)
            for name, p in model.named_parameters():
                expected = ref.get_parameter(name)
                assert p.dtype == expected.dtype, f"{what}, step {step}: shard of {name} is {p.dtype}, not {expected.dtype}"
                if expected.grad is None:
                    assert p.grad is None, f"{what}, step {step}: {name} has a gradient; the reference has none"
                else:
                    assert p.grad is not None, f"{what}, step {step}: {name} has no gradient after backward"
                    assert_close(p.grad, expected_shard(expected.grad, rank, n),
                                 f"{what}, step {step}: gradient of {name}'s shard", **tol)
            assert all(u.full is None and u.pending is None for u in units_of(model)), \
                f"{what}, step {step}: a unit still holds its full parameters or a pending all-gather after backward"
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
            full = full_state_dict(model)
            for name, value in ref.state_dict().items():
                assert_close(full[name], value, f"{what}, after step {step}: {name}", **tol)
    drawn_mixed_precision(seed, draws)
    # One unit, two dtypes, no mp_policy: refused before any communication.
    mixed = DrawnNet(dict(seed=0, vocab=3, widths=[2, 3, 2], bias=[True], dtypes=[torch.float32], frozen=None))
    with CommTracer() as tracer:
        try:
            fully_shard(mixed)
        except ValueError as error:
            assert "dtype" in str(error), f"fsdp.shard: the error for mixed dtypes does not say so: {error}"
        else:
            raise AssertionError("fsdp.shard: fully_shard accepted one unit of float64 and float32 parameters")
    assert_ops(tracer, [], "fsdp.shard: fully_shard of mixed dtypes must refuse before communicating")


class MixedNet(torch.nn.Module):
    """An fp32 model for mixed precision (no dtype casts of its own: the policy sets them): token
    ids -> embedding [V, d] -> Linear layers of drawn widths, one maybe frozen -> tied head."""

    def __init__(self, cfg):
        super().__init__()
        import torch.nn as nn
        gen = torch.Generator().manual_seed(cfg["seed"])
        widths = cfg["widths"]
        with torch.random.fork_rng(devices=[]):
            self.emb = nn.Embedding(cfg["vocab"], widths[0])
            self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias) for a, b, bias in zip(widths, widths[1:], cfg["bias"]))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(max(p.shape[-1], 1)))
        if cfg["frozen"] is not None:
            self.layers[cfg["frozen"]].requires_grad_(False)

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return torch.nn.functional.linear(h, self.emb.weight)


def drawn_mixed_precision(seed: int, draws: int) -> None:
    """Issue 39: ``mp_policy`` drawn (param_dtype bf16 or fp16 in turn, reduce_dtype None, float32 or
    param_dtype) on drawn fp32 models (widths 1-9: uneven shards at 3 ranks; units drawn; a frozen
    layer; the world or a subgroup), 2 SGD steps with a random incoming gradient, against the file's
    single-process reference with the same casts (``emulated_mixed_precision``'s: parameters cast to
    param_dtype for forward and backward, gradients cast back onto the fp32 masters) on the global
    batch. Checked: the output in param_dtype, the all-gathers in param_dtype and the reduce-scatters
    in reduce_dtype (traced), fp32 master shards and gradients, each shard gradient and the full
    state after each step. Tolerance: labkit.check's rtol for param_dtype, atol that rtol x the
    largest reference magnitude (each rank's share is rounded to param_dtype before the sum: the
    error scales with the shares, not with a sum that may cancel)."""
    from labkit.check import tolerance as check_tolerance
    from labkit.fsdp import full_state_dict, fully_shard
    from labkit.oracles import mixed_precision_policy
    rng = random.Random(f"{seed}:mixed precision")
    groups = [(None, list(range(dist.get_world_size())))] + subgroups()
    start = rng.randrange(2)
    for draw in range(draws):
        param_dtype = (torch.bfloat16, torch.float16)[(draw + start) % 2]
        # the first draw reduces in float32 (the one setting where it is not param_dtype), the others drawn
        reduce_dtype = torch.float32 if draw == 0 else rng.choice([None, torch.float32, param_dtype])
        layers = rng.randint(1, 3)
        widths = [rng.randint(1, 9) for _ in range(layers)]
        cfg = dict(seed=rng.randrange(2**31), vocab=rng.randint(2, 11), widths=widths + [widths[0]],
                   bias=[rng.random() < 0.6 for _ in range(layers)], frozen=rng.choice([None, *range(layers)]),
                   units=[i for i in range(layers) if rng.random() < 0.5], partition=rng.randrange(len(groups)),
                   rows=[rng.randint(1, 3) for _ in range(dist.get_world_size())], seq=rng.randint(1, 4),
                   scale=rng.choice([0.25, 3.0]), data_seed=rng.randrange(2**31))
        group, ranks = groups[cfg["partition"]]
        rank, n = dist.get_rank(group), dist.get_world_size(group)
        what = (f"fsdp.backward: drawn mixed precision {draw} of seed {seed} (param_dtype {param_dtype}, reduce_dtype "
                f"{reduce_dtype}, {cfg}), rank {dist.get_rank()} (rank {rank} of {n} in ranks {ranks})")
        ref, model = MixedNet(cfg), MixedNet(cfg)
        policy = mixed_precision_policy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        for i in cfg["units"]:
            fully_shard(model.layers[i], process_group=group, mp_policy=policy)
        fully_shard(model, process_group=group, mp_policy=policy)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        rtol = check_tolerance(param_dtype)[0]
        gen = torch.Generator().manual_seed(cfg["data_seed"])
        rows = [cfg["rows"][r] for r in range(n)]
        start_row = sum(rows[:rank])
        mine = slice(start_row, start_row + rows[rank])
        for step in range(2):
            ids = torch.randint(0, cfg["vocab"], (sum(rows), cfg["seq"]), generator=gen)
            grad_out = torch.randn(sum(rows), cfg["seq"], cfg["vocab"], generator=gen) * cfg["scale"]
            with CommTracer() as tracer:
                out = model(ids[mine])
                out.backward(grad_out[mine].to(param_dtype))
            assert out.dtype == param_dtype, f"{what}, step {step}: output in {out.dtype}, want {param_dtype}"
            gathers = {e.dtype for e in tracer.events if e.kind == "all_gather"}
            scatters = {e.dtype for e in tracer.events if e.kind == "reduce_scatter"}
            assert gathers <= {param_dtype} and scatters <= {reduce_dtype or param_dtype}, (
                f"{what}, step {step}: all-gathers moved {sorted(map(str, gathers))} (want {param_dtype}), "
                f"reduce-scatters {sorted(map(str, scatters))} (want {reduce_dtype or param_dtype})")
            # the reference: the same casts, the whole group's batch, the mean over the ranks
            names = dict(ref.named_parameters())
            low = {name: p.detach().to(param_dtype).requires_grad_(p.requires_grad) for name, p in names.items()}
            ref_out = torch.func.functional_call(ref, low, (ids,))
            ref_out.backward((grad_out / n).to(param_dtype))
            for name, p in model.named_parameters():
                expected = low[name].grad
                assert p.dtype == torch.float32, f"{what}, step {step}: master shard of {name} is {p.dtype}, want float32"
                if expected is None:
                    assert p.grad is None, f"{what}, step {step}: {name} has a gradient; the reference has none"
                    continue
                assert p.grad is not None and p.grad.dtype == torch.float32, (
                    f"{what}, step {step}: gradient of {name}'s shard is {None if p.grad is None else p.grad.dtype}, "
                    "want float32 (on the master)")
                names[name].grad = expected.float()
                want = expected_shard(expected.float(), rank, n)
                assert_close(p.grad, want, f"{what}, step {step}: gradient of {name}'s shard vs one process with the "
                             "same casts", rtol=rtol, atol=rtol * max(float(expected.float().abs().max()), 1e-3))
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad(set_to_none=True)
            full = full_state_dict(model)
            for name, value in ref.state_dict().items():
                assert full[name].dtype == torch.float32, f"{what}, after step {step}: {name} is {full[name].dtype}"
                assert_close(full[name], value, f"{what}, after step {step}: {name}",
                             rtol=rtol, atol=rtol * max(float(value.abs().max()), 1e-3))
            # from the same masters again: each step's gradients compared from equal weights (a
            # param_dtype cast of masters that differ in the last bits may round the other way)
            ref.load_state_dict({name: full[name] for name in ref.state_dict()})


# ----------------------------------------------------------------------------- tests


@task("fsdp.shard", points=2)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_shard(world_size):
    run_graded("fsdp.shard", shard_on_rank, world_size, configs.announce(), DRAWS)


@task("fsdp.forward", points=3)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_forward_gathers_then_frees(world_size):
    run_graded("fsdp.forward", forward_on_rank, world_size, configs.announce("fsdp.forward"), DRAWS)


@task("fsdp.backward", points=3)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_training_matches_single_process_and_fully_shard(world_size):
    run_graded("fsdp.backward", backward_on_rank, world_size, configs.announce(), DRAWS)


@task("fsdp.prefetch", points=2)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_prefetch_issues_all_gathers_early(world_size):
    run_graded("fsdp.prefetch", prefetch_on_rank, world_size, configs.announce("fsdp.prefetch"), DRAWS)


# ----------------------------------------------------------------------------- mixed precision


MP_TOLERANCE = dict(rtol=1e-2, atol=1e-3)  # losses in bf16/fp16: ~3 significant digits


def emulated_mixed_precision(model, x, y, param_dtype):
    """One process, the same casts: the fp32 master weights copied to ``param_dtype`` for
    forward and backward; the gradients cast back to fp32 onto the masters."""
    names = dict(model.named_parameters())
    low = {name: p.detach().to(param_dtype).requires_grad_(p.requires_grad) for name, p in names.items()}
    loss = torch.func.functional_call(model, low, (x, y))[1]
    loss.backward()
    for name, p in names.items():
        if low[name].grad is not None:
            p.grad = low[name].grad.float()
    return loss


def mixed_precision_on_rank(param_dtype, reduce_dtype, replicate=False):
    from labkit.fsdp import fully_shard
    from labkit.models import GPT, GPTConfig
    from labkit.oracles import builtin_fully_shard, mixed_precision_policy
    one_thread()
    rank, n = dist.get_rank(), dist.get_world_size()
    policy = mixed_precision_policy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    ours, theirs, single = GPT(GPTConfig()), GPT(GPTConfig()), GPT(GPTConfig())
    # replicate: the LayerNorms and the output-projection biases kept whole; they must compute
    # in param_dtype too (torch shards them all: the same numbers, another route for the gradients)
    kept = lambda m: [p for name, p in m.named_parameters()  # noqa: E731
                      if "ln_" in name or name.endswith("c_proj.bias")] if replicate else []
    for block in ours.blocks:
        fully_shard(block, mp_policy=policy, replicate_params=kept(block))
    fully_shard(ours, mp_policy=policy, replicate_params=list(ours.ln_f.parameters()) if replicate else [])
    builtin_fully_shard(theirs, mp_policy=policy)
    units = [""] + [f"blocks.{i}" for i in range(len(ours.blocks))]
    whole = {name for name, _ in single.named_parameters() if "ln_" in name or name.endswith("c_proj.bias")} \
        if replicate else set()
    itemsize = lambda dtype: torch.empty((), dtype=dtype).element_size()  # noqa: E731
    # every parameter of the GPT gets a gradient
    signature = fsdp_signature(single, units, n, {name for name, _ in single.named_parameters()}, whole=whole,
                               param_itemsize=itemsize(param_dtype), reduce_itemsize=itemsize(reduce_dtype or param_dtype))
    seen = []
    ours.blocks[0].mlp.c_fc.register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype))
    ours.blocks[0].ln_1.register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs, single)]
    for step in range(STEPS):
        x, y = batch("gpt", step)
        with CommTracer() as tracer:
            loss = ours(my_part(x), my_part(y))[1]
            loss.backward()
        their_loss = theirs(my_part(x), my_part(y))[1]
        their_loss.backward()
        what = f"fsdp.backward: mixed precision {param_dtype}/{reduce_dtype}, rank {rank} of {n}, step {step}"
        assert_close(loss.float(), their_loss.float(), f"{what}: loss vs torch's fully_shard", **MP_TOLERANCE)
        if n == 1:  # the whole batch here: the single process with the same casts must agree too
            expected = emulated_mixed_precision(single, x, y, param_dtype)
            assert_close(loss.float(), expected.float(), f"{what}: loss vs one process with the same casts", **MP_TOLERANCE)
        assert loss.dtype == param_dtype and set(seen[-2:]) == {param_dtype}, \
            f"{what}: forward must run in {param_dtype}; the loss is {loss.dtype}, the weights {seen[-2:]}"
        gathers = [e for e in tracer.events if e.kind == "all_gather"]
        scatters = [e for e in tracer.events if e.kind == "reduce_scatter"]
        assert gathers and {e.dtype for e in gathers} == {param_dtype}, \
            f"{what}: all-gathers moved {sorted({str(e.dtype) for e in gathers})}, expected {param_dtype}"
        assert scatters and {e.dtype for e in scatters} == {reduce_dtype or param_dtype}, \
            f"{what}: reduce-scatters moved {sorted({str(e.dtype) for e in scatters})}, expected {reduce_dtype or param_dtype}"
        check_signature(tracer.events, what, *signature)
        for p in ours.parameters():
            assert p.dtype == torch.float32 and (p.grad is None or p.grad.dtype == torch.float32), \
                f"{what}: master shards and their gradients must stay float32 (got {p.dtype}, {p.grad.dtype})"
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
    state = [v for s in opts[0].state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
    assert state and all(v.dtype == torch.float32 for v in state), "fsdp.backward: optimizer state must be float32"


@task("fsdp.backward", points=2)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_mixed_precision_like_fsdp2(world_size):
    run_graded("fsdp.backward", mixed_precision_on_rank, world_size, torch.bfloat16, torch.float32, True)
    run_graded("fsdp.backward", mixed_precision_on_rank, world_size, torch.float16, None)


# ----------------------------------------------------------------------------- replicated parameters


def replicated_on_rank():
    from labkit.fsdp import fully_shard
    from labkit.models import GPT, GPTConfig
    one_thread()
    rank, n = dist.get_rank(), dist.get_world_size()
    ref, model = GPT(GPTConfig()).double(), GPT(GPTConfig()).double()
    norms = lambda m: [p for name, p in m.named_parameters() if "ln_" in name]  # noqa: E731  LayerNorms
    for block in model.blocks:
        fully_shard(block, replicate_params=norms(block))
    fully_shard(model, replicate_params=list(model.ln_f.parameters()))
    whole = {name: p.shape for name, p in ref.named_parameters() if "ln_" in name}
    units = [""] + [f"blocks.{i}" for i in range(len(model.blocks))]
    signature = fsdp_signature(ref, units, n, {name for name, _ in ref.named_parameters()}, whole=set(whole))
    opts = [torch.optim.AdamW(m.parameters(), lr=LR) for m in (ref, model)]
    for step in range(STEPS):
        x, y = batch("gpt", step)
        ref(x, y)[1].backward()
        with CommTracer() as tracer:
            model(my_part(x), my_part(y))[1].backward()
        params = dict(model.named_parameters())
        for name, shape in whole.items():
            assert params[name].shape == shape, f"fsdp.backward: replicated {name} has shape {tuple(params[name].shape)}, not whole {tuple(shape)}"
            assert_close(params[name].grad, dict(ref.named_parameters())[name].grad,
                         f"fsdp.backward: rank {rank} of {n}, step {step}: the averaged gradient of replicated {name}")
        check_signature(tracer.events, f"fsdp.backward: rank {rank} of {n}, step {step}, LayerNorms kept whole",
                        *signature)
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
    for name, p in model.named_parameters():
        if name in whole:
            assert_close(p, dict(ref.named_parameters())[name], f"fsdp.backward: rank {rank}: replicated {name} after {STEPS} steps")


@task("fsdp.backward", points=2)
@pytest.mark.parametrize("world_size", [2, 3])
def test_replicated_parameters_stay_whole_and_equal(world_size):
    run_graded("fsdp.backward", replicated_on_rank, world_size)
