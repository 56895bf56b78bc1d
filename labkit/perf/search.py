"""perf.search: every layout of a cluster (tp, cp, pp, dp, ep, ZeRO, micro-batch, schedule,
recomputation) and its predicted step time, best first (the overview: ``labkit/perf/__init__.py``).
"""

from __future__ import annotations

from labkit.hardware import Cluster
from labkit.perf.flops import RECOMPUTE, Model
from labkit.perf.step import SEARCHED, Layout, StepTime, step_time

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(model: Model, gpus: int, global_batch: int, *, zero=(0, 1, 2, 3),
                      microbatch=(1, 2, 4, 8), schedules=SEARCHED, virtual=(2, 4),
                      recompute=RECOMPUTE, max_tp: int | None = None, max_cp: int | None = 1,
                      max_ep: int | None = None, uneven: bool = False, flash=(False,), grad_bytes: int = 2,
                      tp_overlap: bool = False, tp_regather: bool = True):
    """Every layout the search considers, in a fixed order: tp, cp, pp, ep over the divisors
    that split the GPUs, heads, sequence, layers and experts (tp <= max_tp, cp <= max_cp, ep <=
    max_ep when given), dp the rest, dividing the batch; each ZeRO stage of ``zero`` (only the
    first when dp x cp = 1: nothing to shard), each micro-batch size of ``microbatch`` that
    divides a replica's batch; with pp = 1 only "1f1b" (a pipeline schedule without a
    pipeline), else each of ``schedules`` (by default ``SEARCHED``, the schedules the published
    runs ran; any of ``SCHEDULES``), "interleaved" with each v of ``virtual`` that divides
    the layers and whose m is a multiple of pp, "dualpipe" where pp and m are even; each
    recomputation mode. ``uneven``: pp and v
    need not divide the layers (a layer or more per chunk), and such layouts get uneven=True.
    ``flash``: the attention kernels tried (innermost loop; default plain attention only);
    ``grad_bytes``, ``tp_overlap``, ``tp_regather``: what every layout gets (the stack's gradient
    precision, whether it overlaps TP communication, whether it re-gathers TP inputs in backward).
    Layouts that ``step_time`` refuses are not generated."""
    # BEGIN SOLUTION perf.search: nested loops over tp | gpus, cp | rest, pp | rest, dp = rest, ep | dp; zero, microbatch, schedule (+virtual), recompute; skip what step_time would refuse
    for tp in _divisors(gpus):
        if model.heads % tp or (max_tp is not None and tp > max_tp):
            continue
        for cp in _divisors(gpus // tp):
            if model.seq % cp or (max_cp is not None and cp > max_cp):
                continue
            for pp in _divisors(gpus // (tp * cp)):
                dp = gpus // (tp * cp * pp)
                if (model.layers % pp and not uneven) or model.layers < pp or global_batch % dp:
                    continue
                eps = [e for e in _divisors(dp) if model.experts and model.experts % e == 0
                       and (max_ep is None or e <= max_ep)] or [1]
                for ep in eps:
                    for z in (zero if dp * cp > 1 else zero[:1]):
                        for b in microbatch:
                            if global_batch % (dp * b):
                                continue
                            m = global_batch // (dp * b)
                            plans = [("1f1b", 1)] if pp == 1 else [
                                (s, v) for s in schedules for v in ((1,) if s != "interleaved" else virtual)
                                if (s != "interleaved" or (m % pp == 0 and model.layers >= pp * v
                                                           and (uneven or model.layers % (pp * v) == 0)))
                                and (s != "dualpipe" or (pp % 2 == 0 and m % 2 == 0))]
                            for schedule, v in plans:
                                for r in recompute:
                                    for fused in flash:
                                        yield Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=z, microbatch=b,
                                                     schedule=schedule, virtual=v, recompute=r,
                                                     uneven=model.layers % (pp * v) != 0, flash=fused,
                                                     grad_bytes=grad_bytes, tp_overlap=tp_overlap,
                                                     tp_regather=tp_regather)
    # END SOLUTION


def search_layouts(model: Model, cluster: Cluster, gpus: int, global_batch: int, top: int = 5,
                   **limits) -> list[tuple[Layout, StepTime]]:
    """The ``top`` fastest layouts of ``candidate_layouts(model, gpus, global_batch, **limits)``
    that fit in the GPUs' memory, as (layout, step_time(...)), fastest first; ties broken by
    less memory, then by ``Layout.key``. Fewer when fewer fit."""
    # BEGIN SOLUTION perf.search: step_time of every candidate; keep those that fit; sort by (total, memory, layout.key()); the first `top`
    if top < 1:
        raise ValueError(f"perf.search: top must be at least 1, got {top}")
    found = []
    for layout in candidate_layouts(model, gpus, global_batch, **limits):
        result = step_time(model, layout, cluster, global_batch, gpus)
        if result.fits:
            found.append(((result.total, result.memory, layout.key()), layout, result))
    found.sort(key=lambda item: item[0])
    return [(layout, result) for _, layout, result in found[:top]]
    # END SOLUTION
