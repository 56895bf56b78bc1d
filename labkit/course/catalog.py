"""The list of exercises ``labkit tasks`` prints: chapter order, points, where, hint, status.

Read from source text only (no torch, no pytest collection), so the listing takes well
under a second. Points are what grading awards: the sum of a task's test points over the
parametrisations of each test, world size 1 excluded (a diagnostic). They are read from
the ``@task(...)`` decorators and their ``@pytest.mark.parametrize`` lists; a count that
cannot be read that way shows as '?'.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from labkit.course import workspace
from labkit.course.chapters import CHAPTERS  # noqa: F401 - number -> module, re-exported



@dataclass
class TaskInfo:
    task: str
    chapter: str
    where: str          # 'labkit/pp.py:123' (the stub or region), or the module alone
    hint: str
    points: float | None
    status: str         # 'stub', 'solution' (reference region) or 'written' (no stub left)


def tasks(root: Path) -> list[TaskInfo]:
    pkg = root / "labkit"
    in_workspace = workspace.is_student_workspace(root)
    listed = workspace.listed_tasks(root) if in_workspace else workspace.tasks(pkg)
    points = static_points(root)
    found: list[TaskInfo] = []
    for chapter, module in CHAPTERS.items():
        path = pkg / f"{module}.py"
        seen: dict[str, TaskInfo] = {}
        if path.exists():
            places: dict[str, int] = {}
            for region, status in [(r, "solution") for r in workspace.find_regions(path)] + \
                                  [(r, "stub") for r in workspace.find_stubs(path)]:
                places[region.task] = places.get(region.task, 0) + 1
                if region.task not in seen:
                    seen[region.task] = TaskInfo(region.task, chapter, f"labkit/{module}.py:{region.begin + 1}",
                                                 region.hint, points.get(region.task), status)
            for task, count in places.items():  # a task of several regions: say how many more
                if count > 1:
                    seen[task].hint += f"  (+{count - 1} more in this file)"
        # A task whose stub is gone (written, or the module replaced whole) is still listed.
        for task, hint in listed.items():
            if task.split(".")[0] == module and task not in seen:
                seen[task] = TaskInfo(task, chapter, f"labkit/{module}.py", hint, points.get(task), "written")
        found.extend(sorted(seen.values(), key=lambda t: _line(t.where)))
    return found


def _line(where: str) -> int:
    return int(where.rsplit(":", 1)[1]) if where.count(":") else 10**9


def static_points(root: Path, visible: bool = True, hidden: bool = True) -> dict[str, float | None]:
    """Task -> points, from the grading tests' decorators (see module docstring); ``hidden``:
    count tests/grading/hidden/ (left out of learner workspaces), ``visible``: the others."""
    grading = root / "tests" / "grading"
    points: dict[str, float | None] = {}
    paths = (sorted(grading.glob("test_*.py")) if visible else []) + \
        (sorted((grading / "hidden").glob("test_*.py")) if hidden else [])
    for path in paths:
        tree = ast.parse(path.read_text())
        constants = _module_constants(tree)
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef):
                continue
            task, each = _task_of(node)
            if task is None:
                continue
            count = _parametrisations(node, constants)
            old = points.get(task, 0.0)
            points[task] = None if count is None or old is None else old + each * count
    return points


def _task_of(fn: ast.FunctionDef) -> tuple[str | None, float]:
    for deco in fn.decorator_list:
        if isinstance(deco, ast.Call) and getattr(deco.func, "id", "") == "task" and deco.args:
            each = next((k.value.value for k in deco.keywords if k.arg == "points"), ast.Constant(1))
            each = each if isinstance(each, (int, float)) else getattr(each, "value", 1)
            return deco.args[0].value, float(each)
    return None, 0.0


def _module_constants(tree: ast.Module) -> dict[str, object]:
    constants = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                constants[node.targets[0].id] = ast.literal_eval(node.value)
            except (ValueError, SyntaxError, TypeError):
                pass
    return constants


def _parametrisations(fn: ast.FunctionDef, constants: dict) -> int | None:
    """How many of the test's parametrisations carry points (world size 1 does not)."""
    count = 1
    for deco in fn.decorator_list:
        if not (isinstance(deco, ast.Call) and getattr(deco.func, "attr", "") == "parametrize"):
            continue
        names_node, values_node = deco.args[:2]
        try:
            names = ast.literal_eval(names_node)
            values = (constants[values_node.id] if isinstance(values_node, ast.Name)
                      else ast.literal_eval(values_node))
        except (ValueError, SyntaxError, KeyError, TypeError):
            return None
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        if "world_size" in names:
            at = names.index("world_size")
            values = [v for v in values if (v[at] if len(names) > 1 else v) != 1]
        count *= len(values)
    return count


def format_tasks(infos: list[TaskInfo]) -> str:
    width = max(len(t.task) for t in infos) + 2
    where = max(len(t.where) for t in infos) + 2
    lines = [f"ch  {'task':<{width}}{'points':>6}  {'status':<9}{'where':<{where}}hint"]
    for t in infos:
        pts = "?" if t.points is None else f"{t.points:g}"
        lines.append(f"{t.chapter}  {t.task:<{width}}{pts:>6}  {t.status:<9}{t.where:<{where}}{t.hint}")
    return "\n".join(lines)
