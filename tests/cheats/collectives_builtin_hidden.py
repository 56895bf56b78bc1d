"""The built-in collectives, reached where the rules scan did not look: a computed attribute
name, distributed_c10d's internals, and a module reached through a course tool's imports;
a forged ring of sends feeds the tracer what it wants to see."""

EXPECT = [24, 29, 34]

import torch
import torch.distributed as dist
import labkit.models

_NAME = "all_" + "reduce"


def _forge_ring(tensor, group) -> None:
    me, n = dist.get_rank(group), dist.get_world_size(group)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor.clone(), (me + 1) % n, group),
                                   dist.P2POp(dist.irecv, tensor.clone(), (me - 1) % n, group)])
    for r in reqs:
        r.wait()


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    _forge_ring(output, group)
    dist.distributed_c10d.reduce_scatter_tensor(output, input, group=group)


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    _forge_ring(input, group)
    labkit.models.torch.distributed.all_gather_into_tensor(output, input, group=group)


def ring_all_reduce(tensor: torch.Tensor, group=None) -> None:
    _forge_ring(tensor, group)
    getattr(dist, _NAME)(tensor, group=group)
