"""Emulated nodes (``labkit.runtime.netbed``) and the alpha-beta model calibrated on them.

    results = run_on_nodes(fn, nodes, ranks_per_node, *args, bandwidth="1gbit", latency_us=0)
    links = calibrate(nodes=2, ranks_per_node=2, bandwidth="1gbit")
    links["inside"], links["across"]   # (alpha s, beta s/B) per message, as chapter 00 fits them

``calibrate`` times ping-pongs (a send, then the answer back; half the round trip is one
message; the fastest of a few) between rank 0 and a rank of its own node, then a rank of the
next node, over a few message sizes, and fits t = alpha + beta * bytes with ``labkit.comm.fit_alpha_beta``.

Chapter 14 holds its model to the bed (needs root) in ``labkit.course.emulated``:

    result = emulated.validate()                # one launch, 2 nodes x 2 ranks, 100 Mbit/s between nodes
    print(result.table()); result.ok(0.25)

``validate`` fits alpha-beta per link class from 2-rank all-reduces in the same launch, then
times and predicts (with ``labkit.perf.collective_time``) the hierarchical vs the flat
all-reduce, a 2-stage pipeline vs TP=2 across the nodes, and TP inside x DP across vs DP over
all four ranks; each row has predicted, measured (median step), error, and each pair a
verdict computed from the run. It lives in the course room because it runs the exercises
(chapter 11's hierarchical all-reduce, chapters 05/06's TP and pipeline) on the bed.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from labkit.comm import fit_alpha_beta
from labkit.runtime.netbed import NetbedError, NetbedUnavailable, netem_available, node_address, run_on_nodes, unavailable

__all__ = ["run_on_nodes", "calibrate", "ping_pong", "unavailable", "netem_available", "node_address",
           "NetbedError", "NetbedUnavailable"]

SIZES = (1 << 10, 1 << 14, 1 << 17, 1 << 19, 1 << 21)  # 1 KiB .. 2 MiB


def ping_pong(peer: int, sizes=SIZES, repeats: int = 9) -> dict[int, float]:
    """On rank 0 and ``peer`` (the others return {}): the fastest one-way time of a message of
    each size in bytes (half a round trip), after one warm-up round trip. The fastest, not the
    median: on a shared machine the noise (a rank not scheduled) only ever adds time."""
    rank = dist.get_rank()
    if rank not in (0, peer):
        return {}
    other = peer if rank == 0 else 0
    times = {}
    for size in sizes:
        buf = torch.zeros(size, dtype=torch.uint8)
        samples = []
        for i in range(repeats + 1):
            start = time.perf_counter()
            if rank == 0:
                dist.send(buf, other)
                dist.recv(buf, other)
            else:
                dist.recv(buf, other)
                dist.send(buf, other)
            if i:
                samples.append((time.perf_counter() - start) / 2)
        times[size] = min(samples)
    return times


def _calibrate_rank(ranks_per_node: int, sizes, repeats: int):
    inside = ping_pong(1, sizes, repeats) if ranks_per_node > 1 else {}
    dist.barrier()
    across = ping_pong(ranks_per_node, sizes, repeats)
    return {"inside": inside, "across": across}


def calibrate(nodes: int = 2, ranks_per_node: int = 2, bandwidth: str = "1gbit", latency_us: float = 0,
              sizes=SIZES, repeats: int = 9, timeout: float = 300) -> dict:
    """Per link class ("inside" a node, "across" nodes): ``(alpha, beta)`` fitted from
    ping-pongs on emulated nodes, and the raw ``times`` {class: {bytes: seconds}}."""
    if nodes < 2:
        raise ValueError(f"calibrate: needs at least 2 nodes to time a link across nodes, got {nodes}")
    times = run_on_nodes(_calibrate_rank, nodes, ranks_per_node, ranks_per_node, sizes, repeats,
                         bandwidth=bandwidth, latency_us=latency_us, timeout=timeout)[0]
    fits = {k: fit_alpha_beta(list(v), list(v.values())) for k, v in times.items() if v}
    return dict(fits, times=times)
