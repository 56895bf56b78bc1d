"""Automatic mutation testing of the grader: mechanical edits of every solution region.

Beside the hand-written mutants of ``tests/mutants`` (``labkit.course.mutants``), which a
test author thought of, ``labkit mutate`` makes small edits by rule inside each
``# BEGIN SOLUTION`` ... ``# END SOLUTION`` region of ``labkit/<module>.py`` and grades
each edit on its own task alone. An edit whose task keeps all its points *survived*: either
the tests miss a wrong implementation, or the edit changes nothing that matters.

Operators (the ``op`` part of an id):

    delete     a statement replaced by ``pass``          wait      ``x.wait()`` dropped
    if_true    an ``if`` test forced True                 if_false  forced False
    if_body    the if-branch replaced by ``pass``         else      the else-branch dropped
    ifexp      ``a if c else b`` -> a, or -> b            group     a group argument -> None
    int        an integer literal +1 / -1                 dim       ``dim=d`` -> d + 1 / d - 1
    swap       two neighbouring positional arguments of a call swapped
    cmp        < <=, > >=, == !=, is / is not, in / not in flipped
    arith      + -, * /, // -> * swapped (also in ``x += y``)
    bool       True <-> False                             return    ``return x`` -> ``return None``
    drop_call  ``.detach()`` / ``.clone()`` / ``.contiguous()`` dropped
    move_wait  ``h.wait()`` moved up to just after the statement that made ``h``

Each edit is spliced into the original text at the node's line/column span (the rest of the
file is untouched), checked to parse to exactly the intended tree, and skipped if it does
not compile. Its id, ``<task>/<op>/<hash>``, hashes the enclosing statement's text, the
edited text and its replacement, so it survives unrelated lines moving.

Grading reuses the ``--mutants`` machinery of the grading plugin: the mutants are written
to a JSON file that ``LABKIT_MUTANTS_FILE`` names (the plugin then loads those instead of
``tests/mutants``), and ``pytest tests/grading/[hidden/]test_<module>.py --mutants
--grade-task <task>`` runs them, each stopping at its first failing test.

Equivalent mutants (edits that cannot change a result, e.g. ``.contiguous()`` of a tensor
that already is) are listed in the chapter's ``tests/mutants/<module>.py``::

    EQUIVALENT = {"moe.dispatch/drop_call/1a2b3c4d": "x is contiguous already (made by cat)"}

A survivor listed there is not a failure; an entry without a reason is an error. This is
a tool to run while writing tests, not part of CI:

    labkit mutate moe                      # every mutant of chapter 10
    labkit mutate moe.router --list        # what would run
    labkit mutate 03 --sample 5 --seed 1   # five per task, at random
    labkit mutate --id moe.layer/group/ad77e31d   # one mutant (ids do not move with lines)
"""

from __future__ import annotations

import ast
import copy
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from labkit.course import grading, mutants, workspace
from labkit.course.chapters import exercise_files

MUTANTS_ENV = mutants.GENERATED_ENV   # a JSON list of mutants the grading plugin runs instead
DROPPED_CALLS = {"detach", "clone", "contiguous"}
CMP_FLIP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
            ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
ARITH_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult}


@dataclass(frozen=True)
class AutoMutant:
    task: str
    op: str
    id: str        # <task>/<op>/<hash>: stable when unrelated lines move
    line: int      # 1-based, where the edit starts
    old: str       # the edited text (one line, shortened)
    new: str       # its replacement
    find: str      # a chunk of the module, present exactly once ...
    replace: str   # ... and what it becomes

    @property
    def description(self) -> str:
        return f"line {self.line}: `{self.old}` -> `{self.new}`"

    def mutant(self) -> mutants.Mutant:
        return mutants.Mutant(self.task, self.id.split("/", 1)[1], self.description, self.find, self.replace)


# ----------------------------------------------------------------------------- generating


def _int(value: int) -> ast.expr:
    return ast.UnaryOp(ast.USub(), ast.Constant(-value)) if value < 0 else ast.Constant(value)


def _int_value(node) -> int | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and _int_value(node.operand) is not None:
        return -node.operand.value
    return None


def _is_group(node) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name == "group" or name.endswith("_group")


def _is_wait(node) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "wait"
            and not node.args and not node.keywords)


def _assigns(stmt, name: str) -> bool:
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
    return any(isinstance(n, ast.Name) and n.id == name for t in targets for n in ast.walk(t))


def _edits(node, field: str, value):
    """(op, field, slice or None, new value) edits of ``node``: each replaces ``node.<field>``
    (or a slice of that list) with the new value."""
    if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
        for i, stmt in enumerate(value):
            wait = isinstance(stmt, ast.Expr) and _is_wait(stmt.value)
            skip = (isinstance(stmt, (ast.Pass, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                    or (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant))  # docstring
                    or (isinstance(stmt, ast.Return) and stmt.value is not None)            # see 'return'
                    or (isinstance(stmt, ast.If) and not stmt.orelse))                      # see 'if_false'
            if not skip:
                yield ("wait" if wait else "delete"), field, (i, i + 1), [ast.Pass()]
            if wait and isinstance(stmt.value.func.value, ast.Name):
                name = stmt.value.func.value.id
                made = [j for j in range(i) if _assigns(value[j], name)]
                if made and made[-1] < i - 1:
                    j = made[-1]
                    yield "move_wait", field, (j + 1, i + 1), [stmt, *value[j + 1:i]]
        return
    if not isinstance(value, ast.AST):
        return
    new = None
    if isinstance(node, ast.If) and field == "test":
        yield "if_true", field, None, ast.Constant(True)
        yield "if_false", field, None, ast.Constant(False)
    if isinstance(node, ast.keyword) and field == "value":
        if node.arg and (node.arg == "group" or node.arg.endswith("_group")) and not _is_none(value):
            yield "group", field, None, ast.Constant(None)
        if node.arg == "dim" and _int_value(value) is None:
            yield "dim", field, None, ast.BinOp(value, ast.Add(), ast.Constant(1))
            yield "dim", field, None, ast.BinOp(value, ast.Sub(), ast.Constant(1))
    if isinstance(node, ast.Call) and field == "args" and _is_group(value):
        yield "group", field, None, ast.Constant(None)
    number = _int_value(value)
    if number is not None:
        op = "dim" if isinstance(node, ast.keyword) and node.arg == "dim" else "int"
        yield op, field, None, _int(number + 1)
        yield op, field, None, _int(number - 1)
        return
    if isinstance(value, ast.Constant) and isinstance(value.value, bool):
        yield "bool", field, None, ast.Constant(not value.value)
    elif isinstance(value, ast.IfExp):
        yield "ifexp", field, None, value.body
        yield "ifexp", field, None, value.orelse
    elif isinstance(value, ast.Compare):
        for k, cmp in enumerate(value.ops):
            if type(cmp) in CMP_FLIP:
                new = copy.copy(value)
                new.ops = [*value.ops[:k], CMP_FLIP[type(cmp)](), *value.ops[k + 1:]]
                yield "cmp", field, None, new
    elif isinstance(value, (ast.BinOp, ast.AugAssign)) and type(value.op) in ARITH_SWAP:
        operands = [value.left, value.right] if isinstance(value, ast.BinOp) else [value.value]
        if not any(isinstance(o, (ast.Constant, ast.JoinedStr)) and isinstance(getattr(o, "value", ""), str)
                   for o in operands):
            new = copy.copy(value)
            new.op = ARITH_SWAP[type(value.op)]()
            yield "arith", field, None, new
    elif isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and not value.args \
            and not value.keywords and value.func.attr in DROPPED_CALLS | {"wait"}:
        if not (value.func.attr == "wait" and isinstance(node, ast.Expr)):   # a statement: see 'wait'
            yield ("wait" if value.func.attr == "wait" else "drop_call"), field, None, value.func.value
    elif isinstance(value, ast.Return) and value.value is not None and not _is_none(value.value):
        yield "return", field, None, ast.Return(ast.Constant(None))
    elif isinstance(value, ast.If):
        if value.orelse:
            yield "if_body", field, None, ast.If(value.test, [ast.Pass()], value.orelse)
            yield "else", field, None, ast.If(value.test, value.body, [])
    if isinstance(value, ast.Call):
        positional = value.args
        if not any(isinstance(a, ast.Starred) for a in positional):
            for k in range(len(positional) - 1):
                pair = positional[k:k + 2]
                if ast.dump(pair[0]) != ast.dump(pair[1]) and not any(isinstance(a, ast.Constant) for a in pair):
                    new = copy.copy(value)
                    new.args = [*positional[:k], positional[k + 1], positional[k], *positional[k + 2:]]
                    yield "swap", field, None, new


def _is_none(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


class _Source:
    """The module's text as bytes per line (ast's columns count UTF-8 bytes)."""

    def __init__(self, text: str, elsewhere: str = ""):
        self.text = text
        self.elsewhere = elsewhere   # the chapter package's other files: a find must not occur there
        self.data = text.encode()
        self.starts = [0]
        for line in self.data.splitlines(keepends=True):
            self.starts.append(self.starts[-1] + len(line))

    def offset(self, line: int, col: int) -> int:
        return self.starts[line - 1] + col

    def span(self, nodes) -> tuple[int, int]:
        return self.offset(nodes[0].lineno, nodes[0].col_offset), self.offset(nodes[-1].end_lineno, nodes[-1].end_col_offset)

    def segment(self, start: int, end: int) -> str:
        return self.data[start:end].decode()

    def indent(self, line: int) -> str:
        text = self.data[self.starts[line - 1]:self.starts[line]].decode()
        return text[:len(text) - len(text.lstrip())]


def _header(stmt, src: _Source) -> str:
    """The statement's text, without the bodies of a compound statement (for stable ids)."""
    body = getattr(stmt, "body", None)
    end = src.offset(body[0].lineno, 0) if isinstance(body, list) and body and isinstance(body[0], ast.stmt) \
        else src.offset(stmt.end_lineno, stmt.end_col_offset)
    return " ".join(src.segment(src.offset(stmt.lineno, stmt.col_offset), end).split())


def _children(node):
    for field, value in ast.iter_fields(node):
        if isinstance(value, list):
            if value and isinstance(value[0], ast.stmt):
                yield field, value, None
            for i, item in enumerate(value):
                if isinstance(item, ast.AST):
                    yield field, item, i
        elif isinstance(value, ast.AST):
            yield field, value, None


def generate(text: str, module: str, tasks=None, elsewhere: str = "") -> list[AutoMutant]:
    """Every mutant of the solution regions in ``text`` (the source of ``labkit/<module>.py``,
    or of one file of a chapter package, whose other files are ``elsewhere``), optionally only
    those of the named tasks, in the order of the file."""
    tree = ast.parse(text)
    src = _Source(text, elsewhere)
    regions, begin = [], None   # (task, first line, last line), 1-based, between the markers
    for number, line in enumerate(text.splitlines(), 1):
        if match := workspace.BEGIN.match(line):
            begin = (match["task"], number + 1)
        elif workspace.END.match(line) and begin:
            regions.append((*begin, number - 1))
            begin = None

    def region_of(nodes):
        first, last = nodes[0].lineno, nodes[-1].end_lineno
        return next((task for task, a, b in regions if a <= first and last <= b), None)

    def overlaps(node):
        return not hasattr(node, "lineno") or any(a <= node.end_lineno and node.lineno <= b for _, a, b in regions)

    found, seen = [], {}
    for top, top_node in enumerate(tree.body):
        if not overlaps(top_node):
            continue
        stack = [(top_node, top_node)]   # (node, the innermost statement around it)
        while stack:
            node, stmt = stack.pop()
            for field, child, index in reversed(list(_children(node))):
                for op, f, sl, new in _edits(node, field, child):   # child: a node, or a block of statements
                    m = _mutant(tree, top, src, node, f, index, sl, new, op, stmt, region_of, tasks, seen)
                    if m is not None:
                        found.append(m)
                if isinstance(child, ast.AST) and not isinstance(child, (ast.JoinedStr, ast.Raise)) \
                        and overlaps(child) and _int_value(child) is None:   # -1 is one literal
                    stack.append((child, child if isinstance(child, ast.stmt) else stmt))
    found.sort(key=lambda m: (m.line, m.id))
    unique = {}   # two rules may make the same edit (group -> None, a ... if ... else None -> None)
    for m in found:
        unique.setdefault((m.find, m.replace), m)
    return list(unique.values())


def _mutant(tree, top, src, node, field, index, sl, new, op, stmt, region_of, tasks, seen):
    value = getattr(node, field)
    old_nodes = value[sl[0]:sl[1]] if sl else [value[index] if index is not None else value]
    if not all(hasattr(n, "lineno") for n in old_nodes):
        return None
    task = region_of(old_nodes)
    if task is None or (tasks and task not in tasks):
        return None
    start, end = src.span(old_nodes)
    new_nodes = new if isinstance(new, list) else [new]
    indent = src.indent(old_nodes[0].lineno)
    text = ("\n" + indent).join(ast.unparse(n).replace("\n", "\n" + indent) for n in new_nodes)
    # The intended tree, to check the splice against (precedence may need brackets).
    if sl:
        saved = value[sl[0]:sl[1]]
        value[sl[0]:sl[1]] = new_nodes
    elif index is not None:
        saved, value[index] = value[index], new
    else:
        saved = value
        setattr(node, field, new)
    try:
        intended = ast.dump(tree.body[top])
    finally:
        if sl:
            value[sl[0]:sl[0] + len(new_nodes)] = saved
        elif index is not None:
            value[index] = saved
        else:
            setattr(node, field, saved)
    # Only the edited top-level statement is parsed and compiled again (whole lines of it).
    top_node = tree.body[top]
    first = min([top_node.lineno] + [d.lineno for d in getattr(top_node, "decorator_list", [])])
    lo, hi = src.starts[first - 1], src.starts[top_node.end_lineno]
    for candidate in (text, f"({text})"):
        mutated = (src.data[lo:start] + candidate.encode() + src.data[end:hi]).decode()
        try:
            parsed = ast.parse(mutated)
            compile(parsed, f"{op}", "exec")
        except SyntaxError:
            continue
        if len(parsed.body) == 1 and ast.dump(parsed.body[0]) == intended:
            break
    else:
        return None
    old = src.segment(start, end)
    context = _header(stmt, src)
    key = f"{task}|{op}|{context}|{' '.join(old.split())}|{' '.join(candidate.split())}"
    seen[key] = seen.get(key, 0) + 1
    if seen[key] > 1:
        key += f"|{seen[key]}"
    digest = hashlib.sha1(key.encode()).hexdigest()[:8]
    find, replace = _unique_chunk(src, start, end, candidate)
    return AutoMutant(task, op, f"{task}/{op}/{digest}", old_nodes[0].lineno, _short(old), _short(candidate),
                      find, replace)


def _short(text: str, limit: int = 90) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _unique_chunk(src: _Source, start: int, end: int, new: str) -> tuple[str, str]:
    """Whole lines around [start, end) that occur once in the module, and their edited text."""
    lo = max(i for i, s in enumerate(src.starts) if s <= start)
    hi = min(i for i, s in enumerate(src.starts) if s >= end) if end < src.starts[-1] else len(src.starts) - 1
    while True:
        chunk = src.segment(src.starts[lo], src.starts[hi])
        if (src.text.count(chunk) == 1 and chunk not in src.elsewhere) or (lo == 0 and hi == len(src.starts) - 1):
            edited = src.segment(src.starts[lo], start) + new + src.segment(end, src.starts[hi])
            return chunk, edited
        lo, hi = max(lo - 1, 0), min(hi + 1, len(src.starts) - 1)


# ----------------------------------------------------------------------------- equivalents


def equivalents(root: Path, module: str) -> dict[str, str]:
    """``EQUIVALENT`` of ``tests/mutants/<module>.py``: mutant id -> why it changes nothing."""
    path = root / "tests" / "mutants" / f"{module}.py"
    if not path.exists():
        return {}
    tree = ast.parse(path.read_text())
    for stmt in tree.body:
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and any(
                isinstance(t, ast.Name) and t.id == "EQUIVALENT"
                for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target])):
            listed = ast.literal_eval(stmt.value)
            empty = sorted(k for k, v in listed.items() if not str(v).strip())
            if empty:
                raise ValueError(f"{path}: EQUIVALENT entries need a reason: {empty}")
            return dict(listed)
    return {}


# ----------------------------------------------------------------------------- running


def _selection(names: list[str], root: Path) -> tuple[list[str], set[str]]:
    """(modules, task ids) of the selection; a name that is no chapter or task, or a tree
    without solutions (a learner workspace: nothing to mutate), is a ValueError."""
    if workspace.is_student_workspace(root):
        raise ValueError(f"{root} is a learner workspace: it has no solution regions to mutate; "
                         "run labkit mutate in the course's clone")
    chapters, tasks = grading.resolve_selection(names, root)   # a typo: one sentence, a did-you-mean
    files = grading.grading_files(chapters, root)
    modules = list(dict.fromkeys(f.stem.removeprefix("test_") for f in files))
    return modules, set(tasks)


def _grade(root: Path, task: str, batch: list[AutoMutant], timeout: float, log) -> dict[str, dict]:
    """Fates of a batch of one task's mutants: {id: {killed, by, message, tests}}; a batch
    that runs past ``len(batch) * timeout`` is split, a single mutant that does is killed."""
    module = task.split(".")[0]
    files = [f for f in grading.grading_files([module], root)]
    with tempfile.TemporaryDirectory(prefix="labkit-mutate-") as tmp:
        spec, report = Path(tmp) / "mutants.json", Path(tmp) / "fates.json"
        spec.write_text(json.dumps([asdict(m.mutant()) for m in batch]))
        env = dict(os.environ, **{MUTANTS_ENV: str(spec)})
        env["PYTHONPATH"] = os.pathsep.join(p for p in [str(root), env.get("PYTHONPATH", "")] if p)
        cmd = [sys.executable, "-m", "pytest", *map(str, files), "--mutants", f"--mutants-report={report}",
               f"--grade-task={task}", "-p", "no:cacheprovider", "-p", "no:xdist", "-o", "addopts=",
               f"--rootdir={root}", "-q", "--tb=no", "-p", "no:warnings"]
        try:
            proc = subprocess.run(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  timeout=timeout * len(batch), start_new_session=True)
            failure = None if report.exists() else f"pytest exited with {proc.returncode} and no report"
        except subprocess.TimeoutExpired:
            failure = f"no verdict within {timeout:g} s"
        if failure and len(batch) > 1:   # find the one that hangs or crashes pytest
            half = len(batch) // 2
            return {**_grade(root, task, batch[:half], timeout, log), **_grade(root, task, batch[half:], timeout, log)}
        if failure:
            fates = {batch[0].id: dict(killed=True, by="timeout" if "verdict" in failure else "crash",
                                       message=failure, tests=0)}
        else:
            fates = {f["mutant"]: f for f in json.loads(report.read_text())}
    for m in batch:
        fate = fates.get(m.id, dict(killed=False, by="", tests=0))
        log(m, fate)
    return {m.id: fates.get(m.id, dict(killed=False, by="", tests=0)) for m in batch}


def collect(root: Path, names: list[str], sample: int | None = None, seed: int = 0,
            ids=()) -> dict[str, list[AutoMutant]]:
    """Task -> its mutants, for the selected chapters or tasks (``sample`` per task at random;
    only the given ids, if any: their tasks are selected by them)."""
    names = [*names, *{i.split("/")[0] for i in ids}]
    modules, wanted = _selection(names, root)
    by_task: dict[str, list[AutoMutant]] = {}
    for module in modules:
        texts = [path.read_text() for path in exercise_files(root / "labkit", module)]
        for m in (m for i, text in enumerate(texts)
                  for m in generate(text, module, wanted or None, "\0".join(texts[:i] + texts[i + 1:]))):
            if not ids or m.id in ids:
                by_task.setdefault(m.task, []).append(m)
    unknown = set(ids) - {m.id for ms in by_task.values() for m in ms}
    if unknown:
        raise ValueError(f"no such automatic mutant {sorted(unknown)} (labkit mutate <task> --list shows them)")
    if sample:
        rng = random.Random(seed)
        by_task = {t: sorted(rng.sample(ms, min(sample, len(ms))), key=lambda m: m.line) for t, ms in by_task.items()}
    return by_task


def run(root: Path, names: list[str], sample=None, seed=0, jobs=2, timeout=600.0, batch=8,
        list_only=False, ids=(), out=print) -> int:
    by_task = collect(root, names, sample, seed, ids)
    total = sum(map(len, by_task.values()))
    if list_only:
        for task, ms in by_task.items():
            for m in ms:
                out(f"{m.id:<40} {m.description}")
        out(f"{total} automatic mutants in {len(by_task)} tasks")
        return 0
    listed = {}
    for module in dict.fromkeys(t.split(".")[0] for t in by_task):
        listed.update(equivalents(root, module))
    batches = [(t, ms[i:i + batch]) for t, ms in by_task.items() for i in range(0, len(ms), batch)]
    out(f"labkit mutate: {total} automatic mutants of {len(by_task)} tasks in {len(batches)} batches, "
        f"{jobs} at a time ({tree_label(root)})", flush=True)
    done = [0]

    def log(m, fate):
        done[0] += 1
        special = fate.get("by") in ("timeout", "crash")
        verdict = (f"killed ({fate['by']})" if special else "killed") if fate["killed"] \
            else "equivalent" if m.id in listed else "SURVIVED"
        by = f" by {fate['by']}" if fate["killed"] and not special else ""
        out(f"[{done[0]}/{total}] {verdict:<16} {m.id:<36} {m.description}{by}", flush=True)

    start = time.monotonic()
    fates: dict[str, dict] = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for result in pool.map(lambda tb: _grade(root, tb[0], tb[1], timeout, log), batches):
            fates.update(result)
    elapsed = time.monotonic() - start
    every = [m for ms in by_task.values() for m in ms]
    survivors = [m for m in every if not fates[m.id]["killed"]]
    equivalent = [m for m in survivors if m.id in listed]
    real = [m for m in survivors if m.id not in listed]
    timeouts = [m for m in every if fates[m.id].get("by") in ("timeout", "crash")]
    out("")
    for m in real:
        out(f"SURVIVED  {m.id:<36} {m.task:<20} {m.description}")
    for m in equivalent:
        out(f"equivalent {m.id:<36} {listed[m.id]}")
    stale = sorted(i for i in listed if i in fates and fates[i]["killed"])
    if stale:
        out(f"listed as equivalent but killed (remove from EQUIVALENT): {', '.join(stale)}")
    if timeouts:
        out(f"killed by the {timeout:g} s timeout (a hang, or a slow machine) or by crashing pytest: "
            f"{', '.join(m.id for m in timeouts)}")
    out(f"automatic mutants: {total - len(survivors)} killed of {total} ({len(real)} survived, "
        f"{len(equivalent)} equivalent) in {elapsed:.0f} s")
    return 1 if real else 0


def tree_label(root: Path) -> str:
    return f"{root} ({'learner workspace' if workspace.is_student_workspace(root) else 'reference solutions'})"


def load_file(path: str) -> list[mutants.Mutant]:
    """The mutants of a ``LABKIT_MUTANTS_FILE`` (for the grading plugin)."""
    return mutants.load_file(path)
