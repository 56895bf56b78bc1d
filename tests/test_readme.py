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
    see_these_packages(venv)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}", VIRTUAL_ENV=str(venv),
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    setup = readme_block("setup")[-1]  # the README's install line (its venv line is the one above)
    assert setup == "pip install -e .", setup
    proc = subprocess.run(["bash", "-c", setup], cwd=clone, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return dict(base=base, clone=clone, env=env)


def run_block(marker: str, cwd: Path, env: dict) -> tuple[list[tuple[str, subprocess.CompletedProcess]], dict]:
    """The lines as one bash session would run them (a `cd` and an activated environment carry
    over); the output of every line, and the environment after the last.

    A virtual environment a line creates (the workspace's own) is given this one's packages,
    as the scratch venv is, so that its `pip install -e .` installs only labkit."""
    results, here, env = [], cwd, dict(env)
    state = cwd.parent / ".state"
    for line in readme_block(marker):
        script = (f"cd {here}\n{line}\nstatus=$?\npwd > {state}.pwd\nenv -0 > {state}.env\n"
                  f"exit $status\n")
        proc = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=900)
        here = Path(Path(f"{state}.pwd").read_text().strip())
        env = dict(item.split("=", 1) for item in Path(f"{state}.env").read_text().split("\0") if "=" in item)
        for key in ("_", "SHLVL", "OLDPWD", "PWD"):
            env.pop(key, None)
        venv = here / ".venv"
        if (venv / "pyvenv.cfg").exists() and not list(venv.glob("lib/python*/site-packages/parent_env.pth")):
            see_these_packages(venv)
        results.append((line, proc))
    return results, env


def see_these_packages(venv: Path) -> None:
    """A plain path line: this venv's packages are visible there, its own .pth files (labkit's) are not."""
    site = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "parent_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")


def chapter_points(tree: Path, module: str) -> float:
    """The points a chapter's graded tests award, read from their source (``labkit tasks``)."""
    from labkit.course import catalog
    return sum(p for task, p in catalog.static_points(tree).items() if task.startswith(module + "."))


def test_the_learner_path_works_as_written(scratch):
    results, learner_env = run_block("learner", scratch["clone"], scratch["env"])
    out = {line.split("#")[0].strip(): proc for line, proc in results}
    workspace = scratch["base"] / "my-labs"
    assert out["labkit workspace ../my-labs"].returncode == 0, out["labkit workspace ../my-labs"].stderr
    for line, proc in results[1:3]:   # the workspace's own environment, and labkit installed in it
        assert proc.returncode == 0, line + "\n" + proc.stdout[-2000:] + proc.stderr[-2000:]
    assert learner_env["VIRTUAL_ENV"] == str(workspace / ".venv"), learner_env.get("VIRTUAL_ENV")
    assert_the_install_line_resolves_the_clones_torch(workspace, learner_env, scratch["env"])
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
    again = subprocess.run(["bash", "-c", line], cwd=workspace, env=learner_env, capture_output=True, text=True)
    assert again.returncode == 0 and "4/4" in again.stdout, again.stdout + again.stderr
    where = subprocess.run(["python", "-c", "import labkit; print(labkit.__file__)"], cwd=workspace / "labs",
                           env=learner_env, capture_output=True, text=True)
    assert where.stdout.strip() == str(workspace / "labkit" / "__init__.py"), where.stdout + where.stderr
    # The clone's environment still means the clone: switching back is activating it again.
    back = subprocess.run(["python", "-c", "import labkit; print(labkit.__file__)"], cwd=scratch["clone"] / "labs",
                          env=scratch["env"], capture_output=True, text=True)
    assert back.stdout.strip() == str(scratch["clone"] / "labkit" / "__init__.py"), back.stdout + back.stderr


def assert_the_install_line_resolves_the_clones_torch(workspace: Path, learner_env: dict, clone_env: dict) -> None:
    """The block's install line, as pip's resolver reads it in a fresh environment: the torch
    it would install is the clone's build, to the local label (``2.13.0+cpu`` on a laptop set up
    with the CPU index; PyPI's ``2.13.0`` where the clone has that one). CI reaches PyPI only:
    on a PyPI clone the pin needs PyPI alone; here a +cpu pin resolves from the machine's wheels."""
    line = next(l.split("#")[0] for l in readme_block("learner") if "pip install" in l)
    install = line[line.index("pip install"):].strip()
    report = workspace.parent / "resolved.json"
    proc = subprocess.run(["bash", "-c", f"{install} --dry-run --ignore-installed --no-deps --quiet --report {report}"],
                          cwd=workspace, env=learner_env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, install + "\n" + proc.stdout[-2000:] + proc.stderr[-2000:]
    resolved = {i["metadata"]["name"]: i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    clones = subprocess.run(["python", "-c", "from importlib import metadata; print(metadata.version('torch'))"],
                            env=clone_env, capture_output=True, text=True, check=True).stdout.strip()
    assert resolved.get("torch") == clones, f"{install!r} resolves torch {resolved.get('torch')}; the clone has {clones}"


def test_the_instructor_path_works_as_written(scratch):
    results, _ = run_block("instructor", scratch["clone"], scratch["env"])
    for line, proc in results:
        assert proc.returncode == 0, f"{line}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    base = scratch["base"]
    assert (base / "student-release" / ".labkit-workspace").exists()
    assert (base / "autograder.zip").stat().st_size > 0
    results = json.loads((base / "results.json").read_text())   # the reference, hidden tests included
    assert results["score"] == results["max_score"] == chapter_points(ROOT, "collectives"), results["score"]
