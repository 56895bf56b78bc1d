"""Tests for labkit.comm: CommTracer sees every way of communicating, and its byte counts and
cost formulas are the ones of chapter 00.

One ``labkit.launch`` per world size (2 and 3 ranks) runs a fixed script of calls under the
tracer (``_traced_script``) and sends the recorded events back; the parent rebuilds what each
rank should have recorded from first principles (``expected_events``: numel x element size,
the ring formulas) and compares event by event.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import all_reduce as imported_all_reduce  # the by-name import path

import labkit
from labkit.comm import CommTracer, fit_alpha_beta, ring_all_reduce_time, wire_bytes

WORLD_SIZES = (2, 3)
CHUNK = 6  # elements each rank contributes to all_gather_single / receives from reduce_scatter
F32, F64, I32, I64 = torch.float32, torch.float64, torch.int32, torch.int64


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def ring_wire(kind: str, size: float, n: int) -> float:
    """Bytes one rank sends under a bandwidth-optimal algorithm (the chapter 00 formulas)."""
    if kind == "send":
        return size
    if kind in ("recv", "barrier"):
        return 0.0
    if kind == "all_reduce":  # reduce-scatter then all-gather: 2(N-1) steps of S/N
        return 2 * (n - 1) / n * size
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):  # N-1 steps of S/N
        return (n - 1) / n * size
    if kind == "broadcast":  # pipelined: every byte crosses a rank's outgoing link once
        return float(size) if n > 1 else 0.0
    raise AssertionError(f"no formula for {kind}")


# ----------------------------------------------------------------------------- the script
# _traced_script (runs on every rank) and expected_events (runs in the parent) describe the
# same calls in the same order; keep them in step.


def _traced_script(world: int) -> dict:
    rank = dist.get_rank()
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    sub_ranks = list(range(world - 1))  # a subgroup smaller than the world: [0] or [0, 1]
    sub = dist.new_group(sub_ranks)      # every rank must take part in creating it

    param = torch.ones(17, dtype=F64, requires_grad=True)
    param.register_post_accumulate_grad_hook(lambda p: dist.all_reduce(p.grad))  # DDP-style hook

    dist.all_reduce(torch.ones(3))  # before the block: must not be recorded
    values = {}
    tracer = CommTracer()
    t_enter = time.perf_counter()
    with tracer:
        t = torch.ones(10, dtype=F32)
        dist.all_reduce(t)
        values["all_reduce"] = t.tolist()
        junk = (torch.randn(8, 8) @ torch.randn(8, 8)).relu().sum()  # ordinary ops in between
        work = dist.all_reduce(torch.ones(12, dtype=F64), async_op=True)
        work.wait()
        imported_all_reduce(torch.ones(14, dtype=I32))
        dist.group.WORLD.allreduce([torch.ones(16, dtype=F32)]).wait()
        gathered = torch.empty(CHUNK * world, dtype=F32)
        dist.all_gather_single(gathered, torch.full((CHUNK,), float(rank)))
        values["all_gather_single"] = gathered.tolist()
        scattered = torch.empty(CHUNK, dtype=F64)
        dist.reduce_scatter_single(scattered, torch.ones(CHUNK * world, dtype=F64))
        values["reduce_scatter_single"] = scattered.tolist()
        dist.all_gather([torch.empty(5, dtype=I64) for _ in range(world)], torch.full((5,), rank, dtype=I64))
        dist.broadcast(torch.ones(9, dtype=F32), src=0)
        dist.all_to_all_single(torch.empty(4 * world, dtype=F32), torch.ones(4 * world, dtype=F32))
        dist.barrier()
        # blocking point-to-point along the ring 0 -> 1 -> ... -> 0 (rank 0 starts it)
        msg, got = torch.full((5,), float(rank), dtype=F64), torch.empty(5, dtype=F64)
        if rank == 0:
            dist.send(msg, nxt)
            dist.recv(got, prv)
        else:
            dist.recv(got, prv)
            dist.send(msg, nxt)
        values["recv"] = got.tolist()
        reqs = [dist.isend(torch.ones(7, dtype=I32), nxt), dist.irecv(torch.empty(7, dtype=I32), prv)]
        for req in reqs:
            req.wait()
        ops = [dist.P2POp(dist.isend, torch.ones(8, dtype=F32), nxt),
               dist.P2POp(dist.irecv, torch.empty(8, dtype=F32), prv)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        reduced = funcol.wait_tensor(funcol.all_reduce(torch.ones(11, dtype=F32), "sum", dist.group.WORLD))
        values["funcol.all_reduce"] = reduced.tolist()
        funcol.wait_tensor(funcol.all_gather_single(torch.ones(4, dtype=F64), 0, dist.group.WORLD))
        funcol.wait_tensor(funcol.reduce_scatter_single(torch.ones(2 * world, dtype=F32), "sum", 0,
                                                        dist.group.WORLD))
        if rank in sub_ranks:
            dist.all_reduce(torch.ones(13, dtype=F32), group=sub)
            funcol.wait_tensor(funcol.all_reduce(torch.ones(15, dtype=F32), "sum", sub))
        (param * param).sum().backward()  # the hook all-reduces param.grad during backward
        junk = junk + 1
    t_exit = time.perf_counter()
    recorded_in_block = len(tracer.events)
    dist.all_reduce(torch.ones(3))  # after the block: must not be recorded

    with CommTracer() as quiet:  # ordinary tensor ops only
        a = torch.randn(16, 16, requires_grad=True)
        b = (a @ a.T).softmax(-1).sum()
        b.backward()
        torch.cat([a.detach(), a.detach()]).add_(1).mean()

    return dict(
        rank=rank,
        events=[dataclasses.asdict(e) for e in tracer.events],
        recorded_in_block=recorded_in_block,
        summary=tracer.summary(),
        counts={k: tracer.count(k) for k in tracer.kinds()},
        sent_bytes=tracer.sent_bytes(),
        quiet_events=len(quiet.events),
        quiet_summary=quiet.summary(),
        t_enter=t_enter, t_exit=t_exit,
        values=values,
    )


def expected_events(rank: int, world: int) -> list[dict]:
    """What rank ``rank`` must record for ``_traced_script(world)``, from first principles."""
    sub_size = world - 1
    events = []

    def add(label, kind, numel, dtype, group=world, in_backward=False):
        size = numel * element_size(dtype) if dtype is not None else 0
        events.append(dict(label=label, kind=kind, bytes=size, wire_bytes=ring_wire(kind, size, group),
                           group_size=group, dtype=dtype, in_backward=in_backward))

    add("dist.all_reduce", "all_reduce", 10, F32)
    add("dist.all_reduce(async_op=True)", "all_reduce", 12, F64)
    add("all_reduce imported by name", "all_reduce", 14, I32)
    add("ProcessGroup.allreduce", "all_reduce", 16, F32)
    add("dist.all_gather_single", "all_gather", CHUNK * world, F32)        # S = the full output
    add("dist.reduce_scatter_single", "reduce_scatter", CHUNK * world, F64)  # S = the full input
    add("dist.all_gather (list)", "all_gather", 5 * world, I64)
    add("dist.broadcast", "broadcast", 9, F32)
    add("dist.all_to_all_single", "all_to_all", 4 * world, F32)
    add("dist.barrier", "barrier", 0, None)
    if rank == 0:
        add("dist.send", "send", 5, F64)
        add("dist.recv", "recv", 5, F64)
    else:
        add("dist.recv", "recv", 5, F64)
        add("dist.send", "send", 5, F64)
    add("dist.isend", "send", 7, I32)
    add("dist.irecv", "recv", 7, I32)
    add("batch_isend_irecv: isend", "send", 8, F32)
    add("batch_isend_irecv: irecv", "recv", 8, F32)
    add("funcol.all_reduce", "all_reduce", 11, F32)
    add("funcol.all_gather_single", "all_gather", 4 * world, F64)
    add("funcol.reduce_scatter_single", "reduce_scatter", 2 * world, F32)
    if rank < sub_size:
        add("subgroup dist.all_reduce", "all_reduce", 13, F32, group=sub_size)
        add("subgroup funcol.all_reduce", "all_reduce", 15, F32, group=sub_size)
    add("all_reduce in a backward hook", "all_reduce", 17, F64, in_backward=True)
    return events


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"{n}ranks")
def traced(request):
    world = request.param
    results = labkit.launch(_traced_script, world, world, timeout=120)
    assert [r["rank"] for r in results] == list(range(world)), "launch returned results out of rank order"
    return world, results


def per_rank(traced):
    world, results = traced
    for result in results:
        yield world, result["rank"], result, expected_events(result["rank"], world)


def is_subgroup(expected: dict) -> bool:
    return expected["label"].startswith("subgroup")


# ----------------------------------------------------------------------------- tracer, on ranks


def test_every_call_path_is_recorded_once_in_order(traced):
    for world, rank, result, expected in per_rank(traced):
        got = [e["kind"] for e in result["events"]]
        want = [e["kind"] for e in expected]
        labels = [e["label"] for e in expected]
        assert len(got) == len(want), (
            f"{world} ranks, rank {rank}: recorded {len(got)} events, the script issued {len(want)} "
            f"({labels}); recorded kinds: {got}")
        for i, (g, w) in enumerate(zip(got, want)):
            assert g == w, (f"{world} ranks, rank {rank}, call #{i} ({labels[i]}): recorded as {g!r}, "
                            f"want {w!r} (op {result['events'][i]['op']})")


def test_bytes_and_wire_bytes_follow_the_formulas(traced):
    for world, rank, result, expected in per_rank(traced):
        for got, want in zip(result["events"], expected):
            if is_subgroup(want):
                continue  # checked in test_subgroup_collective_uses_the_subgroup_size
            where = f"{world} ranks, rank {rank}, {want['label']} ({got['op']})"
            assert got["bytes"] == want["bytes"], f"{where}: logical bytes {got['bytes']}, want S = {want['bytes']}"
            assert got["wire_bytes"] == pytest.approx(want["wire_bytes"], rel=1e-12, abs=0), (
                f"{where}: wire bytes {got['wire_bytes']}, want {want['wire_bytes']} "
                f"(ring formula for {want['kind']} with S={want['bytes']}, N={want['group_size']})")
            assert got["group_size"] == want["group_size"], f"{where}: group_size {got['group_size']}, want {world}"
            if want["dtype"] is not None:
                assert got["dtype"] == want["dtype"], f"{where}: dtype {got['dtype']}, want {want['dtype']}"


def test_subgroup_collective_uses_the_subgroup_size(traced):
    for world, rank, result, expected in per_rank(traced):
        sub = [(g, w) for g, w in zip(result["events"], expected) if is_subgroup(w)]
        assert len(sub) == (2 if rank < world - 1 else 0), f"rank {rank}: {len(sub)} subgroup events"
        for got, want in sub:
            where = f"{world} ranks, rank {rank}, {want['label']} on new_group({list(range(world - 1))}) ({got['op']})"
            assert got["group_size"] == world - 1, (
                f"{where}: group_size {got['group_size']}, want the subgroup's size {world - 1}")
            assert got["bytes"] == want["bytes"], f"{where}: bytes {got['bytes']}, want {want['bytes']}"
            assert got["wire_bytes"] == pytest.approx(want["wire_bytes"], rel=1e-12, abs=0), (
                f"{where}: wire bytes {got['wire_bytes']}, want 2(n-1)/n*S = {want['wire_bytes']} "
                f"with n={world - 1}, S={want['bytes']}")


def test_in_backward_only_for_the_hook(traced):
    for world, rank, result, expected in per_rank(traced):
        for got, want in zip(result["events"], expected):
            assert got["in_backward"] is want["in_backward"], (
                f"{world} ranks, rank {rank}, {want['label']}: in_backward={got['in_backward']}, "
                f"want {want['in_backward']}")


def test_summary_count_and_sent_bytes_match_the_events(traced):
    for world, rank, result, expected in per_rank(traced):
        want = defaultdict(lambda: dict(calls=0, bytes=0, wire_bytes=0.0))
        for e in expected:
            want[e["kind"]]["calls"] += 1
            want[e["kind"]]["bytes"] += e["bytes"]
            want[e["kind"]]["wire_bytes"] += e["wire_bytes"]
        summary = result["summary"]
        # The sums over the recorded events must be what summary() reports, whatever the events are...
        from_events = defaultdict(lambda: dict(calls=0, bytes=0, wire_bytes=0.0))
        for e in result["events"]:
            from_events[e["kind"]]["calls"] += 1
            from_events[e["kind"]]["bytes"] += e["bytes"]
            from_events[e["kind"]]["wire_bytes"] += e["wire_bytes"]
        assert set(summary) == set(from_events), f"rank {rank}: summary kinds {set(summary)}"
        for kind, row in from_events.items():
            assert summary[kind]["calls"] == row["calls"], f"rank {rank}, {kind}: summary calls"
            assert summary[kind]["bytes"] == row["bytes"], f"rank {rank}, {kind}: summary bytes"
            assert summary[kind]["wire_bytes"] == pytest.approx(row["wire_bytes"], rel=1e-12), \
                f"rank {rank}, {kind}: summary wire bytes"
        # ... and the calls and logical bytes must be the script's (wire bytes of the subgroup
        # call are checked on their own in test_subgroup_collective_uses_the_subgroup_size).
        assert set(summary) == set(want), f"{world} ranks, rank {rank}: kinds {set(summary)}, want {set(want)}"
        for kind, row in want.items():
            assert summary[kind]["calls"] == row["calls"], (
                f"{world} ranks, rank {rank}: summary()[{kind!r}]['calls'] = {summary[kind]['calls']}, "
                f"the script made {row['calls']}")
            assert summary[kind]["bytes"] == row["bytes"], (
                f"{world} ranks, rank {rank}: summary()[{kind!r}]['bytes'] = {summary[kind]['bytes']}, "
                f"want {row['bytes']}")
            assert result["counts"][kind] == row["calls"], f"rank {rank}: count({kind!r}) = {result['counts'][kind]}"
        assert result["sent_bytes"] == pytest.approx(sum(e["wire_bytes"] for e in result["events"]), rel=1e-12), \
            f"rank {rank}: sent_bytes() is not the sum of the events' wire bytes"


def test_nothing_outside_the_block_and_no_ordinary_ops(traced):
    for world, rank, result, expected in per_rank(traced):
        assert len(result["events"]) == result["recorded_in_block"], (
            f"{world} ranks, rank {rank}: {len(result['events']) - result['recorded_in_block']} event(s) "
            f"recorded after the with block ended")
        assert result["quiet_events"] == 0 and result["quiet_summary"] == {}, (
            f"rank {rank}: ordinary tensor ops (matmul, softmax, backward, cat...) were recorded: "
            f"{result['quiet_summary']}")
        # the all-reduces of 3 floats before and after the block are absent
        assert all(e["bytes"] != 3 * element_size(F32) for e in result["events"]), \
            f"rank {rank}: an all-reduce issued outside the block was recorded"


def test_event_times_are_issue_order_inside_the_block(traced):
    for world, rank, result, _ in per_rank(traced):
        times = [e["time"] for e in result["events"]]
        assert times == sorted(times), f"rank {rank}: event times are not in issue order"
        assert result["t_enter"] <= times[0] and times[-1] <= result["t_exit"], (
            f"rank {rank}: event times [{times[0]}, {times[-1]}] fall outside the block "
            f"[{result['t_enter']}, {result['t_exit']}]")


def test_traced_collectives_still_compute(traced):
    world, results = traced
    for result in results:
        rank, values = result["rank"], result["values"]
        assert values["all_reduce"] == [float(world)] * 10, f"rank {rank}: all_reduce of ones under the tracer"
        assert values["funcol.all_reduce"] == [float(world)] * 11, f"rank {rank}: funcol.all_reduce"
        assert values["all_gather_single"] == [float(r) for r in range(world) for _ in range(CHUNK)], \
            f"rank {rank}: all_gather_single"
        assert values["reduce_scatter_single"] == [float(world)] * CHUNK, f"rank {rank}: reduce_scatter_single"
        assert values["recv"] == [float((rank - 1) % world)] * 5, f"rank {rank}: recv got the wrong message"


# ----------------------------------------------------------------------------- formulas


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8, 64])
def test_wire_bytes_function(world):
    size = 3 * 5 * 7 * 1024  # divisible by every world size above except 64 (fractions allowed)
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "recv", "barrier"):
        want = ring_wire(kind, size, world)
        if world == 1 and kind != "send":
            want = 0.0  # a group of one moves nothing
        assert wire_bytes(kind, size, world) == pytest.approx(want, rel=1e-12, abs=0), \
            f"wire_bytes({kind!r}, {size}, {world}) = {wire_bytes(kind, size, world)}, want {want}"


def test_fit_alpha_beta_recovers_the_parameters():
    for alpha, beta in [(5e-6, 1 / 10e9), (2e-5, 1 / 1e9), (0.0, 1e-10), (1e-4, 0.0)]:
        sizes = [2 ** k for k in range(10, 27, 2)]
        seconds = [alpha + beta * s for s in sizes]
        fit_a, fit_b = fit_alpha_beta(sizes, seconds)
        assert fit_a == pytest.approx(alpha, rel=1e-7, abs=1e-13), f"alpha: fitted {fit_a}, true {alpha}"
        assert fit_b == pytest.approx(beta, rel=1e-9, abs=1e-20), f"beta: fitted {fit_b}, true {beta}"
    # two points determine the line exactly
    fit_a, fit_b = fit_alpha_beta([1000, 3000], [1.0 + 2.0 * 1000, 1.0 + 2.0 * 3000])
    assert (fit_a, fit_b) == (pytest.approx(1.0, rel=1e-9), pytest.approx(2.0, rel=1e-12)), (fit_a, fit_b)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_ring_all_reduce_time(world):
    alpha, beta = 3e-6, 1 / 25e9
    for size in (0, 4, 1 << 20, 3 * (1 << 24)):
        want = 2 * (world - 1) * alpha + 2 * (world - 1) / world * size * beta
        got = ring_all_reduce_time(size, world, alpha, beta)
        assert got == pytest.approx(want, rel=1e-12, abs=0), \
            f"ring_all_reduce_time(S={size}, N={world}) = {got}, want 2(N-1)a + 2(N-1)/N*S*b = {want}"
        if world == 1:
            assert got == 0.0, f"a single rank all-reduces for free, got {got}"
    # the model is the ring wire bytes times beta plus a latency per step
    size = 1 << 22
    assert ring_all_reduce_time(size, world, 0.0, beta) == pytest.approx(wire_bytes("all_reduce", size, world) * beta,
                                                                        rel=1e-12, abs=0)


# ----------------------------------------------------------------------------- grading checks


def _groups_peers_and_overlap() -> dict:
    from labkit.comm import Op, assert_ops, assert_overlap
    rank = dist.get_rank()
    sub = dist.new_group([1, 2, 3])
    nxt, prv = (rank + 1) % 4, (rank - 1) % 4
    with CommTracer() as tracer:
        dist.all_reduce(torch.ones(4))
        if rank:
            dist.all_reduce(torch.ones(2), group=sub)
        buf, got = torch.ones(8), torch.empty(8)
        reqs = [dist.isend(buf, nxt), dist.irecv(got, prv)]
        torch.randn(4, 4) @ torch.randn(4, 4)  # computation while the exchange is in flight
        for req in reqs:
            req.wait()
        for req in [dist.isend(buf, nxt), dist.irecv(got, prv)]:  # waited on at once
            req.wait()
    expected = [Op("all_reduce", 16)] + [Op("all_reduce", 8, group=[1, 2, 3])] * (rank > 0)
    expected += [Op("send", 32, peer=nxt), Op("recv", 32, peer=prv)] * 2
    out = {"ops": [repr(op) for op in tracer.ops()], "steps": [(s.what, s.op) for s in tracer.timeline]}
    assert_ops(tracer, expected, "whole trace")
    errors = []
    for wrong in ([*expected[:-1], Op("all_gather", 32)], [*expected, Op("send", 32, peer=nxt)],
                  [Op("send", 32, peer=prv) if op == Op("send", 32, peer=nxt) else op for op in expected]):
        try:
            assert_ops(tracer, wrong, "wrong")
        except AssertionError as error:
            errors.append(str(error))
    out["ops_errors"] = errors
    first_pair = [i for i, e in enumerate(tracer.events) if e.kind in ("send", "recv")][:2]
    assert_overlap(tracer, "first exchange", events=first_pair)
    try:
        assert_overlap(tracer, "every exchange")
    except AssertionError as error:
        out["overlap_error"] = str(error)
    return out


def test_grading_checks_see_groups_peers_and_the_order_of_post_compute_wait():
    results = labkit.launch(_groups_peers_and_overlap, 4)
    for rank, out in enumerate(results):
        assert (f"all_reduce of 8 B over ranks (1, 2, 3)" in out["ops"]) == (rank > 0)
        assert f"send of 32 B to rank {(rank + 1) % 4}" in out["ops"]
        assert f"recv of 32 B from rank {(rank - 1) % 4}" in out["ops"]
        assert len(out["ops_errors"]) == 3, out
        assert "extra:   1 x all_reduce of 16 B" not in out["ops_errors"][0]
        assert "missing: 1 x all_gather of 32 B" in out["ops_errors"][0]
        assert "missing: 1 x send of 32 B" in out["ops_errors"][1] and "extra" not in out["ops_errors"][1]
        assert f"extra:   2 x send of 32 B to rank {(rank + 1) % 4}" in out["ops_errors"][2]
        assert "send #3 of 4" in out["overlap_error"] and "no overlap" in out["overlap_error"]
        steps = out["steps"]
        assert steps.index(("compute", "mm")) < steps.index(("wait", "send"))


def _callback_collectives() -> dict:
    """A collective issued from a future's callback (on gloo's thread, as a communication hook's
    second step is) is traced; after the block, callbacks run untraced."""
    import threading
    rank = dist.get_rank()
    seen = {}

    def second(done):
        seen["thread"] = threading.current_thread() is not threading.main_thread()
        dist.all_reduce(torch.ones(3), group=None)
        return done.value()

    with CommTracer() as tracer:
        store = dist.distributed_c10d._get_default_store()
        if rank == 1:  # rank 0's all-reduce completes on gloo's thread, after rank 1 joins
            store.wait(["registered"])
        future = dist.all_reduce(torch.ones(2), async_op=True).get_future().then(second)
        if rank == 0:
            store.set("registered", "1")
        future.wait()
    inside = [(e.kind, e.bytes) for e in tracer.events]
    with CommTracer() as later:
        pass
    dist.all_reduce(torch.ones(5), async_op=True).get_future().then(lambda f: dist.all_reduce(torch.ones(7))).wait()
    return {"inside": inside, "after": [(e.kind, e.bytes) for e in later.events], "thread": seen["thread"]}


def test_collectives_issued_from_future_callbacks_are_traced():
    results = labkit.launch(_callback_collectives, 2)
    for out in results:
        assert out["inside"] == [("all_reduce", 8), ("all_reduce", 12)], out
        assert out["after"] == [], out
    assert results[0]["thread"], "rank 0's callback ran on another thread (gloo's)"
