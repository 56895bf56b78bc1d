"""Grading: tasks and points on tests, a pytest plugin that records them, score tables,
and Gradescope's ``results.json``.

A graded test names its task and carries points::

    from labkit.grading import task

    @task("collectives.all_reduce", points=2)
    def test_matches_builtin(world_size): ...

``labkit grade [chapter] [--json results.json]`` runs the chapter's tests
(``tests/grading/test_<module>.py``) in a fresh pytest process, prints a table of points
per task and optionally writes the Gradescope file (``score``, ``max_score``,
``tests[]`` with ``name``, ``score``, ``max_score``, ``output``, ``visibility``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

from labkit import workspace

# Chapter number -> exercise module; tests live in tests/grading/test_<module>.py.
CHAPTERS = {"00": "collectives", "01": "dp", "02": "ddp", "03": "zero", "04": "fsdp",
            "05": "tp", "06": "pp", "07": "sp", "08": "mesh", "09": "elastic"}
OUTPUT_LIMIT = 4000  # characters of failure text kept per test in results.json


def task(task_id: str, points: float = 1):
    """Mark a test as graded: it belongs to ``task_id`` and is worth ``points``."""
    return pytest.mark.grade(task_id, points=points)


def known_tasks(root: Path | None = None) -> set[str]:
    """Task ids of this tree: from the solution regions, or the workspace's list of them."""
    root = root or workspace.package_dir().parent
    marker = root / workspace.MARKER_FILE
    if marker.exists():
        return set(marker.read_text().split())
    return set(workspace.tasks(root / "labkit"))


# ----------------------------------------------------------------------------- pytest plugin


def pytest_addoption(parser):
    parser.addoption("--grade-report", default=None, metavar="PATH",
                     help="labkit: write each graded test's task, points and outcome to PATH (JSON)")


def pytest_collection_modifyitems(config, items):
    known = known_tasks(Path(str(config.rootpath)))
    problems = []
    for item in items:
        marker = item.get_closest_marker("grade")
        if marker is None:
            if "grading" in Path(str(item.path)).parts:
                problems.append(f"{item.nodeid}: a test under tests/grading needs @task(<id>, points=...)")
            continue
        if not marker.args or marker.args[0] not in known:
            problems.append(f"{item.nodeid}: unknown task {marker.args[:1]}; known: {sorted(known)}")
    if problems:
        raise pytest.UsageError("labkit grading:\n  " + "\n  ".join(problems))


_records: dict[str, dict] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    marker = item.get_closest_marker("grade")
    if marker is None:
        return
    record = _records.setdefault(item.nodeid, dict(
        name=item.nodeid, task=marker.args[0], points=float(marker.kwargs.get("points", 1)),
        outcome="passed", output=""))
    if report.failed or (report.skipped and record["outcome"] == "passed"):
        record["outcome"] = "failed" if report.failed else "skipped"
        record["output"] = _failure_text(report)


def pytest_sessionfinish(session):
    path = session.config.getoption("--grade-report")
    if path:
        Path(path).write_text(json.dumps(list(_records.values()), indent=1))


def _failure_text(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message
    return str(report.longrepr)  # skips are (file, line, reason) tuples


# ----------------------------------------------------------------------------- running


@dataclass
class TaskScore:
    task: str
    passed: int
    total: int
    score: float
    max_score: float


def grading_files(chapters: list[str], root: Path) -> list[Path]:
    """The grading test files of the named chapters (number or module name; none = all)."""
    grading = root / "tests" / "grading"
    available = {p.stem.removeprefix("test_"): p for p in sorted(grading.glob("test_*.py"))}
    if not chapters:
        return list(available.values())
    files = []
    for name in chapters:
        module = CHAPTERS.get(name.zfill(2) if name.isdigit() else "", name)
        if module not in available:
            raise ValueError(f"no graded chapter {name!r}; available: {', '.join(available)}")
        files.append(available[module])
    return files


def run_tests(files: list[Path], root: Path, extra_args=()) -> list[dict]:
    """Run the graded tests in a fresh pytest process; return one record per test."""
    with tempfile.TemporaryDirectory(prefix="labkit-grade-") as tmp:
        report = Path(tmp) / "report.json"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
        cmd = [sys.executable, "-m", "pytest", *map(str, files), "-q", "-p", "no:cacheprovider",
               "-o", "addopts=", f"--grade-report={report}", *extra_args]
        proc = subprocess.run(cmd, cwd=root, env=env)
        if not report.exists():
            raise RuntimeError(f"pytest exited with status {proc.returncode} before grading anything")
        return json.loads(report.read_text())


def score_by_task(records: list[dict]) -> list[TaskScore]:
    by_task: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_task[r["task"]].append(r)
    scores = []
    for name, rs in sorted(by_task.items()):
        passed = [r for r in rs if r["outcome"] == "passed"]
        scores.append(TaskScore(name, len(passed), len(rs), sum(r["points"] for r in passed),
                                sum(r["points"] for r in rs)))
    return scores


def format_table(scores: list[TaskScore]) -> str:
    width = max([len("task")] + [len(s.task) for s in scores]) + 2
    lines = [f"{'task':<{width}}{'tests':>9}{'points':>12}"]
    for s in scores:
        lines.append(f"{s.task:<{width}}{f'{s.passed}/{s.total}':>9}{f'{s.score:g}/{s.max_score:g}':>12}")
    got, best = sum(s.score for s in scores), sum(s.max_score for s in scores)
    lines.append(f"{'total':<{width}}{'':>9}{f'{got:g}/{best:g}':>12}")
    return "\n".join(lines)


def gradescope_results(records: list[dict]) -> dict:
    """Gradescope autograder format: one entry per test, scores summed."""
    tests = []
    for r in records:
        earned = r["points"] if r["outcome"] == "passed" else 0.0
        output = r["output"]
        if len(output) > OUTPUT_LIMIT:
            output = output[:OUTPUT_LIMIT] + "\n... (truncated)"
        tests.append(dict(name=f"{r['task']} :: {r['name']}", score=earned, max_score=r["points"],
                          output=output or "passed", visibility="visible"))
    return dict(score=sum(t["score"] for t in tests), max_score=sum(t["max_score"] for t in tests),
                tests=tests)


# ----------------------------------------------------------------------------- in tests


def run_graded(task_id: str, fn, world_size: int, *args, timeout: float = 60, **kwargs) -> list:
    """``labkit.launch`` for a graded test: any failure is reported under the task's id."""
    from labkit.launch import LaunchError, launch
    try:
        return launch(fn, world_size, *args, timeout=timeout, **kwargs)
    except LaunchError as error:
        kind = "hung" if isinstance(error, TimeoutError) else "failed"
        raise AssertionError(f"{task_id}: {kind} at world size {world_size}: {error}") from None
