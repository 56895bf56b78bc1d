"""Lab 04 as a script: your fully_shard vs torch's fully_shard and a single process, on N ranks.

    torchrun --standalone --nproc-per-node 4 labs/04_fsdp.py
    python labs/04_fsdp.py --world-size 4        # labkit.launch starts the ranks

It shards the lab GPT (``labkit.oracles.FSDP_BENCH_GPT``: 4 blocks and a root unit holding the
tied wte/lm_head) with your ``fully_shard`` (``labkit/fsdp.py``) and with
``torch.distributed.fsdp.fully_shard``; trains both and a single-process model for 5 AdamW
steps in float64 and compares losses and parameters on every rank; traces one step's bytes
against 3(N-1)/N Phi-hat; reports each rank's parameter, gradient and optimizer-state bytes
and the peak during a step; and times a step of both (median of interleaved runs, slowest
rank). Rank 0 prints; the exit status is 1 if a check fails.

The backend follows ``labkit.launch``'s "auto": NCCL with one GPU per rank (the models on
``cuda:LOCAL_RANK``), gloo on CPU otherwise; ``--backend`` overrides it.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from labkit.oracles import FSDP_BENCH_GPT, builtin_fully_shard
from labkit.comm import CommTracer
from labkit.data import markov_tokens
from labkit.course.labscript import lab_arguments, run_lab
from labkit.memory import PeakMemory, memory_report
from labkit.models import GPT, GPTConfig

CONFIG = GPTConfig(**FSDP_BENCH_GPT)
BATCH = 2          # sequences per rank per step
STEPS = 5
TOLERANCE = 1e-9   # float64: what is left after 5 steps is rounding (about 1e-13)


# ----------------------------------------------------------------------------- on every rank


def rank_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_model(kind: str, device, dtype=torch.float32, **options):
    """The lab GPT, sharded per block and at the root: "ours", "torch", or "full" (not sharded)."""
    model = GPT(CONFIG).to(device=device, dtype=dtype)
    if kind == "ours":
        from labkit.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block, **options)
        fully_shard(model, **options)
    elif kind == "torch":
        builtin_fully_shard(model)  # over every rank, on the model's device type
    return model


def batches(device):
    """This rank's slice and the global batch of every step (the same data on every rank)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    x, y = markov_tokens(STEPS * BATCH * n, CONFIG.block_size, CONFIG.vocab_size, seed=0)
    x, y = x.to(device), y.to(device)
    for step in range(STEPS):
        xg, yg = x[step * BATCH * n:(step + 1) * BATCH * n], y[step * BATCH * n:(step + 1) * BATCH * n]
        yield (xg[rank * BATCH:(rank + 1) * BATCH], yg[rank * BATCH:(rank + 1) * BATCH]), (xg, yg)


def train_step(model, opt, batch) -> float:
    loss = model(*batch)[1]
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def check_correctness(device) -> dict:
    from labkit.fsdp import full_state_dict
    models = {kind: make_model(kind, device, torch.float64) for kind in ("ours", "torch", "full")}
    optims = {kind: torch.optim.AdamW(m.parameters(), lr=1e-2) for kind, m in models.items()}
    losses = {kind: [] for kind in models}
    for mine, whole in batches(device):
        for kind, model in models.items():
            losses[kind].append(train_step(model, optims[kind], whole if kind == "full" else mine))
    ref = dict(models["full"].named_parameters())
    ours = full_state_dict(models["ours"])
    theirs = {name: p.full_tensor() for name, p in models["torch"].named_parameters()}
    return dict(losses=losses, gap={name: max((got[k] - p).abs().max().item() for k, p in ref.items())
                                    for name, got in (("ours", ours), ("torch", theirs))})


def trace_and_measure(device) -> dict:
    from labkit.fsdp import step_bytes
    out = {}
    for kind in ("ours", "torch"):
        model = make_model(kind, device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        (mine, _), (second, _) = list(batches(device))[:2]
        train_step(model, opt, mine)           # warm-up: Adam's state exists from here on
        with CommTracer() as tracer:           # never time code under the tracer
            train_step(model, opt, second)
        with PeakMemory(model, opt, device=device) as mem:
            train_step(model, opt, mine)
        report = memory_report(model, opt)
        out[kind] = dict(summary=tracer.summary(), sent=tracer.sent_bytes(), peak=mem.peak_bytes,
                         params=report.params, state=report.optimizer_state,
                         formula=step_bytes(model)["total"] if kind == "ours" else None)
    return out


def time_steps(device, repeats: int) -> dict:
    models = {kind: make_model(kind, device) for kind in ("ours", "torch")}
    optims = {kind: torch.optim.AdamW(m.parameters(), lr=1e-3) for kind, m in models.items()}
    mine = next(batches(device))[0]
    times = {kind: [] for kind in models}
    for rep in range(3 + repeats):  # 3 warm-ups
        for kind in (("ours", "torch") if rep % 2 == 0 else ("torch", "ours")):
            sync(device)
            dist.barrier()
            start = time.perf_counter()
            train_step(models[kind], optims[kind], mine)
            sync(device)
            if rep >= 3:
                times[kind].append(time.perf_counter() - start)
    return times


def main(repeats: int) -> dict:
    device = rank_device()
    result = dict(backend=dist.get_backend(), device=str(device), missing=None)
    try:
        result["correct"] = check_correctness(device)
    except NotImplementedError as exc:  # a stub raises on every rank alike
        result["missing"] = str(exc)
        return result
    result["measured"] = trace_and_measure(device)
    result["times"] = time_steps(device, repeats)
    return result


# ----------------------------------------------------------------------------- report


def report(results: list[dict]) -> bool:
    n = len(results)
    print(f"Lab 04: FSDP on {n} rank(s), backend {results[0]['backend']}, rank 0 on {results[0]['device']}")
    print(f"GPT {FSDP_BENCH_GPT}, {BATCH} sequences per rank per step\n")
    if results[0]["missing"]:
        print(f"not implemented yet: {results[0]['missing']}")
        return False

    print(f"correctness: {STEPS} AdamW steps in float64 vs a single process and torch's fully_shard")
    print(f"  {'rank':>4} {'max |loss yours - fully_shard|':>31} {'max |params yours - single|':>28} "
          f"{'max |params fully_shard - single|':>34}")
    ok = True
    for rank, r in enumerate(results):
        c = r["correct"]
        vs_torch = max(abs(a - b) for a, b in zip(c["losses"]["ours"], c["losses"]["torch"]))
        ok &= max(vs_torch, c["gap"]["ours"]) < TOLERANCE
        print(f"  {rank:>4} {vs_torch:>31.1e} {c['gap']['ours']:>28.1e} {c['gap']['torch']:>34.1e}")
    mean_loss = [statistics.fmean(r["correct"]["losses"]["ours"][s] for r in results) for s in range(STEPS)]
    single = results[0]["correct"]["losses"]["full"]
    gap = max(abs(a - b) for a, b in zip(mean_loss, single))
    ok &= gap < TOLERANCE
    print(f"  mean over ranks of your losses vs the single process, per step: max diff {gap:.1e}")
    print(f"  {'ok' if ok else 'WRONG'} (bound {TOLERANCE:g})\n")
    if not ok:
        print("fix correctness first: the measurements below assume a working fully_shard")
        return False

    m = results[0]["measured"]
    others = sorted(set(m["ours"]["summary"]) - {"all_gather", "reduce_scatter"})
    traffic_ok = abs(m["ours"]["sent"] - m["ours"]["formula"]) < 1e-6 and not others
    print("bytes one rank sent in one step (ring model), against 3(N-1)/N Phi-hat:")
    for kind, name in (("ours", "yours"), ("torch", "fully_shard")):
        calls = ", ".join(f"{row['calls']} {op}" for op, row in sorted(m[kind]["summary"].items()))
        print(f"  {name:<12} {m[kind]['sent']:>12,.0f} B   ({calls})")
    print(f"  {'formula':<12} {m['ours']['formula']:>12,.0f} B   "
          f"{'ok' if traffic_ok else 'MISMATCH'}{'; also issued ' + ', '.join(others) if others else ''}\n")

    mib = 2 ** 20
    print("memory of rank 0 between steps and its peak during one (MB):")
    print(f"  {'':<12} {'params':>8} {'Adam state':>11} {'peak':>8}")
    for kind, name in (("ours", "yours"), ("torch", "fully_shard")):
        print(f"  {name:<12} {m[kind]['params'] / mib:>8.3f} {m[kind]['state'] / mib:>11.3f} {m[kind]['peak'] / mib:>8.3f}")
    full = sum(p.numel() for p in GPT(CONFIG).parameters()) * 4
    print(f"  unsharded parameters: {full / mib:.3f} MB; 1/N of that: {full / n / mib:.3f} MB\n")

    med = {kind: statistics.median(max(reps) for reps in zip(*(r["times"][kind] for r in results)))
           for kind in ("ours", "torch")}
    print(f"time per step (median of interleaved runs, slowest rank): yours {med['ours'] * 1e3:.1f} ms, "
          f"fully_shard {med['torch'] * 1e3:.1f} ms, ratio {med['ours'] / med['torch']:.2f}")
    return traffic_ok


if __name__ == "__main__":
    parser = lab_arguments(__doc__)
    parser.add_argument("--reps", type=int, default=10, help="timed steps per implementation")
    args = parser.parse_args()
    run_lab(main, report, args, args.reps)
