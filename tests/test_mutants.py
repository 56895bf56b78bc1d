"""Mutation testing of the grader, standing: every wrong implementation in ``tests/mutants``
must lose all of its task's points (``labkit.course.mutants``).

The chapters' mutants run in two pytest processes side by side (a launch mostly waits on
its ranks), split by the cost recorded in ``tests/mutants/first.json``, each mutant trying
first the test that killed it last time and stopping at its first failing test. The summary line
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


RECORD = ROOT / "build" / "mutants-first.json"   # this run's record; tests/mutants/first.json is the committed one


def run_in_parallel(groups: list[list[str]], tmp_path: Path) -> list[dict]:
    """One pytest process per group of chapter modules (a launch mostly waits on its ranks)."""
    procs = []
    for n, group in enumerate(groups):
        report = tmp_path / f"mutants-{n}.json"
        files = [str(ROOT / "tests" / "grading" / f"test_{m}.py") for m in group]
        cmd = [sys.executable, "-m", "pytest", *files, "--mutants", f"--mutants-report={report}",
               "-p", "no:cacheprovider", "-o", "addopts=", "-q", "--tb=no", "-p", "no:xdist"]
        log = open(tmp_path / f"mutants-{n}.log", "w")
        # Without CI/BUILD_NUMBER: there pytest explains every failed `==` of two lists with a full
        # difflib diff (quadratic; minutes for perf.search's thousands of layouts), which --tb=no
        # then throws away.
        env = {k: v for k, v in os.environ.items() if k not in ("CI", "BUILD_NUMBER")}
        procs.append((subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                       env=dict(env, PYTHONPATH=str(ROOT))), report, log))
    fates = []
    for proc, report, log in procs:
        try:
            proc.wait(timeout=2400)
        except subprocess.TimeoutExpired:
            for other, _, _ in procs:
                other.kill()
            raise AssertionError(f"the mutants of {groups} took over 40 minutes; the end of one log:\n"
                                 + (tmp_path / log.name).read_text()[-3000:]) from None
        log.close()
        assert report.exists(), (tmp_path / log.name).read_text()[-4000:]
        fates += json.loads(report.read_text())
    return fates


def test_every_mutant_loses_its_task(tmp_path):
    known = mutants.load(ROOT)
    stale = []
    for mutant in known:   # one whose find text is gone would mutate nothing
        try:
            mutant.source(ROOT)
        except mutants.StaleMutant as error:
            stale.append(str(error))
    assert not stale, "\n".join(stale)
    tasks = workspace.tasks(ROOT / "labkit")
    covered = {m.module for m in known}   # the chapters with a mutants file
    per_task = {t: [m for m in known if m.task == t] for t in tasks if t.split(".")[0] in covered}
    thin = sorted(t for t, ms in per_task.items() if len(ms) < 2)
    assert not thin, f"every graded task needs at least two mutants; too few for {thin}"
    modules = sorted(covered, key=lambda m: list(grading.CHAPTERS.values()).index(m))
    record = mutants.load_record(ROOT)
    groups = mutants.balance(modules, known, record["seconds"], parts=2)
    start = time.monotonic()
    fates = run_in_parallel(groups, tmp_path)
    elapsed = time.monotonic() - start
    killed = [f for f in fates if f["killed"]]
    as_recorded = sum(record["first"].get(f["mutant"]) == f["by"] for f in killed)
    lines = [f"mutants killed: {len(killed)} of {len(known)} ({elapsed:.0f} s; "
             f"{as_recorded} by the test that killed them last time)"]
    if as_recorded < len(killed):
        lines.append(f"  to try this run's killers first next time: cp {RECORD.relative_to(ROOT)} "
                     f"{mutants.FIRST_FILE}")
    lines += [f"  SURVIVED {f['mutant']}: {f['why']}" for f in fates if not f["killed"]]
    SUMMARY.parent.mkdir(exist_ok=True)
    SUMMARY.write_text("\n".join(lines) + "\n")
    RECORD.write_text(json.dumps(mutants.record_of(fates), indent=1, sort_keys=True) + "\n")
    assert {f["mutant"] for f in fates} == {m.id for m in known}, "a mutant did not run"
    assert len(killed) == len(known), "\n".join(lines)
