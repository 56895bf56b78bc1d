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

Drawn configurations (``tests/grading/configs.py``): besides the fixed cases above, every
launch runs K configurations drawn in the test process from the run's seed (a new one each
run, printed in every failure; ``LABKIT_SEED`` replays, ``LABKIT_LONG=1`` draws more): any
dtype gloo reduces (float16/bfloat16/float32/float64, int8/uint8/int32/int64), shapes of 1-3
dimensions including one element and sizes N does not divide, any group of the launch's
layouts (bystanders included), and one after another in the same process, so nothing may be
cached from an earlier call. Reduce-scatter and all-gather are also called IN PLACE, as
``reduce_scatter_tensor``/``all_gather_into_tensor`` allow: the output a view of the input's
own chunk (reduce-scatter), the input a view of the output's own chunk (all-gather); the
all-reduce also gets non-contiguous tensors.
"""

import pytest
import torch
import torch.distributed as dist

from labkit.check import assert_close
from labkit.comm import CommTracer, ConfinedTracer, Op, assert_ops
from labkit.course.grading import run_graded, task
from tests.grading import configs

WORLD_SIZES = [1, 2, 3, 4]
# (dtype, shape of one rank's chunk): odd sizes, floats and integers; every other one is
# passed in place (see reduce_scatter_case and all_gather_case).
CHUNKS = [(torch.float32, (7,)), (torch.float64, (1001,)), (torch.int64, (13,)), (torch.float32, (1,))]
# (dtype, shape) for all-reduce: any size and shape, mostly not divisible by N; the 3-D one
# is passed as a non-contiguous view (see all_reduce_case).
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


DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64,
          torch.int8, torch.uint8, torch.int32, torch.int64]


def draw_shape(rng) -> tuple:
    """1-3 dimensions, sizes 1-9 (one element now and then, a long vector now and then)."""
    kind = rng.random()
    if kind < 0.15:
        return (1,)
    if kind < 0.3:
        return (rng.randint(100, 3000),)
    return tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 3)))


def draw(task_id: str, n: int) -> list[dict]:
    """K configurations for one launch at world size ``n``, from the run's seed."""
    rng = configs.rng(f"{task_id}:{n}")
    return [dict(dtype=rng.choice(DTYPES), shape=draw_shape(rng), layout=rng.randrange(1 + len(layouts(n))),
                 in_place=rng.random() < 0.5, transposed=rng.random() < 0.3, salt=100 + i,
                 replay=configs.replay(f"{task_id}, world size {n}, drawn case {i}"))
            for i in range(configs.budget(ci=6, long=60))]


def all_groups(n: int) -> list:
    """(group, its global ranks) of this rank for the world and each layout, made once."""
    return list(own_groups(n))


def tracer_for(group, members, what):
    return CommTracer() if group is None else ConfinedTracer(members, what)


def rank_data(rank: int, shape, dtype, salt: int) -> torch.Tensor:
    """Rank ``rank``'s input, reproducible on every rank (so each can build the reference)."""
    gen = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype in (torch.float16, torch.bfloat16):
        # Quarters in [-8, 8]: sums of 4 are exact in 8 bits of mantissa, in any order.
        return (torch.randint(-32, 33, shape, generator=gen) / 4).to(dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    low, high = {torch.int8: (-30, 31), torch.uint8: (0, 60)}.get(dtype, (-1000, 1000))  # no overflow at N = 4
    return torch.randint(low, high, shape, generator=gen, dtype=dtype)


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


def check_refused(task_id, fn, output, input, group, members) -> None:
    """``fn(output, input, group=group)`` with a buffer of N + 1 chunks (N the group's size,
    the world's size when that differs) raises ValueError, before any communication."""
    what = (f"{task_id}: rank {dist.get_rank()} in group {members}, output of {output.numel()} and input of "
            f"{input.numel()} elements (the group has {len(members)} ranks)")
    with CommTracer() as tracer:
        try:
            fn(output, input, group=group)
        except ValueError:
            pass
        else:
            raise AssertionError(f"{what}: accepted; raise ValueError when the sizes do not match the group's size")
    assert not tracer.events, f"{what}: communicated before refusing: {tracer.summary()}"


def reduce_scatter_on_rank(drawn=()) -> None:
    rank = dist.get_rank()
    groups = all_groups(dist.get_world_size())
    cases = [dict(dtype=dtype, shape=chunk, layout=layout, in_place=salt % 2 == 1, salt=salt, replay="")
             for layout in range(len(groups)) for salt, (dtype, chunk) in enumerate(CHUNKS)]
    for case in [*cases, *drawn]:
        group, members = groups[case["layout"]]
        reduce_scatter_case(group, members, case)
    for group, members in groups:
        check_refused("collectives.reduce_scatter", reduce_scatter_fn(), torch.zeros(3),
                      torch.zeros(3 * (len(members) + 1)), group, members)


def reduce_scatter_fn():
    from labkit.collectives import ring_reduce_scatter
    return ring_reduce_scatter


def reduce_scatter_case(group, members, case) -> None:
    rank = dist.get_rank()
    n, me = len(members), members.index(rank)
    dtype, chunk = case["dtype"], tuple(case["shape"])
    whole = (n * chunk[0], *chunk[1:])   # N chunks along the first dimension
    inputs = {r: rank_data(r, whole, dtype, case["salt"]) for r in members}
    expected = sum(inputs.values()).reshape(n, -1)[me].view(chunk)
    builtin = torch.empty(chunk, dtype=dtype)
    dist.reduce_scatter_single(builtin, inputs[rank].clone(), group=group)
    mine = inputs[rank].clone()
    if case["in_place"]:   # the output is this rank's own chunk of the input
        output = mine[me * chunk[0]:(me + 1) * chunk[0]]
    else:
        output = torch.full(chunk, 7, dtype=dtype)
    what = (f"collectives.reduce_scatter: rank {rank} (group rank {me}) in group {members}, {dtype}, "
            f"output shape {chunk}{', in place (output a view of the input)' if case['in_place'] else ''} "
            f"{case['replay']}")
    with tracer_for(group, members, what) as tracer:
        reduce_scatter_fn()(output, mine, group=group)
    assert_close(output, expected, what + " vs the single-process sum (chunk of the group rank)")
    assert_close(output, builtin, what + " vs dist.reduce_scatter_single")
    if not case["in_place"]:
        assert_close(mine, inputs[rank], what + ": the input must not be modified")
    check_traffic(tracer, what, members, rank, builtin.nbytes)


def all_gather_on_rank(drawn=()) -> None:
    from labkit.collectives import ring_all_gather
    groups = all_groups(dist.get_world_size())
    cases = [dict(dtype=dtype, shape=chunk, layout=layout, in_place=salt % 2 == 1, salt=salt, replay="")
             for layout in range(len(groups)) for salt, (dtype, chunk) in enumerate(CHUNKS)]
    for case in [*cases, *drawn]:
        group, members = groups[case["layout"]]
        all_gather_case(group, members, case)
    for group, members in groups:
        check_refused("collectives.all_gather", ring_all_gather, torch.zeros(3 * (len(members) + 1)),
                      torch.zeros(3), group, members)


def all_gather_case(group, members, case) -> None:
    from labkit.collectives import ring_all_gather
    rank = dist.get_rank()
    n, me = len(members), members.index(rank)
    dtype, chunk = case["dtype"], tuple(case["shape"])
    inputs = {r: rank_data(r, chunk, dtype, case["salt"]) for r in members}
    expected = torch.cat([inputs[r] for r in members])
    output = torch.full((n * chunk[0], *chunk[1:]), 7, dtype=dtype)
    if case["in_place"]:   # the input is this rank's own chunk of the output
        mine = output[me * chunk[0]:(me + 1) * chunk[0]]
        mine.copy_(inputs[rank])
    else:
        mine = inputs[rank].clone()
    what = (f"collectives.all_gather: rank {rank} (group rank {me}) in group {members}, {dtype}, "
            f"input shape {chunk}{', in place (input a view of the output)' if case['in_place'] else ''} "
            f"{case['replay']}")
    with tracer_for(group, members, what) as tracer:
        ring_all_gather(output, mine, group=group)
    assert_close(output, expected, what + " vs the inputs concatenated in group rank order")
    if not case["in_place"]:
        assert_close(mine, inputs[rank], what + ": the input must not be modified")
    builtin = torch.empty_like(output)
    dist.all_gather_single(builtin, inputs[rank], group=group)
    assert_close(output, builtin, what + " vs dist.all_gather_single")
    check_traffic(tracer, what, members, rank, inputs[rank].nbytes)


def all_reduce_on_rank(group_ranks=None, drawn=()) -> None:
    """On the world and every layout of ``layouts``, then the drawn cases (or only on
    ``group_ranks``, the others standing by)."""
    rank = dist.get_rank()
    if group_ranks:
        group = dist.new_group(group_ranks)
        if rank in group_ranks:
            for salt, (dtype, shape) in enumerate(TENSORS):
                all_reduce_case(group, group_ranks, dict(dtype=dtype, shape=shape, salt=salt))
        return
    groups = all_groups(dist.get_world_size())
    cases = [dict(dtype=dtype, shape=shape, layout=layout, salt=salt, transposed=len(shape) == 3)
             for layout in range(len(groups)) for salt, (dtype, shape) in enumerate(TENSORS)]
    for case in [*cases, *drawn]:
        all_reduce_case(*groups[case["layout"]], case)


def all_reduce_case(group, members, case) -> None:
    from labkit.collectives import ring_all_reduce
    rank, n = dist.get_rank(), len(members)
    dtype, shape = case["dtype"], tuple(case["shape"])
    transposed = case.get("transposed", False) and len(shape) >= 2
    inputs = {r: rank_data(r, shape, dtype, case["salt"]) for r in members}
    # A transposed view is not contiguous: the ring must still reduce it in place.
    tensor = inputs[rank].clone().transpose(0, 1).contiguous().transpose(0, 1) if transposed else inputs[rank].clone()
    storage = tensor.untyped_storage().data_ptr()
    what = (f"collectives.all_reduce: rank {rank} in group {members}, {dtype}, shape {shape}"
            f"{' (not contiguous)' if transposed else ''} {case.get('replay', '')}")
    with tracer_for(group, members, what) as tracer:
        ring_all_reduce(tensor, group=group)
    assert tensor.untyped_storage().data_ptr() == storage, what + ": the result must be written into the tensor"
    assert_close(tensor, sum(inputs.values()), what + " vs the single-process sum over the group")
    builtin = inputs[rank].clone()
    dist.all_reduce(builtin, group=group)
    assert_close(tensor, builtin, what + " vs dist.all_reduce")
    chunk_bytes = -(-builtin.numel() // n) * builtin.element_size()  # ceil(S/N), padded
    check_traffic(tracer, what, members, rank, chunk_bytes, passes=2)


@task("collectives.reduce_scatter", points=1)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_scatter(world_size):
    run_graded("collectives.reduce_scatter", reduce_scatter_on_rank, world_size,
               draw("collectives.reduce_scatter", world_size))


@task("collectives.all_gather", points=1)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_gather(world_size):
    run_graded("collectives.all_gather", all_gather_on_rank, world_size, draw("collectives.all_gather", world_size))


@task("collectives.all_reduce", points=1)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_reduce(world_size):
    run_graded("collectives.all_reduce", all_reduce_on_rank, world_size, None,
               draw("collectives.all_reduce", world_size))


@task("collectives.all_reduce", points=1)
def test_all_reduce_on_a_subgroup():
    # Ranks 1-3 of 4 form a ring of 3; rank 0 stays out. Later chapters reduce over
    # sub-groups of a device mesh, so group= and its rank numbering must be honoured.
    run_graded("collectives.all_reduce", all_reduce_on_rank, 4, [1, 2, 3])
