"""The judge: grading where the submission cannot reach the score (``labkit grade --judge``;
the autograder bundle always uses it). ARCHITECTURE.md ("Threat model") says what it defends
against and what it cannot see.

1. **Policy first** (``labkit.course.policy``): every submitted exercise module is read, never
   run, before any test starts; a module that breaks the policy earns none of its tasks' points
   (every graded test of it fails at once, naming file:line), and the breach is listed for the
   instructor (``flagged``).
2. **No submitted module in the judge's process**: this pytest plugin (``-p labkit.course.judge``)
   refuses any import of an exercise module in the pytest process that decides and records the
   score. A graded test that calls the learner's code in-process (chapter 14's) meets that refusal
   and is run again whole in a child process (a world-size-1 launch), whose outcome comes back
   as the launcher's plain data (``labkit.runtime.sandbox``).
3. **Plain data across the boundary**: ranks' results load with ``torch.load(weights_only=True)``
   and carry a per-launch token; error reports are JSON (``sandbox``). The report path travels
   in the environment (read and removed at start), not on a command line visible in /proc.
4. **Isolation as root**: with ``LABKIT_JUDGE_USER`` the ranks run as that user, the report and
   results folders are not theirs, and every process of that user is killed when a launch ends
   and before the report is read (``sandbox.kill_student``).
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from pathlib import Path

import pytest

from labkit.course import policy
from labkit.course.chapters import CHAPTERS
from labkit.runtime import sandbox

JUDGE_ENV = sandbox.JUDGE_ENV
USER_ENV = sandbox.USER_ENV
STUDENT_USER = "labkit-student"  # created by the autograder when it runs as root


# ----------------------------------------------------------------------------- the policy


def check_submission(package: Path, modules=None) -> dict[str, list[policy.Violation]]:
    """Policy violations of every exercise module in ``package`` (or only ``modules``), by
    chapter module (a chapter package's files all count for it)."""
    sources = policy.all_sources(package)
    found = {}
    for module in modules or CHAPTERS.values():
        broken = [v for name, text in sources.items() if name.split(".")[0] == module
                  for v in policy.violations(name, text, sources=sources)]
        if broken:
            found[module] = broken
    return found


def isolation(scratch: Path) -> dict[str, str]:
    """As root: make sure the student's user exists, let it read (not write) the scratch tree,
    and return the environment that makes the ranks run as it. Without root: nothing (README)."""
    if os.geteuid() != 0:
        return {}
    import pwd
    import subprocess
    try:
        pwd.getpwnam(STUDENT_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                        STUDENT_USER], check=True, capture_output=True)
    entry = pwd.getpwnam(STUDENT_USER)
    if sandbox.unreadable_by(entry.pw_uid, entry.pw_gid, [sys.executable, *sys.path]):
        return {}  # e.g. a Python under /root: the ranks could not import it (README says so)
    os.chmod(scratch, 0o755)  # TemporaryDirectory makes it 0700: the ranks must read the tree
    return {USER_ENV: STUDENT_USER}


# ----------------------------------------------------------------------------- the pytest plugin


class SubmissionImport(ImportError):
    """The judge's process imported an exercise module (``run_in_child`` takes over)."""


class _Guard(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if policy.is_exercise(name):   # a chapter module, or a file of a chapter package
            raise SubmissionImport(f"the judge's process never imports {name} (a submitted module); "
                                   "a test that calls it runs in a child process", name=name)
        return None


def pytest_configure(config):
    loaded = sorted(n for n in sys.modules if policy.is_exercise(n))
    if loaded:
        raise pytest.UsageError(f"labkit judge: submitted modules were imported before the judge started: {loaded}")
    sys.meta_path.insert(0, _Guard())
    sandbox.adopt_orphans()


COLLECT_ENV = "LABKIT_JUDGE_COLLECT"  # make_bundle: write the graded tests (no run) to this path


def pytest_collection_finish(session):
    """``make_bundle`` lists the bundle's graded tests (task, points) once, so that a module that
    breaks the policy is scored without running anything."""
    path = os.environ.get(COLLECT_ENV)
    if not path:
        return
    import json
    tests = []
    for item in session.items:
        marker = item.get_closest_marker("grade")
        if marker is not None:
            callspec = getattr(item, "callspec", None)
            size = callspec.params.get("world_size") if callspec else None
            tests.append(dict(name=item.nodeid, task=marker.args[0], world_size=size,
                              points=0.0 if size == 1 else float(marker.kwargs.get("points", 1)),
                              hidden="hidden" in Path(str(item.path)).parent.name))
    Path(path).write_text(json.dumps(tests))
    session.items[:] = []


def policy_records(tests: list[dict], broken: dict) -> list[dict]:
    """Failing records, without running anything, for the tests of modules that break the policy."""
    out = []
    for t in tests:
        module = t["task"].split(".")[0]
        if module in broken:
            message = (f"{t['task']}: not graded: {policy.POLICY_BROKEN} "
                       + "; ".join(map(str, broken[module])))
            out.append(dict(t, outcome="failed", output=message, details="", frame=""))
    return out


@pytest.fixture(autouse=True)
def _judge_tmp_path(request):
    """As root, a test's tmp_path (where its ranks write, e.g. chapter 09's checkpoints) is the
    student user's, and the folders above it only traversable."""
    ids = sandbox.student()
    if ids is not None and "tmp_path" in request.fixturenames:
        path = request.getfixturevalue("tmp_path")
        for parent in path.parents:
            if parent == Path("/tmp") or parent.stat().st_uid != 0:
                break
            os.chmod(parent, parent.stat().st_mode | 0o111)
        os.chown(path, *ids)
    yield


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A graded test runs here; if it reaches for a submitted module, it runs again in a child."""
    if pyfuncitem.get_closest_marker("grade") is None:
        return None
    kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    try:
        pyfuncitem.obj(**kwargs)
    except SubmissionImport:
        run_in_child(pyfuncitem.obj, kwargs)
    return True


def run_in_child(test, kwargs: dict) -> None:
    """Run ``test(**kwargs)`` in a world-size-1 launch; raise what it raised, as plain text."""
    from labkit.course.grading import TIMEOUT_ENV
    from labkit.launch import LaunchError, WorkerError, launch
    cap = float(os.environ.get(TIMEOUT_ENV) or 300)
    try:
        launch(_call, 1, test, kwargs, timeout=cap)
    except WorkerError as error:
        if error.exc_type == "Skipped":
            pytest.skip(error.message)
        failure = AssertionError(f"{error.exc_type}: {error.message}")
        failure.details = error.remote_traceback
        raise failure from None
    except LaunchError as error:
        raise AssertionError(str(error).split("\n")[0]) from None


def _call(test, kwargs) -> None:
    test(**kwargs)  # in the child: returns nothing; what it raises is reported as JSON
