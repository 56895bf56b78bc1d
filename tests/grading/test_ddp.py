"""Graded tests for chapter 02: DDP built from autograd hooks.

Every check runs on every rank at world sizes 1-4. Numbers: over 5 optimizer steps (SGD
with momentum and weight decay, so that a zero gradient and a missing one differ), the
learner's DDP must match a single-process model trained on the global batch and the
built-in ``DistributedDataParallel``, gradient by gradient after each backward and
parameter by parameter after each step. The models carry tied, frozen and unused
parameters (``ToyModel``) and a GPT with a tied head and a frozen position embedding.

Behaviour, traced with ``CommTracer``: one all-reduce per gradient (per-parameter mode) or
per bucket, with the buckets the size cap implies (derived here from the parameter sizes),
the first one issued during backward, before the last gradient is ready; and no
communication at all inside ``no_sync()``.

Tests of one task never depend on another's stub being filled in first, except that the
no_sync test also runs bucketed mode after per-parameter mode.
"""

import time
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from labkit.check import assert_close
from labkit.comm import CommTracer
from labkit.data import markov_tokens, regression
from labkit.course.grading import run_graded, task
from labkit.models import GPT, GPTConfig, ToyModel, toy_loss

WORLD_SIZES = [1, 2, 3, 4]
STEPS = 5
BATCH = 2  # samples per rank per micro-batch
# Weight decay: a parameter whose .grad is None is skipped, one with a zero .grad decays.
SGD = dict(lr=0.1, momentum=0.9, weight_decay=0.01)
GPT_CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
KiB = 1024 / 2 ** 20  # in MB, the unit of bucket_cap_mb

# name -> (model, DDP keyword arguments); cases are checked one after another in one launch.
CASES = {
    "toy, per-parameter": ("toy", dict(bucket_cap_mb=None, find_unused_parameters=True)),
    "gpt, per-parameter": ("gpt", dict(bucket_cap_mb=None)),
    "toy, 25 MB buckets": ("toy", dict(bucket_cap_mb=25.0, find_unused_parameters=True)),
    "toy, 100-byte buckets": ("toy", dict(bucket_cap_mb=100 / 2 ** 20, find_unused_parameters=True)),
    "gpt, 4 KiB buckets": ("gpt", dict(bucket_cap_mb=4 * KiB)),
}


def one_thread(fn, *args) -> None:
    """Run ``fn`` on a rank with one intra-op thread: these models are tiny, and on shared
    cores a second OpenMP thread per rank costs more (spinning, waiting) than it gives."""
    torch.set_num_threads(1)
    fn(*args)


def make_model(kind: str) -> torch.nn.Module:
    """Identical on every rank: seeded weights."""
    if kind == "toy":
        return ToyModel(seed=0)  # tied `shared`, frozen `frozen`, unused `unused`, buffer `scale`
    model = GPT(GPT_CONFIG, seed=0)  # lm_head tied to wte
    model.wpe.weight.requires_grad_(False)  # a frozen parameter in the GPT too
    return model


def make_data(kind: str, samples: int):
    if kind == "toy":
        return regression(samples, 8, 8, seed=1)
    return markov_tokens(samples, GPT_CONFIG.block_size, GPT_CONFIG.vocab_size, seed=1)


def loss_of(kind: str, model, x, y) -> torch.Tensor:
    return toy_loss(model, x, y) if kind == "toy" else model(x, y)[1]


def expected_all_reduce_bytes(model, ddp_kwargs, got_grad) -> list[int]:
    """Sizes of the gradient all-reduces one synchronised backward must issue.

    Per-parameter mode: one per parameter that some rank used, sorted (hook order is
    autograd's business). Bucketed: the rule of ``assign_buckets`` (reverse order; close a
    bucket once it holds >= cap bytes), written out again here from the parameter sizes, in
    bucket order: the order in which they must be launched.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if ddp_kwargs["bucket_cap_mb"] is None:
        return sorted(p.numel() * p.element_size() for p in params if got_grad[p])
    cap = int(ddp_kwargs["bucket_cap_mb"] * 2 ** 20)
    sizes, size, dtype = [], 0, None
    for p in reversed(params):
        if size and p.dtype != dtype:
            sizes.append(size)
            size = 0
        size, dtype = size + p.numel() * p.element_size(), p.dtype
        if size >= cap:
            sizes.append(size)
            size = 0
    return sizes + ([size] if size else [])


def check_grads(task_id: str, where: str, model, other, against: str) -> None:
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        what = f"{task_id}: {where}, gradient of {name!r} vs {against}"
        if q.grad is None:
            assert p.grad is None, f"{what}: should be None (frozen, or used by no rank), got a tensor"
        else:
            assert p.grad is not None, f"{what}: is None after backward"
            assert_close(p.grad, q.grad, what)


def check_params(task_id: str, where: str, model, other, against: str) -> None:
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert_close(p.detach(), q.detach(), f"{task_id}: {where}, parameter {name!r} vs {against}")


def check_traced_backward(task_id, where, tracer, hook_times, expected, per_parameter, find_unused,
                          overlap) -> None:
    grads = [e for e in tracer.events if e.kind == "all_reduce" and e.dtype != torch.int32]
    sizes = [e.bytes for e in grads]  # in the order issued
    assert (sorted(sizes) if per_parameter else sizes) == expected, (
        f"{task_id}: {where}: {len(sizes)} gradient all-reduces of {sizes} bytes in one backward; "
        f"expected {len(expected)} of {expected} bytes, " +
        ("one per gradient" if per_parameter else "one per bucket the cap implies, launched in bucket order"))
    usage = tracer.count("all_reduce") - len(grads)
    assert usage == int(find_unused), (
        f"{task_id}: {where}: {usage} extra all-reduces; find_unused_parameters adds exactly one")
    others = tracer.kinds() - {"all_reduce"}
    assert not others, f"{task_id}: {where}: unexpected {sorted(others)} during the step"
    assert all(e.in_backward for e in grads), f"{task_id}: {where}: an all-reduce was issued outside backward"
    if overlap:
        first, last_hook = min(e.time for e in grads), max(hook_times)
        assert first < last_hook, (
            f"{task_id}: {where}: the first all-reduce was issued {1e3 * (first - last_hook):.2f} ms "
            "after the last gradient was ready: launch it from the hook, not at the end of backward")


def train_and_compare(task_id: str, case: str, micro_steps: int = 1, group_ranks=None) -> None:
    """On every rank: STEPS optimizer steps of ours, the built-in and the reference, compared."""
    from labkit.ddp import DDP
    kind, ddp_kwargs = CASES[case]
    group = dist.new_group(group_ranks) if group_ranks else None  # every rank must call new_group
    rank = dist.get_rank()
    if group_ranks and rank not in group_ranks:
        return
    members = group_ranks or list(range(dist.get_world_size()))
    n, me = len(members), members.index(rank)

    models = {name: make_model(kind) for name in ("ours", "builtin", "reference")}
    hook_times = []
    for p in models["ours"].parameters():  # ours fire after DDP's own hooks: when each grad is done
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda _: hook_times.append(time.perf_counter()))
    ours = DDP(models["ours"], process_group=group, init_sync=False, broadcast_buffers=False, **ddp_kwargs)
    builtin = DistributedDataParallel(models["builtin"], process_group=group,
                                      find_unused_parameters=ddp_kwargs.get("find_unused_parameters", False))
    optims = {name: torch.optim.SGD(m.parameters(), **SGD) for name, m in models.items()}
    per_step = micro_steps * n * BATCH
    x, y = make_data(kind, STEPS * per_step)

    for step in range(STEPS):
        where = f"rank {rank} of {n}, {case}, step {step}"
        for micro in range(micro_steps):
            start = step * per_step + micro * n * BATCH
            gx, gy = x[start:start + n * BATCH], y[start:start + n * BATCH]  # the global micro-batch
            lx, ly = gx[me * BATCH:(me + 1) * BATCH], gy[me * BATCH:(me + 1) * BATCH]  # this rank's
            sync = micro == micro_steps - 1
            hook_times.clear()
            with (nullcontext() if sync else ours.no_sync()), CommTracer() as tracer:
                loss_of(kind, ours, lx, ly).backward()
            with nullcontext() if sync else builtin.no_sync():
                loss_of(kind, builtin, lx, ly).backward()
            loss_of(kind, models["reference"], gx, gy).backward()  # mean over the global batch
            if not sync:
                assert not tracer.events, (f"{task_id}: {where}, micro-batch {micro}: inside no_sync() "
                                           f"DDP communicated: {tracer.format()}")
            elif step == 1:  # not the first step: the bookkeeping must also be reset between steps
                got_grad = {p: p.grad is not None for p in models["reference"].parameters()}
                expected = expected_all_reduce_bytes(models["reference"], ddp_kwargs, got_grad)
                # Overlap is checked where the first bucket can fill early: not when one
                # bucket holds everything, nor when it holds `unused` (ready at the end only).
                per_parameter = ddp_kwargs["bucket_cap_mb"] is None
                overlap = per_parameter or (kind == "gpt" and len(expected) > 1)
                check_traced_backward(task_id, where, tracer, hook_times, expected, per_parameter,
                                      ddp_kwargs.get("find_unused_parameters", False), overlap)
        check_grads(task_id, where, models["ours"], models["reference"], "the single-process reference")
        check_grads(task_id, where, models["ours"], models["builtin"], "DistributedDataParallel")
        for name in models:
            optims[name].step()
            optims[name].zero_grad()
        check_params(task_id, where + " (after the optimizer step)", models["ours"], models["reference"],
                     "the single-process reference")
        check_params(task_id, where + " (after the optimizer step)", models["ours"], models["builtin"],
                     "DistributedDataParallel")


# ----------------------------------------------------------------------------- ddp.broadcast


def broadcast_on_rank(group_ranks=None) -> None:
    from labkit.ddp import DDP
    group = dist.new_group(group_ranks) if group_ranks else None
    rank = dist.get_rank()
    if group_ranks and rank not in group_ranks:
        return
    src = group_ranks[0] if group_ranks else 0
    where = f"ddp.broadcast: rank {rank}" + (f" in group {group_ranks}" if group_ranks else "")
    rank0 = {"toy": ToyModel(seed=src), "gpt": GPT(GPT_CONFIG, seed=src)}  # group rank 0's models
    for kind, expected in rank0.items():
        model = ToyModel(seed=rank) if kind == "toy" else GPT(GPT_CONFIG, seed=rank)  # differ by rank
        with torch.no_grad():
            for module in (model, expected):  # buffers differ by rank too
                for b in module.buffers():
                    b.mul_(1 + (rank if module is model else src))
        ddp = DDP(model, bucket_cap_mb=None, process_group=group)
        for (name, t), e in zip([*model.named_parameters(), *model.named_buffers()],
                                [*expected.parameters(), *expected.buffers()]):
            assert_close(t.detach(), e.detach(),
                         f"{where}, {kind} model, {name!r} after DDP(...) vs group rank 0's")
        if kind == "gpt":
            assert model.lm_head.weight is model.wte.weight, f"{where}: the tied lm_head/wte weight split"
        else:  # buffers again at every forward (broadcast_buffers=True, the default)
            with torch.no_grad():
                model.scale.add_(rank)
            ddp(torch.zeros(1, 8))
            assert_close(model.scale, expected.scale + src,
                         f"{where}, toy model, buffer 'scale' after forward vs group rank 0's "
                         "(broadcast_buffers=True)")
    builtin = DistributedDataParallel(ToyModel(seed=rank), process_group=group)
    for (name, t), e in zip(builtin.module.named_parameters(), rank0["toy"].parameters()):
        assert_close(t.detach(), e.detach(), f"{where}: the test's own check of the built-in, {name!r}")


@task("ddp.broadcast", points=0.5)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_broadcast(world_size):
    run_graded("ddp.broadcast", one_thread, world_size, broadcast_on_rank)


@task("ddp.broadcast", points=0.5)
def test_broadcast_on_a_subgroup():
    # Ranks 1-3 of 4 share a model: the source is the group's first rank, global rank 1.
    run_graded("ddp.broadcast", one_thread, 4, broadcast_on_rank, [1, 2, 3])


# ----------------------------------------------------------------------------- ddp.per_parameter


def per_parameter_on_rank() -> None:
    for case in ("toy, per-parameter", "gpt, per-parameter"):
        train_and_compare("ddp.per_parameter", case)


@task("ddp.per_parameter", points=1)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_per_parameter(world_size):
    run_graded("ddp.per_parameter", one_thread, world_size, per_parameter_on_rank)


# ----------------------------------------------------------------------------- ddp.bucketed


def bucketed_on_rank(group_ranks=None) -> None:
    # On a sub-group, one case is enough: it checks that process_group= is honoured.
    cases = ["gpt, 4 KiB buckets"] if group_ranks else ["toy, 25 MB buckets", "toy, 100-byte buckets",
                                                        "gpt, 4 KiB buckets"]
    for case in cases:
        train_and_compare("ddp.bucketed", case, group_ranks=group_ranks)


@task("ddp.bucketed", points=1.5)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bucketed(world_size):
    run_graded("ddp.bucketed", one_thread, world_size, bucketed_on_rank)


@task("ddp.bucketed", points=0.5)
def test_bucketed_on_a_subgroup():
    run_graded("ddp.bucketed", one_thread, 4, bucketed_on_rank, [1, 2, 3])


# ----------------------------------------------------------------------------- ddp.no_sync


def no_sync_on_rank() -> None:
    from labkit.ddp import DDP
    # 2 micro-batches per step: the first under no_sync(), the second synchronises the sum.
    for case in ("toy, per-parameter", "gpt, 4 KiB buckets"):
        train_and_compare("ddp.no_sync", case, micro_steps=2)
    ddp = DDP(ToyModel(), bucket_cap_mb=None, init_sync=False)
    try:
        with ddp.no_sync():
            raise KeyError("raised inside the with-block")
    except KeyError:
        pass
    assert ddp.require_backward_grad_sync, (f"ddp.no_sync: rank {dist.get_rank()}: after a with-block that "
                                            "raised, require_backward_grad_sync is still False")


@task("ddp.no_sync", points=0.5)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_no_sync(world_size):
    run_graded("ddp.no_sync", one_thread, world_size, no_sync_on_rank)
