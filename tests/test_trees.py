"""One tree per run: a script and every rank it launches import labkit from the same course
tree, whichever tree the working directory belongs to (issue 33: ``python -m`` put the working
directory first for the rank server only, so from a second tree's root the driver ran one
tree's labkit and the ranks the other's).

Both ways round, from the root of a second tree (a copy of this labkit):
- the script imports this tree's labkit (its folder is first on the path): so do the ranks, and
  the warning names this tree as the one the ranks run;
- the script imports the second tree's labkit (the working directory first): so do the ranks.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PROBE = '''
import labkit

def where():
    import labkit.collectives, labkit.runtime.worker
    return [labkit.__file__, labkit.collectives.__file__, labkit.runtime.worker.__file__]

print("driver", labkit.__file__)
for rank, files in enumerate(labkit.launch(where, 2, timeout=120)):
    print("rank", rank, *files)
'''


# A lab file: it imports the lab shell (labkit.course.labscript), as every labs/NN_*.py does.
LAB_PROBE = "import labkit.course.labscript\n" + PROBE


@pytest.fixture(scope="module")
def other_tree(tmp_path_factory) -> Path:
    """A second course tree: a copy of this labkit, with tests/grading/ and pyproject.toml."""
    tree = tmp_path_factory.mktemp("other") / "course"
    shutil.copytree(ROOT / "labkit", tree / "labkit", ignore=shutil.ignore_patterns("__pycache__"))
    (tree / "tests" / "grading").mkdir(parents=True)
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    (tree / "labs").mkdir()
    (tree / "labs" / "probe.py").write_text(PROBE)
    (tree / "labs" / "lab_probe.py").write_text(LAB_PROBE)
    return tree


def run_probe(tree: Path, *cmd: str, pythonpath: str) -> tuple[list[tuple[str, ...]], str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LABKIT_RANK", "WORLD_SIZE", "RANK")}
    env["PYTHONPATH"] = pythonpath
    proc = subprocess.run([sys.executable, *cmd], cwd=tree, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [tuple(line.split()) for line in proc.stdout.splitlines() if line.startswith(("driver", "rank"))]
    return lines, proc.stderr


def package_files(lines) -> set[str]:
    return {f for line in lines for f in line if f.endswith(".py")}


def test_a_script_from_another_trees_root_runs_its_own_labkit_on_every_rank(other_tree):
    # python labs/probe.py from the other tree's root: labs/ is first on the path, then this
    # tree (PYTHONPATH, as an install of this tree would be): the driver imports this tree's
    # labkit. Before the fix the ranks imported the working directory's.
    lines, stderr = run_probe(other_tree, "labs/probe.py", pythonpath=str(ROOT))
    assert len(lines) == 3, lines
    files = package_files(lines)
    assert all(f.startswith(str(ROOT / "labkit")) for f in files), \
        f"the driver or a rank ran another tree's labkit:\n" + "\n".join(" ".join(l) for l in lines)
    # The warning is true: it names this tree as the one the ranks run, and the tree you are in.
    assert f"every rank it launches run {ROOT}'s labkit" in stderr and str(other_tree) in stderr, stderr


def test_a_script_that_imports_the_working_trees_labkit_runs_it_on_every_rank(other_tree):
    # python -c from the other tree's root: the working directory is first on the path, so
    # the driver imports the other tree's labkit; the ranks must follow it, not an install.
    lines, stderr = run_probe(other_tree, "-c", PROBE, pythonpath=str(ROOT))
    assert len(lines) == 3, lines
    files = package_files(lines)
    assert all(f.startswith(str(other_tree / "labkit")) for f in files), \
        f"the driver or a rank ran another tree's labkit:\n" + "\n".join(" ".join(l) for l in lines)
    assert "UserWarning" not in stderr, stderr


# ----------------------------------------------------------------------------- issue 43 item 2


@pytest.fixture(scope="module")
def third_tree(tmp_path_factory, other_tree) -> Path:
    """Another course tree beside ``other_tree``, with the same lab probe."""
    tree = tmp_path_factory.mktemp("third") / "course"
    shutil.copytree(other_tree, tree, ignore=shutil.ignore_patterns("__pycache__"))
    return tree


@pytest.mark.parametrize("direction", ["clone-env-workspace-lab", "workspace-env-clone-lab"])
def test_a_lab_file_runs_its_own_trees_labkit_wherever_you_stand(direction, other_tree, third_tree, tmp_path):
    # `python ../my-labs/labs/00_collectives.py` with the clone's environment active, from a
    # folder of neither tree: before, the clone's labkit ran the workspace's lab (its reference
    # solutions passed, silently); and the other way round, the stubs ran the clone's lab.
    # The lab file's own tree wins, on the driver and every rank, and the first line says so.
    script_tree, env_tree = (other_tree, third_tree) if direction.startswith("clone") else (third_tree, other_tree)
    env = {k: v for k, v in os.environ.items() if k not in ("LABKIT_RANK", "WORLD_SIZE", "RANK")}
    env["PYTHONPATH"] = str(env_tree)
    proc = subprocess.run([sys.executable, str(script_tree / "labs" / "lab_probe.py")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [tuple(line.split()) for line in proc.stdout.splitlines() if line.startswith(("driver", "rank"))]
    assert len(lines) == 3, proc.stdout
    files = package_files(lines)
    assert all(f.startswith(str(script_tree / "labkit")) for f in files), \
        f"the lab ran another tree's labkit:\n" + "\n".join(" ".join(l) for l in lines)
    first = proc.stdout.splitlines()[0]
    assert f"belongs to {script_tree}" in first and str(env_tree) in first, proc.stdout
