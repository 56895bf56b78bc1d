"""The learner workspace, end to end: every task full on the reference, zero on its stub
with a failure that names it, and the infrastructure tests green in both trees."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from labkit import workspace
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
    proc = run_in(ROOT, "-m", "labkit.cli", "workspace", str(dest))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dest


def graded(tree: Path, results: Path) -> tuple[subprocess.CompletedProcess, dict]:
    proc = run_in(tree, "-m", "labkit.cli", "grade", "--json", str(results))
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
        assert "NotImplementedError" in test["output"] and f"{task}:" in test["output"], \
            f"{test['name']}: the failure does not name the task's stub:\n{test['output']}"
    assert tasks_seen == set(listed_tasks(student))


def listed_tasks(tree: Path) -> list[str]:
    return (tree / workspace.MARKER_FILE).read_text().split()


def test_every_task_scores_full_on_the_reference(tmp_path):
    proc, results = graded(ROOT, tmp_path / "results.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert results["score"] == results["max_score"] > 0, proc.stdout
    assert {t["name"].split(" :: ")[0] for t in results["tests"]} == set(workspace.tasks())
    assert "total" in proc.stdout and "points" in proc.stdout


def test_the_infrastructure_tests_pass_in_the_workspace(student):
    proc = run_in(student, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                  "--ignore=tests/grading", "--deselect=tests/test_workspace.py")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" in proc.stdout, proc.stdout[-2000:]
