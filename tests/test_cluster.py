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
    return re.search(r"bash -c '(.*)'( \|\| status=\$\?)?$", line).group(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_sbatch_torchrun_line_runs_as_two_agents(tmp_path):
    venv_bin = Path(os.sys.executable).parent
    env = dict(os.environ, PYTHONPATH=str(ROOT), PATH=f"{venv_bin}:{os.environ['PATH']}",
               SLURM_NNODES="2", RANKS_PER_NODE="1", MAX_RESTARTS="0", SLURM_JOB_ID="labkit-test", HEAD_NODE="127.0.0.1",
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


STAND_IN_SRUN = """#!/bin/bash
# srun as one node sees it: what it was given, then the command itself
echo "srun SRUN_CPUS_PER_TASK=$SRUN_CPUS_PER_TASK"
while [[ "$1" == --* ]]; do shift; done
exec "$@"
"""
STAND_IN_TORCHRUN = """#!/bin/bash
echo "torchrun VIRTUAL_ENV=$VIRTUAL_ENV OMP_NUM_THREADS=$OMP_NUM_THREADS"
for arg in "$@"; do echo "arg [$arg]"; done
"""


def run_sbatch(tmp_path, job_id: str, *lab_args: str) -> str:
    """The whole sbatch script, as Slurm would run it on a 2-node job of 8 GPUs and 16 CPUs a node,
    with stand-ins for srun and scontrol, and torchrun in the job's environment printing its arguments."""
    bin_dir, venv = tmp_path / "bin", tmp_path / "submit" / ".venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    bin_dir.mkdir(exist_ok=True)
    for path, text in ((bin_dir / "srun", STAND_IN_SRUN), (bin_dir / "scontrol", "#!/bin/bash\necho node0; echo node1\n"),
                       (venv / "bin" / "torchrun", STAND_IN_TORCHRUN),
                       (venv / "bin" / "activate", f'export VIRTUAL_ENV={venv}\nexport PATH="{venv}/bin:$PATH"\n')):
        path.write_text(text)
        path.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "SRUN", "VIRTUAL_ENV", "CONDA_PREFIX"))
           and k not in ("OMP_NUM_THREADS", "RDZV_PORT", "HEAD_NODE", "GPUS_PER_NODE", "VENV")}
    env.update(PATH=f"{bin_dir}:/usr/bin:/bin", SLURM_NNODES="2", SLURM_GPUS_ON_NODE="8", SLURM_CPUS_PER_TASK="16",
               SLURM_JOB_ID=job_id, SLURM_JOB_NODELIST="node[0-1]", SLURM_SUBMIT_DIR=str(tmp_path / "submit"))
    proc = subprocess.run(["bash", str(SBATCH), "labs/09_elastic.py", *lab_args], cwd=tmp_path / "submit", env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_the_sbatch_script_passes_cpus_environment_threads_a_port_of_its_own_and_every_argument(tmp_path):
    out = run_sbatch(tmp_path, "1234", "--checkpoint-dir", "/shared/my ckpt", "--fail-at", "3", "--note", "$HOME;*")
    assert "srun SRUN_CPUS_PER_TASK=16" in out, out                        # srun gets --cpus-per-task again
    venv = tmp_path / "submit" / ".venv"
    assert f"torchrun VIRTUAL_ENV={venv} OMP_NUM_THREADS=2" in out, out   # activated; 16 CPUs / 8 ranks
    assert "16 CPUs per node, 2 OpenMP thread(s) per rank" in out, out     # the CPUs are the node's
    args = [line[5:-1] for line in out.splitlines() if line.startswith("arg [")]
    assert args[-7:] == ["labs/09_elastic.py", "--checkpoint-dir", "/shared/my ckpt", "--fail-at", "3",
                         "--note", "$HOME;*"], args                         # every argument intact, unexpanded
    endpoint = args[args.index("--rdzv-endpoint") + 1]
    other = run_sbatch(tmp_path, "1235")
    other_args = [line[5:-1] for line in other.splitlines() if line.startswith("arg [")]
    assert endpoint.startswith("node0:") and endpoint != other_args[other_args.index("--rdzv-endpoint") + 1], \
        "two jobs on the same first node must rendezvous on different ports"


STAND_IN_NVIDIA_SMI = """#!/bin/bash
echo "No devices were found"
exit 6
"""


def test_the_sbatch_example_runs_end_to_end_and_leaves_nothing_behind(tmp_path):
    # The script's own example, `slurm.sbatch labs/09_elastic.py --fail-at 3`, on one node
    # without a GPU: srun is a stand-in that runs the step here (the real torchrun, the real
    # lab). Before: --nproc-per-node 0, no --max-restarts (the injected failure ended the job),
    # and a checkpoint folder left in this node's /tmp.
    import sys
    import tempfile
    bin_dir, submit = tmp_path / "bin", tmp_path / "submit"
    bin_dir.mkdir()
    submit.mkdir()
    for name, text in (("srun", STAND_IN_SRUN), ("scontrol", "#!/bin/bash\necho 127.0.0.1\n"),
                       ("nvidia-smi", STAND_IN_NVIDIA_SMI)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    job = f"43{os.getpid() % 10000}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "SRUN", "VIRTUAL_ENV", "CONDA_PREFIX"))
           and k not in ("OMP_NUM_THREADS", "RDZV_PORT", "HEAD_NODE", "GPUS_PER_NODE", "RANKS_PER_NODE", "VENV",
                         "MAX_RESTARTS", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LABKIT_RANK")}
    venv = Path(sys.prefix)
    env.update(PATH=f"{bin_dir}:{venv / 'bin'}:/usr/bin:/bin", PYTHONPATH=str(ROOT), SLURM_NNODES="1",
               SLURM_CPUS_PER_TASK="2", SLURM_JOB_ID=job, SLURM_JOB_NODELIST="localhost",
               SLURM_SUBMIT_DIR=str(submit), RDZV_PORT=str(free_port()))
    if (venv / "bin" / "activate").exists():
        env["VENV"] = str(venv)
    else:
        env["CONDA_PREFIX"] = str(venv)
    proc = subprocess.run(["bash", str(SBATCH), str(ROOT / "labs" / "09_elastic.py"), "--fail-at", "3"],
                          cwd=submit, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "1 node(s) x 1 rank(s) on CPU (no GPU visible" in out and "2 CPUs per node" in out, out[:2000]
    assert f"checkpoints in {submit / f'labkit-checkpoints-{job}'}" in out, out[:2000]
    assert "resuming from" in out, out[-5000:]           # the rank died at step 3 and torchrun restarted it
    assert list(submit.iterdir()) == [], list(submit.iterdir())                       # checkpoints removed
    assert not (Path(tempfile.gettempdir()) / f"labkit-elastic-{job}").exists()   # nothing in /tmp (run id = job)
