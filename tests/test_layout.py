"""The house rules of ``labkit/`` (ARCHITECTURE.md): four rooms, imports one way.

    runtime    labkit/runtime/*                    imports only the runtime
    tools      launch, comm, memory, models, ...   imports tools and the runtime
    exercises  one module per chapter              imports exercises, tools and the runtime
    course     labkit/course/*                     imports anything; only the course imports it

Every import counts, at the top of a module or inside a function, and the graph of module
imports has no cycle, the course machinery included.
"""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from labkit.course.chapters import CHAPTERS, exercise_files

PACKAGE = Path(__file__).resolve().parent.parent / "labkit"
EXERCISES = set(CHAPTERS.values())


def room(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("runtime", "course"):
        return parts[1]
    if len(parts) > 1 and parts[1] in EXERCISES:
        return "exercises"
    return "tools"  # labkit itself, launch, comm, memory, models, data, check, timing, viz, oracles, trees


ALLOWED = {"runtime": {"runtime"}, "tools": {"tools", "runtime"},
           "exercises": {"exercises", "tools", "runtime"}, "course": {"course", "exercises", "tools", "runtime"}}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def labkit_imports(path: Path) -> set[str]:
    """Every labkit module ``path`` imports (``from labkit import pp`` counts as labkit.pp)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "labkit"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "labkit":
            for a in node.names:
                candidate = f"{node.module}.{a.name}"
                is_module = (PACKAGE.parent / Path(*candidate.split("."))).with_suffix(".py").exists() or \
                    (PACKAGE.parent / Path(*candidate.split("."))).is_dir()
                found.add(candidate if is_module else node.module)
    return found


def graph() -> dict[str, set[str]]:
    return {module_name(p): labkit_imports(p) for p in PACKAGE.rglob("*.py")}


def test_imports_run_one_way():
    wrong = []
    for module, imports in graph().items():
        if module == "labkit":
            continue  # the package's face: its lazy attributes name the launcher (a tool)
        for target in imports:
            if room(target) not in ALLOWED[room(module)]:
                wrong.append(f"{module} ({room(module)}) imports {target} ({room(target)})")
    assert not wrong, "upward imports:\n  " + "\n  ".join(sorted(wrong))


def test_no_import_cycle():
    edges = {m: {t for t in ts if t != m} for m, ts in graph().items()}
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for nxt in edges.get(node, ()):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in edges:
        if node not in state:
            visit(node, [node])


def test_every_chapter_has_its_files():
    """The five files of a chapter (ARCHITECTURE.md's checklist)."""
    root = PACKAGE.parent
    for number, module in CHAPTERS.items():
        assert exercise_files(root / "labkit", module), module   # labkit/<module>.py or the package labkit/<module>/
        assert (root / "tests" / "grading" / f"test_{module}.py").exists(), module
        for folder, suffix in (("chapters", ".ipynb"), ("labs", ".ipynb"), ("labs", ".py")):
            assert list((root / folder).glob(f"{number}_*{suffix}")), f"{folder}/{number}_*{suffix} missing"


# PyTorch's implementations the oracles set up; the comparison code (tests, labs and their
# notebooks, bench) asks labkit.oracles for them instead of writing the set-up again.
# (init_device_mesh is not listed: tests also call it to compare layouts. tests/mutants use
# built-ins on purpose; the chapters' notebooks show the built-ins themselves.)
BUILTINS = ("torch.distributed.fsdp", "torch.distributed.optim", "torch.distributed.pipelining",
            "torch.distributed.checkpoint", "torch.distributed.algorithms", "torch.nn.parallel",
            "torch.utils.checkpoint", "torch.distributed.tensor.parallel")


def dotted(node) -> str | None:
    """'torch.nn.parallel.DistributedDataParallel' for that attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def python_source(path: Path) -> str:
    """A Python file's text, or a notebook's code cells (IPython's % and ! lines left out)."""
    if path.suffix != ".ipynb":
        return path.read_text()
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    lines = [line for c in cells for line in "".join(c["source"]).splitlines() + [""]]
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in lines)


def test_builtins_are_set_up_only_in_the_oracles():
    root = PACKAGE.parent
    files = [*root.glob("labs/*.py"), *(PACKAGE / "course" / "bench").glob("*.py"),
             *root.glob("tests/grading/**/*.py"), *root.glob("tests/test_*.py"), *root.glob("labs/*.ipynb")]
    found = []
    for path in files:
        for node in ast.walk(ast.parse(python_source(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [dotted(node) or ""] if isinstance(node, ast.Attribute) else []
            found += [f"{path.relative_to(root)}:{node.lineno}: {name}" for name in names
                      if name.startswith(BUILTINS)]
    assert not found, "set up in labkit.oracles instead:\n  " + "\n  ".join(sorted(set(found)))


def test_importing_the_oracles_costs_nothing_beyond_torch():
    """labkit.oracles imports torch.distributed's submodules inside its functions: `labkit
    tasks` and the pytest process stay fast (torch.distributed.optim compiles TorchScript)."""
    code = ("import sys, torch; before = set(sys.modules); import labkit.oracles; "
            "print(sorted(m for m in set(sys.modules) - before if m.startswith('torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=str(PACKAGE.parent))).stdout
    assert out.strip() == "[]", f"importing labkit.oracles imported {out.strip()} beyond torch"


def test_the_conda_environments_install_the_pinned_set_and_the_cpu_one_pins_torch_alike():
    """environment.yml and environment-cpu.yml install the package (so pyproject.toml's pins);
    the CPU variant names torch at pyproject's version, from PyTorch's CPU index."""
    import tomllib
    pins = {re.split(r"[=<>]", d)[0]: d for d in tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]["dependencies"]}
    torch_pin = pins["torch"].split("==")[1]
    for name in ("environment.yml", "environment-cpu.yml"):
        lines = [ln.strip() for ln in (PACKAGE.parent / name).read_text().splitlines() if not ln.lstrip().startswith("#")]
        assert "- python=3.11" in lines and "- -e ." in lines, f"{name}: python 3.11 and `-e .` (the pinned set)"
        assert f"conda env create -f {name}" in (PACKAGE.parent / "README.md").read_text(), f"the README does not mention {name}"
    cpu = [ln.strip() for ln in (PACKAGE.parent / "environment-cpu.yml").read_text().splitlines()]
    assert f"- torch=={torch_pin}+cpu" in cpu, f"environment-cpu.yml: torch {torch_pin}+cpu (pyproject: {pins['torch']})"
    assert "- --extra-index-url https://download.pytorch.org/whl/cpu" in cpu
