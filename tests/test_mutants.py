"""Mutation testing of the grader, standing: every wrong implementation in ``tests/mutants``
must lose all of its task's points (``labkit.course.mutants``).

The chapters' mutants run in two pytest processes side by side (a launch mostly waits on
its ranks), each mutant stopping at its first failing test. The summary line
``mutants killed: K of M`` is printed at the end of the session (``tests/conftest.py``).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from labkit.course import grading, mutants, workspace
from tests.conftest import needs_solutions

ROOT = Path(__file__).resolve().parent.parent
SUMMARY = ROOT / "build" / "mutants-summary.txt"
pytestmark = needs_solutions  # the mutants are edits of the reference solutions


def run_halves(files: list[Path], tmp_path: Path) -> list[dict]:
    halves = [files[0::2], files[1::2]]
    procs = []
    for n, half in enumerate(h for h in halves if h):
        report = tmp_path / f"mutants-{n}.json"
        cmd = [sys.executable, "-m", "pytest", *map(str, half), "--mutants", f"--mutants-report={report}",
               "-p", "no:cacheprovider", "-o", "addopts=", "-q", "--tb=no", "-p", "no:xdist"]
        log = open(tmp_path / f"mutants-{n}.log", "w")
        procs.append((subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                       env=dict(os.environ, PYTHONPATH=str(ROOT))), report, log))
    fates = []
    for proc, report, log in procs:
        proc.wait(timeout=1200)
        log.close()
        assert report.exists(), (tmp_path / log.name).read_text()[-4000:]
        fates += json.loads(report.read_text())
    return fates


def test_every_mutant_loses_its_task(tmp_path):
    known = mutants.load(ROOT)
    tasks = workspace.tasks(ROOT / "labkit")
    covered = {m.module for m in known}   # the chapters with a mutants file
    per_task = {t: [m for m in known if m.task == t] for t in tasks if t.split(".")[0] in covered}
    thin = sorted(t for t, ms in per_task.items() if len(ms) < 2)
    assert not thin, f"every graded task needs at least two mutants; too few for {thin}"
    modules = sorted({m.module for m in known}, key=lambda m: list(grading.CHAPTERS.values()).index(m))
    files = [ROOT / "tests" / "grading" / f"test_{m}.py" for m in modules]
    start = time.monotonic()
    fates = run_halves(files, tmp_path)
    elapsed = time.monotonic() - start
    killed = [f for f in fates if f["killed"]]
    lines = [f"mutants killed: {len(killed)} of {len(known)} ({elapsed:.0f} s)"]
    lines += [f"  SURVIVED {f['mutant']}: {f['why']}" for f in fates if not f["killed"]]
    SUMMARY.parent.mkdir(exist_ok=True)
    SUMMARY.write_text("\n".join(lines) + "\n")
    assert {f["mutant"] for f in fates} == {m.id for m in known}, "a mutant did not run"
    assert len(killed) == len(known), "\n".join(lines)
