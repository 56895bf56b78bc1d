"""Every chapter has a lab script in ``labs/`` (``NN_<topic>.py``) that runs as a plain script
(``--world-size N``: labkit starts the ranks) and under ``torchrun``, and exits 0 on the
reference solutions: the checks it prints all passed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.course.chapters import CHAPTERS
from tests.conftest import needs_solutions

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "labs").glob("[0-9][0-9]_*.py"))
pytestmark = needs_solutions  # a workspace's scripts exit 1 until its tasks are done


def run(*cmd: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(list(cmd), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_every_chapter_has_a_lab_script():
    numbered = {path.name[:2] for path in SCRIPTS}
    assert set(CHAPTERS) <= numbered, f"chapters without a labs/NN_*.py script: {sorted(set(CHAPTERS) - numbered)}"


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_the_script_passes_its_checks_on_two_ranks(script):
    proc = run(sys.executable, str(script), "--world-size", "2")
    assert proc.returncode == 0, f"{script.name} exited {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    assert "WRONG" not in proc.stdout and "not implemented" not in proc.stdout, proc.stdout[-3000:]


def test_a_script_runs_under_torchrun():
    torchrun = Path(sys.executable).parent / "torchrun"
    proc = run(str(torchrun), "--standalone", "--nproc-per-node", "2", str(ROOT / "labs" / "02_ddp.py"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "DDP, buckets               ok" in proc.stdout, proc.stdout
