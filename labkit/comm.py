"""Communication tracing and the cost formulas it is compared with.

``CommTracer`` records every collective and point-to-point op issued on this rank while it
is active. It sits at the dispatcher: ``dist.all_reduce``, ``ProcessGroup.allreduce``,
``isend``/``irecv``, ``batch_isend_irecv``, functional collectives and DTensor all end in
``c10d::*`` or ``_c10d_functional::*`` ops, so it sees them however they were imported.

    with CommTracer() as tracer:
        dist.all_reduce(t)
    tracer.summary()   # {"all_reduce": {"calls": 1, "bytes": S, "wire_bytes": 2(N-1)/N*S}}

Two byte counts per op:
* ``bytes``: the size S of the logical buffer (the tensor all-reduced, the full gathered
  tensor, the full tensor before reduce-scatter, the message sent or received);
* ``wire_bytes``: what this rank sends under a bandwidth-optimal (ring) algorithm, the
  quantity the cost formulas of the course are written in.
"""

from __future__ import annotations

import time
from collections import defaultdict
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


class CommTracer(TorchDispatchMode):
    """Context manager recording this rank's communication ops (see module docstring).

    It routes every tensor op through Python while active, so do not time code under it.
    """

    def __init__(self):
        super().__init__()
        self.events: list[CommEvent] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(_is_dtensor_type(t) for t in types):
            # Let DTensor run first: the collectives it issues to carry out the op then come
            # back through this mode (the way torch's CommDebugMode sees them).
            return NotImplemented
        kwargs = kwargs or {}
        kind = OP_KINDS.get(func._opname) if func.namespace in NAMESPACES else None
        issued = time.perf_counter()
        out = func(*args, **kwargs)
        if kind is not None:
            self.events.append(self._event(kind, func, args, kwargs, out, issued))
        return out

    def _event(self, kind, func, args, kwargs, out, issued) -> CommEvent:
        named = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
        size = 0 if kind == "barrier" else max(
            [_tensor_bytes(a) for a in named.values()] + [_tensor_bytes(out)])
        if func.namespace != "c10d" and kind == "all_gather":  # output not an argument
            size = max(size, _tensor_bytes(named.get("input", named.get("inputs"))) * _group_size(named))
        dtypes = [t.dtype for t in tree_leaves(list(named.values())) if isinstance(t, torch.Tensor)]
        world = _group_size(named)
        return CommEvent(kind, str(func), size, wire_bytes(kind, size, world), world,
                         dtypes[0] if dtypes else None, issued,
                         torch._C._current_graph_task_id() != -1)

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
