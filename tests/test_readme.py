"""The README's learner and instructor paths, followed literally in a scratch copy of the
course: every command of the blocks marked ``<!-- ci:learner -->`` and
``<!-- ci:instructor -->`` runs as written, in bash, from a fresh clone, with a fresh
virtual environment that sees this one's packages (so ``pip install -e .`` takes seconds
and installs only labkit). Then we check what a newcomer would see.

These need ``pip`` to reach PyPI (pip builds labkit in an isolated environment), so they
run only when ``LABKIT_CI=1`` (``.ci/run`` sets it).
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import needs_solutions

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [
    needs_solutions,
    pytest.mark.skipif(os.environ.get("LABKIT_CI") != "1",
                       reason="follows the README with pip installs; set LABKIT_CI=1 to run"),
]


def readme_block(marker: str) -> list[str]:
    """The command lines of the first fenced block after ``<!-- ci:<marker> -->``."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index(f"<!-- ci:{marker} -->")
    assert lines[start + 1].startswith("```"), f"no code block after the {marker} marker"
    block = []
    for line in lines[start + 2:]:
        if line.startswith("```"):
            return block
        if line.strip():
            block.append(line)
    raise AssertionError(f"the {marker} block is not closed")


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> dict:
    """A clone of the course and a fresh venv that sees this venv's packages but not labkit."""
    base = tmp_path_factory.mktemp("newcomer")
    clone = base / "course"
    if (ROOT / ".git").exists():
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        for path in subprocess.run(["git", "ls-files", "-m", "-o", "--exclude-standard"], cwd=ROOT,
                                   capture_output=True, text=True).stdout.split():
            if (ROOT / path).is_file():  # the working tree as it is, not only the last commit
                (clone / path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / path, clone / path)
    else:
        shutil.copytree(ROOT, clone, ignore=shutil.ignore_patterns(".venv", "__pycache__", "*.egg-info"))
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    site = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # A plain path line: the packages are visible, this venv's own .pth files (labkit's) are not.
    Path(site, "parent_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}", VIRTUAL_ENV=str(venv),
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    setup = readme_block("setup")[-1]  # the README's install line (its venv line is the one above)
    assert setup == "pip install -e .", setup
    proc = subprocess.run(["bash", "-c", setup], cwd=clone, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return dict(base=base, clone=clone, env=env)


def run_block(marker: str, cwd: Path, env: dict) -> list[tuple[str, subprocess.CompletedProcess]]:
    """Each line in one bash session (a `cd` carries over); the output of every line."""
    results, here = [], cwd
    for line in readme_block(marker):
        script = f"cd {here}\n{line}\nstatus=$?\npwd > {cwd.parent}/.pwd\nexit $status\n"
        proc = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=900)
        here = Path((cwd.parent / ".pwd").read_text().strip())
        results.append((line, proc))
    return results


def chapter_points(tree: Path, module: str) -> float:
    """The points a chapter's graded tests award, read from their source (``labkit tasks``)."""
    from labkit.course import catalog
    return sum(p for task, p in catalog.static_points(tree).items() if task.startswith(module + "."))


def test_the_learner_path_works_as_written(scratch):
    results = run_block("learner", scratch["clone"], scratch["env"])
    out = {line.split("#")[0].strip(): proc for line, proc in results}
    workspace = scratch["base"] / "my-labs"
    assert out["labkit workspace ../my-labs"].returncode == 0, out["labkit workspace ../my-labs"].stderr
    install = out["cd ../my-labs && pip install -e ."]
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
    tasks = out["labkit tasks"]
    assert tasks.returncode == 0 and f"exercises in {workspace} (learner workspace)" in tasks.stdout, tasks.stderr
    assert "collectives.reduce_scatter" in tasks.stdout and "labkit/collectives.py:" in tasks.stdout
    one = out["labkit grade collectives.reduce_scatter"]
    assert one.returncode == 1 and f"graded: {workspace} (learner workspace)" in one.stdout, one.stdout + one.stderr
    assert "NOT IMPLEMENTED collectives.reduce_scatter" in one.stdout and "0/4" in one.stdout
    chapter = out["labkit grade 00"]
    best = chapter_points(workspace, "collectives")   # what chapter 00's tests award (no hidden ones here)
    assert chapter.returncode == 1 and f"0/{best:g}" in chapter.stdout, chapter.stdout + chapter.stderr
    # The learner implements the task; the same command now gives full marks for it, and
    # the notebooks' `import labkit` is the workspace's (pip install -e . pointed it there).
    shutil.copy(ROOT / "labkit" / "collectives.py", workspace / "labkit" / "collectives.py")
    line = next(l for l in readme_block("learner") if "grade collectives.reduce_scatter" in l)
    again = subprocess.run(["bash", "-c", line], cwd=workspace, env=scratch["env"], capture_output=True, text=True)
    assert again.returncode == 0 and "4/4" in again.stdout, again.stdout + again.stderr
    where = subprocess.run(["python", "-c", "import labkit; print(labkit.__file__)"], cwd=workspace / "labs",
                           env=scratch["env"], capture_output=True, text=True)
    assert where.stdout.strip() == str(workspace / "labkit" / "__init__.py"), where.stdout + where.stderr


def test_the_instructor_path_works_as_written(scratch):
    results = run_block("instructor", scratch["clone"], scratch["env"])
    for line, proc in results:
        assert proc.returncode == 0, f"{line}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    base = scratch["base"]
    assert (base / "student-release" / ".labkit-workspace").exists()
    assert (base / "autograder.zip").stat().st_size > 0
    results = json.loads((base / "results.json").read_text())   # the reference, hidden tests included
    assert results["score"] == results["max_score"] == chapter_points(ROOT, "collectives"), results["score"]
