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

Scoring: a task earns its points only when every one of its tests passes, at every world
size; a test at world size 1 carries no points of its own (it stays as a diagnostic line).
Before each graded test the task's module is checked against ``labkit.course.rules``
(no PyTorch implementation of the technique in its place). Tests in
``tests/grading/hidden/`` grade like the others but are left out of learner workspaces.
With ``--mutants`` the plugin runs the mutation tests of ``labkit.course.mutants``.
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
from labkit.course.chapters import CHAPTERS, chapter_module, chapter_names  # noqa: F401 - CHAPTERS re-exported
from labkit.course.chapters import exercise_files, exercise_sources

HIDDEN_DIR = "hidden"  # tests/grading/hidden/: graded, left out of learner workspaces
OUTPUT_LIMIT = 4000    # characters of failure text kept per test in results.json
TIMEOUT_ENV = "LABKIT_GRADE_TIMEOUT"  # caps every graded launch's timeout (autograders set it)
REPORT_ENV = "LABKIT_GRADE_REPORT"    # where the report goes: the environment, not a command line in /proc


def task(task_id: str, points: float = 1):
    """Mark a test as graded: it belongs to ``task_id`` and is worth ``points``."""
    return pytest.mark.grade(task_id, points=points)


def known_tasks(root: Path | None = None) -> set[str]:
    """Task ids of this tree: from the solution regions, or the workspace's list of them."""
    root = root or workspace.package_dir().parent
    if (root / workspace.MARKER_FILE).exists():
        return set(workspace.listed_tasks(root))
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
_active_mutant = ""   # the mutant swapped in for the running test ("" = the tree's own code)


def run_graded(task_id: str, fn, world_size: int, *args, timeout: float = 60, **kwargs) -> list:
    """``labkit.launch`` for a graded test: any failure is reported under the task's id."""
    __tracebackhide__ = True  # pytest shows the test and the rank's traceback, not this frame
    from labkit.launch import Deadlock, LaunchError, LaunchTimeout, WorkerError, launch
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split("[")[0].split(" ")[0] + _active_mutant
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
    from labkit.runtime.deadlock import FRAME, location
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
    group.addoption("--mutants", action="store_true",
                    help="labkit: run every graded test against the wrong implementations in tests/mutants")
    group.addoption("--mutant", action="append", default=[], metavar="ID",
                    help="labkit: with --mutants, only this mutant (task/name; repeatable)")
    group.addoption("--mutants-report", default=None, metavar="PATH",
                    help="labkit: with --mutants, write each mutant's fate to PATH (JSON)")


def pytest_configure(config):
    """Refuse to grade a tree with another tree's code: the labkit imported must be this one.
    Then hold every call of an exercise to its contracts (``labkit.course.contracts``), here
    and in every rank launched from here, before any test module imports an exercise."""
    import labkit
    from labkit.course import contracts
    config._labkit_report = config.getoption("--grade-report") or os.environ.pop(REPORT_ENV, None)
    root = Path(str(config.rootpath)).resolve()
    imported = Path(labkit.__file__).resolve().parent.parent
    if (root / "labkit").is_dir() and imported != root:
        raise pytest.UsageError(
            f"labkit grading: these tests belong to {root}, but Python imported labkit from "
            f"{imported}. Grading them would grade the wrong code. Run `labkit grade` inside "
            f"{root} (it imports that tree's labkit), or `pip install -e .` there.")
    config._labkit_contracts = contracts.enable()


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
    if config.getoption("--mutants"):
        # One mutant at a time, stopping at its first failure: the test that killed it last
        # time first (labkit.course.mutants.load_record), its world-size-1 diagnostics last.
        from labkit.course import mutants
        first = mutants.load_record(Path(str(config.rootpath)))["first"]
        keep = [i for i in items if _mutant_of(i) is not None]
        config.hook.pytest_deselected(items=[i for i in items if _mutant_of(i) is None])
        order = {id(i): n for n, i in enumerate(keep)}

        def key(item):
            mutant = _mutant_of(item)
            listed = first.get(mutant.id) == item.nodeid.split("::", 1)[-1]
            return mutant.id, not listed, _world_size(item) == 1, order[id(item)]
        keep.sort(key=key)
        items[:] = keep


def _world_size(item) -> int | None:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("world_size") if callspec else None


def _mutant_of(item):
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("labkit_exercise") if callspec else None


def pytest_generate_tests(metafunc):
    """With --mutants: every graded test once per mutant of its task."""
    marker = metafunc.definition.get_closest_marker("grade")
    if marker is None or not metafunc.config.getoption("--mutants"):
        return
    chosen = [m for m in _mutants(metafunc.config) if m.task == marker.args[0]]
    metafunc.config._labkit_mutants_used.update(m.id for m in chosen)  # only these are reported
    if chosen:
        metafunc.parametrize("labkit_exercise", chosen, indirect=True, ids=[m.name for m in chosen])


def _mutants(config) -> list:
    if not hasattr(config, "_labkit_mutants"):
        from labkit.course import mutants
        generated = os.environ.get(mutants.GENERATED_ENV)   # labkit mutate's, instead of tests/mutants
        found = mutants.load_file(generated) if generated else mutants.load(Path(str(config.rootpath)))
        wanted = set(config.getoption("--mutant"))
        unknown = wanted - {m.id for m in found}
        if unknown:
            raise pytest.UsageError(f"labkit grading: no such mutant {sorted(unknown)}")
        config._labkit_mutants = [m for m in found if not wanted or m.id in wanted]
        config._labkit_fates = {}
        config._labkit_mutants_used = set()
    return config._labkit_mutants


@pytest.fixture(autouse=True)
def labkit_contracts(request):
    """Around every graded test: the ranks it launches check every exercise call's contracts
    too (``labkit.runtime.contracts``; this process checks them from the start)."""
    from labkit.runtime.contracts import CONTRACTS_ENV
    exported = getattr(request.config, "_labkit_contracts", None)
    if request.node.get_closest_marker("grade") is None or not exported:
        yield
        return
    before = os.environ.get(CONTRACTS_ENV)
    os.environ[CONTRACTS_ENV] = exported
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(CONTRACTS_ENV, None)
        else:
            os.environ[CONTRACTS_ENV] = before


@pytest.fixture(autouse=True)
def labkit_exercise(request):
    """Around every graded test: the task's module may not use PyTorch's implementation of
    the technique (``labkit.course.rules``); under --mutants, the mutant is swapped in."""
    global _active_mutant
    marker = request.node.get_closest_marker("grade")
    mutant = getattr(request, "param", None)
    if marker is None:
        yield None
        return
    from labkit.course import policy
    root = Path(str(request.config.rootpath))
    if mutant is None:
        sources = exercise_sources(root / "labkit", marker.args[0].split('.')[0])
        if sources:
            policy.check_task(marker.args[0], sources)
        yield None
        return
    from labkit.course import mutants
    fates = request.config._labkit_fates
    if fates.get(mutant.id, {}).get("killed"):
        pytest.skip(f"mutant {mutant.id} killed already")
    policy.check_task(marker.args[0], mutant.sources(root))
    path = mutants.write_source(mutant, root)
    overrides = {mutant.module: str(path)}
    saved = mutants.install_overrides(overrides)
    before = os.environ.get(mutants.OVERRIDES_ENV)
    os.environ[mutants.OVERRIDES_ENV] = json.dumps(overrides)
    _active_mutant = "/" + mutant.id
    try:
        yield mutant
    finally:
        _active_mutant = ""
        if before is None:
            os.environ.pop(mutants.OVERRIDES_ENV, None)
        else:
            os.environ[mutants.OVERRIDES_ENV] = before
        mutants.restore(saved)


_records: dict[str, dict] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    marker = item.get_closest_marker("grade")
    if marker is None:
        return
    mutant = _mutant_of(item)
    if mutant is not None:
        _mutant_fate(item.config, mutant, item, report, call)
        return
    size = _world_size(item)
    record = _records.setdefault(item.nodeid, dict(
        name=item.nodeid, task=marker.args[0],
        points=0.0 if size == 1 else float(marker.kwargs.get("points", 1)),  # N = 1: diagnostic
        world_size=size, hidden="hidden" in Path(str(item.path)).parent.name,
        outcome="passed", output="", details="", frame=""))
    if report.failed or (report.skipped and record["outcome"] == "passed"):
        record["outcome"] = "failed" if report.failed else "skipped"
        error = call.excinfo.value if call.excinfo is not None else None
        if getattr(error, "details", ""):  # the rank's own traceback, printed as lines
            size = getattr(error, "world_size", None)   # a GradedFailure's; a judge's child may carry none
            report.sections.append((f"where it failed{f' (world size {size})' if size else ''}", error.details))
        record["output"] = unescape_tracebacks(_failure_text(report, error))
        record["details"] = unescape_tracebacks(getattr(error, "details", "") or str(report.longrepr))
        record["frame"] = learner_frame(record["details"] + "\n" + str(report.longrepr))
    if report.when == "teardown":
        _progress(item.config, record)


def _mutant_fate(config, mutant, item, report, call) -> None:
    fate = config._labkit_fates.setdefault(mutant.id, dict(mutant=mutant.id, task=mutant.task, why=mutant.why,
                                                           killed=False, by="", tests=0, seconds=0.0))
    fate["seconds"] += report.duration
    if report.when == "call" or report.failed:
        fate["tests"] += report.when == "call"
    from labkit.course import mutants
    error = call.excinfo.value if call.excinfo is not None else None
    if isinstance(error, mutants.StaleMutant):   # it mutated nothing: never a kill
        fate["why"] = f"STALE, not run: {error}"
        return
    if report.failed and not fate["killed"]:
        fate.update(killed=True, by=item.nodeid.split("::", 1)[-1],
                    message=_failure_text(report, error).splitlines()[0][:300] if _failure_text(report, error) else "")


def pytest_terminal_summary(terminalreporter, config):
    if not config.getoption("--mutants") or not hasattr(config, "_labkit_fates"):
        return
    fates = [config._labkit_fates.get(m.id, dict(mutant=m.id, task=m.task, why=m.why, killed=False,
                                                by="", tests=0))
             for m in config._labkit_mutants if m.id in config._labkit_mutants_used]
    write = terminalreporter.write_line
    write("")
    for fate in fates:
        if fate["killed"]:
            write(f"killed    {fate['mutant']:<44} by {fate['by']}: {fate.get('message', '')[:160]}")
        else:
            write(f"SURVIVED  {fate['mutant']:<44} ({fate['why']}) passed {fate['tests']} test(s)")
    killed = sum(f["killed"] for f in fates)
    write(f"mutants killed: {killed} of {len(fates)}")
    path = config.getoption("--mutants-report")
    if path:
        Path(path).write_text(json.dumps(fates, indent=1))


def _progress(config, record: dict) -> None:
    fd = config.getoption("--grade-progress-fd")
    if fd is None:
        return
    mark = {"passed": "pass", "failed": "FAIL", "skipped": "skip"}[record["outcome"]]
    test = record["name"].split("::", 1)[-1]
    os.write(fd, f"  {mark}  {record['task']:<28} {test}\n".encode())


def pytest_sessionfinish(session):
    path = getattr(session.config, "_labkit_report", None)
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


def unescape_tracebacks(text: str) -> str:
    """A traceback quoted inside a message's repr (pytest.raises(match=...) prints the
    message that way) reads as one long escaped line: turn it back into lines."""
    if "Traceback (most recent call last):\\n" not in text:
        return text
    return text.replace("\\n", "\n").replace("\\'", "'").replace('\\"', '"')


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
    hidden = {p.stem.removeprefix("test_"): p for p in sorted((grading / HIDDEN_DIR).glob("test_*.py"))}
    modules = list(available)
    if chapters:
        modules = []
        for name in chapters:
            module = chapter_module(name) or name
            if module not in available:
                raise ValueError(f"no graded chapter {name!r}; available: {', '.join(available)}")
            if module not in modules:
                modules.append(module)
    return [f for m in modules for f in (available[m], hidden.get(m)) if f is not None]


def resolve_selection(names: list[str], root: Path) -> tuple[list[str], list[str]]:
    """``labkit grade`` arguments, every one checked before anything runs: (chapter modules,
    task ids). A chapter may be named by number, module, title or lab (``12``, ``recompute``,
    ``memory``, ``12_memory``); anything else raises ValueError with a did-you-mean."""
    known = known_tasks(root)
    chapters, tasks = [], []
    for name in names:
        module = chapter_module(name)
        if module is None and name in known:
            tasks.append(name)
            module = name.split(".")[0]
        if module is None:
            raise ValueError(unknown_selection(name, known))
        if module not in chapters:
            chapters.append(module)
    return chapters, tasks


def unknown_selection(name: str, known: set[str]) -> str:
    """One sentence for a name that is neither a chapter nor a task, with the closest ones."""
    import difflib
    candidates = sorted(known) if "." in name else [*CHAPTERS.values(), *sorted(chapter_names()), *sorted(known)]
    close = list(dict.fromkeys(difflib.get_close_matches(name.lower(), candidates, n=2, cutoff=0.75)))
    kind = "task" if "." in name else "chapter or task"
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    chapters = ", ".join(f"{n} {m}" for n, m in CHAPTERS.items())
    return (f"no {kind} {name!r}; {hint}(`labkit tasks` lists every task id; chapters: {chapters})")


def split_selection(names: list[str]) -> tuple[list[str], list[str]]:
    """``labkit grade`` arguments: chapters ('00', 'ddp') and task ids ('ddp.bucketed')."""
    chapters = [n for n in names if "." not in n]
    tasks = [n for n in names if "." in n]
    return chapters + [t.split(".")[0] for t in tasks], tasks


def run_tests(files: list[Path], root: Path, extra_args=(), tasks=(), verbose: bool = False,
              progress: bool = True, env=None, judge: bool = False) -> tuple[list[dict], str]:
    """Run the graded tests of ``root`` in a fresh pytest process that imports ``root``'s
    labkit; return (one record per test, pytest's own output unless it was streamed).
    ``judge``: the submission never runs in that process (``labkit.course.judge``)."""
    with tempfile.TemporaryDirectory(prefix="labkit-grade-") as tmp:
        report, log = Path(tmp) / "report.json", Path(tmp) / "pytest.log"
        env = dict(env or os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
        env[REPORT_ENV] = str(report)
        if judge:
            env["LABKIT_JUDGE"] = "1"
            extra_args = ["-p", "labkit.course.judge", *extra_args]
        cmd = [sys.executable, "-m", "pytest", *map(str, files), "-p", "no:cacheprovider",
               "-o", "addopts=", f"--rootdir={root}",
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
        if judge:  # nothing of the submission may be running when the report is read
            from labkit.runtime import sandbox
            sandbox.kill_student()
        if not report.exists():
            raise RuntimeError(f"pytest exited with status {proc.returncode} before grading "
                               f"anything:\n{output[-3000:]}")
        return json.loads(report.read_text()), output


def score_by_task(records: list[dict]) -> list[TaskScore]:
    """Points per task, in chapter order. A task earns its points only when every one of
    its tests passed: a wrong implementation that fails one world size earns nothing."""
    by_task: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_task[r["task"]].append(r)
    scores = []
    for name, rs in sorted(by_task.items(), key=lambda kv: task_order(kv[0])):
        passed = [r for r in rs if r["outcome"] == "passed"]
        best = sum(r["points"] for r in rs)
        scores.append(TaskScore(name, len(passed), len(rs), best if len(passed) == len(rs) else 0.0, best))
    return scores


def task_order(task_id: str) -> tuple:
    """Chapter order (00 collectives ... 09 elastic), then the task's place in its module."""
    module = task_id.split(".")[0]
    chapter = next((int(n) for n, m in CHAPTERS.items() if m == module), 99)
    return chapter, _order_in_module(module).get(task_id, 999), task_id


def _order_in_module(module: str) -> dict[str, int]:
    order: dict[str, int] = {}
    for path in exercise_files(workspace.package_dir(), module):
        for region in workspace.find_regions(path) or workspace.find_stubs(path):
            order.setdefault(region.task, len(order))
    return order


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


def stub_dependency(record: dict) -> str | None:
    """The other task whose stub this test met (it uses that task's code), or None."""
    m = re.search(rf"NotImplementedError: ({workspace.TASK_ID}):", record["output"] + "\n" + record.get("details", ""))
    return m.group(1) if m and m.group(1) != record["task"] else None


def failure_report(records: list[dict]) -> str:
    """Every failure, briefly: first the tasks that wait on another task's stub (implement
    that one first), then one line per task still a stub, then one block per other failure."""
    failed = [r for r in records if r["outcome"] != "passed"]
    stubs: dict[str, list[dict]] = defaultdict(list)
    needs: dict[str, tuple[str, str]] = {}
    blocks = []
    for r in failed:
        other = stub_dependency(r)
        if other and not is_stub_failure(r):
            where = (r.get("frame") or "").split("\n")[0]
            needs.setdefault(r["task"], (other, f" ({where})" if where else ""))
        elif is_stub_failure(r):
            stubs[r["task"]].append(r)
        else:
            blocks.append(failure_block(r))
    lines = [f"NEEDS {other}: {name} uses your {other}{where}, still a stub: implement {other} first"
             for name, (other, where) in needs.items()]
    for name, rs in stubs.items():
        where = rs[0]["frame"].split("\n")[0] if rs[0].get("frame") else ""
        lines.append(f"NOT IMPLEMENTED {name}: {len(rs)} test(s)" + (f" · {where}" if where else ""))
    return "\n".join(lines + blocks)


def _without_repeats(details: str, shown: str) -> str:
    """The lines of ``details`` that do not say again what ``shown`` says (pytest's last line,
    ``E   ...GradedFailure: <task>: <message>``, and a rank's ``SomeError: <message>`` repeat
    the message the block above printed)."""
    flat = " ".join(shown.split())

    def repeats(line: str) -> bool:
        text = re.sub(r"^E\s+", "", line.strip())
        text = re.sub(r"^[\w.]+(Error|Failure|Exception|Timeout|Deadlock)\b:\s*", "", text)
        text = " ".join(text.split())
        return len(text) > 20 and (text in flat or text.split(": ", 1)[-1] in flat)

    return "\n".join(line for line in details.splitlines() if not repeats(line)).strip()


def gradescope_results(records: list[dict]) -> dict:
    """Gradescope autograder format: one entry per test, scores summed. A test scores only
    when its whole task passed; hidden tests are shown once the grades are published."""
    tests = []
    incomplete = {s.task: s for s in score_by_task(records) if s.passed < s.total}
    for r in records:
        earned = r["points"] if r["outcome"] == "passed" and r["task"] not in incomplete else 0.0
        if r["outcome"] != "passed":
            output = failure_block(r)
        elif r["task"] in incomplete:
            missing = incomplete[r["task"]]
            output = (f"passed; but {r['task']} earns its points only when all of its tests pass "
                      f"({missing.total - missing.passed} of {missing.total} failed)")
        else:
            output = "passed"
        if r.get("points") == 0 and r.get("world_size") == 1:
            output += " (world size 1: a diagnostic, no points of its own)"
        if r["outcome"] != "passed" and r.get("details"):
            details = _without_repeats(r["details"], output)
            if details:
                output += "\n\n" + details
        if len(output) > OUTPUT_LIMIT:
            output = output[:OUTPUT_LIMIT] + "\n... (truncated)"
        tests.append(dict(name=f"{r['task']} :: {r['name']}", score=earned, max_score=r["points"],
                          output=output, visibility="after_published" if r.get("hidden") else "visible"))
    return dict(score=sum(t["score"] for t in tests), max_score=sum(t["max_score"] for t in tests),
                tests=tests)
