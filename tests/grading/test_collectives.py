"""Graded tests for chapter 00: ring collectives from point-to-point ops.

Each check runs on every rank at world sizes 1-4 and compares the learner's result with a
single-process reference (every rank rebuilds all ranks' inputs from seeds and sums them
itself) and with the torch.distributed built-in. The tracer then checks the technique: the
whole trace is the ring's and nothing else — N-1 sends of one chunk (S/N bytes) to the next
rank of the group and N-1 receives from the previous one per pass (two passes for
all-reduce), global ranks, the group's ring order.
"""

import pytest
import torch
import torch.distributed as dist

from labkit.check import assert_close
from labkit.comm import CommTracer, Op, assert_ops
from labkit.course.grading import run_graded, task

WORLD_SIZES = [1, 2, 3, 4]
# (dtype, shape of one rank's chunk): odd sizes, floats and integers.
CHUNKS = [(torch.float32, (7,)), (torch.float64, (1001,)), (torch.int64, (13,)), (torch.float32, (1,))]
# (dtype, shape) for all-reduce: any size and shape, mostly not divisible by N.
TENSORS = [(torch.float32, (1001,)), (torch.float64, (5, 3)), (torch.int64, (7,)),
           (torch.int32, (1,)), (torch.float32, (4, 4, 4))]


def rank_data(rank: int, shape, dtype, salt: int) -> torch.Tensor:
    """Rank ``rank``'s input, reproducible on every rank (so each can build the reference)."""
    gen = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=gen, dtype=dtype)


def ring_ops(members: list[int], rank: int, chunk_bytes: int, passes: int) -> list[Op]:
    """The ring's whole trace on ``rank``: per pass, N-1 sends of one chunk to the next
    member and N-1 receives from the previous one (global ranks)."""
    n, me = len(members), members.index(rank)
    nxt, prv = members[(me + 1) % n], members[(me - 1) % n]
    return passes * (n - 1) * [Op("send", chunk_bytes, members, peer=nxt), Op("recv", chunk_bytes, members, peer=prv)]


def check_traffic(tracer: CommTracer, what: str, members: list[int], rank: int, chunk_bytes: int,
                  passes: int = 1) -> None:
    used = tracer.kinds() - {"send", "recv"}
    assert not used, f"{what}: called {sorted(used)}; build it from send/recv only"
    assert_ops(tracer, ring_ops(members, rank, chunk_bytes, passes),
               f"{what} (a ring: {passes} x (N-1) sends of one chunk to the next rank, receives from the previous)")


def reduce_scatter_on_rank() -> None:
    from labkit.collectives import ring_reduce_scatter
    rank, n = dist.get_rank(), dist.get_world_size()
    for salt, (dtype, chunk) in enumerate(CHUNKS):
        inputs = [rank_data(r, (n * chunk[0],), dtype, salt) for r in range(n)]
        expected = sum(inputs).reshape(n, -1)[rank]
        output = torch.full(chunk, 7, dtype=dtype)
        with CommTracer() as tracer:
            ring_reduce_scatter(output, inputs[rank].clone())
        what = f"collectives.reduce_scatter: rank {rank} of {n}, {dtype}, {chunk[0]} elements per rank"
        assert_close(output, expected, what + " vs the single-process sum")
        builtin = torch.empty(chunk, dtype=dtype)
        dist.reduce_scatter_single(builtin, inputs[rank].clone())
        assert_close(output, builtin, what + " vs dist.reduce_scatter_single")
        check_traffic(tracer, what, list(range(n)), rank, builtin.nbytes)


def all_gather_on_rank() -> None:
    from labkit.collectives import ring_all_gather
    rank, n = dist.get_rank(), dist.get_world_size()
    for salt, (dtype, chunk) in enumerate(CHUNKS):
        inputs = [rank_data(r, chunk, dtype, salt) for r in range(n)]
        output = torch.full((n * chunk[0],), 7, dtype=dtype)
        mine = inputs[rank].clone()
        with CommTracer() as tracer:
            ring_all_gather(output, mine)
        what = f"collectives.all_gather: rank {rank} of {n}, {dtype}, {chunk[0]} elements per rank"
        assert_close(output, torch.cat(inputs), what + " vs the concatenated inputs")
        assert_close(mine, inputs[rank], what + ": the input must not be modified")
        builtin = torch.empty_like(output)
        dist.all_gather_single(builtin, inputs[rank])
        assert_close(output, builtin, what + " vs dist.all_gather_single")
        check_traffic(tracer, what, list(range(n)), rank, inputs[rank].nbytes)


def all_reduce_on_rank(group_ranks=None) -> None:
    from labkit.collectives import ring_all_reduce
    rank = dist.get_rank()
    group = dist.new_group(group_ranks) if group_ranks else None
    if group_ranks and rank not in group_ranks:
        return
    members = group_ranks or list(range(dist.get_world_size()))
    n = len(members)
    for salt, (dtype, shape) in enumerate(TENSORS):
        inputs = {r: rank_data(r, shape, dtype, salt) for r in members}
        tensor = inputs[rank].clone()
        with CommTracer() as tracer:
            ring_all_reduce(tensor, group=group)
        what = f"collectives.all_reduce: rank {rank} in a group of {n}, {dtype}, shape {shape}"
        assert_close(tensor, sum(inputs.values()), what + " vs the single-process sum")
        builtin = inputs[rank].clone()
        dist.all_reduce(builtin, group=group)
        assert_close(tensor, builtin, what + " vs dist.all_reduce")
        chunk_bytes = -(-builtin.numel() // n) * builtin.element_size()  # ceil(S/N), padded
        check_traffic(tracer, what, members, rank, chunk_bytes, passes=2)


@task("collectives.reduce_scatter", points=1)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_scatter(world_size):
    run_graded("collectives.reduce_scatter", reduce_scatter_on_rank, world_size)


@task("collectives.all_gather", points=1)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_gather(world_size):
    run_graded("collectives.all_gather", all_gather_on_rank, world_size)


@task("collectives.all_reduce", points=1)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_reduce(world_size):
    run_graded("collectives.all_reduce", all_reduce_on_rank, world_size)


@task("collectives.all_reduce", points=1)
def test_all_reduce_on_a_subgroup():
    # Ranks 1-3 of 4 form a ring of 3; rank 0 stays out. Later chapters reduce over
    # sub-groups of a device mesh, so group= and its rank numbering must be honoured.
    run_graded("collectives.all_reduce", all_reduce_on_rank, 4, [1, 2, 3])
