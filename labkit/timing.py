"""Timing distributed code fairly: what the labs and ``labkit bench`` use to compare two
implementations in one run.

``interleaved_medians`` runs every candidate in turn (A B, then B A, ...), after a warm-up,
so that neither always goes first into a cold cache or a busy moment of the machine, and
reports the median over repetitions. One repetition's time is the slowest rank's: a
distributed step is only done when its last rank is. CUDA work is synchronised before the
clock stops, so asynchronous kernels are timed to completion, not to their launch.

``WaitClock`` measures the other half of an overlap: the seconds a rank spent waiting on
collectives (``Work.wait``), the communication the computation did not hide (chapter 11's
collective matmul, lab 11).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist


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
            sync_device()
            dist.barrier()
            start = time.perf_counter()
            candidates[name](x)
            sync_device()  # CUDA work is asynchronous: time its completion, not its launch
            elapsed = time.perf_counter() - start
            if i >= warmup:
                times[name].append(elapsed)
    medians = {}
    for name in names:
        slowest = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        medians[name] = statistics.median(slowest.tolist())
    return medians


def sync_device() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class WaitClock:
    """Exposed communication, measured: the seconds this rank spent inside ``Work.wait()``
    while active (time the computation could not hide). Not for use under a ``CommTracer``."""

    def __enter__(self):
        self.seconds, self._original = 0.0, dist.distributed_c10d.Work.wait
        clock, original = self, self._original

        def wait(work, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(work, *args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - start

        dist.distributed_c10d.Work.wait = wait
        return self

    def __exit__(self, *exc):
        dist.distributed_c10d.Work.wait = self._original
