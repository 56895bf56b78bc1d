"""Lab 00 as a script: your ring collectives vs torch.distributed, on N real ranks.

    torchrun --standalone --nproc-per-node 4 labs/00_collectives.py
    python labs/00_collectives.py --world-size 4        # labkit.launch starts the ranks

It runs your ``ring_reduce_scatter``, ``ring_all_gather`` and ``ring_all_reduce`` (from
``labkit/collectives.py``) against ``dist.reduce_scatter_single``, ``dist.all_gather_single``
and ``dist.all_reduce``; counts the bytes ``ring_all_reduce`` sends against 2(N-1)/N * S';
and times it next to ``dist.all_reduce`` (median of interleaved runs, slowest rank).
Rank 0 prints; the exit status is 1 if a check fails.

The backend follows ``labkit.launch``'s "auto": NCCL with one GPU per rank (tensors on
``cuda:LOCAL_RANK``), gloo on CPU otherwise; ``--backend`` overrides it.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from labkit.collectives import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from labkit.comm import CommTracer
from labkit.course.labscript import lab_arguments, run_lab

TOLERANCE = {torch.float32: 1e-5, torch.int64: 0}
ALL_REDUCE_SHAPES = [(1,), (29, 31)]   # 1 and 899 elements: not divisible by 2, 3 or 4
CHUNK_NUMELS = [1, 1001]               # one rank's chunk for reduce-scatter / all-gather
TRACE_NUMEL = 250_001                  # float32: S = 1,000,004 bytes


# ----------------------------------------------------------------------------- on every rank


def rank_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rank_input(shape, dtype, seed, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        x = torch.randn(shape, generator=gen, dtype=dtype)
    else:
        x = torch.randint(-1000, 1000, shape, generator=gen, dtype=dtype)
    return x.to(device)


def run_learner(fn, *args) -> str | None:
    """None if ``fn`` ran; a note if it is still a stub (which raises on every rank alike)."""
    try:
        fn(*args)
        return None
    except NotImplementedError as exc:
        return f"not implemented: {exc}"


def check_correctness(device) -> list[dict]:
    me, n = dist.get_rank(), dist.get_world_size()
    cases = []

    def record(op, dtype, size, missing, mine, ref):
        diff = missing if missing else (mine.double() - ref.double()).abs().max().item()
        cases.append(dict(op=op, dtype=dtype, size=size, diff=diff))

    for dtype in (torch.float32, torch.int64):
        for shape in ALL_REDUCE_SHAPES:
            x = rank_input(shape, dtype, 100 + me, device)
            mine, ref = x.clone(), x.clone()
            missing = run_learner(ring_all_reduce, mine)
            dist.all_reduce(ref)
            record("all_reduce", dtype, str(shape), missing, mine, ref)
        for c in CHUNK_NUMELS:
            x = rank_input((n * c,), dtype, 200 + me, device)
            mine, ref = (torch.empty(c, dtype=dtype, device=device) for _ in range(2))
            missing = run_learner(ring_reduce_scatter, mine, x.clone())
            dist.reduce_scatter_single(ref, x.clone())
            record("reduce_scatter", dtype, f"({n * c},) -> ({c},)", missing, mine, ref)
        for c in CHUNK_NUMELS:
            x = rank_input((c,), dtype, 300 + me, device)
            mine, ref = (torch.empty(n * c, dtype=dtype, device=device) for _ in range(2))
            missing = run_learner(ring_all_gather, mine, x.clone())
            dist.all_gather_single(ref, x.clone())
            record("all_gather", dtype, f"({c},) -> ({n * c},)", missing, mine, ref)
    return cases


def trace_bytes(device) -> dict:
    x = torch.ones(TRACE_NUMEL, device=device)
    with CommTracer() as tracer:   # never time code under the tracer
        ring_all_reduce(x)
    sends = [e for e in tracer.events if e.kind == "send"]
    return dict(sends=len(sends), recvs=tracer.count("recv"), kinds=sorted(tracer.kinds()),
                sent_bytes=sum(e.bytes for e in sends))


def time_sizes(sizes, reps, device) -> dict:
    """Per size: this rank's time of every repetition, ring and built-in interleaved."""
    timings = {}
    for nbytes in sizes:
        x = torch.randn(nbytes // 4, device=device)
        bufs = {"ring": x.clone(), "builtin": x.clone()}
        ring_all_reduce(bufs["ring"])   # warm-up
        dist.all_reduce(bufs["builtin"])
        times = {"ring": [], "builtin": []}
        for rep in range(max(3, reps if nbytes < 2**22 else reps // 3)):
            for name in (("ring", "builtin") if rep % 2 == 0 else ("builtin", "ring")):
                bufs[name].copy_(x)
                sync(device)
                dist.barrier()
                start = time.perf_counter()
                ring_all_reduce(bufs[name]) if name == "ring" else dist.all_reduce(bufs[name])
                sync(device)
                times[name].append(time.perf_counter() - start)
        timings[nbytes] = times
    return timings


def main(sizes, reps) -> dict:
    device = rank_device()
    cases = check_correctness(device)
    bad = any(isinstance(c["diff"], str) or c["diff"] > TOLERANCE[c["dtype"]] for c in cases)
    # Decide together: a rank alone skipping the ring below would leave the others hanging.
    flag = torch.tensor([int(bad)], device=device)
    dist.all_reduce(flag)
    result = dict(backend=dist.get_backend(), device=str(device), cases=cases, trace=None, timing=None)
    if flag.item() == 0:
        result["trace"] = trace_bytes(device)
        result["timing"] = time_sizes(sizes, reps, device)
    return result


# ----------------------------------------------------------------------------- report


def show_size(nbytes: int) -> str:
    return f"{nbytes // 2**20} MB" if nbytes >= 2**20 else f"{nbytes // 2**10} KB"


def report(results: list[dict], sizes) -> bool:
    n = len(results)
    print(f"Lab 00: ring collectives on {n} rank(s), backend {results[0]['backend']}, "
          f"rank 0 on {results[0]['device']}\n")

    print("correctness: max |yours - torch.distributed| over ranks")
    print(f"  {'op':<15}{'dtype':<9}{'input -> output':<21}{'max diff':>9}  {'worst rank':>10}  verdict")
    failures = 0
    for i, case in enumerate(results[0]["cases"]):
        diffs = [r["cases"][i]["diff"] for r in results]
        missing = next((d for d in diffs if isinstance(d, str)), None)
        dtype = str(case["dtype"]).removeprefix("torch.")
        if missing:
            worst, shown, verdict = "-", "-", missing
        else:
            worst = max(range(n), key=lambda r: diffs[r])
            shown = "0" if diffs[worst] == 0 else f"{diffs[worst]:.1e}"
            verdict = "ok" if diffs[worst] <= TOLERANCE[case["dtype"]] else "WRONG"
        failures += verdict != "ok"
        print(f"  {case['op']:<15}{dtype:<9}{case['size']:<21}{shown:>9}  {worst:>10}  {verdict}")
    total = len(results[0]["cases"])
    print(f"  {total - failures} of {total} cases ok (float32 within {TOLERANCE[torch.float32]:g}, int64 exact)\n")
    if failures:
        print("fix the failing cases first: bytes and timing need a correct ring_all_reduce")
        return False

    itemsize = 4
    chunk = -(-TRACE_NUMEL // n)
    padded = n * chunk * itemsize
    formula = 2 * (n - 1) / n * padded
    print(f"bytes: ring_all_reduce on S = {TRACE_NUMEL * itemsize:,} B (float32), padded to "
          f"S' = N*ceil(S/N) = {padded:,} B; formula 2(N-1)/N*S' = {formula:,.0f} B")
    print(f"  {'rank':>4} {'sends':>6} {'recvs':>6} {'sent bytes':>12} {'sent/formula':>13}  ops issued")
    traffic_ok = True
    for rank, r in enumerate(results):
        t = r["trace"]
        ratio = f"{t['sent_bytes'] / formula:.4f}" if formula else "n/a"
        p2p = set(t["kinds"]) <= {"send", "recv"}
        traffic_ok &= p2p and t["sent_bytes"] <= formula
        print(f"  {rank:>4} {t['sends']:>6} {t['recvs']:>6} {t['sent_bytes']:>12,} {ratio:>13}  "
              f"{', '.join(t['kinds']) or '-'}{'' if p2p else '  <- not only send/recv'}")
    print()

    bus = 2 * (n - 1) / n
    print("time: ring_all_reduce vs dist.all_reduce (float32; median over interleaved repetitions "
          "of the slowest rank)")
    print(f"  {'size':>7} {'ring ms':>10} {'built-in ms':>12} {'ring/built-in':>14} "
          f"{'ring busbw GB/s':>16} {'built-in busbw GB/s':>20}")
    for s in sizes:
        med = {name: statistics.median(max(reps) for reps in zip(*(r["timing"][s][name] for r in results)))
               for name in ("ring", "builtin")}
        bw = {name: (f"{s / t * bus / 1e9:.3f}" if bus else "n/a") for name, t in med.items()}
        print(f"  {show_size(s):>7} {med['ring'] * 1e3:>10.3f} {med['builtin'] * 1e3:>12.3f} "
              f"{med['ring'] / med['builtin']:>14.2f} {bw['ring']:>16} {bw['builtin']:>20}")
    return traffic_ok


if __name__ == "__main__":
    parser = lab_arguments(__doc__)
    parser.add_argument("--max-mb", type=int, default=16,
                        help="timed sizes are 4 KB, 64 KB, 1 MB, 16 MB, 256 MB, ... up to this many MB (default 16)")
    parser.add_argument("--reps", type=int, default=15, help="timed repetitions per size (a third from 4 MB on)")
    args = parser.parse_args()
    sizes = [2**k for k in range(12, 40, 4) if 2**k <= args.max_mb * 2**20]   # 4 KB, 64 KB, 1 MB, 16 MB, ...
    run_lab(main, lambda results: report(results, sizes), args, sizes, args.reps)
