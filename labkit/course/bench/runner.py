"""The benchmark runner: rows register here, run in one process each, and print as one table.

Every row times both sides in the same launch, interleaved (A B, then B A, ...), after a
warm-up, and reports medians; the time of one repetition is the slowest rank's. The
ratio is ours / built-in, so below 1 means faster than PyTorch. Next to it, the bytes one
rank sent (traced) and what the formula says it should send.

Chapters add rows in ``labkit/course/bench/chNN_<module>.py`` by decorating a function with
``@row("name")``; it returns a ``BenchRow``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch.distributed as dist

from labkit.launch import WorkerError
from labkit.timing import interleaved_medians


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


def rank_batch(config, batch: int):
    """This rank's ``batch`` sequences of one global batch of Markov tokens (seeded)."""
    from labkit.data import markov_tokens
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = markov_tokens(batch * world, config.block_size, config.vocab_size, seed=0)
    return x[rank * batch:(rank + 1) * batch], y[rank * batch:(rank + 1) * batch]


def race_training_steps(models: dict, optimizers: dict, batch, repeats: int, warmup: int = 3,
                        loss_contexts: dict | None = None):
    """On every rank: a full step (forward, backward, optimizer step) of each model, timed
    interleaved; then one traced step each. ``loss_contexts[name]``: a function returning the
    context its forward and backward run in (torch's TP loss needs ``loss_parallel()``).
    Returns (medians, {name: CommTracer})."""
    from labkit.comm import CommTracer

    contexts = loss_contexts or {}

    def stepper(name):
        def step(b):
            with contexts.get(name, contextlib.nullcontext)():
                models[name](*b)[1].backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
        return step

    steps = {name: stepper(name) for name in models}
    medians = interleaved_medians(steps, lambda: batch, repeats, warmup)
    tracers = {}
    for name, step in steps.items():
        with CommTracer() as tracers[name]:  # after the timing: never time under the tracer
            step(batch)
    return medians, tracers



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
        if r.extra:  # row-specific figures, e.g. all-reduce calls per step for both sides
            lines.append("    " + ", ".join(f"{k}={_show(v)}" for k, v in r.extra.items()))
    lines.append("ratio = ours / torch (median of interleaved repetitions; < 1 is faster); "
                 "sent/rank = bytes one rank sent, traced")
    return "\n".join(lines)


def _show(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return f"{value:,}" if isinstance(value, int) else str(value)
