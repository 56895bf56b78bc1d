"""The cluster recipe: the torchrun line of ``labs/cluster/slurm.sbatch`` runs here as two
agents on one machine (what srun does on two nodes), rendezvousing on 127.0.0.1, and the
lab script passes its checks at world size 2."""

import os
import re
import socket
import subprocess
from pathlib import Path

from tests.conftest import needs_solutions

ROOT = Path(__file__).resolve().parent.parent
SBATCH = ROOT / "labs" / "cluster" / "slurm.sbatch"
pytestmark = needs_solutions


def torchrun_line() -> str:
    """The command srun runs on every node (the single-quoted argument of bash -c)."""
    line = next(ln for ln in SBATCH.read_text().splitlines() if ln.startswith("srun "))
    return re.search(r"bash -c '(.*)'$", line).group(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_sbatch_torchrun_line_runs_as_two_agents(tmp_path):
    venv_bin = Path(os.sys.executable).parent
    env = dict(os.environ, PYTHONPATH=str(ROOT), PATH=f"{venv_bin}:{os.environ['PATH']}",
               SLURM_NNODES="2", GPUS_PER_NODE="1", SLURM_JOB_ID="labkit-test", HEAD_NODE="127.0.0.1",
               RDZV_PORT=str(free_port()), LAB=str(ROOT / "labs" / "02_ddp.py"), LAB_ARGS="", OMP_NUM_THREADS="1")
    agents = [subprocess.Popen(["bash", "-c", torchrun_line()], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True) for _ in range(2)]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=300)[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, 9)
    assert [a.returncode for a in agents] == [0, 0], "\n\n".join(o[-3000:] for o in outputs)
    report = next(o for o in outputs if "Lab 02: DDP on 2 rank(s)" in o)
    assert "DDP, buckets               ok" in report, report
