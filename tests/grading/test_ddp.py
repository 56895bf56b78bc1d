"""Graded tests for chapter 02: DDP built from autograd hooks.

Every check runs on every rank at world sizes 1-4. Numbers: over 5 optimizer steps (SGD
with momentum and weight decay, so that a zero gradient and a missing one differ), the
learner's DDP must match a single-process model trained on the global batch and the
built-in ``DistributedDataParallel``, gradient by gradient after each backward and
parameter by parameter after each step. The models carry tied, frozen and unused
parameters (``ToyModel``), a GPT with a tied head and a frozen position embedding, and a
model with float32 and float64 parameters (``MixedToy``: per-parameter mode and 100-byte
buckets, which split where the dtype changes; float32 tolerances there).

Behaviour, traced with ``CommTracer`` at every step, the whole signature and nothing else:

* ddp.broadcast: at construction one broadcast per dtype of the parameters (a tied one once)
  and buffers, of their summed numel x element size, on the model's group; at each forward
  one per dtype of the buffers; the values are those of the group's first rank, written into
  each tensor's own memory (its storage is kept).
* ddp.per_parameter / ddp.bucketed, per synchronised backward: one all-reduce per gradient
  (per-parameter mode) or per bucket, with the bytes the size cap implies (derived here from
  the parameter sizes), launched in bucket order, on the model's group, during backward; plus
  the one small int32 all-reduce of the given find_unused_parameters code. Overlap, from the
  traced order of post, compute and wait: every gradient all-reduce but the last is posted
  before the last gradient is ready, and backward computation (not DDP's own hook work) runs
  between its post and its wait.
* ddp.no_sync: nothing at all inside ``no_sync()``; the synchronising backward after it is a
  normal one, signature and overlap included.

Communication hooks (ddp.bucketed): launching a bucket goes through the given
``DDP._communicate``, which runs a registered hook. With a test hook that averages in float64
(cast, divide, all-reduce, a new float32 tensor as the future's value), on the GPT with 4 KiB
buckets over the model's group: per step the hook is called once per bucket, in index order,
``is_last()`` on the last only, ``gradients()`` views of ``buffer()`` shaped like
``parameters()``; the trace is one float64 all-reduce per bucket (twice the float32 bytes of
the cap rule), in bucket order; gradients and parameters match the reference and the built-in
running the same hook. ``register_comm_hook`` refuses per-parameter mode, a second hook and a
hook after a backward (given code, checked without communication).

Process groups are partitions of the world (e.g. [0] and [1, 2, 3]): every rank trains in
its own group, so an implementation that ignores ``process_group`` meets the other group's
ranks in its collectives and the trace names the wrong group. Where each group-taking
function is graded on a subgroup (each partition inside one launch of 4 ranks):
    broadcast_tensors(tensors, group) and DDP(process_group) at init/forward (ddp.broadcast):
        [0] | [1,2,3], then the 2x2 grid's two axes [0,2] | [1,3] and [0,1] | [2,3]: the source
        is the group's first rank, which is neither global rank 0 nor "my rank minus my group
        rank" on a strided group
    DDP(process_group), per-parameter mode (ddp.per_parameter): halves at 2-4 ([0] | [1,2] at 3)
    DDP(process_group), buckets and comm hook (ddp.bucketed): [0] | [1,2,3] and [0,2] | [1,3]
Overlap (event order on the traced timeline, not wall time), where it is checked:
    ddp.per_parameter: every all-reduce but the last posted before the last gradient is ready,
        backward compute (outside DDP's hooks) between its post and its wait (world and halves)
    ddp.bucketed: the same per bucket, on the GPT with 4 KiB buckets (world and subgroups)
    ddp.no_sync: the synchronising backward after no_sync(), the same

Tests of one task never depend on another's stub being filled in first, except that the
no_sync test also runs bucketed mode after per-parameter mode.
"""

import gc
import weakref
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from labkit.check import assert_close, tolerance
from labkit.comm import CommTracer, Op, assert_ops, assert_overlap
from labkit.data import markov_tokens, regression
from labkit.course.grading import run_graded, task
from labkit.models import GPT, GPTConfig, ToyModel, toy_loss
from labkit.oracles import builtin_ddp
from tests.grading import configs
from tests.grading.configs import Drawn, DrawnMLP, draw_model, draw_partition, mlp_data, mlp_loss

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
    "mixed dtypes, per-parameter": ("mixed", dict(bucket_cap_mb=None, find_unused_parameters=True)),
    "mixed dtypes, 100-byte buckets": ("mixed", dict(bucket_cap_mb=100 / 2 ** 20, find_unused_parameters=True)),
}


class MixedToy(torch.nn.Module):
    """Parameters of two dtypes in one model: a float32 matrix used twice, float64 biases, and
    a float64 vector no forward uses. Buckets split where the dtype changes; every gradient
    keeps its parameter's dtype."""

    def __init__(self):
        super().__init__()
        toy = ToyModel(seed=0)
        self.weight = torch.nn.Parameter(toy.shared.detach().clone())
        self.bias = torch.nn.Parameter(toy.bias_in.detach().double())
        self.out = torch.nn.Parameter(toy.bias_out.detach().double())
        self.unused = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))

    def forward(self, x):
        h = torch.tanh(x @ self.weight.t() + self.bias)   # float32 + float64 -> float64
        return h.float() @ self.weight + self.out


def one_thread(fn, *args) -> None:
    """Run ``fn`` on a rank with one intra-op thread: these models are tiny, and on shared
    cores a second OpenMP thread per rank costs more (spinning, waiting) than it gives."""
    torch.set_num_threads(1)
    fn(*args)


def make_model(kind) -> torch.nn.Module:
    """Identical on every rank: seeded weights. ``kind``: a name, or a ``Drawn`` model."""
    if isinstance(kind, Drawn):
        return DrawnMLP(kind)
    if kind == "toy":
        return ToyModel(seed=0)  # tied `shared`, frozen `frozen`, unused `unused`, buffer `scale`
    if kind == "mixed":
        return MixedToy()
    model = GPT(GPT_CONFIG, seed=0)  # lm_head tied to wte
    model.wpe.weight.requires_grad_(False)  # a frozen parameter in the GPT too
    return model


def make_data(kind, samples: int):
    if isinstance(kind, Drawn):
        return mlp_data(kind, samples)
    if kind in ("toy", "mixed"):
        return regression(samples, 8, 8, seed=1)
    return markov_tokens(samples, GPT_CONFIG.block_size, GPT_CONFIG.vocab_size, seed=1)


def loss_of(kind, model, x, y) -> torch.Tensor:
    if isinstance(kind, Drawn):
        return mlp_loss(kind, model, x, y)
    return toy_loss(model, x, y) if kind in ("toy", "mixed") else model(x, y)[1]


def halves(n: int) -> list[list[int]]:
    """The world in two groups, [0, n//2) and [n//2, n); the whole world when n == 1."""
    return [list(range(n))] if n == 1 else [list(range(n // 2)), list(range(n // 2, n))]


def on_partitions(fn, partitions) -> None:
    """``fn(partition)`` for each partition of the world in turn, in one launch."""
    for partition in partitions:
        fn(partition)


def own_group(groups):
    """(group, its global ranks) of this rank. ``groups``: a partition of the world (every rank
    creates every group: new_group is collective), or None for the default group."""
    if not groups:
        return None, list(range(dist.get_world_size()))
    made = [dist.new_group(ranks) for ranks in groups]
    index = next(i for i, ranks in enumerate(groups) if dist.get_rank() in ranks)
    return made[index], groups[index]


def per_dtype_bytes(tensors) -> list[int]:
    """Bytes of each dtype's share of ``tensors`` (each tensor once): one flat message per dtype."""
    sizes, seen = {}, set()
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            sizes[t.dtype] = sizes.get(t.dtype, 0) + t.numel() * t.element_size()
    return list(sizes.values())


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
    return [sum(params[i].numel() * params[i].element_size() for i in bucket)
            for bucket in expected_buckets(params, cap)]


def expected_buckets(params, cap: int) -> list[list[int]]:
    """The indices of ``params`` in each bucket, in launch order: assign_buckets' documented
    rule written out again (reverse order; a dtype change starts a bucket; close one once it
    holds >= cap bytes)."""
    buckets, current, size = [], [], 0
    for i in reversed(range(len(params))):
        if current and params[i].dtype != params[current[0]].dtype:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += params[i].numel() * params[i].element_size()
        if size >= cap:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


def check_grads(task_id: str, where: str, model, other, against: str, rtol=None, atol=None) -> None:
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        what = f"{task_id}: {where}, gradient of {name!r} vs {against}"
        if q.grad is None:
            assert p.grad is None, f"{what}: should be None (frozen, or used by no rank), got a tensor"
        else:
            assert p.grad is not None, f"{what}: is None after backward"
            assert_close(p.grad, q.grad, what, rtol, atol)


def check_params(task_id: str, where: str, model, other, against: str, rtol=None, atol=None) -> None:
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert_close(p.detach(), q.detach(), f"{task_id}: {where}, parameter {name!r} vs {against}", rtol, atol)


def check_traced_backward(task_id, where, tracer, hooks, expected, per_parameter, find_unused,
                          trainable, members, overlap) -> None:
    """One synchronised backward's whole trace: the gradient all-reduces (``expected`` bytes),
    the int32 usage all-reduce of find_unused_parameters, nothing else; then their order,
    dtype, backward, and overlap. ``hooks``: per gradient ready, the timeline positions just
    before and just after DDP's own hook ran."""
    num_params = len(trainable)
    usage = [Op("all_reduce", 4 * num_params, members)] if find_unused else []  # int32 per parameter
    assert_ops(tracer, [Op("all_reduce", size, members) for size in expected] + usage,
               f"{task_id}: {where}: " + (f"one all-reduce per gradient ({len(expected)})" if per_parameter else
                                          f"one all-reduce per bucket the cap implies ({len(expected)})") +
               f" over ranks {tuple(members)}" + (", plus find_unused_parameters' one int32 all-reduce of "
                                                 f"{num_params} flags" if find_unused else ""))
    flags = next((i for i, e in enumerate(tracer.events) if e.dtype == torch.int32), None) if find_unused else None
    grads = [i for i in range(len(tracer.events)) if i != flags]
    sizes = [tracer.events[i].bytes for i in grads]  # in the order issued
    if not per_parameter:
        assert sizes == expected, (f"{task_id}: {where}: buckets all-reduced in the order {sizes} (bytes); "
                                   f"launch them in bucket order, {expected}, on every rank")
    own = {str(p.dtype) for p in trainable}
    wrong = sorted({str(tracer.events[i].dtype) for i in grads} - own)
    assert not wrong, f"{task_id}: {where}: gradients all-reduced in {wrong}, not in their own {sorted(own)}"
    late = [n + 1 for n, i in enumerate(grads) if not tracer.events[i].in_backward]
    assert not late, (f"{task_id}: {where}: gradient all-reduce(s) #{late} of {len(grads)} issued after "
                      "backward returned: launch them from the hooks")
    if overlap:
        check_overlap(task_id, where, tracer, grads, hooks)


def check_overlap(task_id, where, tracer, grads, hooks) -> None:
    """Every gradient all-reduce but the last: posted before the last gradient was ready,
    and with backward's own computation between its post and its wait. The computation
    DDP does inside its hooks (dividing, copying into a bucket) does not count: it is no
    work that communication hides."""
    if len(grads) < 2:
        return
    last_ready, end = hooks[-1]
    posted = {step.event: i for i, step in enumerate(tracer.timeline) if step.what == "post"}
    for n, i in enumerate(grads[:-1]):
        if posted[i] >= last_ready:
            raise AssertionError(
                f"{task_id}: {where}: gradient all-reduce #{n + 1} of {len(grads)} ({tracer.events[i].bytes} B) was "
                "posted only when the last gradient was ready, at the end of backward: launch each one from "
                "the hook as soon as its gradients are in, so that it overlaps the rest of backward (no overlap)")
    in_hooks = {i for start, stop in hooks for i in range(start, stop)}
    backward = SimpleNamespace(events=tracer.events, timeline=[
        step for i, step in enumerate(tracer.timeline)
        if step.what != "compute" or (i < end and i not in in_hooks)])
    assert_overlap(backward, f"{task_id}: {where}: backward computation must run while each gradient "
                   "all-reduce is in flight", events=grads, exempt_last=1)


def check_gradients_freed(task_id: str, where: str, ddp, released: list) -> None:
    """After zero_grad(set_to_none=True) the step's gradients must be freed: nothing of DDP's
    may hold them into the next forward (a gradient that is a view of a bucket's buffer, as
    with DDP's gradient_as_bucket_view, costs no memory of its own and may stay)."""
    gc.collect()
    buffers = {b.buffer.untyped_storage().data_ptr() for b in ddp.buckets or ()}
    kept = [ref() for ref in released if ref() is not None]
    kept = [g for g in kept if g.untyped_storage().data_ptr() not in buffers]
    assert not kept, (
        f"{task_id}: {where}: {len(kept)} of the step's {len(released)} gradients are still alive after "
        "zero_grad(set_to_none=True): something of DDP's still holds them (the handles of all-reduces already "
        "waited on?), so a whole gradient's memory stays allocated through the next forward")


def train_and_compare(task_id: str, case: str, micro_steps: int = 1, groups=None) -> None:
    """On every rank: STEPS optimizer steps of ours, the built-in and the reference, compared.
    ``groups``: a partition of the world, one model per group (None: one over the world)."""
    from labkit.ddp import DDP
    kind, ddp_kwargs = CASES[case] if isinstance(case, str) else case  # a name, or (Drawn, kwargs)
    drawn = isinstance(kind, Drawn)
    case = kind.label if drawn else case
    # float32 parameters feed float64 ones: every value carries float32 rounding. The drawn
    # models' gradients are O(1) sums that may cancel to 1e-5: an absolute 2e-5 (float32's
    # rounding of the terms over 5 steps) besides the relative 1e-5.
    tol = tolerance(torch.float32) if kind == "mixed" else (1e-5, 2e-5) if drawn else (None, None)
    group, members = own_group(groups)
    rank = dist.get_rank()
    n, me = len(members), members.index(rank)

    models = {name: make_model(kind) for name in ("ours", "builtin", "reference")}
    # Hooks of the test around DDP's own (post-accumulate-grad hooks run in the order they
    # were registered): where on the traced timeline each gradient became ready, and where
    # DDP's hook for it ended. What lies between is DDP's own work, not backward's.
    traced, before, hooks = [None], [], []
    trainable = [p for p in models["ours"].parameters() if p.requires_grad]
    for p in trainable:
        p.register_post_accumulate_grad_hook(lambda _: before.append(len(traced[0].timeline)))
    ours = DDP(models["ours"], process_group=group, init_sync=False, broadcast_buffers=False, **ddp_kwargs)
    for p in trainable:
        p.register_post_accumulate_grad_hook(lambda _: hooks.append((before.pop(), len(traced[0].timeline))))
    builtin = builtin_ddp(models["builtin"], process_group=group,
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
            hooks.clear()
            with (nullcontext() if sync else ours.no_sync()), CommTracer() as tracer:
                traced[0] = tracer
                loss_of(kind, ours, lx, ly).backward()
            with nullcontext() if sync else builtin.no_sync():
                loss_of(kind, builtin, lx, ly).backward()
            loss_of(kind, models["reference"], gx, gy).backward()  # mean over the global batch
            if not sync:
                assert_ops(tracer, [], f"{task_id}: {where}, micro-batch {micro}: inside no_sync() the gradients "
                                       "stay local: no communication at all in its forward and backward")
            else:  # every step: the bookkeeping must also be reset between steps
                got_grad = {p: p.grad is not None for p in models["reference"].parameters()}
                expected = expected_all_reduce_bytes(models["reference"], ddp_kwargs, got_grad)
                # Overlap is checked where the first bucket can fill early: not when one
                # bucket holds everything, nor when it holds `unused` (ready at the end only).
                per_parameter = ddp_kwargs["bucket_cap_mb"] is None
                overlap = not drawn and ((per_parameter and kind != "mixed") or (kind == "gpt" and len(expected) > 1))
                check_traced_backward(task_id, where, tracer, hooks, expected, per_parameter,
                                      ddp_kwargs.get("find_unused_parameters", False), trainable,
                                      members, overlap)
        check_grads(task_id, where, models["ours"], models["reference"], "the single-process reference", *tol)
        check_grads(task_id, where, models["ours"], models["builtin"], "DistributedDataParallel", *tol)
        released = [weakref.ref(p.grad) for p in models["ours"].parameters() if p.grad is not None]
        for name in models:
            optims[name].step()
            optims[name].zero_grad()
        traced[0] = tracer = None  # the tracer keeps the step's all-reduce handles
        check_gradients_freed(task_id, where, ours, released)
        check_params(task_id, where + " (after the optimizer step)", models["ours"], models["reference"],
                     "the single-process reference", *tol)
        check_params(task_id, where + " (after the optimizer step)", models["ours"], models["builtin"],
                     "DistributedDataParallel", *tol)


# ----------------------------------------------------------------------------- ddp.broadcast


def mixed_tensors(seed: int) -> list[torch.Tensor]:
    """Tensors of six dtypes, interleaved (two float widths, three integer widths and bool: each
    needs its own message, and torch.cat of two integer widths would promote them), with values
    that differ by ``seed``."""
    return [torch.arange(3, dtype=torch.float32) + seed, torch.arange(5, dtype=torch.int64) * (seed + 1),
            torch.full((2, 2), seed + 0.5, dtype=torch.float64), torch.arange(4, dtype=torch.int8) - seed,
            torch.tensor([seed % 2 == 0, True, seed % 3 == 0]), torch.arange(4, dtype=torch.float32) - seed,
            torch.arange(2, dtype=torch.int32) * (seed + 2)]


def broadcast_on_rank(groups=None) -> None:
    from labkit.ddp import DDP, broadcast_tensors
    group, members = own_group(groups)
    rank, src = dist.get_rank(), members[0]
    where = f"ddp.broadcast: rank {rank} in group {members}"
    one_per_dtype = "one broadcast per dtype (the tensors of that dtype flattened into one message)"

    tensors, expected = mixed_tensors(rank), mixed_tensors(src)
    storages = [t.data_ptr() for t in tensors]
    with CommTracer() as tracer:
        call_broadcast(where, src, broadcast_tensors, tensors, group)
    for i, (t, before) in enumerate(zip(tensors, storages)):
        assert t.data_ptr() == before, (f"{where}, broadcast_tensors: tensor {i} now lives in other memory; "
                                        "overwrite each tensor in place (copy_), do not rebind it (.data =)")
    assert_ops(tracer, [Op("broadcast", size, members) for size in per_dtype_bytes(expected)],
               f"{where}, broadcast_tensors of float32, int64, float64, int8, bool, float32 and int32 tensors: "
               f"{one_per_dtype}, "
               f"over ranks {tuple(members)}")
    for i, (t, e) in enumerate(zip(tensors, expected)):
        assert_close(t, e, f"{where}, broadcast_tensors: tensor {i} ({e.dtype}) vs group rank 0's")

    rank0 = {"toy": ToyModel(seed=src), "gpt": GPT(GPT_CONFIG, seed=src)}  # group rank 0's models
    for kind, expected in rank0.items():
        model = ToyModel(seed=rank) if kind == "toy" else GPT(GPT_CONFIG, seed=rank)  # differ by rank
        with torch.no_grad():
            for module in (model, expected):  # buffers differ by rank too
                for b in module.buffers():
                    b.mul_(1 + (rank if module is model else src))
        with CommTracer() as tracer:
            ddp = call_broadcast(where, src, DDP, model, bucket_cap_mb=None, process_group=group)
        # Parameters (a tied one once, frozen ones too) and buffers: one message per dtype.
        assert_ops(tracer, [Op("broadcast", size, members) for size in
                            per_dtype_bytes([*model.parameters(), *model.buffers()])],
                   f"{where}, {kind} model, DDP(...): {one_per_dtype} of its parameters and buffers, "
                   f"over ranks {tuple(members)}")
        for (name, t), e in zip([*model.named_parameters(), *model.named_buffers()],
                                [*expected.parameters(), *expected.buffers()]):
            assert_close(t.detach(), e.detach(),
                         f"{where}, {kind} model, {name!r} after DDP(...) vs group rank 0's")
        if kind == "gpt":
            assert model.lm_head.weight is model.wte.weight, f"{where}: the tied lm_head/wte weight split"
        else:  # buffers again at every forward (broadcast_buffers=True, the default)
            with torch.no_grad():
                model.scale.add_(rank)
            with CommTracer() as tracer:
                ddp(torch.zeros(1, 8))
            assert_ops(tracer, [Op("broadcast", size, members) for size in per_dtype_bytes(model.buffers())],
                       f"{where}, toy model, forward with broadcast_buffers=True: {one_per_dtype} of its "
                       f"buffers, over ranks {tuple(members)}")
            assert_close(model.scale, expected.scale + src,
                         f"{where}, toy model, buffer 'scale' after forward vs group rank 0's "
                         "(broadcast_buffers=True)")
    builtin = builtin_ddp(ToyModel(seed=rank), process_group=group)
    for (name, t), e in zip(builtin.module.named_parameters(), rank0["toy"].parameters()):
        assert_close(t.detach(), e.detach(), f"{where}: the test's own check of the built-in, {name!r}")


def call_broadcast(where, src, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``; a source outside the group is named in the course's terms."""
    try:
        return fn(*args, **kwargs)
    except ValueError as error:
        if "group" not in str(error):
            raise
        raise AssertionError(f"{where}: the broadcast's source is not the group's first rank (global rank "
                             f"{src}): broadcast with group=... and group_src=0 ({error})") from None


@task("ddp.broadcast", points=0.5)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_broadcast(world_size):
    run_graded("ddp.broadcast", one_thread, world_size, broadcast_on_rank)


@task("ddp.broadcast", points=0.5)
def test_broadcast_on_a_subgroup():
    # Ranks 1-3 of 4 share a model, rank 0 has its own: the source of the first is the
    # group's first rank, global rank 1; a broadcast over the world meets rank 0 there.
    # Then the 2x2 grid's axes: on [0, 2] | [1, 3] the source of the second is global rank 1,
    # which "my rank minus my group rank" (right on contiguous groups) misses.
    run_graded("ddp.broadcast", one_thread, 4, on_partitions, broadcast_on_rank,
               [[[0], [1, 2, 3]], [[0, 2], [1, 3]], [[0, 1], [2, 3]]])


# ----------------------------------------------------------------------------- ddp.per_parameter


def per_parameter_on_rank() -> None:
    # The GPT trains in two groups (halves of the world, each its own model): process_group=
    # and its size must be honoured.
    train_and_compare("ddp.per_parameter", "toy, per-parameter")
    train_and_compare("ddp.per_parameter", "mixed dtypes, per-parameter")
    train_and_compare("ddp.per_parameter", "gpt, per-parameter", groups=halves(dist.get_world_size()))


@task("ddp.per_parameter", points=1)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_per_parameter(world_size):
    run_graded("ddp.per_parameter", one_thread, world_size, per_parameter_on_rank)


# ----------------------------------------------------------------------------- ddp.bucketed


def bucketed_on_rank(groups=None) -> None:
    # On sub-groups, one case is enough: it checks that process_group= is honoured.
    cases = ["gpt, 4 KiB buckets"] if groups else ["toy, 25 MB buckets", "toy, 100-byte buckets",
                                                   "gpt, 4 KiB buckets", "mixed dtypes, 100-byte buckets"]
    for case in cases:
        train_and_compare("ddp.bucketed", case, groups=groups)
    train_with_hook(groups)


class HookLog(SimpleNamespace):
    """The test hook's state: its process group and size, and what it saw of each bucket."""


def float64_hook(state: HookLog, bucket):
    """Average the bucket in float64 and hand back a new float32 tensor: a hook whose trace
    (float64, twice the bytes) tells it apart from DDP's default all-reduce."""
    buffer, grads = bucket.buffer(), bucket.gradients()
    starts = torch.tensor([0] + [g.numel() for g in grads]).cumsum(0).tolist()
    views = all(g.data_ptr() == buffer.data_ptr() + start * g.element_size() for g, start in zip(grads, starts))
    shapes = [g.shape for g in grads] == [p.shape for p in bucket.parameters()]
    state.calls.append((bucket.index(), bucket.is_last(), views, shapes))
    wide = buffer.double().div_(state.size)
    future = dist.all_reduce(wide, group=state.group, async_op=True).get_future()
    return future.then(lambda done: done.value()[0].float())


def check_hook_rules(where: str) -> None:
    """register_comm_hook's refusals (given code), with no communication: init_sync=False, and
    the backward runs under no_sync()."""
    from labkit.ddp import DDP

    def noop(state, bucket):
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    refusals = [(DDP(ToyModel(), bucket_cap_mb=None, init_sync=False), "per-parameter mode")]
    twice = DDP(ToyModel(), init_sync=False)
    twice.register_comm_hook(None, noop)
    refusals.append((twice, "a second hook"))
    late = DDP(ToyModel(), init_sync=False, broadcast_buffers=False, find_unused_parameters=True)
    with late.no_sync():
        toy_loss(late, *regression(2, 8, 8, seed=1)).backward()
    refusals.append((late, "a hook after the first backward"))
    for ddp, what in refusals:
        with pytest.raises(RuntimeError):
            ddp.register_comm_hook(None, noop)
            raise AssertionError(f"ddp.bucketed: {where}: register_comm_hook accepted {what}")


def train_with_hook(groups=None) -> None:
    """STEPS steps of the GPT (4 KiB buckets) with ``float64_hook`` on ours and on the built-in."""
    from labkit.ddp import DDP
    kind, ddp_kwargs = CASES["gpt, 4 KiB buckets"]
    group, members = own_group(groups)
    rank = dist.get_rank()
    n, me = len(members), members.index(rank)
    where = f"rank {rank} of {n}, gpt, 4 KiB buckets, float64 test hook"
    check_hook_rules(where)
    models = {name: make_model(kind) for name in ("ours", "builtin", "reference")}
    ours = DDP(models["ours"], process_group=group, init_sync=False, broadcast_buffers=False, **ddp_kwargs)
    builtin = builtin_ddp(models["builtin"], process_group=group)
    logs = {name: HookLog(group=group, size=n, calls=[]) for name in ("ours", "builtin")}
    ours.register_comm_hook(logs["ours"], float64_hook)
    builtin.register_comm_hook(logs["builtin"], float64_hook)
    optims = {name: torch.optim.SGD(m.parameters(), **SGD) for name, m in models.items()}
    x, y = make_data(kind, STEPS * n * BATCH)
    for step in range(STEPS):
        at = f"{where}, step {step}"
        gx, gy = x[step * n * BATCH:(step + 1) * n * BATCH], y[step * n * BATCH:(step + 1) * n * BATCH]
        lx, ly = gx[me * BATCH:(me + 1) * BATCH], gy[me * BATCH:(me + 1) * BATCH]
        logs["ours"].calls.clear()
        with CommTracer() as tracer:
            loss_of(kind, ours, lx, ly).backward()
        loss_of(kind, builtin, lx, ly).backward()
        loss_of(kind, models["reference"], gx, gy).backward()

        expected = expected_all_reduce_bytes(models["reference"], ddp_kwargs, {})
        calls = logs["ours"].calls
        assert [c[0] for c in calls] == list(range(len(expected))), (
            f"ddp.bucketed: {at}: the hook saw buckets {[c[0] for c in calls]}, expected each of the "
            f"{len(expected)} once, in index order: launch every bucket with self._communicate(bucket)")
        assert [c[1] for c in calls] == [i == len(expected) - 1 for i in range(len(expected))], \
            f"ddp.bucketed: {at}: is_last() must be True for the last bucket only"
        assert all(c[2] and c[3] for c in calls), \
            f"ddp.bucketed: {at}: the hook's gradients() must be views of buffer() shaped like parameters()"
        assert_ops(tracer, [Op("all_reduce", 2 * size, members) for size in expected],
                   f"ddp.bucketed: {at}: one float64 all-reduce per bucket, issued by the registered hook")
        got = [e.bytes for e in tracer.events]
        assert got == [2 * size for size in expected] and all(e.dtype == torch.float64 for e in tracer.events), \
            f"ddp.bucketed: {at}: the hook's all-reduces in the order {got} (bytes), expected bucket order"
        check_grads("ddp.bucketed", at, models["ours"], models["reference"], "the single-process reference")
        check_grads("ddp.bucketed", at, models["ours"], models["builtin"], "DistributedDataParallel, same hook")
        for name in models:
            optims[name].step()
            optims[name].zero_grad()
        check_params("ddp.bucketed", at + " (after the optimizer step)", models["ours"], models["reference"],
                     "the single-process reference")
        check_params("ddp.bucketed", at + " (after the optimizer step)", models["ours"], models["builtin"],
                     "DistributedDataParallel, same hook")


def check_assign_buckets() -> None:
    """assign_buckets alone, on sizes where a bucket reaches the cap exactly (in a one-rank launch)."""
    from labkit.ddp import assign_buckets
    params = [torch.nn.Parameter(torch.zeros(numel, dtype=dtype)) for numel, dtype in
              [(1, torch.float32), (1, torch.float32), (1, torch.float32), (2, torch.float64),
               (1, torch.float32), (3, torch.float32)]]
    names = {id(p): f"p{i}" for i, p in enumerate(params)}
    # (cap in bytes, expected buckets): reverse order, closed once >= cap, or when the dtype changes.
    for cap, expected in [(6, [["p5"], ["p4"], ["p3"], ["p2", "p1"], ["p0"]]),
                          (8, [["p5"], ["p4"], ["p3"], ["p2", "p1"], ["p0"]]),
                          (16, [["p5", "p4"], ["p3"], ["p2", "p1", "p0"]]),
                          (12, [["p5"], ["p4"], ["p3"], ["p2", "p1", "p0"]]),
                          (4, [["p5"], ["p4"], ["p3"], ["p2"], ["p1"], ["p0"]]),
                          # the float64 bucket closes at 16 B, under the cap: p2's bucket starts from 0 B
                          (40, [["p5", "p4"], ["p3"], ["p2", "p1", "p0"]])]:
        got = [[names[id(p)] for p in bucket] for bucket in assign_buckets(params, cap)]
        assert got == expected, (
            f"ddp.bucketed: assign_buckets of parameters p0..p5 of 4, 4, 4, 16 (float64), 4, 12 bytes, cap {cap} B: "
            f"{got}, expected {expected} (walk them in reverse; close a bucket as soon as it holds >= the cap, "
            "or when the dtype changes)")


@task("ddp.bucketed", points=1.5)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bucketed(world_size):
    run_graded("ddp.bucketed", check_assign_buckets, 1)  # in a rank: the judge's process imports no submission
    run_graded("ddp.bucketed", one_thread, world_size, bucketed_on_rank)


@task("ddp.bucketed", points=0.5)
def test_bucketed_on_a_subgroup():
    # Ranks 1-3 of 4 share a model, rank 0 has its own; then the strided axis of a 2x2 grid.
    run_graded("ddp.bucketed", one_thread, 4, on_partitions, bucketed_on_rank, [[[0], [1, 2, 3]], [[0, 2], [1, 3]]])


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
    with ddp.no_sync():
        with ddp.no_sync():
            pass
        assert not ddp.require_backward_grad_sync, (
            f"ddp.no_sync: rank {dist.get_rank()}: inside an outer no_sync(), after an inner one ended, "
            "require_backward_grad_sync is True again: restore the value it had before, not True")
    assert ddp.require_backward_grad_sync, (f"ddp.no_sync: rank {dist.get_rank()}: after nested no_sync() "
                                            "blocks, require_backward_grad_sync is still False")


@task("ddp.no_sync", points=0.5)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_no_sync(world_size):
    run_graded("ddp.no_sync", one_thread, world_size, no_sync_on_rank)


# ----------------------------------------------------------------------------- drawn configurations
#
# Besides the fixed cases above, every task runs K configurations drawn from the run's seed
# (tests/grading/configs.py: a new seed each run, printed in every failure; LABKIT_SEED replays,
# LABKIT_LONG=1 draws more), in one launch of 4 ranks: a chain of linear layers of drawn widths
# and dtypes (float32/float64 in any order), with or without biases, some frozen, one perhaps
# tied to another, one perhaps used by no forward; a loss scaled by a drawn factor (0.25-4);
# the world split into a drawn partition of groups (strided and single-rank ones
# included); a drawn bucket cap; 2-4 micro-batches per step (ddp.no_sync). Checked as above
# (tolerance: float32's, with an absolute 2e-5 for gradients that cancel to nearly zero):
# gradients and parameters against the reference and the built-in at every step, and the
# whole trace of each synchronised backward. ddp.broadcast draws tensors of any dtype gloo
# broadcasts (bool, 8- to 64-bit ints and floats, 0-dim ones included) and the drawn models;
# ddp.bucketed also checks assign_buckets on drawn parameter lists and caps.

DRAWN_WORLD = 4
BROADCAST_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                    torch.int8, torch.uint8, torch.bool)


def draw_cases(task_id: str) -> list[dict]:
    rng = configs.rng(task_id)
    cases = []
    for i in range(configs.budget(ci=3, long=20)):
        label = f"drawn case {i} {configs.replay(task_id + f', case {i}')}"
        spec = draw_model(rng, label)
        params = [p for p in DrawnMLP(spec).parameters() if p.requires_grad]
        total = sum(p.numel() * p.element_size() for p in params)
        cap = None if task_id == "ddp.per_parameter" else rng.randint(1, total + 8) / 2 ** 20
        if task_id == "ddp.no_sync" and rng.random() < 0.5:
            cap = None
        kwargs = dict(bucket_cap_mb=cap, find_unused_parameters=spec.spare or rng.random() < 0.3)
        cases.append(dict(case=(spec, kwargs), groups=draw_partition(rng, DRAWN_WORLD),
                          micro_steps=rng.randint(2, 4) if task_id == "ddp.no_sync" else 1))
    return cases


def drawn_training_on_rank(task_id: str, cases: list[dict]) -> None:
    for case in cases:
        train_and_compare(task_id, case["case"], micro_steps=case["micro_steps"], groups=case["groups"])


def drawn_broadcast_on_rank(cases: list[dict]) -> None:
    from labkit.ddp import DDP, broadcast_tensors
    rank = dist.get_rank()
    for case in cases:
        group, members = own_group(case["groups"])
        src = members[0]
        where = f"ddp.broadcast: rank {rank} in group {members}, {case['label']}"
        tensors, expected = (make_tensors(case["tensors"], value_seed) for value_seed in (rank, src))
        storages = [t.data_ptr() for t in tensors]
        with CommTracer() as tracer:
            call_broadcast(where, src, broadcast_tensors, tensors, group)
        assert [t.data_ptr() for t in tensors] == storages, \
            f"{where}: a tensor now lives in other memory; overwrite each in place (copy_)"
        assert_ops(tracer, [Op("broadcast", size, members) for size in per_dtype_bytes(expected)],
                   f"{where}, broadcast_tensors of {[str(t.dtype) for t in expected]}: one broadcast per dtype, "
                   f"over ranks {tuple(members)}")
        for i, (t, e) in enumerate(zip(tensors, expected)):
            assert t.dtype == e.dtype and t.shape == e.shape, f"{where}: tensor {i} changed dtype or shape"
            assert torch.equal(t, e), f"{where}: tensor {i} ({e.dtype}, shape {tuple(e.shape)}) vs group rank 0's"
        spec = case["model"]
        model, theirs = DrawnMLP(spec, seed=rank), DrawnMLP(spec, seed=src)
        DDP(model, process_group=group, bucket_cap_mb=None, find_unused_parameters=True)
        for (name, t), e in zip([*model.named_parameters(), *model.named_buffers()],
                                [*theirs.parameters(), *theirs.buffers()]):
            assert torch.equal(t.detach(), e.detach()), f"{where}: {name!r} after DDP(...) vs group rank 0's"


def make_tensors(specs: list[tuple], value_seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(value_seed)
    out = []
    for dtype, shape in specs:
        values = torch.randint(0, 2 if dtype == torch.bool else 100, shape, generator=g)
        out.append(values.to(dtype) if dtype == torch.bool or not dtype.is_floating_point
                   else (values.double() / 7).to(dtype))
    return out


def draw_broadcasts() -> list[dict]:
    rng = configs.rng("ddp.broadcast")
    cases = []
    for i in range(configs.budget(ci=4, long=30)):
        shapes = [tuple(rng.randint(1, 4) for _ in range(rng.randint(0, 3))) for _ in range(rng.randint(1, 6))]
        cases.append(dict(tensors=[(rng.choice(BROADCAST_DTYPES), shape) for shape in shapes],
                          groups=draw_partition(rng, DRAWN_WORLD), model=draw_model(rng, f"case {i}"),
                          label=f"drawn case {i} {configs.replay(f'ddp.broadcast, case {i}')}"))
    return cases


def check_drawn_buckets() -> None:
    """assign_buckets on drawn parameter lists (1-8 parameters of 1-6 elements, float32/64 and
    float16) and caps, against the rule (in a one-rank launch)."""
    from labkit.ddp import assign_buckets
    rng = configs.rng("ddp.bucketed:assign")
    for _ in range(configs.budget(ci=50, long=500)):
        params = [torch.nn.Parameter(torch.zeros(rng.randint(1, 6), dtype=rng.choice(
            (torch.float32, torch.float64, torch.float16)))) for _ in range(rng.randint(1, 8))]
        cap = rng.randint(1, 40)
        names = {id(p): f"p{i}" for i, p in enumerate(params)}
        got = [[names[id(p)] for p in bucket] for bucket in assign_buckets(params, cap)]
        expected = [[f"p{i}" for i in bucket] for bucket in expected_buckets(params, cap)]
        sizes = [f"{p.numel() * p.element_size()} ({str(p.dtype)[6:]})" for p in params]
        assert got == expected, (f"ddp.bucketed: assign_buckets of parameters of {sizes} bytes, cap {cap} B: {got}, "
                                 f"expected {expected} (walk them in reverse; close a bucket once it holds >= the "
                                 f"cap, or when the dtype changes) {configs.replay()}")


@task("ddp.broadcast", points=0.5)
def test_broadcast_drawn_configurations():
    run_graded("ddp.broadcast", one_thread, DRAWN_WORLD, drawn_broadcast_on_rank, draw_broadcasts())


@task("ddp.per_parameter", points=1)
def test_per_parameter_drawn_configurations():
    run_graded("ddp.per_parameter", one_thread, DRAWN_WORLD, drawn_training_on_rank, "ddp.per_parameter",
               draw_cases("ddp.per_parameter"))


@task("ddp.bucketed", points=1)
def test_bucketed_drawn_configurations():
    run_graded("ddp.bucketed", check_drawn_buckets, 1)
    run_graded("ddp.bucketed", one_thread, DRAWN_WORLD, drawn_training_on_rank, "ddp.bucketed",
               draw_cases("ddp.bucketed"))


@task("ddp.no_sync", points=0.5)
def test_no_sync_drawn_configurations():
    run_graded("ddp.no_sync", one_thread, DRAWN_WORLD, drawn_training_on_rank, "ddp.no_sync",
               draw_cases("ddp.no_sync"))
