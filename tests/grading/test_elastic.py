"""Graded tests for chapter 09: fault tolerance (labkit/elastic.py).

Exact resume: a run in which one rank SIGKILLs itself at a seeded random step and
``launch(..., max_restarts=1)`` restarts every rank ends with the same losses and the same
final checkpoint, bit for bit, as an uninterrupted run, at world sizes 2 and 4 (FSDP and
ZeRO from chapters 03-04, float64). Resharding: a checkpoint saved at world size 2 loads at
1, 3 and 4 and training continues on the same loss curve (float64 tolerance). Atomicity: a
save killed before writing, halfway through a file, before the metadata or before the rename
leaves the previous checkpoint as the one that loads. Bad checkpoints (a missing or
truncated file, another model's shapes) raise CheckpointError naming the file. Against the
built-in: the learner's checkpoint and a torch.distributed.checkpoint (DCP) checkpoint of the
same fully_shard-trained model restore the same full state at another world size.
"""

import functools
import random

import pytest
import torch
import torch.distributed as dist

from labkit.check import assert_close
from labkit.course.grading import run_graded, task

STEPS = 6
BATCH = 12  # global batch: divides by 1, 2, 3 and 4


def gpt_config():
    from labkit.models import GPTConfig
    return GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


@functools.cache
def tokens():
    from labkit.data import markov_tokens
    return markov_tokens(STEPS * BATCH * 2, 8, 32, seed=9)


def my_batch(step):
    rank, n = dist.get_rank(), dist.get_world_size()
    x, y = tokens()
    share = BATCH // n
    first = step * BATCH + rank * share
    return x[first:first + share], y[first:first + share]


def build(kind: str):
    """(model, optimizer) for this rank: the GPT under the learner's FSDP (per block + root),
    or replicated with the learner's ZeRO-2 optimizer (which averages the gradients)."""
    from labkit.fsdp import fully_shard
    from labkit.models import GPT
    from labkit.zero import ShardedOptimizer
    torch.set_num_threads(1)
    model = GPT(gpt_config()).double()
    if kind == "fsdp":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, ShardedOptimizer(model.parameters(), torch.optim.AdamW, shard_gradients=True, lr=1e-2)


def gpt_loss(model, x, y):
    return model(x, y)[1]


def job(kind: str, root: str, steps: int = STEPS, fail_at=None, save_every: int = 2):
    from labkit.elastic import Job
    return Job(build=functools.partial(build, kind), batch=my_batch, loss=gpt_loss, steps=steps, root=root,
               save_every=save_every, samples_per_step=BATCH, fail_at=fail_at)


def final_state(root: str) -> dict:
    """Every tensor of the newest checkpoint under ``root``, read directly from its files."""
    from pathlib import Path
    from labkit.elastic import checkpoint_dir
    latest = max(p for p in Path(root).iterdir() if p.name.startswith("step_") and not p.name.endswith(".partial"))
    out = {}
    for file in sorted(latest.glob("rank*.pt")):
        state = torch.load(file, weights_only=False)
        for section in ("model", "optimizer"):
            for name, piece in state[section].items():
                out[f"{file.name}/{section}/{name}"] = piece.tensor
    return out


def train_job(kind, root, steps=STEPS, fail_at=None):
    from labkit.elastic import resume_training
    return resume_training(job(kind, root, steps, fail_at))


# ----------------------------------------------------------------------------- elastic.state


def state_on_rank(kind: str):
    from labkit.elastic import Progress, capture_state, restore_state
    model, opt = build(kind)
    losses = []

    def steps(first, count):
        out = []
        for step in range(first, first + count):
            loss = gpt_loss(model, *my_batch(step))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(loss.item())
        return out
    losses += steps(0, 2)
    state = capture_state(model, opt, Progress(step=2, position=2 * BATCH, losses=list(losses)))
    draw = (torch.rand(3), random.random())
    first_run = steps(2, 2)
    progress = restore_state(state, model, opt)
    assert (progress.step, progress.position, progress.losses) == (2, 2 * BATCH, losses), \
        f"elastic.state: restored progress {progress}"
    again = (torch.rand(3), random.random())
    assert torch.equal(draw[0], again[0]) and draw[1] == again[1], "elastic.state: the RNG states were not restored"
    second_run = steps(2, 2)
    assert first_run == second_run, \
        f"elastic.state: {kind}: rank {dist.get_rank()}: after restore_state the next steps give {second_run}, not {first_run}"


@task("elastic.state", points=2)
@pytest.mark.parametrize("kind", ["fsdp", "zero"])
def test_capture_and_restore_continue_exactly(kind):
    run_graded("elastic.state", state_on_rank, 2, kind)


# ----------------------------------------------------------------------------- exact resume


@task("elastic.resume", points=3)
@pytest.mark.parametrize("world_size, kind", [(2, "fsdp"), (4, "fsdp"), (2, "zero")])
def test_a_killed_rank_resumes_exactly(tmp_path, world_size, kind):
    import labkit
    step = random.Random(f"{world_size}{kind}").randrange(1, STEPS)  # seeded: reproducible
    victim = world_size - 1
    clean = run_graded("elastic.resume", train_job, world_size, kind, str(tmp_path / "clean"))
    try:
        resumed = labkit.launch(train_job, world_size, kind, str(tmp_path / "killed"), STEPS, (victim, step),
                                max_restarts=1, timeout=120)
    except labkit.LaunchError as error:
        raise AssertionError(f"elastic.resume: the restarted run failed: {str(error)[:1500]}") from None
    for rank in range(world_size):
        assert resumed[rank] == clean[rank], \
            (f"elastic.resume: {kind}, world size {world_size}, rank {victim} killed before step {step}: "
             f"rank {rank}'s losses {resumed[rank]} differ from the uninterrupted run's {clean[rank]}")
    ours, theirs = final_state(str(tmp_path / "killed")), final_state(str(tmp_path / "clean"))
    assert ours.keys() == theirs.keys(), "elastic.resume: the final checkpoints hold different tensors"
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), f"elastic.resume: {name} differs from the uninterrupted run's"


# ----------------------------------------------------------------------------- resharding


def save_after(kind: str, root: str, steps: int):
    from labkit.elastic import Progress, capture_state, save_checkpoint
    model, opt = build(kind)
    losses = []
    for step in range(steps):
        loss = gpt_loss(model, *my_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / dist.get_world_size())
    save_checkpoint(capture_state(model, opt, Progress(step=steps, position=steps * BATCH, losses=losses)), root, steps)
    return losses


def continue_from(kind: str, root: str, more: int):
    from labkit.elastic import latest_checkpoint, load_checkpoint
    model, opt = build(kind)
    progress = load_checkpoint(latest_checkpoint(root), model, opt)
    losses = list(progress.losses)
    for step in range(progress.step, progress.step + more):
        loss = gpt_loss(model, *my_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / dist.get_world_size())
    return losses


@task("elastic.load", points=3)
@pytest.mark.parametrize("kind", ["fsdp", "zero"])
def test_a_checkpoint_from_two_ranks_loads_at_one_three_and_four(tmp_path, kind):
    uninterrupted = run_graded("elastic.load", save_after, 2, kind, str(tmp_path / "whole"), STEPS)[0]
    run_graded("elastic.save", save_after, 2, kind, str(tmp_path / "half"), STEPS // 2)
    for world in (1, 3, 4):
        curve = run_graded("elastic.load", continue_from, world, kind, str(tmp_path / "half"), STEPS - STEPS // 2)[0]
        assert_close(torch.tensor(curve), torch.tensor(uninterrupted),
                     f"elastic.load: {kind}: saved at 2 ranks, resumed at {world}: loss curve vs the uninterrupted run")


# ----------------------------------------------------------------------------- atomicity


def save_twice(root: str, crash_at: str):
    """Save at step 2; then die during the save at step 4."""
    from labkit.elastic import Progress, capture_state, save_checkpoint
    model, opt = build("fsdp")
    save_checkpoint(capture_state(model, opt, Progress(step=2)), root, 2)
    save_checkpoint(capture_state(model, opt, Progress(step=4)), root, 4, crash_at=crash_at)


def latest_after_crash(root: str):
    from labkit.elastic import latest_checkpoint, load_checkpoint
    model, opt = build("fsdp")
    path = latest_checkpoint(root)
    return None if path is None else (path.name, load_checkpoint(path, model, opt).step)


@task("elastic.save", points=2)
@pytest.mark.parametrize("crash_at", ["write", "metadata", "rename"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path, crash_at):
    import labkit
    root = str(tmp_path / "ckpt")
    with pytest.raises(labkit.WorkerError, match="signal 9"):
        labkit.launch(save_twice, 2, root, crash_at, timeout=60)
    found = run_graded("elastic.save", latest_after_crash, 2, root)[0]
    assert found == ("step_00000002", 2), \
        f"elastic.save: after a crash at {crash_at!r} during the step-4 save, the latest loadable checkpoint is {found}; expected step 2"


# ----------------------------------------------------------------------------- bad checkpoints


def bad_checkpoints_on_rank(root: str):
    from pathlib import Path
    from labkit.elastic import CheckpointError, load_checkpoint, validate_checkpoint
    from labkit.models import GPT, GPTConfig
    path = Path(root) / "step_00000002"
    model, opt = build("fsdp")
    if dist.get_rank() == 0:
        assert validate_checkpoint(path)["world_size"] == 2
    dist.barrier()
    other = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=24)).double()
    with pytest.raises(CheckpointError, match="metadata.json.*shape"):
        load_checkpoint(path, other, torch.optim.AdamW(other.parameters()))
    dist.barrier()
    if dist.get_rank() == 0:
        data = (path / "rank1.pt").read_bytes()
        (path / "rank1.pt").write_bytes(data[:len(data) // 2])
    dist.barrier()
    with pytest.raises(CheckpointError, match="rank1.pt.*truncated"):
        load_checkpoint(path, model, opt)
    dist.barrier()
    if dist.get_rank() == 0:
        (path / "rank1.pt").unlink()
    dist.barrier()
    with pytest.raises(CheckpointError, match="rank1.pt.*missing"):
        validate_checkpoint(path)


@task("elastic.load", points=2)
def test_damaged_or_foreign_checkpoints_are_refused_by_name(tmp_path):
    root = str(tmp_path / "ckpt")
    run_graded("elastic.load", save_after, 2, "fsdp", root, 2)
    run_graded("elastic.load", bad_checkpoints_on_rank, 2, root)


# ----------------------------------------------------------------------------- vs DCP


def train_both_and_save(root: str, steps: int):
    """The learner's FSDP GPT and torch's fully_shard GPT, trained side by side; saved with
    elastic.save_checkpoint and with DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from labkit.elastic import Progress, capture_state, save_checkpoint
    from labkit.models import GPT
    model, opt = build("fsdp")
    theirs = GPT(gpt_config()).double()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in theirs.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    their_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    for step in range(steps):
        for m, o in ((model, opt), (theirs, their_opt)):
            gpt_loss(m, *my_batch(step)).backward()
            o.step()
            o.zero_grad(set_to_none=True)
    save_checkpoint(capture_state(model, opt, Progress(step=steps)), f"{root}/ours", steps)
    model_state, optim_state = get_state_dict(theirs, their_opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=f"{root}/dcp")


def load_both_full(root: str, steps: int):
    """Both checkpoints loaded at this world size; the full model states, on rank 0."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from labkit.elastic import checkpoint_dir, load_checkpoint
    from labkit.fsdp import full_state_dict
    from labkit.models import GPT
    model, opt = build("fsdp")
    load_checkpoint(checkpoint_dir(f"{root}/ours", steps), model, opt)
    ours = full_state_dict(model)
    theirs = GPT(gpt_config()).double()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in theirs.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    their_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    model_state, optim_state = get_state_dict(theirs, their_opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=f"{root}/dcp")
    set_state_dict(theirs, their_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full = get_model_state_dict(theirs, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return (ours, full) if dist.get_rank() == 0 else None


@task("elastic.load", points=2)
def test_the_same_state_as_a_dcp_checkpoint_of_fully_shard(tmp_path):
    root = str(tmp_path)
    run_graded("elastic.load", train_both_and_save, 2, root, 3)
    ours, theirs = run_graded("elastic.load", load_both_full, 3, root, 3)[0]
    for name, value in theirs.items():
        assert_close(ours[name], value, f"elastic.load: {name}: your checkpoint vs DCP's, both loaded at 3 ranks")
