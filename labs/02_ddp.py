"""Lab 02 as a script: your DDP on N real ranks, against one process and DistributedDataParallel.

    torchrun --standalone --nproc-per-node 4 labs/02_ddp.py
    python labs/02_ddp.py --world-size 4        # labkit.launch starts the ranks

On every rank: ``labkit.ddp.DDP`` (bucketed and per-parameter) trains a small float64 GPT
(tied embedding, frozen position embedding) for 5 SGD steps, two micro-batches per step
under ``no_sync()``, next to single-process SGD on the global batch and to
``DistributedDataParallel``; then, on a float32 GPT, one traced backward: the gradient
all-reduces (one per bucket, in bucket order), their bytes against 2(N-1)/N of the
gradients, and how many were started before backward ended (the overlap).
Rank 0 prints; the exit status is 1 if a check fails or a task is not implemented yet.

The backend follows ``labkit.launch``'s "auto": NCCL with one GPU per rank (the model on
``cuda:LOCAL_RANK``), gloo on CPU otherwise.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from labkit.check import mismatch
from labkit.comm import CommTracer
from labkit.course.labscript import lab_arguments, run_lab
from labkit.data import markov_tokens
from labkit.ddp import DDP, assign_buckets
from labkit.models import GPT, GPTConfig
from labkit.oracles import DDP_BENCH_GPT, builtin_ddp

SMALL = GPTConfig(block_size=8, n_embd=16)    # for exactness
BENCH = GPTConfig(**DDP_BENCH_GPT)            # for bytes and overlap
GLOBAL_BATCH, MICRO, STEPS, LR = 96, 2, 5, 0.1  # 2 micro-batches of 48: even over 1-4, 6, 8, 12 and 16 ranks
CAP_MB = 0.05                                 # small buckets: several per backward


def rank_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def small_gpt(device):
    model = GPT(SMALL, seed=0).double().to(device)
    model.wpe.weight.requires_grad_(False)
    return model


def train(wrap, device, rank=0, world=1) -> list[list[torch.Tensor]]:
    """STEPS SGD steps, MICRO micro-batches each (the first ones under no_sync when wrapped)."""
    model = small_gpt(device)
    wrapped = wrap(model) if wrap else model
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = markov_tokens(STEPS * GLOBAL_BATCH, SMALL.block_size, SMALL.vocab_size, seed=1)
    history = []
    for step in range(STEPS):
        micro = GLOBAL_BATCH // MICRO
        for m in range(MICRO):
            rows = slice(step * GLOBAL_BATCH + m * micro, step * GLOBAL_BATCH + (m + 1) * micro)
            xb, yb = (t[rows].chunk(world)[rank].to(device) for t in (x, y))
            last = m == MICRO - 1
            context = wrapped.no_sync() if wrap and not last else torch.enable_grad()
            with context:
                (wrapped(xb, yb)[1] / MICRO).backward()
        optimizer.step()
        optimizer.zero_grad()
        history.append([p.detach().cpu().clone() for p in model.parameters()])
    return history


def check_correctness(device) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    reference = train(None, device)
    candidates = {
        "DDP, buckets": lambda m: DDP(m, bucket_cap_mb=CAP_MB),
        "DDP, per parameter": lambda m: DDP(m, bucket_cap_mb=None),
        "DistributedDataParallel": lambda m: builtin_ddp(m, bucket_cap_mb=CAP_MB),
    }
    verdicts = {}
    for label, wrap in candidates.items():
        try:
            history = train(wrap, device, rank, n)
        except NotImplementedError as exc:
            verdicts[label] = f"not implemented: {exc}"
            continue
        bad = [(step, i, why) for step, (got, want) in enumerate(zip(history, reference))
               for i, (a, b) in enumerate(zip(got, want)) if (why := mismatch(a, b))]
        verdicts[label] = "ok" if not bad else f"WRONG: step {bad[0][0]}, parameter #{bad[0][1]}: {bad[0][2]}"
    return verdicts


def measure(device, batch=4) -> dict | str:
    """One traced backward of the float32 GPT under your bucketed DDP (after a warm-up step)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    model = GPT(BENCH).to(device)
    try:
        ddp = DDP(model, bucket_cap_mb=CAP_MB * 8)
        buckets = assign_buckets([p for p in model.parameters() if p.requires_grad], int(CAP_MB * 8 * 2 ** 20))
        x, y = markov_tokens(batch * n, BENCH.block_size, BENCH.vocab_size, seed=0)
        x, y = x.chunk(n)[rank].to(device), y.chunk(n)[rank].to(device)
        ddp(x, y)[1].backward()
        model.zero_grad()
        with CommTracer() as tracer:
            ddp(x, y)[1].backward()
            ended = len(tracer.timeline)
    except NotImplementedError as exc:
        return f"not implemented: {exc}"
    reduces = [i for i, e in enumerate(tracer.events) if e.kind == "all_reduce"]
    posts = {s.event: k for k, s in enumerate(tracer.timeline) if s.what == "post"}
    last_compute = max((k for k, s in enumerate(tracer.timeline[:ended]) if s.what == "compute"), default=-1)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return dict(all_reduces=len(reduces), buckets=len(buckets), grad_bytes=grad_bytes,
                sent=sum(tracer.events[i].wire_bytes for i in reduces),
                before_end=sum(posts[i] < last_compute for i in reduces))


def main() -> dict:
    device = rank_device()
    return dict(backend=dist.get_backend(), device=str(device), correctness=check_correctness(device),
                traffic=measure(device))


def report(results: list[dict]) -> bool:
    n = len(results)
    print(f"Lab 02: DDP on {n} rank(s), backend {results[0]['backend']}, rank 0 on {results[0]['device']}\n")
    ok = True
    print(f"correctness: {STEPS} SGD steps of {MICRO} micro-batches (no_sync on the first) on a float64 GPT "
          "(tied, frozen) vs one process on the global batch, every rank")
    for label in results[0]["correctness"]:
        verdicts = {r["correctness"][label] for r in results}
        verdict = "ok" if verdicts == {"ok"} else sorted(verdicts - {"ok"})[0]
        ok &= verdict == "ok"
        print(f"  {label:<27}{verdict}")
    print("\none traced backward of a float32 GPT, bucketed DDP")
    print(f"  {'rank':>5}{'all-reduces':>13}{'buckets':>9}{'bytes sent':>14}{'2(N-1)/N G':>14}{'before end':>12}")
    for rank, r in enumerate(results):
        t = r["traffic"]
        if isinstance(t, str):
            print(f"  {rank:>5}  {t}")
            ok = False
            continue
        formula = 2 * (n - 1) / n * t["grad_bytes"]
        print(f"  {rank:>5}{t['all_reduces']:>13}{t['buckets']:>9}{t['sent']:>14,.0f}{formula:>14,.0f}"
              f"{t['before_end']:>12}")
        ok &= t["all_reduces"] == t["buckets"] and abs(t["sent"] - formula) <= 1
        ok &= n == 1 or t["before_end"] >= 1  # at least the first bucket overlapped backward
    return ok


if __name__ == "__main__":
    parser = lab_arguments(__doc__)
    args = parser.parse_args()
    run_lab(main, report, args)
