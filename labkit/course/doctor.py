"""``labkit doctor``: what this machine gives the course, the first thing to run on a cluster.

It prints the versions (Python, torch, CUDA, NCCL, gloo), the GPUs CUDA sees, the backend
``labkit.launch`` would pick at each world size, and then measures how long a launch takes
(the first in a process, and later ones), a short all-reduce and a
point-to-point exchange on that backend with their bandwidth, in the units the NCCL tests
use (bus bandwidth = algorithm bandwidth x 2(N-1)/N for an all-reduce). Where something is
missing it says what follows from it (no GPU: the labs run on gloo; fewer GPUs than ranks:
``launch`` falls back to gloo; NCCL absent: ``backend="nccl"`` cannot work).
"""

from __future__ import annotations

import platform
import statistics
import time

import torch
import torch.distributed as dist

from labkit.launch import launch
from labkit.runtime.launcher import resolve_backend

WORLD_SIZES = (1, 2, 4, 8)


def facts() -> dict:
    """Versions, devices and what they imply; no process is started."""
    cuda = torch.cuda.is_available()
    gpus = [dict(index=i, name=torch.cuda.get_device_name(i),
                 memory_gib=torch.cuda.get_device_properties(i).total_memory / 2 ** 30)
            for i in range(torch.cuda.device_count())] if cuda else []
    nccl = None
    if cuda and dist.is_nccl_available():
        version = torch.cuda.nccl.version()
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
                cuda_available=cuda, gpus=gpus, nccl=nccl, nccl_built=dist.is_nccl_available(),
                gloo=dist.is_gloo_available(),
                backends={n: resolve_backend("auto", n) for n in WORLD_SIZES})


def advice(f: dict) -> list[str]:
    notes = []
    if not f["cuda_available"]:
        notes.append("no GPU: every lab runs on gloo over CPU processes (launch picks gloo)")
    elif not f["nccl_built"]:
        notes.append("this torch has no NCCL: GPU labs can only use gloo; install a CUDA build of torch")
    else:
        short = [n for n in WORLD_SIZES if f["backends"][n] != "nccl"]
        if short:
            notes.append(f"{len(f['gpus'])} GPU(s): launch uses NCCL up to {len(f['gpus'])} rank(s) and gloo "
                         f"(CPU) at {', '.join(map(str, short))} ranks; pass backend='nccl' to refuse that")
    if not f["gloo"]:
        notes.append("gloo is missing: the CPU labs cannot run")
    return notes


def _measure(megabytes: float, repeats: int) -> dict:
    """On every rank: timed all-reduces and a ring exchange of ``megabytes``; rank 0's medians."""
    rank, n = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % max(torch.cuda.device_count(), 1)) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    numel = int(megabytes * 2 ** 20) // 4
    data, incoming = torch.ones(numel, device=device), torch.empty(numel, device=device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(step) -> float:
        times = []
        for i in range(repeats + 2):  # two warm-ups
            dist.barrier()
            sync()
            start = time.perf_counter()
            step()
            sync()
            if i >= 2:
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    def exchange():
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, data, (rank + 1) % n),
                                       dist.P2POp(dist.irecv, incoming, (rank - 1) % n)])
        for req in reqs:
            req.wait()

    all_reduce = timed(lambda: dist.all_reduce(data))
    p2p = timed(exchange) if n > 1 else float("nan")
    return dict(backend=dist.get_backend(), device=str(device), bytes=numel * 4, all_reduce_s=all_reduce, p2p_s=p2p)


def _nothing() -> None:
    return None


def launch_times(world_size: int = 2, later: int = 5) -> tuple[float, float]:
    """Seconds for this process's first ``launch`` of a function that does nothing (it starts
    the rank server, which imports torch) and the median of ``later`` ones after it (a fork
    and a process group per rank): the README's figures, as this machine sees them."""
    start = time.perf_counter()
    launch(_nothing, world_size, timeout=300)
    first = time.perf_counter() - start
    times = []
    for _ in range(later):
        start = time.perf_counter()
        launch(_nothing, world_size, timeout=300)
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def measure(world_size: int = 2, megabytes: float = 16, repeats: int = 5) -> dict:
    first, later = launch_times(world_size)
    result = launch(_measure, world_size, megabytes, repeats, timeout=300)[0]
    result.update(first_launch_s=first, later_launch_s=later)
    size, n = result["bytes"], world_size
    algbw = size / result["all_reduce_s"]
    result.update(world_size=n, algbw_gbs=algbw / 1e9, busbw_gbs=algbw * 2 * (n - 1) / n / 1e9,
                  p2p_gbs=size / result["p2p_s"] / 1e9 if n > 1 else float("nan"))
    return result


def report(f: dict, measured: dict | None) -> str:
    lines = [f"python {f['python']}, torch {f['torch']}, CUDA {f['cuda'] or 'none (CPU build)'}, "
             f"NCCL {f['nccl'] or ('built, no GPU' if f['nccl_built'] else 'absent')}, "
             f"gloo {'yes' if f['gloo'] else 'NO'}"]
    if f["gpus"]:
        for g in f["gpus"]:
            lines.append(f"  GPU {g['index']}: {g['name']}, {g['memory_gib']:.0f} GiB")
    else:
        lines.append("  GPUs: none")
    lines.append("backend labkit.launch picks: " + ", ".join(f"{n} rank(s) -> {b}" for n, b in f["backends"].items()))
    lines += [f"note: {note}" for note in advice(f)]
    if measured:
        m = measured
        lines.append(f"measured on {m['world_size']} ranks, {m['backend']} ({m['device']} on rank 0), "
                     f"{m['bytes'] / 2 ** 20:g} MiB, median of the timed repeats:")
        lines.append(f"  all-reduce  {m['all_reduce_s'] * 1e3:9.2f} ms   algbw {m['algbw_gbs']:7.2f} GB/s   "
                     f"busbw {m['busbw_gbs']:7.2f} GB/s (x 2(N-1)/N)")
        if m["world_size"] > 1:
            lines.append(f"  send+recv   {m['p2p_s'] * 1e3:9.2f} ms   {m['p2p_gbs']:7.2f} GB/s per direction (ring exchange)")
        lines.append(f"  launch      {m['first_launch_s']:9.2f} s the first in a process (starts the rank server), "
                     f"{m['later_launch_s']:.2f} s each later one (median of 5, {m['world_size']} ranks)")
    return "\n".join(lines)


def main(world_size: int | None = None, megabytes: float = 16, repeats: int = 5, run: bool = True) -> int:
    f = facts()
    if world_size is None:
        world_size = max(2, min(len(f["gpus"]), 8)) if f["gpus"] else 2
    measured = measure(world_size, megabytes, repeats) if run else None
    print(report(f, measured))
    return 0
