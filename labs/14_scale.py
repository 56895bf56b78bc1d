"""Lab 14 as a script: your model of a training step (labkit/perf/) against PyTorch's FLOP counter, this CPU and published runs, on N ranks.

    torchrun --standalone --nproc-per-node 2 labs/14_scale.py
    python labs/14_scale.py --world-size 2        # labkit.launch starts the ranks
    python labs/14_scale.py --emulated            # also the runs on emulated nodes (root only)

Chapter 14 is arithmetic more than communication; the ranks share what is measured:

* FLOPs: seven course GPTs (dense tied and untied, sequences shorter than the block, MoE top-1
  and top-2, full recomputation with torch.utils.checkpoint around every block) are dealt round
  robin over the ranks; each rank counts one training step of its share with
  ``torch.utils.flop_counter.FlopCounterMode`` (MATH attention, which the counter sees) and
  compares it with your ``flops_per_token(Model.of_gpt(config, seq), recompute)``: equal, exactly
  (with full recomputation, plus the one matmul per block torch's checkpoint does not rerun).
* A roofline row for this CPU: the ranks take turns (one at a time, between barriers) to time a
  float32 matmul (FLOP/s) and a large copy (bytes/s) on one thread; the best of their figures
  make a ``Hardware`` row, and your ``ridge_point``, ``arithmetic_intensity`` and ``op_time``
  place a large matmul and an element-wise add on its two sides. Times are printed next to your
  prediction but not judged (a shared machine's timings are not a test).
* Published runs (``labkit.course.runs``, arithmetic in this process): your ``step_time``
  predicts every run with one efficiency per software stack, calibrated on one run each (and leave-one-out);
  every prediction is within +-15 % of the published throughput or carries its written reason;
  your ``search_layouts`` ranks each published layout in its top three, or the reason is written.
* ``--emulated``: chapter 14's runs on nodes emulated with network namespaces and tc
  (``labkit.course.emulated.validate``): every measured step within +-25 % of the model calibrated on the
  same bed, and the model picks each experiment's winner. Needs root; otherwise one sentence says why.

Rank 0 prints; the exit status is 1 if a check fails or a task is not implemented yet.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from labkit.check import not_implemented
from labkit.course.labscript import lab_arguments, report_checks, run_lab
from labkit.models import GPT, GPTConfig
from labkit.oracles import builtin_checkpoint

BATCH = 2
# name -> (course GPT, tokens per sequence, recomputation)
CONFIGS = {
    "dense, tied": (GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32), 32, "none"),
    "dense, untied": (GPTConfig(vocab_size=96, block_size=48, n_layer=3, n_head=2, n_embd=48, tie_weights=False), 48, "none"),
    "dense, 20 of 48 positions": (GPTConfig(vocab_size=50, block_size=48, n_layer=2, n_head=3, n_embd=24), 20, "none"),
    "MoE, 4 experts, top-2": (GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32, n_experts=4, moe_k=2), 32, "none"),
    "MoE, 8 experts, top-1": (GPTConfig(vocab_size=40, block_size=16, n_layer=3, n_head=2, n_embd=16, n_experts=8, moe_k=1), 16, "none"),
    "dense, full recomputation": (GPTConfig(vocab_size=64, block_size=32, n_layer=3, n_head=4, n_embd=32), 32, "full"),
    "untied, 12 of 24, full recomputation": (GPTConfig(vocab_size=48, block_size=24, n_layer=2, n_head=2, n_embd=16, tie_weights=False), 12, "full"),
}
MATMUL_N, COPY_ELEMENTS, REPEATS = 384, 1 << 23, 5


# ----------------------------------------------------------------------------- FLOPs


def counted_flops(config: GPTConfig, seq: int, recompute: str) -> float:
    """FlopCounterMode's FLOPs per token of one training step (forward + backward) of the
    course GPT; with ``recompute="full"`` every block runs under torch.utils.checkpoint."""
    from torch.nn.attention import SDPBackend, sdpa_kernel   # here: the enum does not travel to the ranks
    from torch.utils.flop_counter import FlopCounterMode
    torch.manual_seed(0)
    model = GPT(config)
    if recompute == "full":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = builtin_checkpoint(block)
    idx = torch.randint(0, config.vocab_size, (BATCH, seq + 1), generator=torch.Generator().manual_seed(seq))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        loss = model(idx[:, :-1], idx[:, 1:])[1]
        loss.backward()
    return counter.get_total_flops() / (BATCH * seq)


def your_flops(config: GPTConfig, seq: int, recompute: str) -> tuple[float | None, str | None]:
    from labkit import perf
    try:
        return perf.flops_per_token(perf.Model.of_gpt(config, seq), recompute), None
    except NotImplementedError as error:
        return None, not_implemented(error) or str(error)


def early_stop_flops(config: GPTConfig, recompute: str) -> int:
    """FLOPs per token that full recomputation as the papers count it (one more forward of every
    block) runs and torch.utils.checkpoint does not: non-reentrant checkpointing stops
    recomputing as soon as it has every tensor backward needs (its "early stop"), and the last
    matmul of a course block, the MLP's [4h, h] output projection, produces none of them
    (backward needs its input, not its output): 2 x 4h x h FLOPs per token and block."""
    return config.n_layer * 2 * 4 * config.n_embd ** 2 if recompute == "full" else 0


def flops_share(rank: int, world: int) -> dict:
    names = list(CONFIGS)[rank::world]
    out = {}
    for name in names:
        config, seq, recompute = CONFIGS[name]
        yours, missing = your_flops(config, seq, recompute)
        out[name] = dict(counted=counted_flops(config, seq, recompute), yours=yours, missing=missing,
                         early_stop=early_stop_flops(config, recompute))
    return out


# ----------------------------------------------------------------------------- this CPU


def best_time(fn, repeats: int = REPEATS) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return min(samples)   # noise on a shared machine only adds time


def measure_cpu() -> dict:
    """One thread: a float32 matmul's FLOP/s, a copy's bytes/s (read + write), an add's time."""
    a, b = torch.randn(MATMUL_N, MATMUL_N), torch.randn(MATMUL_N, MATMUL_N)
    src, dst = torch.randn(COPY_ELEMENTS), torch.empty(COPY_ELEMENTS)
    x, y, z = torch.randn(COPY_ELEMENTS), torch.randn(COPY_ELEMENTS), torch.empty(COPY_ELEMENTS)
    matmul = best_time(lambda: torch.mm(a, b))
    copy = best_time(lambda: dst.copy_(src))
    add = best_time(lambda: torch.add(x, y, out=z))
    return dict(matmul=matmul, copy=copy, add=add)


def measure_in_turn() -> dict | None:
    """Each rank measures alone while the others wait at a barrier; returns this rank's figures."""
    mine = None
    for turn in range(dist.get_world_size()):
        if turn == dist.get_rank():
            mine = measure_cpu()
        dist.barrier()
    return mine


def main() -> dict:
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    return dict(flops=flops_share(rank, world), cpu=measure_in_turn())


# ----------------------------------------------------------------------------- report


def report_flops(results: list[dict]) -> dict[str, bool]:
    shares = {name: r for result in results for name, r in result["flops"].items()}
    counted = {name: shares[name] for name in CONFIGS if name in shares}   # CONFIGS' order, not the ranks'
    missing = next((r["missing"] for r in counted.values() if r["missing"]), None)
    print(f"1. FLOPs per token of one training step: FlopCounterMode vs your flops_per_token "
          f"({len(counted)} course GPTs over {len(results)} rank(s))")
    print(f"{'config':<38}{'recompute':>10}{'FlopCounterMode':>17}{'+ early stop':>14}{'yours':>12}")
    for name, r in counted.items():
        yours = "-" if r["yours"] is None else f"{r['yours']:,.0f}"
        print(f"{name:<38}{CONFIGS[name][2]:>10}{r['counted']:>17,.0f}{r['early_stop']:>14,}{yours:>12}")
    print("   (+ early stop: the MLP output projection's forward, which torch.utils.checkpoint does not rerun)")
    if missing:
        print(missing)   # "not implemented yet: <task> (hint: ...)" already
        return {"perf.flops: flops_per_token equals FlopCounterMode on every config": False}
    return {"perf.flops: flops_per_token equals FlopCounterMode (+ checkpoint's early stop) on every config, exactly":
            all(r["yours"] == r["counted"] + r["early_stop"] for r in counted.values())}


def cpu_row(results: list[dict]):
    from labkit import perf
    best = {key: min(r["cpu"][key] for r in results) for key in results[0]["cpu"]}
    flops, nbytes = 2 * MATMUL_N ** 3, 2 * 4 * COPY_ELEMENTS
    row = perf.Hardware(name="this CPU, 1 thread (float32)", peak_flops=flops / best["matmul"],
                        memory_bandwidth=nbytes / best["copy"], memory_bytes=0.0,
                        source=f"measured by labs/14_scale.py: {MATMUL_N}^3 matmul, copy of {COPY_ELEMENTS:,} floats")
    return row, best


def report_roofline(results: list[dict]) -> dict[str, bool]:
    from labkit import perf
    row, best = cpu_row(results)
    print(f"\n2. A roofline row for this CPU (best of {len(results)} rank(s), each measuring alone)")
    print(f"   matmul {MATMUL_N}^3: {row.peak_flops / 1e9:.1f} GFLOP/s; copy: {row.memory_bandwidth / 1e9:.1f} GB/s "
          f"(read + write)")
    ops = {  # name -> (FLOPs, bytes, measured seconds)
        f"matmul {MATMUL_N}^3": (2 * MATMUL_N ** 3, 3 * MATMUL_N ** 2 * 4, best["matmul"]),
        f"add of {COPY_ELEMENTS:,} floats": (COPY_ELEMENTS, 3 * COPY_ELEMENTS * 4, best["add"]),
    }
    try:
        ridge = perf.ridge_point(row)
        placed = {name: (perf.arithmetic_intensity(f, b), perf.op_time(f, b, row)) for name, (f, b, _) in ops.items()}
        matmul_model = perf.matmul_time(MATMUL_N, MATMUL_N, MATMUL_N, row, element_bytes=4)
    except NotImplementedError as error:
        print(not_implemented(error) or f"not implemented yet: {error}")
        return {"perf.roofline: the CPU row's ridge point and op times": False}
    print(f"   ridge point {ridge:.1f} FLOP/B")
    print(f"   {'op':<26}{'FLOP/B':>8}{'side':>9}{'your op_time':>14}{'measured':>11}   (times are not judged)")
    for name, (intensity, predicted) in placed.items():
        side = "compute" if intensity >= ridge else "memory"
        print(f"   {name:<26}{intensity:>8.2f}{side:>9}{predicted * 1e6:>11.0f} µs{ops[name][2] * 1e6:>8.0f} µs")
    big, add = placed[f"matmul {MATMUL_N}^3"], placed[f"add of {COPY_ELEMENTS:,} floats"]
    return {"perf.roofline: ridge point = measured FLOP/s / bytes/s; the large matmul above it, the add below":
            math.isclose(ridge, row.peak_flops / row.memory_bandwidth, rel_tol=1e-12)
            and big[0] > ridge > add[0],
            "perf.roofline: op_time of the matmul and matmul_time agree, and equal the measured matmul (it set the row)":
            math.isclose(big[1], matmul_model, rel_tol=1e-12) and math.isclose(big[1], best["matmul"], rel_tol=1e-9)}


def report_published() -> dict[str, bool]:
    from labkit.course import runs
    print(f"\n3. Published runs: your step_time with one efficiency per software stack (perf.calibrate on its "
          f"median run), then held out (leave-one-out); your search_layouts' rank of each published layout")
    try:
        fit = runs.fit_efficiency()
        predictions = runs.evaluate(fit=fit)
        searched = {run.name: (run, runs.search_rank(run, fit[run.stack][0])) for run in runs.RUNS}
        ranks = {name: rank for name, (_, (rank, _)) in searched.items()}
    except NotImplementedError as error:
        print(not_implemented(error) or f"not implemented yet: {error}")
        return {"perf.step / perf.search: the published runs": False}
    for stack, (efficiency, run) in fit.items():
        print(f"   {stack}: matmuls at {efficiency:.1%} of the dense bf16 peak, calibrated on {run}")
    print(runs.table(predictions, ranks))
    held = runs.leave_one_out()
    print("\n   Leave-one-out: each stack calibrated on ONE of its runs, predicting the others:")
    print(runs.loo_table(held))
    print(runs.loo_misses(held))
    unexplained = [h.target.name for h in held if not h.within and runs.explain_pair(h) is None]
    unranked = [name for name, rank in ranks.items() if (rank is None or rank > 3) and not runs.SEARCH_REASONS.get(name)]
    within = sum(p.within for p in predictions if not p.fitted)
    print(f"   {within} of {sum(not p.fitted for p in predictions)} runs not fitted on are within "
          f"+-{runs.TOLERANCE:.0%}; published layout in the search's top 3: "
          f"{sum(r is not None and r <= 3 for r in ranks.values())} of {len(ranks)}")
    print(runs.misses(predictions))
    for name in unexplained:
        print(f"   outside +-{runs.TOLERANCE:.0%} with no reason written: {name}")
    for name, (run, (rank, ranked)) in searched.items():
        if (rank is None or rank > 3) and runs.SEARCH_REASONS.get(name):
            print(f"   {name}: {runs.explain_rank(run, fit[run.stack][0], rank, ranked)}")
    for name in unranked:
        print(f"   published layout ranked {ranks[name]} with no reason written: {name}")
    return {"perf.step: every held-out miss (leave-one-out) explained by a computed mechanism": not unexplained,
            "perf.step: fitted on at most a third of the runs": sum(p.fitted for p in predictions) <= len(predictions) / 3,
            "perf.search: every published layout in the top 3, or the reason written": not unranked}


def report_emulated(wanted: bool) -> dict[str, bool]:
    from labkit.course import emulated as netbed  # validate() and the bed's names
    print("\n4. Emulated nodes")
    if not wanted:
        print("   skipped: run with --emulated (root only; a few minutes)")
        return {}
    why = netbed.unavailable()
    if why:
        print(f"   skipped: {why}")
        return {}
    try:
        result = netbed.validate()
    except (NotImplementedError, netbed.NetbedError) as error:
        # your perf.comm prices the bed; the ranks run your compress.hierarchical (chapter 11): a
        # rank's stub comes back inside the bed's NetbedError
        stub = str(error).partition("raised NotImplementedError: ")[2].splitlines()
        if isinstance(error, netbed.NetbedError) and not stub:
            raise
        print(f"not implemented yet: {stub[0]}" if stub else not_implemented(error) or f"not implemented yet: {error}")
        return {"emulated nodes: your perf.comm and compress.hierarchical on the bed": False}
    print(result.table())
    return {"emulated nodes: every step within +-25 % of the calibrated model, and every winner predicted": result.ok(0.25)}


def make_report(emulated: bool):
    def report(results: list[dict]) -> bool:
        print(f"Lab 14: a step's FLOPs, time and layout on {len(results)} rank(s)\n")
        checks = {**report_flops(results), **report_roofline(results), **report_published(), **report_emulated(emulated)}
        print()
        return report_checks(checks)
    return report


if __name__ == "__main__":
    parser = lab_arguments(__doc__)
    parser.set_defaults(backend="gloo")
    parser.add_argument("--emulated", action="store_true", help="also run the emulated-node experiments (root only)")
    args = parser.parse_args()
    run_lab(main, make_report(args.emulated), args)
