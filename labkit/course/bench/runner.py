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
SIZES: dict[str, tuple[callable, str]] = {}   # row -> (accepts(world_size), why), for rows that cannot take any N


def row(name: str, sizes=None, because: str = ""):
    """Register a benchmark row under ``name``; ``sizes(n)`` False: the row cannot run on n
    ranks (``because`` says why), and ``run`` skips it with a line instead of launching."""
    def register(fn):
        ROWS[name] = fn
        if sizes is not None:
            SIZES[name] = (sizes, because)
        return fn
    return register


def divides(*numbers: int):
    """``sizes`` for a row whose shapes split evenly over the ranks: n divides every number."""
    return lambda n: n >= 1 and all(number % n == 0 for number in numbers)


def size_problem(name: str, world_size: int | None) -> str | None:
    """Why row ``name`` cannot run on ``world_size`` ranks, or None."""
    if world_size is None:
        return None
    if world_size < 1:
        return "a world size is at least 1"
    accepts, because = SIZES.get(name, (lambda n: True, ""))
    if accepts(world_size):
        return None
    fits = [str(n) for n in range(1, 17) if accepts(n)]
    return f"{because}; it runs on {', '.join(fits) or 'none of 1-16'}"


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


SKIPPED = "skipped"   # the word a skipped row's line carries (``labkit bench`` exits 0 for those)
FAILED = "FAILED"


def check_names(names: list[str]) -> None:
    """ValueError, with a did-you-mean, unless every name is a row."""
    unknown = [name for name in names if name not in ROWS]
    if unknown:
        import difflib
        close = [m for name in unknown for m in difflib.get_close_matches(name, ROWS, n=1)]
        raise ValueError(f"no benchmark row {', '.join(map(repr, unknown))}"
                         + (f"; did you mean {' or '.join(close)}?" if close else "")
                         + " (labkit bench --list lists them)")


def run(names: list[str] | None = None, **options) -> list[BenchRow | str]:
    """Run the named rows (all by default). Every name is checked first. A row that cannot
    take ``world_size`` ranks is skipped with a line saying why, a row whose exercise is a
    stub says so, a row that fails says how; the others run either way."""
    names = names or list(ROWS)
    check_names(names)
    results = []
    for name in names:
        problem = size_problem(name, options.get("world_size"))
        if problem:
            results.append(f"{name}: {SKIPPED} at {options['world_size']} ranks: {problem}")
            continue
        try:
            results.append(ROWS[name](**options))
        except WorkerError as error:
            if error.exc_type == "NotImplementedError":
                results.append(f"{name}: not implemented yet ({error.message})")
            else:
                results.append(f"{name}: {FAILED} on rank {error.rank}: {error.exc_type}: "
                               + (error.message.splitlines() or [""])[0])
    return results


# What a row's extra figures (the indented line under it) mean; ``format_table`` prints the
# meaning of each one that appears, under the table.
EXTRA_MEANINGS = {
    "all_reduces": "all-reduce calls per step (ours)",
    "all_reduces_per_step": "all-reduce calls per step, ours and torch's (one per bucket)",
    "grad_mb": "gradient megabytes per step",
    "phi_bytes": "bytes of the parameters (Phi)",
    "flag_bytes": "bytes of average_gradients' first all-reduce: one float64 per parameter + the weight",
    "largest_shard_bytes": "bytes of the largest shard: the all-gather pads every shard to it",
    "torch_sent": "bytes one rank of the built-in sent, traced",
    "ops": "the collectives one step issued",
    "optimizer_state_bytes_rank0": "optimizer-state bytes rank 0 holds",
    "param_bytes_full": "parameter bytes of the whole model",
    "param_bytes_rank0": "parameter bytes rank 0 holds (ours)",
    "torch_param_bytes_rank0": "parameter bytes rank 0 holds (the built-in)",
    "zigzag_s": "seconds per step with zig-zag rows",
    "contiguous_s": "seconds per step with contiguous rows",
    "zigzag_over_contiguous": "zig-zag time / contiguous time (< 1: zig-zag balances the causal work)",
    "busiest_rank_gflop": "attention GFLOP of the busiest rank, per layout",
    "flop_ratio_predicted": "busiest rank's FLOPs, zig-zag / contiguous: the time ratio it predicts",
    "busiest_rank_cpu_s": "CPU seconds of the busiest rank, per layout",
    "cpu_zigzag_over_contiguous": "busiest rank's CPU seconds, zig-zag / contiguous",
    "balanced_formula": "the bytes the formula gives if the router spread tokens evenly (formula: as routed)",
    "expert_grad_bytes": "bytes of the expert gradients (not all-reduced over the whole world)",
    "builtin_bytes": "bytes one rank of the built-in sent, traced",
    "exposed_wait_s": "seconds spent waiting on communication not hidden behind compute",
    "no_checkpoint_bytes": "activation bytes saved without checkpointing",
    "blocks_formula_none": "the formula's saved bytes for the blocks without checkpointing",
    "peak_step_bytes_ours": "peak bytes of one step, yours",
    "peak_step_bytes_torch": "peak bytes of one step, torch.utils.checkpoint",
    "peak_step_bytes_none": "peak bytes of one step, no checkpointing",
    "alpha_rpc_us": "one-way latency of rpc_sync, microseconds (half a round trip)",
    "alpha_gloo_us": "one-way latency of a gloo send/recv, microseconds",
    "trainer_received_B": "bytes a trainer received per iteration from the RPC server",
    "ch01_trainer_sent_B": "bytes a trainer sent per iteration to chapter 01's server",
    "formula_flops": "FLOPs of one training step by perf.flops_per_token x tokens (the ours column times this formula)",
    "counted_flops": "FLOPs FlopCounterMode counted in a forward and backward of the same step (torch column: that run)",
    "predicted_ms": "the alpha-beta model's milliseconds, from the link classes calibrated on the same bed",
    "measured_over_predicted": "measured median / predicted (1: the model is right)",
    "alpha_us": "fitted latency of one message per link class, microseconds (2-rank all-reduces, chapter 00's fit; "
                "negative across nodes: tc's 64 KiB burst)",
    "beta_ns_per_B": "fitted inverse bandwidth per link class, nanoseconds per byte (2-rank all-reduces)",
}


def format_table(results: list[BenchRow | str]) -> str:
    rows = [r for r in results if not isinstance(r, str)]
    width = max([len("benchmark")] + [len(r.name) for r in rows]) + 2   # long labels keep the columns in line
    header = f"{'benchmark':<{width}}{'ours ms':>10}{'torch ms':>10}{'ratio':>8}{'sent/rank':>14}{'formula':>14}"
    lines = [header, "-" * len(header)]
    seen = []
    for r in results:
        if isinstance(r, str):
            lines.append(r)
            continue
        sent = f"{r.traced_bytes:,.0f}" if r.traced_bytes is not None else "-"
        formula = f"{r.formula_bytes:,.0f}" if r.formula_bytes is not None else "-"
        lines.append(f"{r.name:<{width}}{r.ours_s * 1e3:>10.2f}{r.builtin_s * 1e3:>10.2f}"
                     f"{r.ratio:>8.2f}{sent:>14}{formula:>14}")
        if r.extra:  # row-specific figures, e.g. all-reduce calls per step for both sides
            lines.append("    " + ", ".join(f"{k}={_show(v)}" for k, v in r.extra.items()))
            seen += [k for k in r.extra if k not in seen]
    lines.append("ratio = ours / torch (median of interleaved repetitions; < 1 is faster); "
                 "sent/rank = bytes one rank sent, traced; formula = what the chapter's formula says it sends")
    if seen:
        lines.append("indented lines: the row's own figures:")
        lines += [f"    {k:<{max(map(len, seen))}}  {EXTRA_MEANINGS.get(k, '')}" for k in seen]
    return "\n".join(lines)


def _show(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return f"{value:,}" if isinstance(value, int) else str(value)
