import pytest

from labkit.course.workspace import is_student_workspace

pytest_plugins = ["labkit.course.grading", "labkit.course.coverage"]

# Tests that exercise the reference solutions (not the infrastructure) skip in a learner
# workspace, where those solutions are stubs; the infrastructure tests run in both trees.
needs_solutions = pytest.mark.skipif(is_student_workspace(), reason="needs the reference solutions")


def pytest_sessionstart(session):
    session.config._labkit_started = __import__("time").time()


def pytest_terminal_summary(terminalreporter, config):
    """The mutation tests' verdict, ``mutants killed: K of M``, at the end of the log (it is
    written by tests/test_mutants.py, perhaps in another xdist worker, during this session)."""
    from pathlib import Path
    summary = Path(__file__).resolve().parent.parent / "build" / "mutants-summary.txt"
    started = getattr(config, "_labkit_started", None)
    if started and summary.exists() and summary.stat().st_mtime >= started and not hasattr(config, "workerinput"):
        terminalreporter.write_sep("-", "mutation testing of the grader")
        terminalreporter.write(summary.read_text())


# The longest files first (minutes each; the rest take seconds to a minute): under
# `-n 2 --dist loadfile --no-loadscope-reorder` each worker takes the next file in this order,
# so these start at once instead of one of them finishing the run alone.
LONGEST_FIRST = ("tests/test_mutants.py", "tests/test_workspace.py", "tests/test_browser.py",
                 "tests/test_readme.py", "tests/test_lab_scripts.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(LONGEST_FIRST)))  # stable
