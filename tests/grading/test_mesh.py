"""Graded tests for chapter 08: hybrid parallelism on a rank mesh (labkit/mesh.py).

Groups: every rank's coordinates and group along every axis (for every rank, in every
launch) equal the ones ``init_device_mesh`` lays out for the same (dp, pp, cp, tp) shape and
names, TP the fastest axis, then CP, PP, DP; so do the process groups ``make_groups`` makes;
a few more uneven shapes are checked against the same layout without communication.
Communication: the first training step of every layout is traced on every rank and compared
with the whole signature the layout implies (``labkit.comm.assert_ops``; groups from the
layout, bytes from the model's shapes): TP all-reduces on the tp group, FSDP all-gathers and
reduce-scatters per unit on the dp group (2-D), 1F1B sends and receives to the neighbouring
stage's rank and the gradient average on the dp group (3-D), and nothing else. Numbers: for the layouts (dp, tp, pp) in
{(1,1,1), (2,2,1), (2,1,2), (1,2,2), (2,2,2)}, at world sizes up to 8, the loss curve over
5 AdamW steps in float64 equals the single-process GPT on the global batch, on every rank;
the learner's 2-D training (their FSDP over dp, their TP over tp) gives the same losses as
torch's (``fully_shard`` on the dp sub-mesh + ``parallelize_module`` on the tp sub-mesh).
Memory: the parameter, gradient and optimizer bytes measured on every rank (labkit.memory)
equal ``mesh.parameters_on_rank``'s prediction exactly (float64, AdamW: 2 moments per element
and a 4-byte step counter per tensor).
Drawn configurations (``tests/grading/configs.py``: a new seed each run, ``LABKIT_SEED``
replays, ``LABKIT_LONG=1`` draws more): one drawn layout per CI run for each of train_2d
(4x1, 2x2, 1x4) and train_3d (2x1x2, 1x2x2) at world size 4, with a drawn GPT (depth, width,
tied or not), AdamW or SGD with momentum over two parameter groups (other lr, weight decay on
matrices only) and a scaled loss, against one process on the global batch; for the plan, 40
drawn model shapes and layouts (dp, tp, pp, cp, ZeRO stage, micro-batches, recomputation,
stage) against a count on the real GPT and the byte arithmetic written out in the test.
"""

import contextlib
import math
import random
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from labkit.check import assert_close
from labkit.course.grading import run_graded, task
from tests.grading import configs

STEPS = 5
GLOBAL_BATCH = 4
LAYOUTS = [(1, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2)]  # (dp, tp, pp)


def config(tie: bool):
    from labkit.models import GPTConfig
    return GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16, tie_weights=tie)


def batches():
    from labkit.data import markov_tokens
    x, y = markov_tokens(STEPS * GLOBAL_BATCH, 8, 32, seed=8)
    return x.view(STEPS, GLOBAL_BATCH, 8), y.view(STEPS, GLOBAL_BATCH, 8)


def reference_losses(tie: bool) -> list[float]:
    from labkit.models import GPT
    model = GPT(config(tie)).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = batches()
    losses = []
    for step in range(STEPS):
        loss = model(x[step], y[step])[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# ----------------------------------------------------------------------------- the grid


# Shapes (dp, pp, cp, tp) checked in every launch without communication, against
# init_device_mesh's layout (torch.arange(world).view(shape)): uneven degrees, so that no
# two axes can be swapped unnoticed.
MORE_SHAPES = [(2, 1, 2, 1), (3, 2, 1, 2), (2, 3, 2, 1), (1, 2, 3, 2), (2, 2, 2, 3), (5, 1, 1, 1)]


def check_layout_of(grid, ranks: torch.Tensor, where: str) -> None:
    """Every rank's coordinates, ``rank_of`` and group along every axis, against ``ranks``
    (the mesh's rank array, shape (dp, pp, cp, tp))."""
    from labkit.mesh import AXES
    for rank in range(ranks.numel()):
        position = tuple(int(i) for i in (ranks == rank).nonzero()[0])
        coords = dict(zip(AXES, position))
        assert grid.coords(rank) == coords, \
            f"mesh.grid: {grid}{where}: coords({rank}) = {grid.coords(rank)}; init_device_mesh puts rank {rank} at {coords}"
        assert grid.rank_of(coords) == rank, \
            f"mesh.grid: {grid}{where}: rank_of({coords}) = {grid.rank_of(coords)}; expected {rank}"
        for i, axis in enumerate(AXES):
            line = list(position)
            line[i] = slice(None)
            expected = ranks[tuple(line)].tolist()
            assert grid.axis_ranks(axis, rank) == expected, \
                (f"mesh.grid: {grid}{where}: axis_ranks({axis!r}, {rank}) = {grid.axis_ranks(axis, rank)}; "
                 f"init_device_mesh's {axis} group of rank {rank} is {expected} (TP fastest, then CP, PP, DP)")


def grid_on_rank(shape):
    from labkit.mesh import AXES, RankGrid
    from labkit.oracles import device_mesh
    rank = dist.get_rank()
    degrees = dict(zip(AXES, shape))
    grid = RankGrid(dist.get_world_size(), **degrees).make_groups()
    mesh = device_mesh(shape, AXES)
    check_layout_of(grid, mesh.mesh, "")  # every rank and every axis, as init_device_mesh lays them out
    for axis in AXES:
        ours = dist.get_process_group_ranks(grid.group(axis))
        theirs = dist.get_process_group_ranks(mesh.get_group(axis))
        assert ours == theirs, f"mesh.grid: {grid}: rank {rank}'s {axis} group is {ours}; init_device_mesh's is {theirs}"
    for other in MORE_SHAPES:  # no groups: coordinates only
        world = math.prod(other)
        check_layout_of(RankGrid(world, **dict(zip(AXES, other))), torch.arange(world).view(other),
                        f" (world {world})")


@task("mesh.grid", points=2)
@pytest.mark.parametrize("shape", [(1, 1, 1, 4), (2, 1, 1, 2), (1, 2, 1, 2), (2, 2, 1, 2), (1, 2, 2, 2)],
                         ids=lambda s: "x".join(map(str, s)))
def test_groups_match_init_device_mesh(shape):
    import math
    run_graded("mesh.grid", grid_on_rank, math.prod(shape), shape)


@task("mesh.grid", points=1)
def test_degrees_that_do_not_multiply_to_the_world_are_refused():
    from labkit.mesh import AXES, RankGrid
    with pytest.raises(ValueError, match="world"):
        RankGrid(8, dp=2, tp=2)
    with pytest.raises(ValueError, match="tp"):
        RankGrid(4, dp=4, tp=0)
    with pytest.raises(ValueError, match="dp"):
        RankGrid(4, dp=-2, pp=-2)  # multiplies to the world, but a degree is at least 1
    seed = configs.announce("mesh.grid")
    rng = random.Random(seed)
    for _ in range(configs.budget(ci=20, long=200)):  # drawn grids, up to 6 per axis
        shape = tuple(rng.randint(1, 6) for _ in range(4))
        world = math.prod(shape)
        check_layout_of(RankGrid(world, **dict(zip(AXES, shape))), torch.arange(world).view(shape),
                        f" (drawn, seed {seed}, world {world})")
        wrong = world + rng.choice([-1, 1]) * rng.randint(1, world)
        if wrong > 0:
            with pytest.raises(ValueError, match="world"):
                RankGrid(wrong, **dict(zip(AXES, shape)))
    grid = RankGrid(8, dp=2, pp=2, tp=2)
    assert [grid.rank_of(grid.coords(r)) for r in range(8)] == list(range(8)), "mesh.grid: rank_of(coords(r)) != r"
    assert grid.axis_ranks("tp", 5) == [4, 5] and grid.axis_ranks("dp", 5) == [1, 5] and grid.axis_ranks("pp", 5) == [5, 7], \
        "mesh.grid: TP must be the fastest axis, DP the slowest"


# ----------------------------------------------------------------------------- training


def layout_groups(dp: int, pp: int, tp: int, rank: int) -> dict[str, tuple[int, ...]]:
    """The chapter's layout from first principles: ranks as a (dp, pp, cp, tp) array, TP the
    fastest axis; ``rank``'s group along each axis is the line through it along that axis."""
    grid = torch.arange(dp * pp * tp).view(dp, pp, 1, tp)
    d, p, c, t = (int(i) for i in (grid == rank).nonzero()[0])
    return {"dp": tuple(grid[:, p, c, t].tolist()), "pp": tuple(grid[d, :, c, t].tolist()),
            "tp": tuple(grid[d, p, c, :].tolist())}


# Which parameters tensor parallelism splits (chapter 05) and along which dim; the rest
# (LayerNorms, wpe, the c_proj biases) stays whole on every TP rank.
TP_SPLIT = {"wte.weight": 0, "lm_head.weight": 0, "attn.c_attn.weight": 0, "attn.c_attn.bias": 0,
            "attn.c_proj.weight": 1, "mlp.c_fc.weight": 0, "mlp.c_fc.bias": 0, "mlp.c_proj.weight": 1}


def tp_shapes(tie: bool, tp: int) -> dict[str, tuple[int, ...]]:
    """Every parameter of the GPT (a tied head once) with the shape one TP rank keeps."""
    from labkit.models import GPT
    shapes = {}
    for name, p in GPT(config(tie)).named_parameters():
        shape = list(p.shape)
        dim = next((d for suffix, d in TP_SPLIT.items() if name.endswith(suffix)), None)
        if dim is not None:
            shape[dim] //= tp
        shapes[name] = tuple(shape)
    return shapes


def training_signature(dp: int, tp: int, pp: int, rank: int) -> list:
    """Every op one rank issues in the set-up and first step of ``train_2d`` (pp = 1: FSDP
    over dp x TP) or ``train_3d`` (1F1B over pp x TP, gradients averaged over dp), on the
    groups of the layout (the set-up communicates nothing).

    Per step, with b = GLOBAL_BATCH / dp samples per replica, H hidden, 8 bytes a number:
    TP (tp group), per (micro-)batch of n samples: forward the embedding's all-reduce and 2
    per block of n*T*H, the loss's 3 of n*T; backward the head's 1 and 2 per block of n*T*H.
    FSDP (dp group), per unit (each block, then the root): all-gather forward, all-gather
    and reduce-scatter backward, each dp x (its parameters, every tensor padded to
    ceil(rows / dp) rows). Pipeline (m = 2 micro-batches of b/2): each micro-batch's
    activation sent to the next stage and its gradient back, [b/2, T, H]; then the DP
    average: one all-reduce of a flag per parameter + 1, one per parameter gradient. The
    reported loss: broadcast from the last stage over pp, all-reduced over dp (8 bytes)."""
    from labkit.comm import Op
    c = config(pp == 1)
    T, H, L, m = c.block_size, c.n_embd, c.n_layer, 2
    groups = layout_groups(dp, pp, tp, rank)
    f8 = torch.float64.itemsize
    shapes = tp_shapes(pp == 1, tp)

    def tp_ops(n, blocks, first, last):
        forward = [Op("all_reduce", n * T * H * f8, groups["tp"])] * (first + 2 * blocks)
        forward += [Op("all_reduce", n * T * f8, groups["tp"])] * (3 * last)
        return forward + [Op("all_reduce", n * T * H * f8, groups["tp"])] * (2 * blocks + last)

    step = [Op("all_reduce", f8, groups["dp"])]  # the reported loss, averaged over replicas
    b = GLOBAL_BATCH // dp
    if pp == 1:
        step += tp_ops(b, L, True, True)
        units = [[n for n in shapes if n.startswith(f"blocks.{i}.")] for i in range(L)]
        units.append([n for n in shapes if not n.startswith("blocks.")])  # the root: wte, wpe, ln_f
        for names in units:
            gathered = dp * sum(-(-s[0] // dp) * math.prod(s[1:]) for s in (shapes[n] for n in names)) * f8
            step += [Op("all_gather", gathered, groups["dp"])] * 2 + [Op("reduce_scatter", gathered, groups["dp"])]
        return step
    stage = groups["pp"].index(rank)
    first, last = stage == 0, stage == pp - 1
    blocks = [i for i in range(L) if i * pp // L == stage]  # contiguous, balanced by layers (L % pp == 0 here)
    mb = b // m
    message = mb * T * H * f8
    for i in range(m):
        step += tp_ops(mb, len(blocks), first, last)
        if not first:  # the activation in, its gradient out
            step += [Op("recv", message, peer=groups["pp"][stage - 1]), Op("send", message, peer=groups["pp"][stage - 1])]
        if not last:  # the activation out, its gradient in
            step += [Op("send", message, peer=groups["pp"][stage + 1]), Op("recv", message, peer=groups["pp"][stage + 1])]
    names = [n for n in shapes if any(n.startswith(f"blocks.{i}.") for i in blocks)]
    names += [n for n in shapes if n.startswith(("wte.", "wpe."))] if first else []
    names += [n for n in shapes if n.startswith(("ln_f.", "lm_head."))] if last else []
    step += [Op("all_reduce", (len(names) + 1) * f8, groups["dp"])]  # which parameters have a gradient
    step += [Op("all_reduce", math.prod(shapes[n]) * f8, groups["dp"]) for n in names]
    step += [Op("broadcast", f8, groups["pp"])]
    return step


@contextlib.contextmanager
def first_step_traced():
    """A ``CommTracer`` over the set-up and the first step of ``train_2d``/``train_3d`` only
    (tracing routes every tensor op through Python: all 5 steps would double a launch). The
    given ``labkit.mesh._global_loss`` ends every step; the tracer is left when it first returns."""
    from labkit import mesh
    from labkit.comm import CommTracer
    tracer, original, active = CommTracer(), mesh._global_loss, [True]

    def stop():
        if active[0]:
            active[0] = False
            tracer.__exit__(None, None, None)

    def end_of_step(*args, **kwargs):
        value = original(*args, **kwargs)
        stop()
        return value

    mesh._global_loss = end_of_step
    tracer.__enter__()
    try:
        yield tracer
    finally:
        stop()
        mesh._global_loss = original


def train_on_rank(dp: int, tp: int, pp: int):
    from labkit.comm import assert_ops
    from labkit.mesh import Layout, ModelShape, RankGrid, parameters_on_rank, train_2d, train_3d
    torch.set_num_threads(1)
    rank = dist.get_rank()
    grid = RankGrid(dist.get_world_size(), dp=dp, tp=tp, pp=pp).make_groups()
    x, y = batches()
    tie = pp == 1
    with first_step_traced() as tracer:
        if pp == 1:
            trained = train_2d(config(tie), grid, x, y, STEPS)
        else:
            trained = train_3d(config(tie), grid, x, y, STEPS, microbatches=2)
    task_id = "mesh.train_2d" if pp == 1 else "mesh.train_3d"
    # Collectives on a one-rank group (dp = 1 or tp = 1) carry no communication: left out on
    # both sides. Pipeline messages are matched by their peer (an expected send has no group).
    assert_ops([e for e in tracer.events if len(e.group) > 1 or e.peer is not None],
               [op for op in training_signature(dp, tp, pp, rank) if len(op[2]) > 1 or op[3] is not None],
               f"{task_id}: dp={dp}, tp={tp}, pp={pp}, rank {rank}: set-up and first training step (TP on the tp group "
               f"{layout_groups(dp, pp, tp, rank)['tp']}, " + ("FSDP" if pp == 1 else "the gradient average")
               + f" on the dp group {layout_groups(dp, pp, tp, rank)['dp']}"
               + ("" if pp == 1 else f", pipeline messages along {layout_groups(dp, pp, tp, rank)['pp']}") + ")")
    layout = Layout(dp=dp, tp=tp, pp=pp, zero=3 if pp == 1 else 0)
    stage = grid.coords(rank)["pp"]
    plan = parameters_on_rank(ModelShape.of(config(tie)), layout, stage)
    # Plain data back to the judge (labkit.runtime.sandbox): never an exercise module's object.
    trained = SimpleNamespace(losses=list(trained.losses), param_bytes=trained.param_bytes,
                              grad_bytes=trained.grad_bytes, optimizer_bytes=trained.optimizer_bytes)
    return trained, plan


def check_layout(dp, tp, pp, task_id):
    results = run_graded(task_id, train_on_rank, dp * tp * pp, dp, tp, pp)
    expected = torch.tensor(reference_losses(pp == 1), dtype=torch.float64)
    for rank, (trained, plan) in enumerate(results):
        what = f"{task_id}: dp={dp}, tp={tp}, pp={pp}, rank {rank}"
        assert_close(torch.tensor(trained.losses, dtype=torch.float64), expected,
                     f"{what}: loss curve over {STEPS} steps vs one process on the global batch")
        measured = (trained.param_bytes, trained.grad_bytes, trained.optimizer_bytes)
        predicted = (8 * plan["params"], 8 * plan["grads"], 8 * plan["optimizer"] + 4 * plan["tensors"])
        assert measured == predicted, (f"{what}: measured (params, grads, optimizer state) bytes {measured}; "
                                       f"mesh.parameters_on_rank predicts {predicted}")


@task("mesh.train_2d", points=3)
@pytest.mark.parametrize("dp, tp", [(1, 1), (2, 2)], ids=["1x1", "2x2"])
def test_2d_training_matches_one_process(dp, tp):
    check_layout(dp, tp, 1, "mesh.train_2d")


@task("mesh.train_3d", points=3)
@pytest.mark.parametrize("dp, tp, pp", [(2, 1, 2), (1, 2, 2), (2, 2, 2)], ids=["2x1x2", "1x2x2", "2x2x2"])
def test_3d_training_matches_one_process(dp, tp, pp):
    check_layout(dp, tp, pp, "mesh.train_3d")


def builtin_2d_on_rank(dp: int, tp: int):
    """torch's 2-D composition of the same (untied) GPT: parallelize_module on the tp
    sub-mesh, then fully_shard on the dp sub-mesh; the loss curve."""
    from labkit.mesh import RankGrid, dp_slice, train_2d
    from labkit.models import GPT
    from labkit.oracles import builtin_2d, loss_parallel
    torch.set_num_threads(1)
    model = builtin_2d(GPT(config(False)).double(), dp, tp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grid = RankGrid(dp * tp, dp=dp, tp=tp).make_groups()
    x, y = batches()
    losses = []
    for step in range(STEPS):
        with loss_parallel():
            loss = model(dp_slice(x[step], grid), dp_slice(y[step], grid))[1]
            loss.backward()
        opt.step()
        opt.zero_grad()
        value = (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach().clone()
        dist.all_reduce(value, group=grid.group("dp"))
        losses.append(value.item() / dp)
    ours = train_2d(config(False), grid, x, y, STEPS).losses
    return ours, losses


@task("mesh.train_2d", points=2)
def test_2d_training_matches_fully_shard_and_parallelize_module():
    results = run_graded("mesh.train_2d", builtin_2d_on_rank, 4, 2, 2)
    for rank, (ours, theirs) in enumerate(results):
        assert_close(torch.tensor(ours, dtype=torch.float64), torch.tensor(theirs, dtype=torch.float64),
                     f"mesh.train_2d: rank {rank}: your 2-D loss curve vs fully_shard + parallelize_module")


# ----------------------------------------------------------------------------- drawn layouts

DRAWN_STEPS = 3


def drawn_training(task_id: str):
    """One drawn configuration per CI run (a launch costs seconds): a layout of world size 4,
    the GPT's width, depth and tying, the optimizer (AdamW or SGD with momentum: state either
    way) with two parameter groups (matrices decayed at lr; vectors and embeddings of positions
    undecayed at another lr), the loss scale before backward; ``configs`` prints the seed."""
    rng = configs.rng(task_id)
    layouts = [(4, 1, 1), (2, 2, 1), (1, 4, 1)] if task_id == "mesh.train_2d" else [(2, 1, 2), (1, 2, 2)]
    dp, tp, pp = rng.choice(layouts)
    spec = dict(n_layer=2 * rng.randint(1, 2) if pp > 1 else rng.randint(1, 2), n_embd=4 * rng.randint(2, 4),
                tie=pp == 1 and rng.random() < 0.5, optimizer=rng.choice(["adamw", "sgd"]),
                lr=rng.choice([1e-2, 3e-2]), other_lr=rng.choice([1e-3, 5e-2]), decay=rng.choice([0.0, 0.1]),
                scale=rng.choice([0.25, 3.0, 1024.0]), data_seed=rng.randrange(1000))
    return (dp, tp, pp), spec, f"{task_id}: drawn dp={dp}, tp={tp}, pp={pp}, {spec} {configs.replay(task_id)}"


def drawn_config(spec):
    from labkit.models import GPTConfig
    return GPTConfig(vocab_size=32, block_size=8, n_layer=spec["n_layer"], n_head=4, n_embd=spec["n_embd"],
                     tie_weights=spec["tie"])


def drawn_optimizer(named, spec):
    """Two groups: matrices (weight decay, lr) and the rest (no decay, another lr), by name."""
    named = list(named)
    vector = [p for n, p in named if n.endswith("bias") or ".ln_" in n or n.startswith("ln_f") or "wpe" in n]
    matrix = [p for n, p in named if all(p is not q for q in vector)]
    groups = [dict(params=matrix, weight_decay=spec["decay"]), dict(params=vector, weight_decay=0.0, lr=spec["other_lr"])]
    if spec["optimizer"] == "adamw":
        return torch.optim.AdamW(groups, lr=spec["lr"])
    return torch.optim.SGD(groups, lr=spec["lr"], momentum=0.9)


def drawn_batches(spec):
    from labkit.data import markov_tokens
    x, y = markov_tokens(DRAWN_STEPS * GLOBAL_BATCH, 8, 32, seed=spec["data_seed"])
    return x.view(DRAWN_STEPS, GLOBAL_BATCH, 8), y.view(DRAWN_STEPS, GLOBAL_BATCH, 8)


def drawn_reference(spec) -> list[float]:
    from labkit.models import GPT
    model = GPT(drawn_config(spec)).double()
    opt = drawn_optimizer(model.named_parameters(), spec)
    x, y = drawn_batches(spec)
    losses = []
    for step in range(DRAWN_STEPS):
        loss = model(x[step], y[step])[1]
        (spec["scale"] * loss).backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def drawn_2d_on_rank(dp: int, tp: int, spec):
    """parallelize_2d, then the loop of ``train_2d`` with the drawn optimizer and loss scale."""
    from labkit.mesh import RankGrid, _global_loss, dp_slice, parallelize_2d
    from labkit.models import GPT
    torch.set_num_threads(1)
    grid = RankGrid(dist.get_world_size(), dp=dp, tp=tp).make_groups()
    model = parallelize_2d(GPT(drawn_config(spec)).double(), grid)
    opt = drawn_optimizer(model.named_parameters(), spec)
    x, y = drawn_batches(spec)
    losses = []
    for step in range(DRAWN_STEPS):
        loss = model(dp_slice(x[step], grid), dp_slice(y[step], grid))[1]
        (spec["scale"] * loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(_global_loss(loss, grid, 0))
    return losses


def drawn_3d_on_rank(dp: int, tp: int, pp: int, spec):
    """build_stages_3d, then the loop of ``train_3d`` (1F1B, 2 micro-batches; the gradient
    average over dp) with the drawn optimizer and the loss scaled inside the loss function."""
    from labkit import pp as pipeline
    from labkit.dp import average_gradients
    from labkit.mesh import RankGrid, _global_loss, build_stages_3d, dp_slice
    from labkit.models import GPT
    from labkit.tp import vocab_parallel_cross_entropy
    torch.set_num_threads(1)
    grid = RankGrid(dist.get_world_size(), dp=dp, tp=tp, pp=pp).make_groups()
    stages = build_stages_3d(GPT(drawn_config(spec)).double(), grid)
    stage = next(iter(stages))
    runner = pipeline.PipelineRunner(stages, pp, group=grid.group("pp"))
    actions = pipeline.one_f_one_b(pp, 2)[stage]

    def scaled_loss(logits, targets):
        return spec["scale"] * vocab_parallel_cross_entropy(logits, targets, group=grid.group("tp"))

    module = stages[stage]
    opt = drawn_optimizer(dict(module.named_parameters()).items(), spec)
    last = grid.axis_ranks("pp", dist.get_rank())[-1]
    x, y = drawn_batches(spec)
    losses = []
    for step in range(DRAWN_STEPS):
        loss, _ = runner.step(actions, dp_slice(x[step], grid), dp_slice(y[step], grid), 2, scaled_loss)
        average_gradients(module, grid.group("dp"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(_global_loss(None if loss is None else loss / spec["scale"], grid, last))
    return losses


@task("mesh.train_2d", points=1)
def test_2d_training_on_a_drawn_layout_optimizer_and_loss_scale():
    (dp, tp, _), spec, what = drawn_training("mesh.train_2d")
    expected = torch.tensor(drawn_reference(spec), dtype=torch.float64)
    for rank, losses in enumerate(run_graded("mesh.train_2d", drawn_2d_on_rank, 4, dp, tp, spec)):
        assert_close(torch.tensor(losses, dtype=torch.float64), expected,
                     f"{what}, rank {rank}: loss curve over {DRAWN_STEPS} steps vs one process on the global batch")


@task("mesh.train_3d", points=1)
def test_3d_training_on_a_drawn_layout_optimizer_and_loss_scale():
    (dp, tp, pp), spec, what = drawn_training("mesh.train_3d")
    expected = torch.tensor(drawn_reference(spec), dtype=torch.float64)
    for rank, losses in enumerate(run_graded("mesh.train_3d", drawn_3d_on_rank, 4, dp, tp, pp, spec)):
        assert_close(torch.tensor(losses, dtype=torch.float64), expected,
                     f"{what}, rank {rank}: loss curve over {DRAWN_STEPS} steps vs one process on the global batch")


# ----------------------------------------------------------------------------- the plan


@task("mesh.plan", points=2)
def test_plan_counts_what_a_layout_leaves_on_a_rank():
    from labkit.mesh import Layout, ModelShape, memory_per_gpu, parameters_on_rank
    shape = ModelShape(layers=4, hidden=8, heads=2, vocab=10, seq=6, tied=True)
    whole = parameters_on_rank(shape, Layout())
    h = 8
    total = 4 * (12 * h * h + 13 * h) + 10 * h + 6 * h + 2 * h  # blocks, wte (tied head), wpe, ln_f
    expected = dict(params=total, grads=total, optimizer=2 * total, tensors=4 * 12 + 4)
    assert whole == expected, f"mesh.plan: one rank of the unsplit model keeps {whole}; expected {expected}"
    tp2 = parameters_on_rank(shape, Layout(tp=2))
    split = 4 * (3 * h * h + 3 * h + h * h + 4 * h * h + 4 * h + 4 * h * h) + 10 * h
    assert tp2["params"] == total - split // 2, f"mesh.plan: TP=2 keeps {tp2['params']}; expected {total - split // 2}"
    zero2 = parameters_on_rank(shape, Layout(dp=3, zero=2))  # this course's ZeRO-1/2 keep the parameters whole
    assert zero2 == whole, f"mesh.plan: ZeRO-2 over 3 leaves the parameters whole; got {zero2}, expected {whole}"
    fsdp3 = parameters_on_rank(shape, Layout(dp=3, zero=3))  # rows padded to ceil(rows / 3)
    padded = 4 * (2 * 3 + 8 * 8 + 8 + 3 * 8 + 3 + 2 * 3 + 11 * 8 + 11 + 3 * 32 + 3) + 4 * 8 + 2 * 8 + 2 * 3
    assert fsdp3["params"] == padded, f"mesh.plan: ZeRO-3 over 3 keeps {fsdp3['params']}; expected {padded}"
    with_cp = parameters_on_rank(shape, Layout(dp=3, cp=2, zero=3))  # this course's FSDP shards over dp only
    assert with_cp == fsdp3, f"mesh.plan: ZeRO-3 over dp=3 with cp=2 keeps {with_cp}; expected {fsdp3} (as with cp=1)"
    last = parameters_on_rank(shape, Layout(pp=2), stage=1)
    assert last["params"] == 2 * (12 * h * h + 13 * h) + 2 * h + 10 * h, f"mesh.plan: the last of 2 stages keeps {last}"
    memory = memory_per_gpu(shape, Layout(dp=4, zero=1), bytes_per_element=2, master_bytes=4)
    assert memory["optimizer"] == (2 * total * 4 + total * 4) / 4 and memory["params"] == 2 * total, \
        f"mesh.plan: ZeRO-1 over 4, 16-bit weights with fp32 moments and master: memory_per_gpu gives {memory}"


def brute_force_plan(shape, layout, stage: int, zero: int) -> dict[str, int]:
    """What one rank of ``stage`` keeps, counted on a real ``labkit.models.GPT`` of that shape:
    its blocks (the stages cut as evenly as possible, the first ones one block longer), wte and
    wpe on the first stage, ln_f and the head on the last (a tied head is wte itself in one
    stage, its own copy on the last of several); each tensor as TP leaves it (``TP_SPLIT``);
    with ZeRO-3 every tensor's rows (a vector: n rows of 1) padded to a multiple of dp."""
    from labkit.models import GPT, GPTConfig
    gpt = GPT(GPTConfig(vocab_size=shape.vocab, block_size=shape.seq, n_layer=shape.layers, n_head=shape.heads,
                        n_embd=shape.hidden, tie_weights=shape.tied))
    sizes = [shape.layers // layout.pp + (s < shape.layers % layout.pp) for s in range(layout.pp)]
    mine = range(sum(sizes[:stage]), sum(sizes[:stage + 1]))
    kept = []
    for name, p in gpt.named_parameters():  # a tied head appears once, as wte.weight
        block = int(name.split(".")[1]) if name.startswith("blocks.") else None
        if (block in mine) or (stage == 0 and name.startswith(("wte.", "wpe."))) or \
                (stage == layout.pp - 1 and name.startswith(("ln_f.", "lm_head."))):
            kept.append((name, list(p.shape)))
    if shape.tied and layout.pp > 1 and stage == layout.pp - 1:
        kept.append(("lm_head.weight", [shape.vocab, shape.hidden]))
    shards = layout.dp if zero >= 3 else 1
    elements = 0
    for name, dims in kept:
        dim = next((d for suffix, d in TP_SPLIT.items() if name.endswith(suffix)), None)
        if dim is not None:
            dims[dim] //= layout.tp
        rows, cols = dims[0], math.prod(dims[1:])
        elements += -(-rows // shards) * cols
    return dict(params=elements, grads=elements, optimizer=2 * elements, tensors=len(kept))


@task("mesh.plan", points=1)
def test_plan_on_drawn_models_and_layouts_matches_a_count_on_the_model():
    """Drawn model shapes (layers, heads, head size, vocab, sequence, tied or not) and layouts
    (dp, tp, pp, cp, ZeRO stage, micro-batches, recomputation) and a drawn stage:
    ``parameters_on_rank`` against ``brute_force_plan``; ``memory_per_gpu`` against the byte
    arithmetic written out here: AdamW two moments in ``master_bytes`` (and a master copy when
    the weights are narrower), ZeRO sharding over dp x cp (Rajbhandari et al. 2020); activations
    (s/cp) b h (34 + 5 a s / h) / tp per layer and micro-batch in flight (Korthikanti et al. 2022),
    with full recomputation 2 (s/cp) b h / tp per layer plus one layer's worth."""
    from labkit.mesh import Layout, ModelShape, memory_per_gpu, parameters_on_rank
    rng = configs.rng("mesh.plan")
    for draw in range(configs.budget(ci=40, long=400)):
        tp = rng.randint(1, 4)
        heads = tp * rng.randint(1, 2)
        shape = ModelShape(layers=rng.randint(1, 5), hidden=heads * rng.randint(1, 3), heads=heads,
                           vocab=tp * rng.randint(1, 6), seq=rng.randint(1, 6), tied=rng.random() < 0.5)
        layout = Layout(dp=rng.randint(1, 5), tp=tp, pp=rng.randint(1, shape.layers), cp=rng.randint(1, 3),
                        zero=rng.randint(0, 3), microbatch=rng.randint(1, 3), microbatches=rng.randint(1, 4),
                        recompute=rng.random() < 0.5)
        stage = rng.randrange(layout.pp)
        at = f"mesh.plan: drawn {draw}: {shape}, {layout}, stage {stage} {configs.replay('mesh.plan')}"
        got, expected = parameters_on_rank(shape, layout, stage), brute_force_plan(shape, layout, stage, layout.zero)
        assert got == expected, f"{at}: parameters_on_rank gives {got}; counted on the model: {expected}"
        param_bytes, master = rng.choice([2, 4]), rng.choice([2, 4])
        memory = memory_per_gpu(shape, layout, stage, bytes_per_element=param_bytes, master_bytes=master)
        whole = brute_force_plan(shape, layout, stage, 0)["params"]
        shards, zero = layout.dp * layout.cp, layout.zero
        optimizer_bytes = 2 * master + (master if master != param_bytes else 0)
        s, b, h, a = shape.seq, layout.microbatch, shape.hidden, shape.heads
        per_layer = s / layout.cp * b * h * (34 + 5 * a * s / h) / layout.tp
        layers = shape.layers // layout.pp + (stage < shape.layers % layout.pp)  # the first stages one longer
        held = min(layout.pp - stage, layout.microbatches) if layout.pp > 1 else 1
        activations = held * layers * (2 * s / layout.cp * b * h / layout.tp if layout.recompute else per_layer) \
            + (per_layer if layout.recompute else 0)
        want = dict(params=param_bytes * whole / (shards if zero >= 3 else 1),
                    grads=param_bytes * whole / (shards if zero >= 2 else 1),
                    optimizer=optimizer_bytes * whole / (shards if zero >= 1 else 1), activations=activations)
        want["total"] = sum(want.values())
        for key, value in want.items():
            assert math.isclose(memory[key], value, rel_tol=1e-12), \
                f"{at}: memory_per_gpu({param_bytes}-byte weights, {master}-byte moments)[{key!r}] = {memory[key]}; " \
                f"expected {value}"
