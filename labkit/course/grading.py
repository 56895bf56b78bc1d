"""Grading: tasks and points on tests, a pytest plugin that records them, score tables,
short failure reports, and Gradescope's ``results.json``.

A graded test names its task and carries points::

    from labkit.course.grading import run_graded, task

    @task("collectives.all_reduce", points=2)
    def test_matches_builtin(world_size):
        run_graded("collectives.all_reduce", check_on_rank, world_size)

``labkit grade [chapter | task id ...]`` (``labkit.course.cli``) runs the chapter's tests
(``tests/grading/test_<module>.py``) of the course tree you stand in, in a fresh pytest
process that imports *that tree's* labkit, and prints one short block per failing test
and a table of points per task. The plugin below refuses to grade a tree whose labkit is
not the one imported: a stubbed workspace must never be graded with the reference code.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

from labkit.course import workspace

# Chapter number -> exercise module; tests live in tests/grading/test_<module>.py.
CHAPTERS = {"00": "collectives", "01": "dp", "02": "ddp", "03": "zero", "04": "fsdp",
            "05": "tp", "06": "pp", "07": "sp", "08": "mesh", "09": "elastic"}
OUTPUT_LIMIT = 4000    # characters of failure text kept per test in results.json
TIMEOUT_ENV = "LABKIT_GRADE_TIMEOUT"  # caps every graded launch's timeout (autograders set it)


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


# ----------------------------------------------------------------------------- in tests


class GradedFailure(AssertionError):
    """A graded launch that failed: what the grader prints about it, short and long.

    ``str()`` is the one-paragraph report: the task, the world size, what went wrong
    (which rank raised what, or who waited where). ``details`` holds the remote traceback
    or every rank's stack, for ``labkit grade --verbose``.
    """

    def __init__(self, task_id: str, world_size: int, kind: str, headline: str, details: str):
        self.task, self.world_size, self.kind, self.details = task_id, world_size, kind, details
        super().__init__(f"{task_id}: {kind} at world size {world_size}: {headline}" if kind != "skipped"
                         else f"{task_id}: {headline} (world size {world_size} not run)")


# Test function -> (what happened, world size) of its first launch that hung or met a stub:
# the rest of its world sizes fail at once instead of hanging again, or of starting ranks
# only to meet the same NotImplementedError (one pytest process grades a whole run).
_given_up: dict[str, tuple[str, int]] = {}


def run_graded(task_id: str, fn, world_size: int, *args, timeout: float = 60, **kwargs) -> list:
    """``labkit.launch`` for a graded test: any failure is reported under the task's id."""
    from labkit.launch import Deadlock, LaunchError, LaunchTimeout, WorkerError, launch
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split("[")[0].split(" ")[0]
    if test in _given_up:
        what, size = _given_up[test]
        raise GradedFailure(task_id, world_size, "skipped", f"skipped: {what} at world size {size}", "")
    cap = os.environ.get(TIMEOUT_ENV)
    timeout = min(timeout, float(cap)) if cap else timeout
    try:
        return launch(fn, world_size, *args, timeout=timeout, **kwargs)
    except WorkerError as error:
        headline = f"rank {error.rank} raised {error.exc_type}: {error.message}"
        if error.exc_type == "NotImplementedError" and workspace.STUB_MESSAGE.match(error.message):
            # a stub raises at every world size (torch's own NotImplementedError may not)
            _given_up[test] = (f"{error.exc_type}: {error.message}", world_size)
        raise GradedFailure(task_id, world_size, "failed", headline, error.remote_traceback) from None
    except Deadlock as error:
        _given_up[test] = ("deadlocked", world_size)
        verdict = str(error).split("\n\nwhere each rank was:")[0]
        raise GradedFailure(task_id, world_size, "deadlocked", verdict, str(error)) from None
    except LaunchTimeout as error:
        _given_up[test] = ("hung", world_size)
        where = "; ".join(f"rank {r}: {_innermost(stack)}" for r, stack in sorted(error.stacks.items()))
        raise GradedFailure(task_id, world_size, "hung",
                            f"no result within {error.timeout:g} s ({where})", str(error)) from None
    except LaunchError as error:
        raise GradedFailure(task_id, world_size, "failed", str(error), str(error)) from None


def _innermost(stack: str) -> str:
    """'file.py:12 in fn' for the innermost frame outside torch, or the stack's own note."""
    from labkit.course.deadlock import FRAME, location
    for file, line, fn in FRAME.findall(stack):
        if "/torch/" not in file:
            return f"{location(file, int(line))} in {fn}"
    return stack.strip().strip("()") or "?"


# ----------------------------------------------------------------------------- pytest plugin


def pytest_addoption(parser):
    group = parser.getgroup("labkit grading")
    group.addoption("--grade-report", default=None, metavar="PATH",
                    help="labkit: write each graded test's task, points and outcome to PATH (JSON)")
    group.addoption("--grade-task", action="append", default=[], metavar="TASK",
                    help="labkit: run only the graded tests of this task id (repeatable)")
    group.addoption("--grade-progress-fd", type=int, default=None, metavar="FD",
                    help="labkit: write one line per finished graded test to this file descriptor")


def pytest_configure(config):
    """Refuse to grade a tree with another tree's code: the labkit imported must be this one."""
    import labkit
    root = Path(str(config.rootpath)).resolve()
    imported = Path(labkit.__file__).resolve().parent.parent
    if (root / "labkit").is_dir() and imported != root:
        raise pytest.UsageError(
            f"labkit grading: these tests belong to {root}, but Python imported labkit from "
            f"{imported}. Grading them would grade the wrong code. Run `labkit grade` inside "
            f"{root} (it imports that tree's labkit), or `pip install -e .` there.")


def pytest_collection_modifyitems(config, items):
    known = known_tasks(Path(str(config.rootpath)))
    problems, wanted = [], set(config.getoption("--grade-task"))
    unknown_wanted = wanted - known
    if unknown_wanted:
        problems.append(f"no such task {sorted(unknown_wanted)}; known: {sorted(known)}")
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
    if wanted:
        keep = [i for i in items if (m := i.get_closest_marker("grade")) and m.args[0] in wanted]
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


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
        outcome="passed", output="", details="", frame=""))
    if report.failed or (report.skipped and record["outcome"] == "passed"):
        record["outcome"] = "failed" if report.failed else "skipped"
        error = call.excinfo.value if call.excinfo is not None else None
        record["output"] = _failure_text(report, error)
        record["details"] = getattr(error, "details", "") or str(report.longrepr)
        record["frame"] = learner_frame(record["details"] + "\n" + str(report.longrepr))
    if report.when == "teardown":
        _progress(item.config, record)


def _progress(config, record: dict) -> None:
    fd = config.getoption("--grade-progress-fd")
    if fd is None:
        return
    mark = {"passed": "pass", "failed": "FAIL", "skipped": "skip"}[record["outcome"]]
    test = record["name"].split("::", 1)[-1]
    os.write(fd, f"  {mark}  {record['task']:<28} {test}\n".encode())


def pytest_sessionfinish(session):
    path = session.config.getoption("--grade-report")
    if path:
        Path(path).write_text(json.dumps(list(_records.values()), indent=1))


def _failure_text(report, error) -> str:
    if isinstance(error, GradedFailure):
        return str(error)
    if isinstance(error, Exception):  # raised in the test process itself
        return f"{type(error).__name__}: {error}"
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message
    return str(report.longrepr)  # skips are (file, line, reason) tuples


def learner_frame(text: str) -> str:
    """The innermost frame of a traceback or stack that lies in an exercise module:
    'labkit/collectives.py:85 in ring_all_gather' plus its source line, or ''."""
    exercise = "|".join(CHAPTERS.values())
    pattern = (r'File "([^"]*labkit/(?:' + exercise + r')\.py)", line (\d+),? in (\S+)(?:\n {4}(\S.*))?')
    frames = re.findall(pattern, text)
    if not frames:
        return ""
    file, line, fn, source = frames[-1] if "most recent call last" in text else frames[0]
    where = f"labkit/{os.path.basename(file)}:{line} in {fn}"
    return where + (f"\n      {source.strip()}" if source else "")


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
        if available[module] not in files:
            files.append(available[module])
    return files


def split_selection(names: list[str]) -> tuple[list[str], list[str]]:
    """``labkit grade`` arguments: chapters ('00', 'ddp') and task ids ('ddp.bucketed')."""
    chapters = [n for n in names if "." not in n]
    tasks = [n for n in names if "." in n]
    return chapters + [t.split(".")[0] for t in tasks], tasks


def run_tests(files: list[Path], root: Path, extra_args=(), tasks=(), verbose: bool = False,
              progress: bool = True, env=None) -> tuple[list[dict], str]:
    """Run the graded tests of ``root`` in a fresh pytest process that imports ``root``'s
    labkit; return (one record per test, pytest's own output unless it was streamed)."""
    with tempfile.TemporaryDirectory(prefix="labkit-grade-") as tmp:
        report, log = Path(tmp) / "report.json", Path(tmp) / "pytest.log"
        env = dict(env or os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
        cmd = [sys.executable, "-m", "pytest", *map(str, files), "-p", "no:cacheprovider",
               "-o", "addopts=", f"--rootdir={root}", f"--grade-report={report}",
               *[f"--grade-task={t}" for t in tasks], *extra_args]
        if verbose:
            cmd += ["-v", "--tb=long", "-rN"]
            proc = subprocess.run(cmd, cwd=root, env=env)
            output = ""
        else:
            cmd += ["-q", "--tb=no", "-rN", "-p", "no:warnings"]
            fds = ()
            if progress:  # a copy of our stdout: pytest captures fd 1 itself while tests run
                sys.stdout.flush()
                fds = (os.dup(sys.stdout.fileno()),)
                cmd.append(f"--grade-progress-fd={fds[0]}")
            try:
                with open(log, "w") as out:
                    proc = subprocess.run(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                          pass_fds=fds)
            finally:
                for fd in fds:
                    os.close(fd)
            output = log.read_text(errors="replace")
        if not report.exists():
            raise RuntimeError(f"pytest exited with status {proc.returncode} before grading "
                               f"anything:\n{output[-3000:]}")
        return json.loads(report.read_text()), output


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


def is_stub_failure(record: dict) -> bool:
    """The test failed because its own task still raises its NotImplementedError stub."""
    return f"NotImplementedError: {record['task']}:" in record["output"]


def failure_block(record: dict) -> str:
    """What a learner needs about one failed test: which, why, and where in their code."""
    test = record["name"].split("::", 1)[-1]
    message = record["output"].removeprefix(f"{record['task']}: ")
    lines = [f"FAILED {record['task']} · {test}"]
    lines += [f"  {line}" for line in message.splitlines()[:12]]
    if record.get("frame") and not is_stub_failure(record):
        lines.append(f"  your code: {record['frame']}")
    return "\n".join(lines)


def failure_report(records: list[dict]) -> str:
    """Every failure, briefly: one line per task still a stub, one block per other failure."""
    failed = [r for r in records if r["outcome"] != "passed"]
    stubs: dict[str, list[dict]] = defaultdict(list)
    blocks = []
    for r in failed:
        if is_stub_failure(r):
            stubs[r["task"]].append(r)
        else:
            blocks.append(failure_block(r))
    lines = []
    for name, rs in stubs.items():
        where = rs[0]["frame"].split("\n")[0] if rs[0].get("frame") else ""
        lines.append(f"NOT IMPLEMENTED {name}: {len(rs)} test(s)" + (f" · {where}" if where else ""))
    return "\n".join(lines + blocks)


def gradescope_results(records: list[dict]) -> dict:
    """Gradescope autograder format: one entry per test, scores summed."""
    tests = []
    for r in records:
        earned = r["points"] if r["outcome"] == "passed" else 0.0
        output = "passed" if r["outcome"] == "passed" else failure_block(r)
        if r["outcome"] != "passed" and r.get("details"):
            output += "\n\n" + r["details"]
        if len(output) > OUTPUT_LIMIT:
            output = output[:OUTPUT_LIMIT] + "\n... (truncated)"
        tests.append(dict(name=f"{r['task']} :: {r['name']}", score=earned, max_score=r["points"],
                          output=output, visibility="visible"))
    return dict(score=sum(t["score"] for t in tests), max_score=sum(t["max_score"] for t in tests),
                tests=tests)
