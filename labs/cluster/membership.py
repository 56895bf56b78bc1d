"""A node leaves and a node joins: chapter 09's job on two torchrun agents on this machine.

    python labs/cluster/membership.py            # prints the story and the verdict; exit 0 if ok

Two agents (``--nnodes 1:2``, c10d rendezvous on 127.0.0.1) act as two nodes and run
``labs/09_elastic.py``, saving a checkpoint every step. Once the two ranks have saved step 3,
the agent that does not host the rendezvous is killed with its worker (a node losing power;
with the c10d backend the job cannot outlive its rendezvous host, which etcd avoids); the survivor's worker fails in
its next collective, its agent re-forms the group alone and resumes at world size 1 from the
newest checkpoint, resharded. Once it has saved a step on its own, a new agent joins (started
earlier, so its imports are done): the survivor's agent sees a node waiting, stops its worker, and the group grows back to two
ranks, resharding again. The script at the end compares every step's loss with one process
(``labkit.check``'s float64 tolerance). ``tests/test_membership.py`` runs this; so does lab 09.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS, PAUSE = 16, 0.4   # a step lasts at least PAUSE seconds: time to kill and to join

# The joining node's agent, started early: it imports torchrun (seconds on a loaded machine)
# and then waits for the go file before it joins. Without this, the survivor could finish
# every step alone while the new agent was still importing, and the job would never regrow.
WARM_AGENT = """import pathlib, sys, time
from torch.distributed.run import main
go = pathlib.Path(sys.argv[1])
while not go.exists():
    time.sleep(0.05)
sys.argv = ["torchrun"] + sys.argv[2:]
main()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


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
    for meta in root.glob("*/metadata.json"):
        try:
            found.append(json.loads(meta.read_text()))
        except (OSError, ValueError):
            continue  # being written or pruned right now
    return sorted(found, key=lambda m: m["step"])


def wait_for(what: str, condition, agents, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        dead = [a for a in agents if a.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"waiting for {what}: " + ("an agent exited" if dead else "timed out"))
        time.sleep(0.1)


def run(workdir: Path) -> dict:
    """The whole story in ``workdir``; returns what happened and the agents' logs."""
    ckpt, logs = workdir / "ckpt", workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    port = free_port()
    command = [torchrun, "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "membership", "--max-restarts", "6",
               "--rdzv-conf", "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3",
               "--monitor-interval", "0.5", str(ROOT / "labs" / "09_elastic.py"),
               "--checkpoint-dir", str(ckpt), "--steps", str(STEPS), "--save-every", "1", "--step-pause", str(PAUSE)]
    # torch 2.13: with the agents sharing one store server, a node that joins waits forever for
    # the new round's MASTER_ADDR (the old leader never publishes it again): every round
    # builds its own store instead.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")

    def agent(name: str, go: Path | None = None) -> subprocess.Popen:
        argv = command if go is None else [sys.executable, "-c", WARM_AGENT, str(go)] + command[1:]
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=open(logs / f"{name}.log", "w"),
                                stderr=subprocess.STDOUT, start_new_session=True)

    story, error = [], None
    agents = [agent("a")]
    try:
        # The first agent hosts the c10d rendezvous store; the node we kill must not be it
        # (with the c10d backend the job does not survive its rendezvous host: use etcd for that).
        wait_for("the first agent's rendezvous store", lambda: listening(port), agents)
        agents.append(agent("b"))
        wait_for("a checkpoint from two ranks at step 3",
                 lambda: any(m["world_size"] == 2 and m["step"] >= 3 for m in checkpoints(ckpt)), agents)
        kill_tree(agents[1].pid)
        agents[1].wait()
        left = max(m["step"] for m in checkpoints(ckpt))
        story.append("two ranks trained and saved; one node was killed (agent and worker)")
        go = workdir / "join"
        agents.append(agent("c", go))   # imports now, joins on the go file
        wait_for("the survivor alone to save a checkpoint",
                 lambda: any(m["world_size"] == 1 and m["step"] > left for m in checkpoints(ckpt)), agents[:1])
        story.append("the survivor re-formed the group alone and saved checkpoints at world size 1")
        go.touch()
        wait_for("a checkpoint from two ranks again",
                 lambda: any(m["world_size"] == 2 and m["step"] > left + 1 for m in checkpoints(ckpt)),
                 [agents[0], agents[2]])
        story.append("a new node joined; the job grew back and saved checkpoints at world size 2")
        for a in (agents[0], agents[2]):
            a.wait(timeout=240)
    except RuntimeError as stuck:   # an agent gave up (say, a task still a stub): report, don't raise
        error = str(stuck)
    finally:
        for a in agents:
            kill_tree(a.pid)  # nothing outlives the run, whatever happened
            a.wait()
    outputs = {name: (logs / f"{name}.log").read_text() for name in ("a", "b", "c") if (logs / f"{name}.log").exists()}
    report = next((o for o in outputs.values() if "Lab 09: resume_training on 2 rank(s)" in o), "")
    missing = next((line for o in outputs.values() for line in o.splitlines() if "not implemented yet" in line), None)
    return dict(story=story, error=error, missing=missing, outputs=outputs,
                exit_codes=[a.returncode for a in agents[::2]],
                sizes=[m["world_size"] for m in checkpoints(ckpt)],
                curve_ok="losses vs one process (float64 tolerance): ok; the same on every rank: ok" in report,
                params_ok="final checkpoint's parameters vs one process" in report and ", ok" in report)


def verdict(result: dict) -> bool:
    return result["exit_codes"] == [0, 0] and result["curve_ok"] and result["params_ok"] and result["sizes"][-1:] == [2]


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="labkit-membership-") as tmp:
        result = run(Path(tmp))
    for line in result["story"]:
        print(line)
    if result["missing"]:
        print(result["missing"].strip())
    elif result["error"]:
        print(f"stopped {result['error']}")
    print(f"both agents exited 0: {'ok' if result['exit_codes'] == [0, 0] else 'WRONG'}; "
          f"losses at every step vs one process: {'ok' if result['curve_ok'] else 'WRONG'}; "
          f"final parameters: {'ok' if result['params_ok'] else 'WRONG'}")
    sys.exit(0 if verdict(result) else 1)
