"""Given code that solves a graded task: the lab's pipelined ring with one segment is the
graded ring all-reduce."""

EXPECT = [11]

import torch
import torch.distributed as dist


def ring_all_reduce(tensor: torch.Tensor, group=None) -> None:
    pipelined_ring_all_reduce(tensor, group, segments=1)


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    raise NotImplementedError("collectives.reduce_scatter: not implemented yet")


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    raise NotImplementedError("collectives.all_gather: not implemented yet")


def pipelined_ring_all_reduce(tensor: torch.Tensor, group=None, segments: int = 4) -> None:
    raise NotImplementedError("the given code, as released")
