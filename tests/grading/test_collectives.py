"""Graded tests for chapter 00: ring collectives from point-to-point ops.

Each check runs on every rank at world sizes 1-4 and compares the learner's result with a
single-process reference (every rank rebuilds all ranks' inputs from seeds and sums them
itself) and with the torch.distributed built-in. The tracer then checks the technique: the
whole trace is the ring's and nothing else — N-1 sends of one chunk (S/N bytes) to the next
rank of the group and N-1 receives from the previous one per pass (two passes for
all-reduce), global ranks, the group's ring order.

Groups (every function here takes ``group=``), graded inside the same launches as the world:
    ring_reduce_scatter(output, input, group)  world sizes 1-4; at 4 on both axes of a 2x2 grid,
                                               {0,1},{2,3} and {0,2},{1,3}; at 3 on {0,2} with
                                               rank 1 alone in its own group (a bystander: it
                                               sends and receives nothing)
    ring_all_gather(output, input, group)      the same groups
    ring_all_reduce(tensor, group)             the same groups, and {1,2,3} of 4 (own test);
                                               hidden: {0,2} of 3
On a subgroup every op is traced under ``ConfinedTracer``: a send or receive to a rank outside
the group (the world's ring, the group's rank used as a global one) fails when posted, and the
whole trace is the group's ring with peers named by global rank (dist.get_global_rank).
Overlap: none of these tasks claims any (the pipelined ring of lab 00 is given code).
"""

import pytest
import torch
import torch.distributed as dist

from labkit.check import assert_close
from labkit.comm import CommTracer, ConfinedTracer, Op, assert_ops
from labkit.course.grading import run_graded, task

WORLD_SIZES = [1, 2, 3, 4]
# (dtype, shape of one rank's chunk): odd sizes, floats and integers.
CHUNKS = [(torch.float32, (7,)), (torch.float64, (1001,)), (torch.int64, (13,)), (torch.float32, (1,))]
# (dtype, shape) for all-reduce: any size and shape, mostly not divisible by N.
TENSORS = [(torch.float32, (1001,)), (torch.float64, (5, 3)), (torch.int64, (7,)),
           (torch.int32, (1,)), (torch.float32, (4, 4, 4))]


def layouts(n: int) -> list:
    """The groups each launch runs on, after the world: partitions of the world (every rank
    calls new_group for each: it is collective). At 4 a 2x2 grid's two axes; at 3 the pair
    {0,2} beside a bystander alone in {1}. Neither is a prefix of the world, so a group's rank
    taken for a global rank sends to the wrong rank."""
    return {4: [[[0, 1], [2, 3]], [[0, 2], [1, 3]]], 3: [[[0, 2], [1]]]}.get(n, [])


def own_groups(n: int):
    """(group, its global ranks) of this rank: first the world (group=None), then one per layout."""
    yield None, list(range(n))
    rank = dist.get_rank()
    for partition in layouts(n):
        made = [dist.new_group(ranks) for ranks in partition]
        index = next(i for i, ranks in enumerate(partition) if rank in ranks)
        yield made[index], partition[index]


def tracer_for(group, members, what):
    return CommTracer() if group is None else ConfinedTracer(members, what)


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
    rank = dist.get_rank()
    for group, members in own_groups(dist.get_world_size()):
        n, me = len(members), members.index(rank)
        for salt, (dtype, chunk) in enumerate(CHUNKS):
            inputs = {r: rank_data(r, (n * chunk[0],), dtype, salt) for r in members}
            expected = sum(inputs.values()).reshape(n, -1)[me]
            output = torch.full(chunk, 7, dtype=dtype)
            what = (f"collectives.reduce_scatter: rank {rank} (group rank {me}) in group {members}, {dtype}, "
                    f"{chunk[0]} elements per rank")
            with tracer_for(group, members, what) as tracer:
                ring_reduce_scatter(output, inputs[rank].clone(), group=group)
            assert_close(output, expected, what + " vs the single-process sum (chunk of the group rank)")
            builtin = torch.empty(chunk, dtype=dtype)
            dist.reduce_scatter_single(builtin, inputs[rank].clone(), group=group)
            assert_close(output, builtin, what + " vs dist.reduce_scatter_single")
            check_traffic(tracer, what, members, rank, builtin.nbytes)


def all_gather_on_rank() -> None:
    from labkit.collectives import ring_all_gather
    rank = dist.get_rank()
    for group, members in own_groups(dist.get_world_size()):
        n = len(members)
        for salt, (dtype, chunk) in enumerate(CHUNKS):
            inputs = {r: rank_data(r, chunk, dtype, salt) for r in members}
            output = torch.full((n * chunk[0],), 7, dtype=dtype)
            mine = inputs[rank].clone()
            what = (f"collectives.all_gather: rank {rank} (group rank {members.index(rank)}) in group {members}, "
                    f"{dtype}, {chunk[0]} elements per rank")
            with tracer_for(group, members, what) as tracer:
                ring_all_gather(output, mine, group=group)
            assert_close(output, torch.cat([inputs[r] for r in members]),
                         what + " vs the inputs concatenated in group rank order")
            assert_close(mine, inputs[rank], what + ": the input must not be modified")
            builtin = torch.empty_like(output)
            dist.all_gather_single(builtin, inputs[rank], group=group)
            assert_close(output, builtin, what + " vs dist.all_gather_single")
            check_traffic(tracer, what, members, rank, inputs[rank].nbytes)


def all_reduce_on_rank(group_ranks=None) -> None:
    """On the world and every layout of ``layouts`` (or only on ``group_ranks``, the others
    standing by)."""
    rank = dist.get_rank()
    if group_ranks:
        group = dist.new_group(group_ranks)
        if rank in group_ranks:
            all_reduce_in(group, group_ranks)
        return
    for group, members in own_groups(dist.get_world_size()):
        all_reduce_in(group, members)


def all_reduce_in(group, members) -> None:
    from labkit.collectives import ring_all_reduce
    rank, n = dist.get_rank(), len(members)
    for salt, (dtype, shape) in enumerate(TENSORS):
        inputs = {r: rank_data(r, shape, dtype, salt) for r in members}
        tensor = inputs[rank].clone()
        what = f"collectives.all_reduce: rank {rank} in group {members}, {dtype}, shape {shape}"
        with tracer_for(group, members, what) as tracer:
            ring_all_reduce(tensor, group=group)
        assert_close(tensor, sum(inputs.values()), what + " vs the single-process sum over the group")
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
