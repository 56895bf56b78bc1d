"""Graded tests for chapter 08: hybrid parallelism on a rank mesh (labkit/mesh.py).

Groups: every rank's group along every axis equals the one ``init_device_mesh`` makes for
the same (dp, pp, cp, tp) shape and names. Numbers: for the layouts (dp, tp, pp) in
{(1,1,1), (2,2,1), (2,1,2), (1,2,2), (2,2,2)}, at world sizes up to 8, the loss curve over
5 AdamW steps in float64 equals the single-process GPT on the global batch, on every rank;
the learner's 2-D training (their FSDP over dp, their TP over tp) gives the same losses as
torch's (``fully_shard`` on the dp sub-mesh + ``parallelize_module`` on the tp sub-mesh).
Memory: the parameter, gradient and optimizer bytes measured on every rank (labkit.memory)
equal ``mesh.parameters_on_rank``'s prediction exactly (float64, AdamW: 2 moments per element
and a 4-byte step counter per tensor).
"""

import pytest
import torch
import torch.distributed as dist

from labkit.check import assert_close
from labkit.course.grading import run_graded, task

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


def grid_on_rank(shape):
    from torch.distributed.device_mesh import init_device_mesh
    from labkit.mesh import AXES, RankGrid
    rank = dist.get_rank()
    degrees = dict(zip(AXES, shape))
    grid = RankGrid(dist.get_world_size(), **degrees).make_groups()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=AXES)
    coords = dict(zip(AXES, mesh.get_coordinate()))
    assert grid.coords(rank) == coords, f"mesh.grid: {grid}: rank {rank} at {grid.coords(rank)}; init_device_mesh puts it at {coords}"
    for axis in AXES:
        ours = dist.get_process_group_ranks(grid.group(axis))
        theirs = dist.get_process_group_ranks(mesh.get_group(axis))
        assert ours == theirs, f"mesh.grid: {grid}: rank {rank}'s {axis} group is {ours}; init_device_mesh's is {theirs}"
        assert grid.axis_ranks(axis, rank) == theirs, f"mesh.grid: axis_ranks({axis!r}, {rank}) = {grid.axis_ranks(axis, rank)}; expected {theirs}"


@task("mesh.grid", points=2)
@pytest.mark.parametrize("shape", [(1, 1, 1, 4), (2, 1, 1, 2), (1, 2, 1, 2), (2, 2, 1, 2), (1, 2, 2, 2)],
                         ids=lambda s: "x".join(map(str, s)))
def test_groups_match_init_device_mesh(shape):
    import math
    run_graded("mesh.grid", grid_on_rank, math.prod(shape), shape)


@task("mesh.grid", points=1)
def test_degrees_that_do_not_multiply_to_the_world_are_refused():
    from labkit.mesh import RankGrid
    with pytest.raises(ValueError, match="world"):
        RankGrid(8, dp=2, tp=2)
    with pytest.raises(ValueError, match="tp"):
        RankGrid(4, dp=4, tp=0)
    grid = RankGrid(8, dp=2, pp=2, tp=2)
    assert [grid.rank_of(grid.coords(r)) for r in range(8)] == list(range(8)), "mesh.grid: rank_of(coords(r)) != r"
    assert grid.axis_ranks("tp", 5) == [4, 5] and grid.axis_ranks("dp", 5) == [1, 5] and grid.axis_ranks("pp", 5) == [5, 7], \
        "mesh.grid: TP must be the fastest axis, DP the slowest"


# ----------------------------------------------------------------------------- training


def train_on_rank(dp: int, tp: int, pp: int):
    from labkit.mesh import Layout, ModelShape, RankGrid, parameters_on_rank, train_2d, train_3d
    torch.set_num_threads(1)
    grid = RankGrid(dist.get_world_size(), dp=dp, tp=tp, pp=pp).make_groups()
    x, y = batches()
    tie = pp == 1
    if pp == 1:
        trained = train_2d(config(tie), grid, x, y, STEPS)
        layout = Layout(dp=dp, tp=tp, pp=1, zero=3)
    else:
        trained = train_3d(config(tie), grid, x, y, STEPS, microbatches=2)
        layout = Layout(dp=dp, tp=tp, pp=pp, zero=0)
    stage = grid.coords(dist.get_rank())["pp"]
    plan = parameters_on_rank(ModelShape.of(config(tie)), layout, stage)
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
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import loss_parallel

    from labkit.oracles import builtin_tensor_parallel
    from labkit.mesh import RankGrid, dp_slice, train_2d
    from labkit.models import GPT
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = builtin_tensor_parallel(GPT(config(False)).double(), mesh["tp"])
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
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


# ----------------------------------------------------------------------------- the plan


@task("mesh.plan", points=2)
def test_plan_counts_what_a_layout_leaves_on_a_rank():
    from labkit.mesh import Layout, ModelShape, memory_per_gpu, parameters_on_rank
    shape = ModelShape(layers=4, hidden=8, heads=2, vocab=10, seq=6, tied=True)
    whole = parameters_on_rank(shape, Layout())
    h = 8
    total = 4 * (12 * h * h + 13 * h) + 10 * h + 6 * h + 2 * h  # blocks, wte (tied head), wpe, ln_f
    assert whole == dict(params=total, grads=total, optimizer=2 * total, tensors=4 * 12 + 4), whole
    tp2 = parameters_on_rank(shape, Layout(tp=2))
    split = 4 * (3 * h * h + 3 * h + h * h + 4 * h * h + 4 * h + 4 * h * h) + 10 * h
    assert tp2["params"] == total - split // 2, f"mesh.plan: TP=2 keeps {tp2['params']}; expected {total - split // 2}"
    fsdp3 = parameters_on_rank(shape, Layout(dp=3, zero=3))  # rows padded to ceil(rows / 3)
    padded = 4 * (2 * 3 + 8 * 8 + 8 + 3 * 8 + 3 + 2 * 3 + 11 * 8 + 11 + 3 * 32 + 3) + 4 * 8 + 2 * 8 + 2 * 3
    assert fsdp3["params"] == padded, f"mesh.plan: ZeRO-3 over 3 keeps {fsdp3['params']}; expected {padded}"
    last = parameters_on_rank(shape, Layout(pp=2), stage=1)
    assert last["params"] == 2 * (12 * h * h + 13 * h) + 2 * h + 10 * h, f"mesh.plan: last of 2 stages: {last}"
    memory = memory_per_gpu(shape, Layout(dp=4, zero=1), bytes_per_element=2, master_bytes=4)
    assert memory["optimizer"] == (2 * total * 4 + total * 4) / 4 and memory["params"] == 2 * total, memory
