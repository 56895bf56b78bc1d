"""The launcher's promises (COURSE.md, "Launching"), one test each."""

import importlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

import labkit
from tests.stamps import seconds_since_last, stamp
launch_module = importlib.import_module("labkit.launch")  # the module; labkit.launch is the function

LABKIT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(labkit.__file__)))


def rank_and_size(offset, scale=1):
    return (dist.get_rank() + offset) * scale, dist.get_world_size()


def process_gone(pid: int) -> bool:
    """True once ``pid`` no longer runs (exited; a zombie awaiting its reaper runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(") ", 1)[1][0]
    except FileNotFoundError:
        return True
    return state in "ZX"


def stamp_now(pid_dir):
    """Write the wall clock into this rank's pid file: the moment the test times from."""
    stamp(pid_dir, str(os.getpid()))


def seconds_since_stamp(pid_dir) -> float:
    """Seconds from the latest ``stamp_now`` in ``pid_dir`` to now (pid files left empty skipped)."""
    return seconds_since_last(pid_dir)


def wait_until(condition, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def run_script(tmp_path, body: str, **popen) -> subprocess.Popen:
    """Start ``body`` as a script's ``__main__`` in a fresh interpreter."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=LABKIT_ROOT)
    return subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **popen)


# ----------------------------------------------------------------------------- results


def test_results_come_back_in_rank_order_with_args_and_kwargs():
    assert labkit.launch(rank_and_size, 4, 10, scale=2) == [(20, 4), (22, 4), (24, 4), (26, 4)]


def test_a_function_defined_in_main_runs_on_four_ranks(tmp_path):
    # Notebook cells live in __main__ too: such functions must travel by value.
    proc = run_script(tmp_path, """
        import torch, torch.distributed as dist, labkit
        OFFSET = 100
        def cell_function(x):
            t = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(t)
            return OFFSET + x + dist.get_rank(), t.item()
        if __name__ == "__main__":
            print("RESULT", labkit.launch(cell_function, 4, 5))
            square = lambda: dist.get_rank() ** 2
            print("LAMBDA", labkit.launch(square, 4))
    """)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "RESULT [(105, 6.0), (106, 6.0), (107, 6.0), (108, 6.0)]" in out, out
    assert "LAMBDA [0, 1, 4, 9]" in out, out


def talk(lines):
    for i in range(lines):
        print(f"line {i} of rank {dist.get_rank()}")
    print("no newline at the end", end="")
    sys.stderr.write(f"stderr of rank {dist.get_rank()}\n")


def test_rank_output_is_relayed_line_by_line_with_rank_prefix(capsys):
    labkit.launch(talk, 3, 4)
    out = capsys.readouterr().out.splitlines()
    for rank in range(3):
        mine = [line for line in out if line.startswith(f"[rank {rank}] ")]
        assert [f"[rank {rank}] line {i} of rank {rank}" for i in range(4)] == \
            [line for line in mine if line.startswith(f"[rank {rank}] line ")], out
        assert f"[rank {rank}] no newline at the end" in mine, out
        assert f"[rank {rank}] stderr of rank {rank}" in mine, out


# ----------------------------------------------------------------------------- failures


def raise_on_rank(bad_rank, pid_dir):
    open(os.path.join(pid_dir, str(os.getpid())), "w").close()
    dist.barrier()  # every rank has written its pid before one raises and the rest are stopped
    if dist.get_rank() == bad_rank:
        stamp_now(pid_dir)
        raise ValueError(f"bad value on rank {bad_rank}")
    time.sleep(60)  # the others would wait a minute: they must be stopped


def test_a_raising_rank_is_named_with_its_traceback_and_others_stopped(tmp_path):
    with pytest.raises(labkit.WorkerError) as info:
        labkit.launch(raise_on_rank, 4, 2, str(tmp_path), timeout=60)
    elapsed = seconds_since_stamp(tmp_path)  # from the raise
    error = info.value
    assert (error.rank, error.exc_type, error.message) == (2, "ValueError", "bad value on rank 2")
    assert 'raise ValueError(f"bad value on rank {bad_rank}")' in error.remote_traceback
    assert "rank 2 raised ValueError" in str(error)
    assert elapsed < 10, f"the other ranks were not stopped promptly ({elapsed:.1f} s after the raise)"
    pids = [int(p) for p in os.listdir(tmp_path)]
    assert len(pids) == 4 and wait_until(lambda: all(map(process_gone, pids)), 5), pids


def exit_without_raising():
    if dist.get_rank() == 1:
        os._exit(3)
    time.sleep(60)


def test_a_rank_that_dies_without_raising_is_reported():
    with pytest.raises(labkit.WorkerError) as info:
        labkit.launch(exit_without_raising, 2, timeout=60)
    assert info.value.rank == 1 and "exited with status 3" in info.value.message


def wait_for_a_message_nobody_sends(pid_dir):
    open(os.path.join(pid_dir, str(os.getpid())), "w").close()
    if dist.get_rank() == 0:
        buffer = torch.zeros(4)
        stamp_now(pid_dir)
        dist.recv(buffer, src=1)  # rank 1 never sends: a classic hang
    return "done"


def test_a_hang_times_out_with_every_ranks_stack(tmp_path):
    start = time.monotonic()
    with pytest.raises(labkit.LaunchTimeout) as info:  # the detector off: the timeout's report
        labkit.launch(wait_for_a_message_nobody_sends, 2, str(tmp_path), timeout=5, detect_deadlock=False)
    elapsed = time.monotonic() - start
    assert isinstance(info.value, TimeoutError) and not isinstance(info.value, labkit.Deadlock)
    assert elapsed >= 5, elapsed  # not before the timeout
    hung_for = seconds_since_stamp(tmp_path)
    assert hung_for < 15, f"reported {hung_for:.1f} s after rank 0 blocked, with a 5-s timeout"
    stack0 = info.value.stacks[0]
    assert "in wait_for_a_message_nobody_sends" in stack0 and "in recv" in stack0, stack0
    assert "finished" in info.value.stacks[1], info.value.stacks[1]
    assert "rank 0" in str(info.value) and "within 5 s" in str(info.value)
    pids = [int(p) for p in os.listdir(tmp_path)]
    assert len(pids) == 2 and wait_until(lambda: all(map(process_gone, pids)), 5), pids


def my_pid():
    return os.getpid(), os.getppid()


def test_no_rank_survives_a_successful_launch():
    pids = [pid for pid, _ in labkit.launch(my_pid, 3)]
    assert wait_until(lambda: all(map(process_gone, pids)), 5), pids


SLEEPING_RANKS = """
    import os, sys, time, labkit
    def sleep_forever(pid_dir):
        with open(os.path.join(pid_dir, f"{os.getpid()}-{os.getppid()}"), "w"):
            pass
        time.sleep(600)
    if __name__ == "__main__":
        labkit.launch(sleep_forever, 2, sys.argv[1], timeout=600)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "sigkill"])
def test_interrupting_or_killing_the_caller_leaves_no_process(tmp_path, sig):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SLEEPING_RANKS))
    env = dict(os.environ, PYTHONPATH=LABKIT_ROOT)
    # Ctrl-C's default: a shell starts background jobs with SIGINT ignored, and a Python
    # started that way ignores it too; a learner's terminal or notebook never does that.
    caller = subprocess.Popen([sys.executable, str(script), str(pid_dir)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert wait_until(lambda: len(os.listdir(pid_dir)) == 2, 60), "the ranks never started"
    ranks_and_server = {int(p) for name in os.listdir(pid_dir) for p in name.split("-")}
    caller.send_signal(sig)
    out, _ = caller.communicate(timeout=30)
    if sig == signal.SIGINT:
        assert "KeyboardInterrupt" in out, out
    assert wait_until(lambda: all(map(process_gone, ranks_and_server)), 10), \
        f"still alive after {sig.name}: {[p for p in ranks_and_server if not process_gone(p)]}"


# ----------------------------------------------------------------------------- concurrency


def reduce_ranks(times):
    total = torch.zeros(1)
    for _ in range(times):
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        total += t
    return total.item()


def test_concurrent_launches_from_threads_do_not_collide():
    results, errors = [], []

    def one_launch():
        try:
            results.append(labkit.launch(reduce_ranks, 2, 20))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one_launch) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == [[60.0, 60.0]] * 3


def test_concurrent_launches_from_separate_processes_do_not_collide(tmp_path):
    body = """
        import threading, torch, torch.distributed as dist, labkit
        def reduce_ranks():
            t = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(t)
            return t.item()
        if __name__ == "__main__":
            # The first launch comes from a thread that then ends: the rank server it
            # started must outlive that thread and serve the launches that follow.
            first = []
            starter = threading.Thread(target=lambda: first.append(labkit.launch(reduce_ranks, 2)))
            starter.start(); starter.join()
            print("RESULTS", first + [labkit.launch(reduce_ranks, 2) for _ in range(4)])
    """
    procs = []
    for i in range(2):
        (tmp_path / str(i)).mkdir()
        procs.append(run_script(tmp_path / str(i), body))
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        assert "RESULTS [[3.0, 3.0], [3.0, 3.0], [3.0, 3.0], [3.0, 3.0], [3.0, 3.0]]" in out, out


# ----------------------------------------------------------------------------- bad input


@pytest.fixture
def no_process_may_start(monkeypatch):
    def refuse():
        raise AssertionError("a rank process was started despite bad arguments")
    monkeypatch.setattr(launch_module._RankServer, "get", staticmethod(refuse))


@pytest.mark.parametrize("world_size, error, words", [
    (0, ValueError, "at least 1"), (-2, ValueError, "at least 1"),
    (1.5, TypeError, "must be an int"), ("2", TypeError, "must be an int"),
])
def test_a_bad_world_size_fails_before_start(no_process_may_start, world_size, error, words):
    with pytest.raises(error, match=words):
        labkit.launch(my_pid, world_size)


def test_bad_arguments_fail_before_start(no_process_may_start):
    with pytest.raises(TypeError, match="callable"):
        labkit.launch("not a function", 2)
    with pytest.raises(ValueError, match="backend must be one of"):
        labkit.launch(my_pid, 2, backend="mpi")
    with pytest.raises(ValueError, match="timeout"):
        labkit.launch(my_pid, 2, timeout=0)
    with pytest.raises(TypeError):  # cannot be sent to the ranks
        labkit.launch(my_pid, 2, threading.Lock())


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_nccl_without_gpus_fails_before_start(no_process_may_start):
    with pytest.raises(ValueError, match=r"needs one CUDA GPU per rank.*has 0 GPU"):
        labkit.launch(my_pid, 2, backend="nccl")


def backend_name():
    return dist.get_backend()


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="auto picks NCCL here")
def test_auto_backend_is_gloo_without_enough_gpus():
    assert labkit.launch(backend_name, 2) == ["gloo", "gloo"]


def nested_launch():
    return labkit.launch(my_pid, 1)


def test_launches_do_not_nest():
    with pytest.raises(labkit.WorkerError, match="do not nest"):
        labkit.launch(nested_launch, 1)


# ----------------------------------------------------------------------------- torchrun


def run_under_torchrun(script, ranks: int = 2) -> str:
    """``torchrun --standalone`` on ``script`` (run in its folder); its stdout, once it exited 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
         str(script)], env=dict(os.environ, PYTHONPATH=LABKIT_ROOT), cwd=script.parent,
        capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def test_the_same_script_runs_under_torchrun(tmp_path):
    script = tmp_path / "lab.py"
    script.write_text(textwrap.dedent("""
        import os, torch, torch.distributed as dist, labkit
        def main(scale):
            t = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(t)
            return dist.get_rank(), t.item() * scale
        if __name__ == "__main__":
            results = labkit.launch(main, int(os.environ.get("WORLD_SIZE", 2)), 10)
            print(f"rank {os.environ.get('RANK')} got {results}")
    """))
    stdout = run_under_torchrun(script)
    for rank in range(2):
        assert f"rank {rank} got [(0, 30.0), (1, 30.0)]" in stdout, stdout


def _send_outside(case: str) -> None:
    group = dist.new_group([0, 1])
    if dist.get_rank() == 0:
        if case == "world":     # gloo itself would crash the process (SIGSEGV) on this one
            dist.send(torch.ones(2), dst=5)
        elif case == "group":   # a group rank passed where a global rank belongs
            dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(2), 2, group=group)])


@pytest.mark.parametrize("case, named", [("world", "rank 5"), ("group", "rank 2")])
def test_a_peer_outside_the_group_is_explained_before_the_transport_sees_it(case, named):
    with pytest.raises(labkit.WorkerError) as caught:
        labkit.launch(_send_outside, 3, case, timeout=30)
    assert caught.value.rank == 0 and caught.value.exc_type == "ValueError", str(caught.value)
    assert f"names {named} as the peer of a send or receive" in caught.value.message
    assert "dist.get_global_rank(group, r)" in caught.value.message


# ----------------------------------------------------------------------------- RPC jobs


def _rpc_ring():
    """Each rank asks its right neighbour, by RPC name, to add to a tensor; the process group
    is there too."""
    from torch.distributed import rpc
    rank, n = dist.get_rank(), dist.get_world_size()
    right = launch_module.rpc_name((rank + 1) % n)
    answer = rpc.rpc_sync(right, torch.add, args=(torch.full((2,), float(rank)), 10.0))
    owned = rpc.remote(right, torch.ones, args=((3,),))  # an RRef owned by the neighbour
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    return rpc.get_worker_info().name, answer.tolist(), owned.to_here().sum().item(), t.item()


@pytest.mark.parametrize("world_size", [2, 3])
def test_an_rpc_job_names_its_workers_and_keeps_the_process_group(world_size):
    results = labkit.launch(_rpc_ring, world_size, rpc=True, timeout=60)
    assert results == [(f"worker{r}", [r + 10.0] * 2, 3.0, float(world_size)) for r in range(world_size)]


def _rpc_raise_on(bad_rank, pid_dir):
    from torch.distributed import rpc
    open(os.path.join(pid_dir, str(os.getpid())), "w").close()
    dist.barrier()
    if dist.get_rank() == bad_rank:
        stamp_now(pid_dir)
        raise KeyError("no such parameter")
    rpc.rpc_sync(launch_module.rpc_name(bad_rank), time.sleep, args=(60,))  # never answered


def test_a_raising_rank_of_an_rpc_job_is_named_and_nothing_survives(tmp_path):
    with pytest.raises(labkit.WorkerError) as caught:
        labkit.launch(_rpc_raise_on, 3, 1, str(tmp_path), rpc=True, timeout=60)
    assert caught.value.rank == 1 and caught.value.exc_type == "KeyError", str(caught.value)
    after = seconds_since_stamp(tmp_path)
    assert after < 30, f"reported {after:.1f} s after the raise: the failure must be reported at once, not at a timeout"
    pids = [int(p) for p in os.listdir(tmp_path)]
    assert len(pids) == 3 and wait_until(lambda: all(map(process_gone, pids)), 5), pids


def _rpc_die_mid_call(pid_dir):
    """Rank 1 dies (os._exit) while rank 0 waits on an RPC it is running."""
    from torch.distributed import rpc
    open(os.path.join(pid_dir, str(os.getpid())), "w").close()
    dist.barrier()
    if dist.get_rank() == 0:
        stamp_now(pid_dir)
        try:
            rpc.rpc_sync(launch_module.rpc_name(1), os._exit, args=(3,))
        except RuntimeError as error:
            raise ConnectionError(f"worker1 went away mid-call: {error}") from None
    else:
        time.sleep(60)


def test_a_rank_dying_mid_rpc_is_reported_within_the_rpc_timeout(tmp_path):
    with pytest.raises(labkit.WorkerError) as caught:
        labkit.launch(_rpc_die_mid_call, 2, str(tmp_path), rpc=True, rpc_timeout=45, timeout=90)
    elapsed = seconds_since_stamp(tmp_path)  # from the lost call
    assert caught.value.rank == 1 and caught.value.exc_type == "ProcessExit", str(caught.value)
    assert "exited with status 3" in caught.value.message
    # the caller of the lost RPC learned it at once, and its view is in the report
    assert "ConnectionError: worker1 went away" in caught.value.peer_errors.get(0, ""), caught.value.peer_errors
    # bounded by what a missed detection costs (the RPC timeout, 45 s), not by a quiet machine's time
    assert elapsed < 45, f"reported {elapsed:.1f} s after the call: a dead peer must not wait for the RPC timeout"
    pids = [int(p) for p in os.listdir(tmp_path)]
    assert len(pids) == 2 and wait_until(lambda: all(map(process_gone, pids)), 5), pids


def _block_forever():
    threading.Event().wait()


def _rpc_wait_forever(pid_dir):
    """Rank 0 calls a function on worker1 that never returns."""
    from torch.distributed import rpc
    open(os.path.join(pid_dir, str(os.getpid())), "w").close()
    if dist.get_rank() == 0:
        rpc.rpc_sync(launch_module.rpc_name(1), _block_forever)


def test_a_hung_rpc_is_a_launch_timeout_with_stacks(tmp_path):
    with pytest.raises(labkit.LaunchTimeout) as caught:
        labkit.launch(_rpc_wait_forever, 2, str(tmp_path), rpc=True, timeout=4)
    assert "_rpc_wait_forever" in caught.value.stacks[0], caught.value.stacks
    pids = [int(p) for p in os.listdir(tmp_path)]
    assert len(pids) == 2 and wait_until(lambda: all(map(process_gone, pids)), 5), pids


def test_bad_rpc_arguments_fail_before_start(no_process_may_start):
    with pytest.raises(ValueError, match="rpc=True runs on CPU"):
        labkit.launch(my_pid, 2, rpc=True, backend="nccl")
    with pytest.raises(TypeError, match="rpc must be True or False"):
        labkit.launch(my_pid, 2, rpc="yes")
    with pytest.raises(ValueError, match="rpc_timeout must be a positive"):
        labkit.launch(my_pid, 2, rpc=True, rpc_timeout=0)
    with pytest.raises(ValueError, match="pass it with rpc=True"):
        labkit.launch(my_pid, 2, rpc_timeout=5)


def test_an_rpc_script_runs_under_torchrun(tmp_path):
    script = tmp_path / "rpc_lab.py"
    script.write_text(textwrap.dedent("""
        import os, torch, torch.distributed as dist, labkit
        from torch.distributed import rpc
        def main():
            peer = f"worker{(dist.get_rank() + 1) % dist.get_world_size()}"
            return rpc.get_worker_info().name, rpc.rpc_sync(peer, torch.mul, args=(torch.ones(1), 5.0)).item()
        if __name__ == "__main__":
            results = labkit.launch(main, int(os.environ.get("WORLD_SIZE", 2)), rpc=True)
            print(f"rank {os.environ.get('RANK')} got {results}")
    """))
    stdout = run_under_torchrun(script)
    for rank in range(2):
        assert f"rank {rank} got [('worker0', 5.0), ('worker1', 5.0)]" in stdout, stdout
