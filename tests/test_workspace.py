"""The learner workspace, end to end: every task full on the reference, zero on its stub
with a failure that names it, and the infrastructure tests green in both trees."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.course import workspace
from tests.conftest import needs_solutions

ROOT = Path(__file__).resolve().parent.parent
pytestmark = needs_solutions  # builds a workspace from the reference solutions


def run_in(tree: Path, *args, timeout=900) -> subprocess.CompletedProcess:
    # The tree's own labkit must win over any installed one: put it first on the path.
    env = dict(os.environ, PYTHONPATH=str(tree))
    return subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def student(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("student") / "workspace"
    proc = run_in(ROOT, "-m", "labkit.course.cli", "workspace", str(dest))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dest


def graded(tree: Path, results: Path) -> tuple[subprocess.CompletedProcess, dict]:
    proc = run_in(tree, "-m", "labkit.course.cli", "grade", "--json", str(results))
    assert results.exists(), proc.stdout + proc.stderr
    return proc, json.loads(results.read_text())


def test_the_workspace_stubs_every_solution_and_keeps_the_rest(student):
    regions = workspace.all_regions(ROOT / "labkit")
    assert regions
    for region in regions:
        text = (student / "labkit" / region.path.name).read_text()
        assert "BEGIN SOLUTION" not in text
        assert f"raise NotImplementedError({f'{region.task}: {region.hint}'!r})" in text
    for folder in ("chapters", "tests"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                assert (student / path.relative_to(ROOT)).read_bytes() == path.read_bytes(), path
    for lab in (student / "labs").glob("*.ipynb"):
        cells = json.loads(lab.read_text())["cells"]
        assert all(not c.get("outputs") for c in cells), f"{lab.name} still shows reference outputs"
    listed = (student / workspace.MARKER_FILE).read_text().split()
    assert sorted(listed) == sorted({r.task for r in regions})


def test_every_task_scores_zero_on_its_stub_and_says_which(student, tmp_path):
    proc, results = graded(student, tmp_path / "results.json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert results["score"] == 0 and results["max_score"] > 0, proc.stdout
    tasks_seen = set()
    for test in results["tests"]:
        task = test["name"].split(" :: ")[0]
        tasks_seen.add(task)
        assert test["score"] == 0, test["name"]
        assert "NotImplementedError" in test["output"] and test["output"].startswith(f"FAILED {task} "), \
            f"{test['name']}: the failure does not name the task's stub:\n{test['output']}"
    assert tasks_seen == set(listed_tasks(student))


def listed_tasks(tree: Path) -> list[str]:
    return (tree / workspace.MARKER_FILE).read_text().split()


def installed_labkit() -> list[str]:
    """The ``labkit`` command as pip installed it: it imports the installed package (here,
    the reference), not whatever tree it is run in."""
    script = Path(sys.executable).parent / "labkit"
    if not script.exists():
        pytest.skip("the labkit command is not installed (pip install -e .)")
    return [str(script)]


def test_grading_uses_the_tree_you_stand_in_whatever_labkit_is_installed(student, tmp_path):
    import labkit
    assert Path(labkit.__file__).resolve().parent.parent == ROOT  # installed: the reference
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # In the stubbed workspace: zero, and the header names the workspace.
    proc = subprocess.run([*installed_labkit(), "grade", "collectives", "--json", str(tmp_path / "ws.json")],
                          cwd=student / "tests", env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"grading {student} (learner workspace)" in proc.stdout, proc.stdout
    assert json.loads((tmp_path / "ws.json").read_text())["score"] == 0
    assert "NOT IMPLEMENTED collectives.all_reduce" in proc.stdout
    assert proc.stdout.rstrip().endswith(f"graded: {student} (learner workspace)"), proc.stdout[-300:]
    # The other way round: the workspace's labkit imported, standing in the reference: full marks.
    proc = subprocess.run([*installed_labkit(), "grade", "00"], cwd=ROOT, capture_output=True, text=True,
                          env=dict(env, PYTHONPATH=str(student)), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"grading {ROOT} (reference solutions)" in proc.stdout and "13/13" in proc.stdout, proc.stdout


def test_grading_refuses_outside_a_course_tree(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "labkit.course.cli", "grade"], cwd=tmp_path,
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 2 and "is not inside a course tree" in proc.stderr, proc.stderr


def test_one_task_can_be_graded_and_tasks_list_file_line_and_hint(student):
    proc = run_in(student, "-m", "labkit.course.cli", "tasks")
    assert proc.returncode == 0, proc.stderr
    for region in workspace.all_regions(ROOT / "labkit"):
        assert f"{region.task}" in proc.stdout and region.hint in proc.stdout
    assert "labkit/collectives.py:" in proc.stdout
    proc = run_in(student, "-m", "labkit.course.cli", "grade", "collectives.reduce_scatter")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    table = proc.stdout[proc.stdout.index("task "):]
    assert "collectives.reduce_scatter" in table and "0/4" in table
    assert "collectives.all_gather" not in table, table


def test_the_infrastructure_tests_pass_in_the_workspace(student):
    proc = run_in(student, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                  "--ignore=tests/grading", "--deselect=tests/test_workspace.py")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" in proc.stdout, proc.stdout[-2000:]
