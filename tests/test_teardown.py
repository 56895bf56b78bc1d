"""Clean teardown: a training script that uses the exercise modules under plain
``mp.spawn`` and ends with ``destroy_process_group()`` exits cleanly, every time.

The failure this guards against: a gloo process group kept alive past
``destroy_process_group()`` (a module holding the group object or an unfinished ``Work``)
keeps gloo's worker threads alive into interpreter shutdown, where releasing an op's
tensors needs the GIL and the process aborts ("terminate called without an active
exception", SIGABRT) now and then, more often on a busy machine.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import needs_solutions

ROOT = Path(__file__).resolve().parent.parent
RUNS = 6   # each run spawns two ranks three times over; the abort this guards against hit 1 run in 6

SCRIPT = textwrap.dedent("""
    import sys, tempfile
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    from labkit.data import markov_tokens
    from labkit.models import GPT, GPTConfig

    def train(rank, world, store_file):
        dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
        torch.set_num_threads(1)
        from labkit.ddp import DDP
        from labkit.fsdp import fully_shard
        from labkit.zero import ShardedOptimizer
        config = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
        x, y = markov_tokens(4, config.block_size, config.vocab_size, seed=rank)
        ddp = DDP(GPT(config))
        zero_model = GPT(config)
        fsdp = GPT(config)
        for block in fsdp.blocks:
            fully_shard(block)
        fully_shard(fsdp)
        runs = [(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3)),
                (zero_model, ShardedOptimizer(zero_model.parameters(), torch.optim.AdamW,
                                              shard_gradients=True, lr=1e-3)),
                (fsdp, torch.optim.AdamW(fsdp.parameters(), lr=1e-3))]
        for model, opt in runs:
            for _ in range(3):
                model(x, y)[1].backward()
                opt.step()
                opt.zero_grad()
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        failures = 0
        for run in range(int(sys.argv[1])):
            with tempfile.NamedTemporaryFile() as store:
                try:
                    mp.spawn(train, args=(2, store.name + ".store"), nprocs=2)
                except Exception as error:  # a rank that died: SIGABRT at exit, say
                    failures += 1
                    print(f"run {run}: {error}", flush=True)
        print(f"{failures} of {sys.argv[1]} runs ended abnormally")
""")


@needs_solutions
def test_training_scripts_under_mp_spawn_exit_cleanly(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(script), str(RUNS)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and f"0 of {RUNS} runs ended abnormally" in proc.stdout, out[-4000:]
    assert "terminate called" not in out, out[-4000:]


# ----------------------------------------------------------------------------- Ctrl-C (issue 43)


def marked_processes(mark: str, ranks_only: bool = False) -> list[int]:
    """The live processes whose environment carries ``LABKIT_TEST_MARK=mark`` (whatever
    session or group they moved to): the command, its pytest, rank server and ranks. The
    ranks: the rank server's children (a fork keeps the server's /proc environ)."""
    found = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        except OSError:
            continue
        if state != "Z" and f"LABKIT_TEST_MARK={mark}".encode() in environ:
            found[int(entry.name)] = (int(ppid), b"LABKIT_RANK_SERVER=1" in environ)
    if ranks_only:
        return [pid for pid, (ppid, _) in found.items() if found.get(ppid, (0, False))[1]]
    return list(found)


def interrupt_once_ranks_run(cmd: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, list[int]]:
    """Start ``cmd`` in a session of its own, as a terminal would in the foreground; once a rank
    is running, press Ctrl-C (SIGINT to the whole foreground group); return how it ended and
    what was still running the moment it had exited."""
    import signal
    import time
    import uuid
    mark = uuid.uuid4().hex
    env = dict(os.environ, PYTHONPATH=str(ROOT), LABKIT_TEST_MARK=mark, PYTHONUNBUFFERED="1")
    # A shell runs a foreground job with SIGINT at its default; a job started in the background
    # of a script (CI's may be) inherits it ignored, and Python then never raises KeyboardInterrupt.
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 300
        while not marked_processes(mark, ranks_only=True):
            assert proc.poll() is None and time.monotonic() < deadline, \
                f"no rank started (status {proc.poll()}): {proc.communicate(timeout=60)}"
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        left = marked_processes(mark)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err), left
    finally:
        for pid in marked_processes(mark):   # whatever a failing run left behind
            os.kill(pid, signal.SIGKILL)


def assert_interrupted_quietly(done: subprocess.CompletedProcess, left: list[int], says: str) -> None:
    assert done.returncode == 130, f"status {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stdout + done.stderr and "KeyboardInterrupt" not in done.stdout + done.stderr, \
        done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1:] == [says], done.stderr[-3000:]
    assert left == [], f"still running after the command exited: {left}"


@needs_solutions
def test_ctrl_c_on_a_lab_is_one_line_exit_130_and_leaves_nothing_running():
    done, left = interrupt_once_ranks_run([sys.executable, "labs/00_collectives.py", "--world-size", "2"], ROOT)
    assert_interrupted_quietly(done, left, "00_collectives.py: interrupted; ranks stopped")


@needs_solutions
def test_ctrl_c_on_labkit_grade_is_one_line_exit_130_and_leaves_nothing_running():
    done, left = interrupt_once_ranks_run(
        [sys.executable, "-m", "labkit.course.cli", "grade", "collectives.reduce_scatter"], ROOT)
    assert_interrupted_quietly(done, left, "labkit grade: interrupted; ranks stopped")
