"""Elastic membership on real torchrun agents (chapter 09): two agents on this machine act as
two nodes (``--nnodes 1:2``, c10d rendezvous on 127.0.0.1) and train the chapter-09 job with
the course's checkpoints. One agent is killed with its worker; the survivor re-forms the
group at world size 1 and resumes from the newest checkpoint, resharded; a new agent joins,
the job grows back to two ranks (resharding again) and finishes.

The losses at every step must equal one process training on the same global batches, within
``labkit.check``'s float64 tolerance: the global batch and its mean loss do not depend on the
world size, only the order of a few additions does (about 1e-15 relative).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import needs_solutions

ROOT = Path(__file__).resolve().parent.parent
pytestmark = needs_solutions
STEPS, PAUSE = 14, 0.4   # a step lasts at least PAUSE seconds: time to kill and to join


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant: a node's power going out. (torchrun starts its
    workers in sessions of their own, so killing the agent's process group is not enough.)"""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    doomed, todo = [], [pid]
    while todo:
        doomed.append(todo.pop())
        todo += children.get(doomed[-1], [])
    for victim in doomed:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def checkpoints(root: Path) -> list[dict]:
    """The metadata of every complete checkpoint under ``root``, oldest first."""
    found = []
    for meta in sorted(root.glob("*/metadata.json")):
        try:
            found.append(json.loads(meta.read_text()))
        except (OSError, ValueError):
            continue  # being written or pruned right now
    return sorted(found, key=lambda m: m["step"])


def wait_for(what: str, condition, agents, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while not condition():
        dead = [a for a in agents if a.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise AssertionError(f"waiting for {what}: " + ("an agent exited" if dead else "timed out"))
        time.sleep(0.1)


def test_a_node_leaves_and_rejoins_and_the_loss_curve_is_unchanged(tmp_path):
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    logs.mkdir()
    torchrun = str(Path(sys.executable).parent / "torchrun")
    command = [torchrun, "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "membership", "--max-restarts", "6",
               "--rdzv-conf", "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3",
               "--monitor-interval", "0.5", str(ROOT / "labs" / "09_elastic.py"),
               "--checkpoint-dir", str(ckpt), "--steps", str(STEPS), "--save-every", "1", "--step-pause", str(PAUSE)]
    # torch 2.13: with the agents sharing one store server, a node that joins waits forever for
    # the new round's MASTER_ADDR (the old leader never publishes it again): every round
    # builds its own store instead.
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")

    def agent(name: str) -> subprocess.Popen:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=open(logs / f"{name}.log", "w"),
                                stderr=subprocess.STDOUT, start_new_session=True)

    agents = [agent("a"), agent("b")]
    try:
        wait_for("a checkpoint from two ranks at step 3",
                 lambda: any(m["world_size"] == 2 and m["step"] >= 3 for m in checkpoints(ckpt)), agents)
        kill_tree(agents[1].pid)                   # the node is gone: its agent and its worker
        agents[1].wait()
        left = max(m["step"] for m in checkpoints(ckpt))
        wait_for("the survivor alone to save a checkpoint",
                 lambda: any(m["world_size"] == 1 and m["step"] > left for m in checkpoints(ckpt)), agents[:1])
        agents.append(agent("c"))                  # a node joins
        wait_for("a checkpoint from two ranks again",
                 lambda: any(m["world_size"] == 2 and m["step"] > left + 1 for m in checkpoints(ckpt)),
                 [agents[0], agents[2]])
        for a in (agents[0], agents[2]):
            a.wait(timeout=240)
    finally:
        for a in agents:
            kill_tree(a.pid)  # nothing outlives the test, whatever happened
            a.wait()
    outputs = {name: (logs / f"{name}.log").read_text() for name in ("a", "b", "c")}
    assert agents[0].returncode == 0 and agents[2].returncode == 0, \
        "\n\n".join(f"--- {n}\n{o[-3000:]}" for n, o in outputs.items())
    report = next(o for o in outputs.values() if "Lab 09: resume_training on 2 rank(s)" in o)
    assert "losses vs one process (float64 tolerance): ok; the same on every rank: ok" in report, report[-3000:]
    assert "final checkpoint's parameters vs one process" in report and ", ok" in report, report[-3000:]
    sizes = [m["world_size"] for m in checkpoints(ckpt)]
    assert sizes[-1] == 2, sizes  # the last checkpoint came from the regrown job
