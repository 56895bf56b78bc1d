"""Communication tracing and the cost formulas it is compared with.

``CommTracer`` records every collective and point-to-point op issued on this rank while it
is active. It sits at the dispatcher: ``dist.all_reduce``, ``ProcessGroup.allreduce``,
``isend``/``irecv``, ``batch_isend_irecv``, functional collectives and DTensor all end in
``c10d::*`` or ``_c10d_functional::*`` ops, so it sees them however they were imported.

    with CommTracer() as tracer:
        dist.all_reduce(t)
    tracer.summary()   # {"all_reduce": {"calls": 1, "bytes": S, "wire_bytes": 2(N-1)/N*S}}

Each event also names its group (the global ranks) and, for a send or receive, its peer;
with the compute ops and the ``wait()`` calls in between, ``tracer.timeline`` is the order of
post, compute and wait that overlap is judged by. A callback chained on a future while a
tracer is active (``future.then(...)``, ``add_done_callback``) runs under that tracer on
whatever thread completes the future (gloo's, for a collective's future), so the collectives a
communication hook issues from its callbacks are traced too. Graded tests compare the whole trace with
the technique's formula (``assert_ops``) and check overlap where a technique claims it
(``assert_overlap``).

Two byte counts per op:
* ``bytes``: the size S of the logical buffer (the tensor all-reduced, the full gathered
  tensor, the full tensor before reduce-scatter, the message sent or received);
* ``wire_bytes``: what this rank sends under a bandwidth-optimal (ring) algorithm, the
  quantity the cost formulas of the course are written in.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Dispatcher op name (without namespace and overload) -> the kind of communication.
OP_KINDS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce", "all_reduce_coalesced_": "all_reduce",
    "allgather_": "all_gather", "_allgather_base_": "all_gather",
    "allgather_coalesced_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all",
    "all_to_all_single": "all_to_all",
    "broadcast_": "broadcast", "broadcast": "broadcast",
    "reduce_": "reduce", "gather_": "gather", "scatter_": "scatter",
    "send": "send", "recv_": "recv", "recv_any_source_": "recv",
    "barrier": "barrier", "monitored_barrier_": "barrier",
}
NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
WAIT_OPS = ("wait_tensor",)  # a functional collective's wait, itself a dispatcher op
# The ops that count as computation on the timeline: what a technique overlaps its
# communication with (matmuls, attention kernels, the additions of a ring reduction).
COMPUTE_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_attention_math", "_flash_attention_forward", "_efficient_attention_forward",
    "add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "exp", "exp_", "addcmul_", "addcdiv_",
    "_softmax", "_log_softmax", "logsumexp", "sum", "mean", "maximum", "where", "gelu", "tanh",
})


def wire_bytes(kind: str, size: int, world: int) -> float:
    """Bytes one rank sends for an op on a buffer of ``size`` bytes among ``world`` ranks,
    with a bandwidth-optimal algorithm (ring): the formulas of chapter 00."""
    if kind == "send":
        return float(size)
    if kind in ("recv", "barrier") or world <= 1:
        return 0.0
    share = (world - 1) / world * size
    if kind == "all_reduce":
        return 2 * share  # reduce-scatter, then all-gather
    if kind in ("broadcast", "reduce"):
        return float(size)  # pipelined: every byte crosses each rank's link once
    return share  # all_gather, reduce_scatter, all_to_all, gather, scatter


@dataclass
class CommEvent:
    kind: str           # "all_reduce", "send", ... (see OP_KINDS)
    op: str             # the dispatcher op, e.g. "c10d.allreduce_.default"
    bytes: int          # logical buffer size S (see module docstring)
    wire_bytes: float   # bytes this rank sends for it under the ring algorithm
    group_size: int
    dtype: torch.dtype | None
    time: float         # time.perf_counter() when the op was issued
    in_backward: bool   # issued while autograd's backward pass was running
    group: tuple[int, ...] = ()   # the global ranks of the group it ran on
    peer: int | None = None       # send/recv: the other rank (global)


@dataclass(frozen=True)
class Step:
    """One entry of ``CommTracer.timeline``: a comm op posted, waited on, or a compute op."""
    what: str              # "post", "wait" or "compute"
    op: str                # the dispatcher op's name (for compute: e.g. "mm")
    time: float
    event: int | None = None   # post/wait: the index of the comm event in ``events``


class Op(tuple):
    """One expected communication op: ``Op(kind, bytes, group=None, peer=None)``.

    ``group``: the global ranks of its group (None: every rank); ``peer``: the other rank of
    a send or receive (global). A send or receive is identified by its peer alone: the same
    message may go over the world group or a subgroup that holds both ranks.
    ``assert_ops`` compares a trace with a list of these."""

    def __new__(cls, kind: str, bytes: int, group=None, peer: int | None = None):
        if kind in ("send", "recv"):
            group = ()
        group = tuple(group) if group is not None else tuple(range(dist.get_world_size()))
        return super().__new__(cls, (kind, int(bytes), group, peer))

    def __repr__(self) -> str:
        kind, size, group, peer = self
        where = f"{'to' if kind == 'send' else 'from'} rank {peer}" if peer is not None else f"over ranks {group}"
        return f"{kind} of {size} B {where}"


class CommTracer(TorchDispatchMode):
    """Context manager recording this rank's communication ops (see module docstring).

    It routes every tensor op through Python while active, so do not time code under it.
    """

    def __init__(self):
        super().__init__()
        self.events: list[CommEvent] = []
        self.timeline: list[Step] = []
        self._work_events: dict[int, tuple[object, int]] = {}   # id(Work) -> (Work, event)
        self._tensor_events: dict[int, tuple[object, int]] = {}  # functional outputs likewise

    def __enter__(self):
        _ACTIVE.append(self)
        _patch_work_wait()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _ACTIVE.remove(self)
            if not _ACTIVE:
                _unpatch_work_wait()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(_is_dtensor_type(t) for t in types):
            # Let DTensor run first: the collectives it issues to carry out the op then come
            # back through this mode (the way torch's CommDebugMode sees them).
            return NotImplemented
        kwargs = kwargs or {}
        comm = func.namespace in NAMESPACES
        kind = OP_KINDS.get(func._opname) if comm else None
        if comm and func._opname in WAIT_OPS and args:
            self._waited(self._tensor_events.get(_storage_key(args[0])))
        issued = time.perf_counter()
        out = func(*args, **kwargs)
        if kind is not None:
            self.events.append(self._event(kind, func, args, kwargs, out, issued))
            self._remember_handles(out, len(self.events) - 1)
            self.timeline.append(Step("post", kind, issued, len(self.events) - 1))
        elif func.namespace == "aten" and func._opname in COMPUTE_OPS:
            self.timeline.append(Step("compute", func._opname, issued))
        return out

    def _remember_handles(self, out, index: int) -> None:
        """Keep the Work (c10d) or output tensors (functional) of event ``index``, so that
        their wait can be put on the timeline. Holding them keeps their ids unique."""
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.ScriptObject):
                try:
                    work = dist.distributed_c10d.Work.unbox(leaf)
                except RuntimeError:
                    continue
                self._work_events[id(work)] = (work, index)
            elif isinstance(leaf, torch.Tensor):
                self._tensor_events[_storage_key(leaf)] = (leaf, index)

    def _waited(self, entry) -> None:
        if entry is not None:
            self.timeline.append(Step("wait", self.events[entry[1]].kind, time.perf_counter(), entry[1]))

    def _event(self, kind, func, args, kwargs, out, issued) -> CommEvent:
        named = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
        size = 0 if kind == "barrier" else max(
            [_tensor_bytes(a) for a in named.values()] + [_tensor_bytes(out)])
        if func.namespace != "c10d" and kind == "all_gather":  # output not an argument
            size = max(size, _tensor_bytes(named.get("input", named.get("inputs"))) * _group_size(named))
        dtypes = [t.dtype for t in tree_leaves(list(named.values())) if isinstance(t, torch.Tensor)]
        world = _group_size(named)
        group = _group_ranks(named)
        peer = None
        if kind in ("send", "recv"):
            local = named.get("dstRank", named.get("dst", named.get("srcRank", named.get("src"))))
            if isinstance(local, int) and local >= 0:
                peer = group[local] if local < len(group) else local
        return CommEvent(kind, str(func), size, wire_bytes(kind, size, world), world,
                         dtypes[0] if dtypes else None, issued,
                         torch._C._current_graph_task_id() != -1, group, peer)

    def ops(self, events=None) -> list[Op]:
        """The trace as ``Op`` tuples (kind, bytes, group, peer), in the order issued."""
        return [Op(e.kind, e.bytes, e.group, e.peer) for e in (self.events if events is None else events)]

    def summary(self) -> dict[str, dict[str, float]]:
        """Per kind of op: number of calls, logical bytes, and ring wire bytes sent."""
        table: dict[str, dict[str, float]] = defaultdict(lambda: dict(calls=0, bytes=0, wire_bytes=0.0))
        for e in self.events:
            row = table[e.kind]
            row["calls"] += 1
            row["bytes"] += e.bytes
            row["wire_bytes"] += e.wire_bytes
        return dict(table)

    def count(self, kind: str) -> int:
        return sum(e.kind == kind for e in self.events)

    def kinds(self) -> set[str]:
        return {e.kind for e in self.events}

    def sent_bytes(self) -> float:
        """Total bytes this rank put on the wire (ring model for collectives)."""
        return sum(e.wire_bytes for e in self.events)

    def format(self) -> str:
        lines = [f"{'op':<16}{'calls':>7}{'bytes':>14}{'wire bytes':>14}"]
        for kind, row in sorted(self.summary().items()):
            lines.append(f"{kind:<16}{row['calls']:>7}{row['bytes']:>14,}{row['wire_bytes']:>14,.0f}")
        return "\n".join(lines)


# ----------------------------------------------------------------------------- waits

_ACTIVE: list[CommTracer] = []
_ORIGINAL_WAIT = None
_ORIGINAL_FUTURE = {}  # "then" / "add_done_callback" -> torch._C.Future's own method


def _under_tracers(callback):
    """``callback`` made to run under the tracers active now, on whatever thread runs it (a
    tracer that has exited by then is skipped; one already on that thread's stack is not
    entered twice)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode
    tracers = list(_ACTIVE)

    def run(future):
        stack = _get_current_dispatch_mode_stack()
        pushed = [t for t in tracers if t in _ACTIVE and all(t is not m for m in stack)]
        for tracer in pushed:
            _push_mode(tracer)
        try:
            return callback(future)
        finally:
            for _ in pushed:
                _pop_mode()
    return run


def _patch_work_wait() -> None:
    """Route ``Work.wait()`` through the active tracers while one is active: a wait is no
    dispatcher op, but overlap is judged by when it happens. Callbacks chained on futures
    meanwhile run under the active tracers (see the module docstring)."""
    global _ORIGINAL_WAIT
    if _ORIGINAL_WAIT is not None:
        return
    work_class = dist.distributed_c10d.Work
    _ORIGINAL_WAIT = work_class.wait

    def wait(self, *args, **kwargs):
        for tracer in _ACTIVE:
            tracer._waited(tracer._work_events.get(id(self)))
        return _ORIGINAL_WAIT(self, *args, **kwargs)

    work_class.wait = wait
    for name in ("then", "add_done_callback"):
        original = _ORIGINAL_FUTURE[name] = getattr(torch._C.Future, name)

        def chained(self, callback, _original=original):
            return _original(self, _under_tracers(callback))

        setattr(torch._C.Future, name, chained)


def _unpatch_work_wait() -> None:
    global _ORIGINAL_WAIT
    if _ORIGINAL_WAIT is not None:
        dist.distributed_c10d.Work.wait = _ORIGINAL_WAIT
        _ORIGINAL_WAIT = None
    for name, original in _ORIGINAL_FUTURE.items():
        setattr(torch._C.Future, name, original)
    _ORIGINAL_FUTURE.clear()


# ----------------------------------------------------------------------------- grading checks


def describe(counts: Counter) -> str:
    return "; ".join(f"{n} x {op!r}" for op, n in sorted(counts.items(), key=lambda kv: repr(kv[0])))


def assert_ops(traced, expected, what: str) -> None:
    """The whole traced communication equals ``expected`` (a list of ``Op``), as a multiset:
    every kind with its count, group, peer and bytes, and nothing else. ``traced``: a
    ``CommTracer`` or a list of its events. The message names what was extra or missing."""
    events = traced.events if isinstance(traced, CommTracer) else list(traced)
    got = Counter(Op(e.kind, e.bytes, e.group, e.peer) for e in events)
    want = Counter(expected)
    if got == want:
        return
    extra, missing = got - want, want - got
    lines = [f"{what}: the traced communication is not the technique's"]
    if extra:
        lines.append(f"  extra:   {describe(extra)}")
    if missing:
        lines.append(f"  missing: {describe(missing)}")
    lines.append(f"  ({sum(got.values())} ops traced, {sum(want.values())} expected)")
    raise AssertionError("\n".join(lines))


def assert_overlap(tracer: CommTracer, what: str, kinds=("send", "recv"), events=None,
                   exempt_last: int = 0) -> None:
    """Every posted op of ``kinds`` (or the given event indices), except the last
    ``exempt_last``, had computation running while it was in flight: at least one compute
    op on the timeline between its post and its wait. An op waited on at once (a blocking
    send, or ``wait()`` straight after posting) fails, and so does one never waited on."""
    chosen = events if events is not None else [i for i, e in enumerate(tracer.events) if e.kind in kinds]
    chosen = chosen[:len(chosen) - exempt_last] if exempt_last else chosen
    posted, waited, computed = {}, {}, []
    for position, step in enumerate(tracer.timeline):
        if step.what == "post":
            posted[step.event] = position
        elif step.what == "wait":
            waited.setdefault(step.event, position)
        else:
            computed.append(position)
    for n, index in enumerate(chosen):
        event = tracer.events[index]
        label = f"{event.kind} #{n + 1} of {len(chosen)} ({event.bytes} B" + (
            f", {'to' if event.kind == 'send' else 'from'} rank {event.peer})" if event.peer is not None else ")")
        if index not in waited:
            raise AssertionError(f"{what}: the {label} was never waited on: wait for each one "
                                 "before its buffer is used or reused")
        start, end = posted[index], waited[index]
        if not any(start < c < end for c in computed):
            raise AssertionError(
                f"{what}: the {label} was waited on before any computation ran while it was in "
                f"flight: post it, compute on what you already have, then wait (no overlap)")


def _storage_key(tensor) -> int:
    """Functional collectives wait on a tensor sharing the output's storage, not on the
    output object itself."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return id(tensor)


def _group_ranks(named: dict) -> tuple[int, ...]:
    group = _process_group(named)
    if group is None:
        return tuple(range(dist.get_world_size()))
    try:
        return tuple(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError, KeyError):
        return tuple(range(group.size()))


def _process_group(named: dict):
    for value in named.values():
        if isinstance(value, dist.ProcessGroup):
            return value
        if isinstance(value, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(value)
            except RuntimeError:
                continue
    if isinstance(named.get("group_name"), str):
        return dist.distributed_c10d._resolve_process_group(named["group_name"])
    return None


def _is_dtensor_type(cls) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(cls, type) and issubclass(cls, DTensor)


def _tensor_bytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def _group_size(named: dict) -> int:
    for value in named.values():
        if isinstance(value, dist.ProcessGroup):
            return value.size()
        if isinstance(value, torch.ScriptObject):  # how c10d ops receive their group
            try:
                return dist.ProcessGroup.unbox(value).size()
            except RuntimeError:
                continue  # another TorchBind object, e.g. the ReduceOp
    if isinstance(named.get("group_size"), int):
        return named["group_size"]
    if isinstance(named.get("group_name"), str):
        return dist.distributed_c10d._resolve_process_group(named["group_name"]).size()
    return dist.get_world_size()


# ----------------------------------------------------------------------------- cost model


def fit_alpha_beta(sizes_bytes, seconds) -> tuple[float, float]:
    """Fit t = alpha + beta * bytes: latency (s) and inverse bandwidth (s/B).

    Whatever (bytes, seconds) pairs you pass is what gets fitted. To get the *per-message*
    alpha and beta that ``ring_all_reduce_time`` takes from whole all-reduce timings, pass
    the message size S/N and the time per step t / (2(N-1)).

    Sizes span decades, so an ordinary least-squares fit would be all about the largest
    messages and leave alpha to noise; we minimise the *relative* error instead (each row
    weighted by 1/t), so small and large messages count alike.
    """
    sizes = torch.as_tensor(sizes_bytes, dtype=torch.float64)
    times = torch.as_tensor(seconds, dtype=torch.float64)
    weight = 1.0 / times
    design = torch.stack([torch.ones_like(sizes), sizes], dim=1) * weight.unsqueeze(1)
    alpha, beta = torch.linalg.lstsq(design, (times * weight).unsqueeze(1)).solution.squeeze(1).tolist()
    return alpha, beta


def ring_all_reduce_time(size_bytes: float, world: int, alpha: float, beta: float) -> float:
    """alpha-beta model of a ring all-reduce: 2(N-1) steps, each moving S/N bytes.

    ``alpha`` and ``beta`` are per message (one send of one step), not per all-reduce.
    """
    if world <= 1:
        return 0.0
    steps = 2 * (world - 1)
    return steps * alpha + steps * (size_bytes / world) * beta


class ConfinedTracer(CommTracer):
    """A ``CommTracer`` that fails at once when an op leaves ``members`` (global ranks): a
    send or receive whose peer is outside, or a collective over a group with a rank outside.

    Graded tests of a function that takes a group run it under this on a subgroup: a wrong
    implementation (the group ignored, the group's rank taken for a global rank) then fails
    with the op named, at the moment it is posted, instead of hanging on a rank that never
    answers."""

    def __init__(self, members, what: str):
        super().__init__()
        self.members = tuple(members)
        self.what = what

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = len(self.events)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for event in self.events[before:]:
            outside = ({event.peer} if event.peer is not None else set(event.group)) - set(self.members)
            if outside:
                where = (f"{'to' if event.kind == 'send' else 'from'} rank {event.peer}" if event.peer is not None
                         else f"over ranks {list(event.group)}")
                raise AssertionError(
                    f"{self.what}: a {event.kind} {where} leaves the group {list(self.members)} (global "
                    f"ranks): use the group's ranks and size (dist.get_rank(group), dist.get_world_size(group)) "
                    f"and translate a group rank to a global one with dist.get_global_rank(group, r)")
        return out
