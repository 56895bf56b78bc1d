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
from labkit.course.chapters import exercise_files, relative_path



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
        seen: dict[str, TaskInfo] = {}
        files = exercise_files(pkg, module)
        for path in files:
            places: dict[str, int] = {}
            for region, status in [(r, "solution") for r in workspace.find_regions(path)] + \
                                  [(r, "stub") for r in workspace.find_stubs(path)]:
                places[region.task] = places.get(region.task, 0) + 1
                if region.task not in seen:
                    seen[region.task] = TaskInfo(region.task, chapter, f"{relative_path(pkg, path)}:{region.begin + 1}",
                                                 region.hint, points.get(region.task), status)
            for task, count in places.items():  # a task of several regions: say how many more
                if count > 1:
                    seen[task].hint += f"  (+{count - 1} more in this file)"
        # A task whose stub is gone (written, or the module replaced whole) is still listed.
        where = relative_path(pkg, files[0].parent) + "/" if len(files) > 1 else f"labkit/{module}.py"
        for task, hint in listed.items():
            if task.split(".")[0] == module and task not in seen:
                seen[task] = TaskInfo(task, chapter, where, hint, points.get(task), "written")
        order = {relative_path(pkg, p): i for i, p in enumerate(files)}   # a package's files in order, then lines
        found.extend(sorted(seen.values(), key=lambda t: (order.get(t.where.rsplit(":", 1)[0], len(files)), _line(t.where))))
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


# ----------------------------------------------------------------------------- what a lab uses


def lab_uses(root: Path, lab: Path, index: "_Index | None" = None) -> list[str]:
    """The tasks a lab script's code reaches, in chapter order: read from source, not run.

    A reference graph over ``labkit/``: each top-level function or class of a module refers
    to the names it uses (its module's own, and what ``import`` and ``from ... import`` bind,
    inside functions too); a task belongs to the definition that holds its solution region
    (or stub). Whatever the lab file refers to, and everything reachable from there, counts.
    Over-approximate where code is picked at run time (a class counts whole), never silent.
    Only the modules reached are parsed (``index``: one already holding some)."""
    index = index or _Index(root)
    tree = ast.parse(lab.read_text())
    seen: set[tuple[str, str]] = set()
    todo = list(index.references(tree, _imports(tree, ""), ""))
    while todo:
        node = index.defined(todo.pop())
        if node in seen or not index.has(node):
            continue
        seen.add(node)
        todo.extend(index.edges(node))
    tasks = {t for node in seen for t in index.tasks.get(node, ())}
    from labkit.course.grading import task_order
    return sorted(tasks, key=task_order)


USES_FILE = ".labkit-lab-uses"   # in a workspace: what each lab uses, read from the reference


def earlier_tasks(root: Path, chapter: str, index: "_Index | None" = None) -> list[str]:
    """The tasks of other chapters that lab ``chapter``'s script runs (``labs/NN_*.py``). In a
    workspace, also those the reference solutions reached (written down by ``write_uses``:
    a stub's body no longer calls the tasks its solution calls)."""
    module = CHAPTERS[chapter]
    labs = sorted((root / "labs").glob(f"{chapter}_*.py"))
    found = {t for lab in labs for t in lab_uses(root, lab, index)}
    if (root / USES_FILE).exists():
        for line in (root / USES_FILE).read_text().splitlines():
            number, _, tasks = line.partition("\t")
            if number == chapter:
                found.update(tasks.split())
    from labkit.course.grading import task_order
    return sorted((t for t in found if t.split(".")[0] != module), key=task_order)


def write_uses(root: Path, dest: Path) -> None:
    """``dest/USES_FILE``: each lab's tasks of other chapters, as the reference at ``root`` runs them."""
    index = _Index(root)
    lines = [f"{chapter}\t{' '.join(earlier_tasks(root, chapter, index))}\n" for chapter in CHAPTERS]
    (dest / USES_FILE).write_text("".join(lines))


def format_earlier(root: Path, chapters: list[str]) -> list[str]:
    """One line per lab that runs earlier chapters' tasks: ``labkit tasks`` prints them."""
    number = {module: n for n, module in CHAPTERS.items()}
    lines, index = [], _Index(root)
    for chapter in chapters:
        used = earlier_tasks(root, chapter, index)
        if used:
            named = ", ".join(f"{t} ({number.get(t.split('.')[0], '?')})" for t in used)
            lines.append(f"lab {chapter} also runs these tasks of other chapters: {named}")
    return lines


def _imports(tree: ast.AST, module: str) -> dict[str, tuple[str, str | None]]:
    """Name -> (module, attribute or None for the module itself), from every import in ``tree``."""
    bound: dict[str, tuple[str, str | None]] = {}
    package = module.rsplit(".", 1)[0] if module else ""
    for node in _statements(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = (alias.name, None)
                else:
                    bound[alias.name.split(".")[0]] = (alias.name.split(".")[0], None)
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:   # relative: from the package of this module
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                source = f"{base}.{source}".strip(".")
            for alias in node.names:
                bound[alias.asname or alias.name] = (source, alias.name)
    return bound


def _statements(tree: ast.AST):
    """Every statement in ``tree``, nested ones too (imports are statements: expressions,
    the bulk of a module's nodes, need no visit)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            children = getattr(node, field, None)
            if isinstance(children, list):
                todo.extend(children)


class _Index:
    """The top-level definitions of ``labkit/``'s modules, parsed when first reached: line
    span, tasks and references."""

    def __init__(self, root: Path):
        self.root = root
        self.defs: dict[tuple[str, str], ast.AST] = {}
        self.tasks: dict[tuple[str, str], set[str]] = {}
        self.bound: dict[str, dict[str, tuple[str, str | None]]] = {}
        self.parsed: dict[str, bool] = {}   # module -> parsed (False: no such labkit module)

    def path(self, module: str) -> Path | None:
        if module != "labkit" and not module.startswith("labkit."):
            return None
        base = self.root.joinpath(*module.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
        return None

    def is_module(self, module: str) -> bool:
        return self.path(module) is not None

    def has(self, key: tuple[str, str]) -> bool:
        module = key[0]
        if module not in self.parsed:
            self.parsed[module] = self._parse(module)
        return key in self.defs

    def _parse(self, module: str) -> bool:
        path = self.path(module)
        if path is None:
            return False
        try:
            tree = ast.parse(path.read_text())
        except SyntaxError:
            return False   # a learner's half-written file: its references are unknown
        self.bound[module] = _imports(tree, module)
        regions = workspace.find_regions(path) or workspace.find_stubs(path)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                key = (module, node.name)
                self.defs[key] = node
                self.tasks[key] = {r.task for r in regions if node.lineno - 1 <= r.begin <= node.end_lineno - 1}
        return True

    def defined(self, key: tuple[str, str]) -> tuple[str, str]:
        """Where a name is defined: through re-exports (a chapter package's ``__init__``
        imports its files' functions), up to a few hops."""
        for _ in range(8):
            if self.has(key) or key[0] not in self.bound:
                return key
            source, attr = self.bound[key[0]].get(key[1], (None, None))
            if source is None or attr is None:
                return key
            key = (source, attr)
        return key

    def edges(self, key: tuple[str, str]) -> set[tuple[str, str]]:
        module = key[0]
        return self.references(self.defs[key], self.bound[module], module)

    def references(self, tree: ast.AST, bound: dict, module: str) -> set[tuple[str, str]]:
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                found |= self._resolve_name(node.id, bound, module)
            elif isinstance(node, ast.Attribute):
                target = self._as_module(node.value, bound)
                if target is not None:
                    found.add((target, node.attr))
        return found

    def _resolve_name(self, name: str, bound: dict, module: str) -> set[tuple[str, str]]:
        if module and self.has((module, name)):
            return {(module, name)}
        source, attr = bound.get(name, (None, None))
        if source is None or attr is None:
            return set()
        return {(source, attr)}

    def _as_module(self, expr: ast.AST, bound: dict) -> str | None:
        """The labkit module an expression names (``perf``, ``labkit.perf``, ``netbed``), or None."""
        if isinstance(expr, ast.Name):
            source, attr = bound.get(expr.id, (None, None))
            if source is None:
                return None
            name = source if attr is None else f"{source}.{attr}"
            return name if self.is_module(name) else None
        if isinstance(expr, ast.Attribute):
            parent = self._as_module(expr.value, bound)
            name = f"{parent}.{expr.attr}" if parent else None
            return name if name and self.is_module(name) else None
        return None
