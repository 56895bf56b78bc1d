"""``labkit bench`` rows of chapter 00 (collectives): the course's implementation vs PyTorch's."""

from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.collectives import pipelined_ring_all_reduce
from labkit.course.bench.runner import BenchRow, row
from labkit.launch import launch
from labkit.timing import interleaved_medians


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




def _pipelined_vs_builtin(numel: int, repeats: int) -> dict:
    from labkit.comm import CommTracer
    make_input = lambda: torch.ones(numel)  # noqa: E731
    medians = interleaved_medians({"ours": pipelined_ring_all_reduce, "builtin": dist.all_reduce},
                                  make_input, repeats)
    with CommTracer() as tracer:
        pipelined_ring_all_reduce(make_input())
    return dict(medians, sent=sum(e.bytes for e in tracer.events if e.kind == "send"))


@row("ring_all_reduce_pipelined")
def pipelined_ring_row(repeats: int = 15, world_size: int = 2, megabytes: float = 16) -> BenchRow:
    """a ring all-reduce with segments in flight (lab 00, closing the gap) vs dist.all_reduce"""
    numel = int(megabytes * 2 ** 20) // 4
    result = launch(_pipelined_vs_builtin, world_size, numel, repeats)[0]
    return BenchRow(f"pipelined ring all-reduce vs dist.all_reduce, {megabytes:g} MB fp32, {world_size} ranks",
                    result["ours"], result["builtin"], result["sent"],
                    2 * (world_size - 1) / world_size * numel * 4)


@row("ring_all_reduce")
def ring_all_reduce_row(repeats: int = 15, world_size: int = 2, megabytes: float = 16) -> BenchRow:
    """the learner's ring all-reduce (chapter 00) vs dist.all_reduce, 16 MB"""
    numel = int(megabytes * 2 ** 20) // 4
    result = launch(_ring_vs_builtin, world_size, numel, repeats)[0]
    size = numel * 4
    return BenchRow(f"ring all-reduce vs dist.all_reduce, {megabytes:g} MB fp32, gloo, {world_size} ranks",
                    result["ours"], result["builtin"], result["sent"],
                    2 * (world_size - 1) / world_size * size)
