"""The learner workspace, end to end: every task full on the reference, zero on its stub
with a failure that names it, and the infrastructure tests green in both trees."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from labkit.course import grading, workspace
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


def graded(tree: Path, results: Path, *chapters: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc = run_in(tree, "-m", "labkit.course.cli", "grade", *chapters, "--json", str(results))
    assert results.exists(), proc.stdout + proc.stderr
    return proc, json.loads(results.read_text())


def test_the_workspace_stubs_every_solution_and_keeps_the_rest(student):
    regions = workspace.all_regions(ROOT / "labkit")
    assert regions
    for region in regions:
        text = (student / region.path.relative_to(ROOT)).read_text()   # labkit/compress/topk.py too
        assert "BEGIN SOLUTION" not in text
        assert f"raise NotImplementedError({f'{region.task}: {region.hint}'!r})" in text
    for folder in ("chapters", "tests"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                private = any(path.relative_to(ROOT).as_posix().startswith(p) for p in workspace.PRIVATE)
                copy = student / path.relative_to(ROOT)
                assert copy.exists() != private, f"{path}: {'copied, but private' if private else 'missing'}"
                if not private:
                    assert copy.read_bytes() == path.read_bytes(), path
    for lab in (student / "labs").glob("*.ipynb"):
        cells = json.loads(lab.read_text())["cells"]
        assert all(not c.get("outputs") for c in cells), f"{lab.name} still shows reference outputs"
    listed = workspace.listed_tasks(student)
    assert sorted(listed) == sorted({r.task for r in regions})
    assert all(listed[r.task] for r in regions), "every task's hint is kept in the workspace's list"


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
    # `labkit tasks` reads each task's points from the tests' source: the same as grading awards.
    from labkit.course import catalog
    awarded = {}
    for test in results["tests"]:
        task = test["name"].split(" :: ")[0]
        awarded[task] = awarded.get(task, 0) + test["max_score"]
    assert catalog.static_points(student) == awarded


def listed_tasks(tree: Path) -> list[str]:
    return list(workspace.listed_tasks(tree))


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
    assert f"grading {ROOT} (reference solutions)" in proc.stdout and "11/11" in proc.stdout, proc.stdout


def test_grading_refuses_outside_a_course_tree(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "labkit.course.cli", "grade"], cwd=tmp_path,
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 2 and "is not inside a course tree" in proc.stderr, proc.stderr


def test_one_task_can_be_graded_and_tasks_list_file_line_and_hint(student):
    proc = run_in(student, "-m", "labkit.course.cli", "tasks")
    assert proc.returncode == 0, proc.stderr
    for task, hint in workspace.tasks(ROOT / "labkit").items():  # the first region's hint
        assert f"{task}" in proc.stdout and hint in proc.stdout
    assert "labkit/collectives.py:" in proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines() if re.match(r"\d\d  ", line)]
    assert [r[0] for r in rows] == sorted(r[0] for r in rows), "tasks in chapter order"
    assert len(rows) == len(workspace.tasks(ROOT / "labkit")), "one line per task"
    assert all(r[3] == "stub" for r in rows), rows
    proc = run_in(student, "-m", "labkit.course.cli", "grade", "collectives.reduce_scatter")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    table = proc.stdout[proc.stdout.index("task "):]
    assert "collectives.reduce_scatter" in table and "0/4" in table
    assert "collectives.all_gather" not in table, table


def test_tasks_lists_every_task_without_torch_even_with_a_module_pasted_whole(student, tmp_path):
    """A learner who replaced a whole module (here with one that still has solution markers)
    still sees every task of every chapter; the listing never imports torch."""
    tree = tmp_path / "pasted"
    shutil.copytree(student, tree)
    shutil.copy(ROOT / "labkit" / "collectives.py", tree / "labkit" / "collectives.py")
    (tree / "labkit" / "dp.py").write_text((ROOT / "labkit" / "dp.py").read_text().replace("# BEGIN SOLUTION", "#")
                                           .replace("# END SOLUTION", "#"))
    script = ("import sys; from labkit.course import cli; code = cli.main(['tasks']); "
              "assert 'torch' not in sys.modules, 'labkit tasks imported torch'; sys.exit(code)")
    proc = run_in(tree, "-c", script)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line.split()[1]: line.split()[3] for line in proc.stdout.splitlines() if re.match(r"\d\d  ", line)}
    assert set(rows) == set(workspace.tasks(ROOT / "labkit")), sorted(set(workspace.tasks(ROOT / "labkit")) - set(rows))
    assert rows["collectives.all_reduce"] == "solution" and rows["dp.sampler"] == "written"
    assert rows["ddp.bucketed"] == "stub"


def test_a_task_that_needs_another_chapters_stub_says_so_first(student, tmp_path):
    """Chapter 07's Megatron-SP block is built from chapter 05's layers: with sp.py written and
    tp.py still stubbed, the grader names the missing task before anything else."""
    tree = tmp_path / "needs"
    shutil.copytree(student, tree)
    shutil.copy(ROOT / "labkit" / "sp.py", tree / "labkit" / "sp.py")
    proc = run_in(tree, "-m", "labkit.course.cli", "grade", "sp.megatron")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = proc.stdout[proc.stdout.index("\n\n"):].strip().splitlines()
    assert re.fullmatch(r"NEEDS tp\.\w+: sp\.megatron uses your tp\.\w+ \(labkit/tp\.py:\d+ in \w+\), "
                        r"still a stub: implement tp\.\w+ first", report[0]), proc.stdout


EXERCISE_USE = re.compile(r"labkit[./](?:" + "|".join(grading.CHAPTERS.values()) + r")\b"
                          r"|from labkit import [^\n]*\b(?:" + "|".join(grading.CHAPTERS.values()) + r")\b"
                          r"|labkit\.course\.bench|course import bench|needs_solutions")


def test_the_infrastructure_tests_pass_in_the_workspace(student):
    """In a workspace the tests that need solutions skip and the rest pass. Only the test
    files that touch exercise code (or say they need it) can behave differently there; the
    others (the launcher's, say) are identical code on identical infrastructure, so they
    are not run twice."""
    files = sorted(p for p in (ROOT / "tests").glob("test_*.py") if p.name != "test_workspace.py")
    touching = [p.name for p in files if EXERCISE_USE.search(p.read_text())]
    assert "test_bench.py" in touching and "test_launch.py" not in touching, touching
    proc = run_in(student, "-m", "pytest", *[f"tests/{name}" for name in touching], "-q",
                  "-p", "no:cacheprovider", "-o", "addopts=")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" in proc.stdout, proc.stdout[-2000:]


def lab_notebooks() -> list[str]:
    return sorted(p.name for p in (ROOT / "labs").glob("*.ipynb"))


@pytest.mark.parametrize("lab", lab_notebooks())
def test_every_lab_runs_on_the_stubs_and_says_what_is_missing(student, lab):
    """A learner opens a lab before writing any code: every section must say which task is
    not implemented and the notebook must go on to the end, without an error."""
    import nbformat
    from nbclient import NotebookClient
    path = student / "labs" / lab
    notebook = nbformat.read(path, as_version=4)
    env_before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(student)  # the kernel imports the workspace's labkit
    try:
        NotebookClient(notebook, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    finally:
        if env_before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = env_before
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    errors = [o for o in outputs if o.output_type == "error"]
    assert not errors, f"{lab} stopped at {errors[0].ename}: {errors[0].evalue}"
    text = "\n".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "not implemented" in text, f"{lab} never says which task is missing"


def test_a_deadlocking_ring_grades_in_seconds_with_every_wait_named(tmp_path):
    """The classic ring deadlock (every rank does a blocking recv before its send) in the
    all-gather, the other two tasks solved: chapter 00 grades without waiting for any launch timeout, every
    hung test named as a deadlock with each rank's wait, its other world sizes not re-run."""
    tree = tmp_path / "workspace"
    proc = run_in(ROOT, "-m", "labkit.course.cli", "workspace", str(tree))
    assert proc.returncode == 0, proc.stderr
    source = (ROOT / "labkit" / "collectives.py").read_text()
    exchange = "        exchange(chunks[(me - step) % n], chunks[(me - step - 1) % n], to_rank, from_rank)\n"
    assert exchange in source
    (tree / "labkit" / "collectives.py").write_text(source.replace(exchange, (
        "        dist.recv(chunks[(me - step - 1) % n], src=from_rank)  # every rank waits first\n"
        "        dist.send(chunks[(me - step) % n], dst=to_rank)\n")))
    start = time.monotonic()
    proc, results = graded(tree, tmp_path / "results.json", "collectives")
    elapsed = time.monotonic() - start
    # Each deadlock is named by the detector ("deadlock after" below), not cut by the 60-s
    # launch timeout: three hung tests left to that timeout would take over 180 s. 65 s has
    # been seen on a loaded 2-core machine, hence the margin.
    assert elapsed < 170, f"grading took {elapsed:.0f} s: a deadlock waited for the launch timeout"
    outputs = {t["name"].split("::")[-1]: t["output"] for t in results["tests"]}
    assert results["score"] == 3, proc.stdout  # reduce-scatter 3/3; all-gather and all-reduce lose all
    deadlocked = [name for name, out in outputs.items() if "deadlock after" in out]
    assert sorted(deadlocked) == ["test_all_gather[2]", "test_all_reduce[2]", "test_all_reduce_on_a_subgroup"], outputs
    for name in deadlocked:
        waits = re.findall(r"rank \d waits in (?:wait for i)?recv from rank \d of \(\d+,\) \w+ at collectives\.py:\d+",
                           outputs[name])
        assert len(waits) >= 2, outputs[name]
    for size in (3, 4):
        assert "skipped: deadlocked at world size 2" in outputs[f"test_all_gather[{size}]"]


# ----------------------------------------------------------------------------- issue 43


def test_the_workspace_pins_the_clones_torch_build_and_the_hint_installs_it(student):
    # The second environment must get the clone's torch build (a laptop's CPU one, not PyPI's
    # CUDA one): the workspace holds it as a pip requirement with its index, and the line
    # that `labkit workspace` and the README's learner block give installs from it.
    assert workspace.torch_requirement("2.13.0+cpu").splitlines()[1:] == [
        "--extra-index-url https://download.pytorch.org/whl/cpu", "torch==2.13.0+cpu"]
    assert workspace.torch_requirement("2.13.0+cu126").splitlines()[1:] == [
        "--extra-index-url https://download.pytorch.org/whl/cu126", "torch==2.13.0+cu126"]
    assert workspace.torch_requirement("2.13.0").splitlines()[1:] == ["torch==2.13.0"]   # PyPI's, as the clone's
    from importlib import metadata
    text = (student / workspace.TORCH_FILE).read_text()
    assert text == workspace.torch_requirement(metadata.version("torch")), text
    assert f"-r {workspace.TORCH_FILE}" in workspace.INSTALL_LINE
    proc = run_in(ROOT, "-m", "labkit.course.cli", "workspace", str(student.parent / "hint"))
    assert proc.returncode == 0 and workspace.INSTALL_LINE in proc.stdout, proc.stdout + proc.stderr
    readme = (ROOT / "README.md").read_text()
    learner = readme.split("<!-- ci:learner -->", 1)[1].split("```", 2)[1]
    assert workspace.INSTALL_LINE in learner, learner          # in the block itself, run verbatim in CI
    assert "pip's cache" not in readme, "pip resolves torch against the index, not its cache"


@pytest.mark.parametrize("where, says", [("inside", "is inside the course's clone"),
                                         ("around", "holds the course's clone"),
                                         ("under-a-file", "cannot write the workspace at")])
def test_a_workspace_goes_beside_the_clone_where_it_can_be_written(where, says, tmp_path):
    # Inside the clone (its `import labkit` would mix trees), around it (--force would delete
    # it), or where no folder can be made: one sentence and exit 2, nothing written.
    (tmp_path / "a-file").write_text("")
    dest = {"inside": ROOT / f"ws-{tmp_path.name}", "around": ROOT.parent,
            "under-a-file": tmp_path / "a-file" / "ws"}[where]
    try:
        proc = run_in(ROOT, "-m", "labkit.course.cli", "workspace", str(dest))
        assert proc.returncode == 2 and says in proc.stderr, proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        if where == "inside":
            assert not dest.exists()
    finally:
        if where == "inside":
            shutil.rmtree(dest, ignore_errors=True)


def test_mutate_in_a_workspace_is_an_error_not_zero_of_zero(student):
    proc = run_in(student, "-m", "labkit.course.cli", "mutate")
    assert proc.returncode == 2 and "learner workspace: it has no solution regions" in proc.stderr, \
        proc.stdout + proc.stderr
    assert "killed" not in proc.stdout, proc.stdout


def test_a_workspace_lists_what_each_lab_runs_of_other_chapters_as_the_clone_does(student):
    # A stub's body no longer calls what its solution calls (tp.model's the tp layers): the
    # workspace keeps the reference's reading, so a learner sees the same list as the clone.
    from labkit.course import catalog
    for chapter in catalog.CHAPTERS:
        assert catalog.earlier_tasks(student, chapter) == catalog.earlier_tasks(ROOT, chapter), chapter
    assert "compress.hierarchical" in catalog.earlier_tasks(student, "14")
