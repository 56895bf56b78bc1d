"""Solution regions, the task registry, and the learner workspace made from them.

An exercise body in ``labkit/*.py`` (or a chapter package's ``labkit/<module>/*.py``) sits between a line ``# BEGIN SOLUTION <task>: <hint>``
(the task id, such as ``ddp.bucketed``, and a one-line hint for the learner) and a line
``# END SOLUTION``. ``make_workspace`` copies the course and replaces every region with
``raise NotImplementedError("<task>: <hint>")`` at the same indentation;
chapters, labs and tests come along unchanged (lab outputs are cleared).
"""

from __future__ import annotations

import ast
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from labkit.course.chapters import CHAPTERS, exercise_files
from labkit.trees import find_course_root, is_course_root, package_dir  # noqa: F401 - re-exported

TASK_ID = r"[a-z0-9_]+\.[a-z0-9_]+"   # chapter.task, such as ddp.bucketed
BEGIN = re.compile(rf"^(?P<indent>\s*)# BEGIN SOLUTION (?P<task>{TASK_ID}):?\s*(?P<hint>.*)$")
END = re.compile(r"^\s*# END SOLUTION\s*$")
MARKER_FILE = ".labkit-workspace"  # present at the root of a learner workspace
# The clone's torch build, as a pip requirement (with its index when it is not PyPI's), and
# the line that installs the workspace with it: the README's learner block and
# `labkit workspace`'s hint both say it, so a laptop's second environment gets the same
# (CPU) build as the first instead of PyPI's CUDA one.
TORCH_FILE = "torch-requirement.txt"
INSTALL_LINE = f"pip install -r {TORCH_FILE} -e ."
TORCH_INDEX = "https://download.pytorch.org/whl/"
COPIED = ["README.md", "ARCHITECTURE.md", "pyproject.toml", "environment.yml", "environment-cpu.yml", ".gitignore",
          "labkit", "chapters", "labs", "tests"]
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints", "*.egg-info")
# What a learner never gets: hidden graded tests (the autograder bundle adds them back), and
# the grader's mutants and coverage exclusions (they quote the solutions).
PRIVATE = ("tests/grading/hidden", "tests/mutants", "tests/coverage_exclusions.txt")


def _ignore(root: Path):
    def ignore(folder: str, names: list[str]) -> set[str]:
        skipped = set(IGNORED(folder, names))
        for name in names:
            if (Path(folder) / name).relative_to(root).as_posix() in PRIVATE:
                skipped.add(name)
        return skipped
    return ignore


@dataclass(frozen=True)
class Region:
    task: str
    hint: str
    path: Path
    begin: int   # 0-based line numbers of the two marker lines
    end: int


def course_root() -> Path:
    """The checkout (or workspace) this labkit was imported from."""
    root = package_dir().parent
    if not is_course_root(root):
        raise RuntimeError(f"labkit at {package_dir()} is not inside a course checkout; "
                           "run from a clone of the repository (pip install -e .)")
    return root


def is_student_workspace(root: Path | None = None) -> bool:
    return ((root or package_dir().parent) / MARKER_FILE).exists()


def find_regions(path: Path) -> list[Region]:
    """The solution regions of one file, checked for balance."""
    regions, open_at = [], None
    for i, line in enumerate(path.read_text().splitlines()):
        begin = BEGIN.match(line)
        if begin:
            if open_at is not None:
                raise ValueError(f"{path}:{i + 1}: BEGIN SOLUTION inside the region opened at line {open_at[0] + 1}")
            if not begin["hint"].strip():
                raise ValueError(f"{path}:{i + 1}: BEGIN SOLUTION {begin['task']} has no hint")
            open_at = (i, begin)
        elif END.match(line):
            if open_at is None:
                raise ValueError(f"{path}:{i + 1}: END SOLUTION without BEGIN SOLUTION")
            start, m = open_at
            regions.append(Region(m["task"], m["hint"].strip(), path, start, i))
            open_at = None
        elif "BEGIN SOLUTION" in line and line.lstrip().startswith("#"):
            raise ValueError(f"{path}:{i + 1}: malformed marker; expected '# BEGIN SOLUTION <chapter>.<task>: <hint>'")
    if open_at is not None:
        raise ValueError(f"{path}:{open_at[0] + 1}: BEGIN SOLUTION is never closed")
    return regions


STUB = re.compile(rf"""^\s*raise NotImplementedError\((?P<message>(?P<q>['"]){TASK_ID}: .*(?P=q))\)\s*$""")
STUB_MESSAGE = re.compile(rf"{TASK_ID}: ")   # how every stub's NotImplementedError message begins


def find_stubs(path: Path) -> list[Region]:
    """The stubs of a learner workspace's file, as one-line regions (the raise line). The
    message is read as the string literal ``stub_source`` wrote (its escapes undone)."""
    found = []
    for i, line in enumerate(path.read_text().splitlines()):
        if m := STUB.match(line):
            task, hint = ast.literal_eval(m["message"]).split(": ", 1)
            found.append(Region(task, hint, path, i, i))
    return found


def code_files(pkg: Path) -> list[Path]:
    """The files that may hold exercises: labkit's own modules, and the files of every chapter
    that is a package (``labkit/compress/*.py``); not the course's tools below ``labkit/``."""
    packaged = [f for m in CHAPTERS.values() for f in exercise_files(pkg, m) if f.parent != pkg]
    return sorted(pkg.glob("*.py")) + packaged


def exercises(pkg: Path) -> list[Region]:
    """Every exercise of the package, reference or workspace: solution regions, or stubs."""
    return all_regions(pkg) or [r for path in code_files(pkg) for r in find_stubs(path)]


def all_regions(pkg: Path | None = None) -> list[Region]:
    return [r for path in code_files(pkg or package_dir()) for r in find_regions(path)]


def tasks(pkg: Path | None = None) -> dict[str, str]:
    """Task id -> hint (the first region's), for every exercise in the package."""
    found: dict[str, str] = {}
    for region in all_regions(pkg):
        found.setdefault(region.task, region.hint)
    return found


def stub_source(path: Path) -> str:
    """The file's text with every solution region replaced by its stub."""
    lines = path.read_text().splitlines(keepends=True)
    for region in reversed(find_regions(path)):
        indent = BEGIN.match(lines[region.begin])["indent"]
        message = f"{region.task}: {region.hint}"
        lines[region.begin:region.end + 1] = [f"{indent}raise NotImplementedError({message!r})\n"]
    source = "".join(lines)
    compile(source, str(path), "exec")  # a stub that does not even import is a bug here
    return source


def clear_outputs(notebook: Path) -> None:
    nb = json.loads(notebook.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    notebook.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


def torch_requirement(version: str | None) -> str:
    """A pip requirements file that installs torch ``version`` as installed (``2.13.0+cpu``:
    from PyTorch's CPU index; ``2.13.0+cu126``: its CUDA 12.6 index; ``2.13.0``: PyPI's)."""
    if version is None:
        return "# torch was not installed where this workspace was made: pip takes pyproject.toml's pin\n"
    head = "# the torch build of the clone this workspace was made from (labkit workspace wrote this)\n"
    _, _, label = version.partition("+")
    index = f"--extra-index-url {TORCH_INDEX}{label}\n" if label else ""
    return f"{head}{index}torch=={version}\n"


def installed_torch() -> str | None:
    """The version of the torch this environment has (``2.13.0+cpu``), without importing it."""
    from importlib import metadata
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def make_workspace(dest: Path, root: Path | None = None, force: bool = False) -> list[Region]:
    """Copy the course to ``dest`` with every solution region stubbed out."""
    root = root or course_root()
    if is_student_workspace(root):
        raise ValueError(f"{root} is a learner workspace already: make workspaces from the course itself")
    dest = Path(dest).resolve()
    if dest == root or root in dest.parents:
        raise ValueError(f"{dest} is inside the course's clone ({root}): a workspace goes beside it, "
                         "e.g. labkit workspace ../my-labs")
    if dest in root.parents:
        raise ValueError(f"{dest} holds the course's clone ({root}): a workspace goes beside it, "
                         "e.g. labkit workspace ../my-labs")
    if dest.exists() and any(dest.iterdir()):
        if not force:
            raise FileExistsError(f"{dest} exists and is not empty (use --force to replace it)")
        shutil.rmtree(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        src = root / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=_ignore(root))
        elif src.exists():
            shutil.copy2(src, dest / name)
    regions = all_regions(root / "labkit")
    for path in sorted({r.path for r in regions}):
        (dest / path.relative_to(root)).write_text(stub_source(path))
    for notebook in (dest / "labs").glob("*.ipynb"):
        clear_outputs(notebook)  # the lab's results come from the learner's own code
    (dest / TORCH_FILE).write_text(torch_requirement(installed_torch()))
    hints = tasks(root / "labkit")
    (dest / MARKER_FILE).write_text("".join(f"{t}\t{hints[t]}\n" for t in sorted(hints)))
    return regions


def listed_tasks(root: Path) -> dict[str, str]:
    """A workspace's task ids and hints, as written when it was made (one 'task<TAB>hint'
    line each; older workspaces list ids alone)."""
    listed = {}
    for line in (root / MARKER_FILE).read_text().splitlines():
        if line.strip():
            task, _, hint = line.partition("\t")
            listed[task.strip()] = hint.strip()
    return listed
