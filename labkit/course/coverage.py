"""Per-task coverage of the solution regions: which lines and branches between
``# BEGIN SOLUTION <task>`` and ``# END SOLUTION`` that task's own graded tests execute.

A line of a wrong implementation that no test reaches keeps its marks, so every line and
every branch of a region must run under its own task's graded tests (coverage.py, with
branches). ``labkit coverage [chapter|task ...]`` runs the graded tests under coverage and
prints the table. As a pytest plugin (``tests/conftest.py``), this module measures any run
when ``LABKIT_COVERAGE=1`` and every CI run (``LABKIT_CI=1``), xdist workers included, and
ends it with the gaps of the tasks whose graded tests all ran (a partial run checks only
those); CI fails on a gap once ``GATE`` is True.

How it is measured. Every process that runs exercise code records coverage.py data into
one folder (``LABKIT_COVERAGE``), one file per process, under a context named by the task:
the pytest process (or each xdist worker) switches its context to the task of the graded
test it runs, and exports the task in ``LABKIT_COVERAGE_TASK`` for the duration of the test,
so the ranks ``labkit.launch`` starts meanwhile record under it (``labkit.runtime.taskcov``).
A line or branch of task T's region counts only if it ran under T's context. A rank that is
killed (SIGKILL, or stopped after a peer failed) records nothing.

Exclusions. A line that no test can reach is named with its reason, either in source,
``... # coverage: <reason>`` (gone in a workspace, with the region), or in
``tests/coverage_exclusions.txt`` as ``<task> | <the line's text> | <reason>``. An excluded line
need not run, nor take every branch; a branch into it is not required either. A missing
reason, or an entry that names no line of its task, is an error.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from labkit.course import workspace
from labkit.runtime import taskcov
from labkit.runtime.taskcov import DIR_ENV, FILES_ENV, TASK_ENV  # noqa: F401 - re-exported

# On: CI (LABKIT_CI=1) fails on a gap in any task whose graded tests all ran; `labkit coverage`
# exits 1 on a gap either way. Every task reached 100% on 2026-11-27 (lines no input reaches
# are listed with their reasons in tests/coverage_exclusions.txt or a `# coverage:` pragma).
# (LABKIT_COVERAGE=0 turns the measurement off, in CI too: measured, the graded tests took
# ~35% more CPU under it, 208 -> 281 CPU-s for all of tests/grading; the other tests nothing.)
GATE = True

OWNER_ENV = "LABKIT_COVERAGE_OWNER"  # pid of the pytest process that owns the folder
EXCLUSIONS = "tests/coverage_exclusions.txt"
PRAGMA = re.compile(r"#\s*coverage:(.*)$")


# ----------------------------------------------------------------------------- recording


def measured_files(root: Path) -> list[str]:
    """The files that hold solution regions: the only ones coverage.py traces."""
    return sorted({str(r.path) for r in workspace.all_regions(root / "labkit")})


def start(context: str | None, root: Path):
    """Record the exercise modules of ``root`` in this process into ``$LABKIT_COVERAGE``
    (and in the ranks it launches while ``LABKIT_COVERAGE_TASK`` is set)."""
    os.environ[FILES_ENV] = os.pathsep.join(measured_files(root))
    return taskcov.start(context)


save = taskcov.save


# ----------------------------------------------------------------------------- analysis


@dataclass
class Gap:
    path: str   # relative to the course root
    line: int
    text: str
    what: str   # "not run", or the branch never taken


@dataclass
class TaskCoverage:
    task: str
    lines: int = 0
    lines_run: int = 0
    branches: int = 0
    branches_taken: int = 0
    excluded: int = 0
    gaps: list[Gap] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.lines_run == self.lines and self.branches_taken == self.branches


def exclusions(root: Path) -> tuple[dict[str, dict[tuple[Path, int], str]], list[str]]:
    """task -> {(file, line): reason} from the pragmas and the exclusions file, and errors."""
    found: dict[str, dict[tuple[Path, int], str]] = {}
    errors = []
    lines: dict[str, list[tuple[Path, int, str]]] = {}
    for region in workspace.all_regions(root / "labkit"):
        source = region.path.read_text().splitlines()
        for n in range(region.begin + 2, region.end + 1):  # 1-based body lines
            lines.setdefault(region.task, []).append((region.path, n, source[n - 1]))
            if m := PRAGMA.search(source[n - 1]):
                if not m[1].strip():
                    errors.append(f"{_rel(region.path, root)}:{n}: '# coverage:' without a reason")
                found.setdefault(region.task, {})[(region.path, n)] = m[1].strip()
    listed = root / EXCLUSIONS
    for i, entry in enumerate(listed.read_text().splitlines() if listed.exists() else [], 1):
        if not entry.strip() or entry.lstrip().startswith("#"):
            continue
        parts = [p.strip() for p in entry.split("|")]
        where = f"{EXCLUSIONS}:{i}"
        if len(parts) != 3 or not all(parts):
            errors.append(f"{where}: expected '<task> | <the line's text> | <reason>', got {entry.strip()!r}")
            continue
        task, text, reason = parts
        hits = [(p, n) for p, n, s in lines.get(task, []) if text in (s.strip(), s.split("#")[0].strip())]
        if not hits:
            errors.append(f"{where}: no line {text!r} in the solution regions of {task}")
        for hit in hits:
            found.setdefault(task, {})[hit] = reason
    return found, errors


def measure(folder: str | Path, root: Path, tasks: list[str]) -> tuple[list[TaskCoverage], list[str]]:
    """Combine the data files in ``folder``; the coverage of each task's regions, and the
    errors of the exclusions."""
    import coverage as coveragepy
    from coverage.python import PythonFileReporter
    from coverage.results import analysis_from_file_reporter

    cov = coveragepy.Coverage(data_file=os.path.join(folder, "combined"), branch=True, config_file=False)
    files = [str(p) for p in Path(folder).glob("cov.*")]
    cov.erase()
    if files:
        with warnings.catch_warnings():  # a rank killed while saving leaves an unreadable file: skipped
            warnings.simplefilter("ignore")
            cov.combine(files, keep=True)
    data = cov.get_data()
    excluded, errors = exclusions(root)
    regions = workspace.all_regions(root / "labkit")
    results = []
    for task in tasks:
        result = TaskCoverage(task)
        data.set_query_contexts([f"^{re.escape(task)}$"])
        skip = excluded.get(task, {})
        result.excluded = len(skip)
        for path in sorted({r.path for r in regions if r.task == task}):
            body = {n for r in regions if r.task == task and r.path == path for n in range(r.begin + 2, r.end + 1)}
            off = {n for p, n in skip if p == path}
            reporter = PythonFileReporter(str(path), coverage=cov)
            a = analysis_from_file_reporter(data, 0, reporter, str(path))
            source = path.read_text().splitlines()
            gap = lambda n, what: Gap(_rel(path, root), n, source[n - 1].strip(), what)  # noqa: E731
            statements = (a.statements & body) - off
            missing = a.missing & statements
            result.lines += len(statements)
            result.lines_run += len(statements) - len(missing)
            result.gaps += [gap(n, "not run") for n in sorted(missing)]
            branching = {n: count for n, count in a.exit_counts.items() if count > 1 and n in statements}
            untaken = {n: [t for t in ts if t not in off] for n, ts in a.missing_branch_arcs().items() if n in branching}
            into_off = sum(1 for s, t in a.arc_possibilities if s in branching and t in off)
            result.branches += sum(branching.values()) - into_off
            result.branches_taken += sum(branching.values()) - into_off - sum(map(len, untaken.values()))
            for n, targets in sorted(untaken.items()):
                if n not in missing:  # a line never run: its branches are counted, not repeated
                    result.gaps += [gap(n, reporter.missing_arc_description(n, t, a.arcs_executed)) for t in targets]
        result.gaps.sort(key=lambda g: (g.path, g.line))
        results.append(result)
    data.set_query_contexts(None)
    return results, errors


def _rel(path: Path, root: Path) -> str:
    return Path(path).resolve().relative_to(root.resolve()).as_posix()


def format_report(results: list[TaskCoverage], errors: list[str] = (), only_gaps: bool = False) -> str:
    width = max([len("task")] + [len(r.task) for r in results]) + 2
    shown = [r for r in results if not (only_gaps and r.complete)]
    lines = [f"{'task':<{width}}{'lines':>10}{'branches':>11}{'excluded':>10}"] if shown else []
    for r in shown:
        mark = "" if r.complete else "   <- below 100%"
        lines.append(f"{r.task:<{width}}{f'{r.lines_run}/{r.lines}':>10}{f'{r.branches_taken}/{r.branches}':>11}"
                     f"{r.excluded or '':>10}{mark}")
        for g in r.gaps:
            what = g.what if g.what == "not run" else re.sub(r"^line \d+ ", "", g.what)
            lines.append(f"    {g.path}:{g.line}: {g.text}    [{what}]")
    full = sum(r.complete for r in results)
    lines.append(f"{full} of {len(results)} tasks at 100% (lines and branches of their solution regions, "
                 f"run by their own graded tests)")
    lines += [f"exclusions: {e}" for e in errors]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- pytest plugin


_cov = None
_collected: dict[str, list[str]] = {}   # task -> its graded tests' node ids, as collected
_outcomes: dict[str, set[str]] = {}    # node id -> its reports' outcomes


def pytest_configure(config):
    """Record when asked (``LABKIT_COVERAGE``) or in CI; the first pytest process owns the
    folder, its xdist workers record into it, a pytest started by a test stays out."""
    global _cov
    mode = os.environ.get(DIR_ENV) or ("1" if os.environ.get("LABKIT_CI") == "1" else "")
    if mode in ("", "0") or config.getoption("--mutants", False):  # LABKIT_COVERAGE=0: off, even in CI
        return
    owner = os.environ.get(OWNER_ENV)
    if hasattr(config, "workerinput"):
        if owner != str(os.getppid()):
            return
    elif owner:
        return  # a pytest run inside a test of the covered run
    else:
        if mode == "1":
            mode = str(Path(str(config.rootpath)) / "build" / "coverage")
            shutil.rmtree(mode, ignore_errors=True)
            config._labkit_coverage_report = True
        os.makedirs(mode, exist_ok=True)
        os.environ[DIR_ENV], os.environ[OWNER_ENV] = mode, str(os.getpid())
    _cov = start(None, Path(str(config.rootpath)))
    if _cov is not None:
        _cov.stop()  # traced only while a graded test runs: the other tests pay nothing


def pytest_itemcollected(item):
    marker = item.get_closest_marker("grade")
    if _cov is not None and marker is not None:
        _collected.setdefault(marker.args[0], []).append(item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A graded test runs under its task's context, and so do the ranks it launches."""
    marker = item.get_closest_marker("grade")
    if _cov is None or marker is None:
        yield
        return
    _cov.start()
    _cov.switch_context(marker.args[0])
    os.environ[TASK_ENV] = marker.args[0]
    try:
        yield
    finally:
        os.environ.pop(TASK_ENV, None)
        _cov.stop()


def pytest_runtest_logreport(report):
    if _cov is not None and (report.failed or report.skipped or report.when == "call"):
        _outcomes.setdefault(report.nodeid, set()).add(report.outcome)


def pytest_sessionfinish(session):
    global _cov
    if _cov is None:
        return
    _cov.save()
    _cov = None
    folder = os.environ[DIR_ENV]
    outcomes = {nodeid: sorted(seen) for nodeid, seen in _outcomes.items()}
    Path(folder, f"tests.{os.getpid()}.json").write_text(json.dumps(dict(collected=_collected, outcomes=outcomes)))
    if not getattr(session.config, "_labkit_coverage_report", False):
        return
    try:
        results, errors, text = check(folder, Path(str(session.config.rootpath)))
    except Exception as error:  # noqa: BLE001 - a broken measurement is reported, not a crash
        results, errors, text = [], [repr(error)], f"could not measure: {error!r}"
    Path(folder, "report.txt").write_text(text + "\n")
    session.config._labkit_coverage_text = text
    if GATE and (errors or not all(r.complete for r in results)):
        session.config._labkit_coverage_text += "\ncoverage gate FAILED: every task must reach 100% (the run exits 1)"
        session.exitstatus = session.exitstatus or 1


def check(folder: str, root: Path) -> tuple[list[TaskCoverage], list[str], str]:
    """The tasks whose every graded test ran in this run (passed or skipped, one at least
    passed), measured: a run of one file, or of some tasks, checks those tasks only."""
    collected: dict[str, set[str]] = {}
    outcomes: dict[str, set[str]] = {}
    for f in Path(folder).glob("tests.*.json"):
        record = json.loads(f.read_text())
        for task, ids in record["collected"].items():
            collected.setdefault(task, set()).update(ids)
        for nodeid, seen in record["outcomes"].items():
            outcomes.setdefault(nodeid, set()).update(seen)
    from labkit.course.grading import task_order
    ran = {t for t, ids in collected.items() if all(outcomes.get(i) and "failed" not in outcomes[i] for i in ids)
           and any("passed" in outcomes[i] for i in ids)}
    tasks = sorted(ran, key=task_order)
    results, errors = measure(folder, root, tasks)
    return results, errors, format_report(results, errors, only_gaps=True)


def pytest_terminal_summary(terminalreporter, config):
    text = getattr(config, "_labkit_coverage_text", None)
    if text is not None:
        terminalreporter.write_sep("-", "coverage of the solution regions by their own task's tests"
                                   + ("" if GATE else " (not gating: GATE = False in labkit/course/coverage.py)"))
        terminalreporter.write_line(text)
