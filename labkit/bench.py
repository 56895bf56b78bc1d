"""``labkit bench``: each course implementation against the PyTorch built-in, in one run.

Every row times both sides in the same launch, interleaved (A B, then B A, ...), after a
warm-up, and reports medians; the time of one repetition is the slowest rank's. The
ratio is ours / built-in, so below 1 means faster than PyTorch. Next to it, the bytes one
rank sent (traced) and what the formula says it should send.

Chapters add rows by decorating a function with ``@row("name")``; it returns a ``BenchRow``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from labkit.launch import WorkerError, launch


@dataclass
class BenchRow:
    name: str
    ours_s: float
    builtin_s: float
    traced_bytes: float | None = None    # bytes one rank sent in one call/step (traced)
    formula_bytes: float | None = None   # what the cost formula predicts
    extra: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.ours_s / self.builtin_s


ROWS: dict[str, callable] = {}


def row(name: str):
    """Register a benchmark row under ``name``."""
    def register(fn):
        ROWS[name] = fn
        return fn
    return register


def interleaved_medians(candidates: dict, make_input, repeats: int, warmup: int = 2) -> dict[str, float]:
    """On every rank: median seconds of each candidate ``fn(make_input())``, interleaved.

    Call inside a launch. One repetition's time is the slowest rank's (all-reduced MAX).
    """
    names = list(candidates)
    times = {name: [] for name in names}
    for i in range(warmup + repeats):
        order = names if i % 2 == 0 else names[::-1]  # so neither side always goes first
        for name in order:
            x = make_input()
            dist.barrier()
            start = time.perf_counter()
            candidates[name](x)
            elapsed = time.perf_counter() - start
            if i >= warmup:
                times[name].append(elapsed)
    medians = {}
    for name in names:
        slowest = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        medians[name] = statistics.median(slowest.tolist())
    return medians


# ----------------------------------------------------------------------------- rows


def _ring_vs_builtin(numel: int, repeats: int) -> dict:
    from labkit.collectives import ring_all_reduce
    from labkit.comm import CommTracer
    make_input = lambda: torch.ones(numel)  # noqa: E731
    medians = interleaved_medians({"ours": ring_all_reduce, "builtin": dist.all_reduce},
                                  make_input, repeats)
    with CommTracer() as tracer:
        ring_all_reduce(make_input())
    sent = sum(e.bytes for e in tracer.events if e.kind == "send")
    return dict(medians, sent=sent)


@row("ring_all_reduce")
def ring_all_reduce_row(repeats: int = 15, world_size: int = 2, megabytes: float = 16) -> BenchRow:
    numel = int(megabytes * 2 ** 20) // 4
    result = launch(_ring_vs_builtin, world_size, numel, repeats)[0]
    size = numel * 4
    return BenchRow(f"ring all-reduce vs dist.all_reduce, {megabytes:g} MB fp32, gloo, {world_size} ranks",
                    result["ours"], result["builtin"], result["sent"],
                    2 * (world_size - 1) / world_size * size)


# ----------------------------------------------------------------------------- table


def run(names: list[str] | None = None, **options) -> list[BenchRow | str]:
    """Run the named rows (all by default); a row whose exercise is a stub says so."""
    results = []
    for name in names or list(ROWS):
        if name not in ROWS:
            raise ValueError(f"no benchmark row {name!r}; available: {', '.join(ROWS)}")
        try:
            results.append(ROWS[name](**options))
        except WorkerError as error:
            if error.exc_type != "NotImplementedError":
                raise
            results.append(f"{name}: not implemented yet ({error.message})")
    return results


def format_table(results: list[BenchRow | str]) -> str:
    header = f"{'benchmark':<62}{'ours ms':>10}{'torch ms':>10}{'ratio':>8}{'sent/rank':>14}{'formula':>14}"
    lines = [header, "-" * len(header)]
    for r in results:
        if isinstance(r, str):
            lines.append(r)
            continue
        sent = f"{r.traced_bytes:,.0f}" if r.traced_bytes is not None else "-"
        formula = f"{r.formula_bytes:,.0f}" if r.formula_bytes is not None else "-"
        lines.append(f"{r.name:<62}{r.ours_s * 1e3:>10.2f}{r.builtin_s * 1e3:>10.2f}"
                     f"{r.ratio:>8.2f}{sent:>14}{formula:>14}")
    lines.append("ratio = ours / torch (median of interleaved repetitions; < 1 is faster); "
                 "sent/rank = bytes one rank sent, traced")
    return "\n".join(lines)
