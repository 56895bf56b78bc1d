"""What a submitted exercise module may contain: a static policy, checked before anything runs.

The judge (``labkit.course.judge``) and every graded test (through ``check_task``) read each
exercise module's source and refuse it, naming ``file:line``, when it

* imports anything outside its chapter's allow-list: torch (minus the internals below),
  ``math``, ``typing``, ``dataclasses``, ``functools``, ``itertools``, ``collections``,
  ``contextlib``, ``enum``, ``abc``, ``numbers``, ``warnings``, ``time``, ``threading``,
  ``random``; the course's tools (``labkit.models``, ``memory``, ``budget``, ``data``, ``check``, ``hooks``, ``hardware``,
  ``launch``'s rank helpers); the exercise modules of earlier chapters; and what a chapter needs
  besides (files for chapter 09, numpy for chapter 11, RPC for chapter 13);
* reaches past that list at run time: ``getattr``/``setattr``/``delattr``/``hasattr`` with a
  computed name, ``__import__``, ``exec``, ``eval``, ``compile``, ``globals``, ``vars``,
  ``locals``, ``open`` (outside chapter 09), dunder attributes that lead to other objects'
  insides (``__dict__`` of a module, ``__globals__``, ``__class__``, ``__subclasses__``,
  ``__builtins__``, ``__code__``...), frame and traceback attributes (``f_back``,
  ``tb_frame``...), a module object used as a value (``d = dist``, ``f(torch.distributed)``),
  a private name of an imported module (``torch._C``, ``dist._world``), torch's internals
  (``distributed_c10d``, ``torch.ops``, ``torch.library``, ``torch.multiprocessing``,
  ``torch.utils.cpp_extension``...), the course's runtime or grader (``labkit.course``,
  ``labkit.runtime``, ``labkit.comm``, ``labkit.oracles``), or process control
  (``os.fork``/``setsid``/``kill``/``system``... where ``os`` is allowed at all);
* changes code it did not write: assigning or deleting an attribute of an imported module or
  class (``torch.distributed.all_reduce = ...``, ``nn.Linear.forward = ...``,
  ``type(x).f = ...``), or defining the hooks that let an object lie to a comparison
  (``__eq__``, ``__bool__``, ``__torch_function__``, ``__torch_dispatch__``) or run code
  where it is unpickled or collected (``__reduce__``, ``__del__``, ``__getattribute__``).

Names are resolved through the module's imports and then through the real objects (the
judge imports torch and the course's tools, never a submission): ``labkit.models.torch``
is ``torch``, so ``labkit.models.torch.distributed.all_reduce`` is checked as
``torch.distributed.all_reduce`` (also against ``labkit.course.rules``). The reference
solutions pass it (``tests/test_policy.py`` checks every one).

What the policy cannot see is listed in ARCHITECTURE.md ("Threat model").
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
import types
from dataclasses import dataclass

from labkit.course.chapters import CHAPTERS

# ----------------------------------------------------------------------------- the tables

STDLIB = ("__future__", "math", "typing", "dataclasses", "functools", "itertools", "collections",
          "contextlib", "enum", "abc", "numbers", "warnings", "time", "threading", "random", "copy",
          "heapq", "bisect", "statistics")
TOOLS = ("labkit.models", "labkit.memory", "labkit.budget", "labkit.data", "labkit.check", "labkit.hooks",
         "labkit.hardware",
         "labkit.launch.restart_count", "labkit.launch.rpc_name", "labkit.launch.under_torchrun")
FILES = ("os", "pathlib", "hashlib", "json", "re", "shutil", "tempfile", "io")

# chapter module -> extra imports it may use; extra private names it may reach.
EXTRA_IMPORTS: dict[str, tuple[str, ...]] = {
    "elastic": FILES, "compress": ("numpy",),
}
PRIVATE_OK = ("torch.autograd.Variable._execution_engine.queue_callback",  # a callback at the end of backward
              "torch.autograd.variable.Variable._execution_engine.queue_callback",
              "torch.ops.aten")  # torch's tensor operators (not torch.ops.c10d: the collectives)
EXTRA_PRIVATE: dict[str, tuple[str, ...]] = {
    "fsdp": ("torch.utils._pytree",),
    "ddp": ("torch._C.Future",),  # what a comm hook's future is (given code)
}
# Attributes of imported code a chapter's given code patches, each restored after use.
EXTRA_PATCH: dict[str, tuple[str, ...]] = {
    "rpc": ("warnings.showwarning",),  # hides one note of torch's about the scripted optimizer
}
EXTRA_OS: dict[str, tuple[str, ...]] = {"elastic": ("os.kill",)}  # the lab's simulated crash kills itself
FILE_CHAPTERS = ("elastic",)
# Given code a graded function may not call: it solves a graded task (lab 00's pipelined ring
# with one segment is the graded ring all-reduce).
GIVEN_ONLY: dict[str, tuple[str, ...]] = {"collectives": ("pipelined_ring_all_reduce",)}  # may call open(), torch.save and torch.load

# Never, in any chapter (a name equal to one, or below it).
BANNED = ("torch._C", "torch.ops.c10d", "torch.ops._c10d_functional", "torch.ops.profiler",
          "torch.ops.load_library", "torch.ops.import_module", "torch.library", "torch.classes", "torch.utils.cpp_extension",
          "torch.multiprocessing", "torch.hub", "torch.package", "torch.jit.load", "torch.from_file",
          "torch.distributed.distributed_c10d", "torch.distributed.elastic", "torch.distributed.launcher",
          "torch.distributed.run", "torch.utils.data.DataLoader", "torch.backends",
          "labkit.course", "labkit.runtime", "labkit.comm", "labkit.oracles", "labkit.launch.launch",
          "labkit.netbed", "labkit.timing", "labkit.viz",
          "numpy.ctypeslib", "numpy.load", "numpy.save", "numpy.savez", "numpy.savez_compressed",
          "numpy.fromfile", "numpy.memmap", "numpy.loadtxt", "numpy.savetxt", "numpy.genfromtxt",
          "numpy.f2py", "numpy.testing", "numpy.lib", "numpy.distutils")
FILE_IO = ("torch.save", "torch.load")
OS_PROCESS = re.compile(r"(fork\w*|setsid|setpgid|setpgrp|kill|killpg|system|popen|exec\w*|spawn\w*|"
                        r"posix_spawn\w*|_exit|abort|putenv|unsetenv|environ\w*|getenv\w*|chroot|"
                        r"set\w*id|setgroups|initgroups|dup2?|pipe2?|pidfd_\w+|register_at_fork|wait\w*|"
                        r"nice|sched_\w+|openpty|login_tty|chmod|chown|lchown|fchmod|fchown|symlink|link|"
                        r"truncate|ftruncate|write|open|read|lseek|close\w*|add_dll_directory|system)")

CALL_ONLY = {"getattr", "setattr", "delattr", "hasattr"}  # with a constant name only
BUILTINS_BANNED = {"__import__", "exec", "eval", "compile", "globals", "locals", "breakpoint",
                   "exit", "quit", "help", "__build_class__"}
NAMES_BANNED = {"__builtins__", "__loader__", "__spec__", "__file__", "__cached__", "__dict__",
                "__globals__", "__path__"}
DUNDER_OK = {"__init__", "__name__", "__qualname__", "__doc__", "__enter__", "__exit__", "__len__",
             "__iter__", "__next__", "__repr__", "__str__", "__post_init__", "__call__", "__getitem__",
             "__setitem__", "__contains__", "__version__", "__all__"}
DUNDER_ON_LOCALS = {"__dict__", "__new__"}  # on a plain local variable, never on an import
FRAME_ATTRS = {"f_back", "f_globals", "f_locals", "f_builtins", "f_code", "f_trace", "tb_frame", "tb_next",
               "gi_frame", "gi_code", "cr_frame", "cr_code", "ag_frame", "ag_code", "co_code", "co_consts",
               "func_globals", "_getframe", "distributed_c10d", "_C", "from_file", "tofile", "fromfile"}
DEFS_BANNED = {"__reduce__", "__reduce_ex__", "__del__", "__getattribute__", "__torch_function__",
               "__torch_dispatch__", "__eq__", "__ne__", "__bool__", "__instancecheck__", "__subclasscheck__",
               "__setstate__", "__getstate__", "__init_subclass__", "__set_name__", "__class_getitem__",
               "__index__", "__float__", "__int__", "__hash__"}


POLICY_BROKEN = ("the submission breaks the policy for exercise modules (labkit/course/policy.py says "
                 "what an exercise may use), so no code of it is run:")


@dataclass(frozen=True)
class Violation:
    file: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.what}"


def allowed_imports(module: str) -> tuple[str, ...]:
    """Every import root ``module``'s chapter may use (a name equal to one or below it): the
    earlier chapters, and its own (a chapter package's files import one another)."""
    chapter = module.split(".")[0]
    order = list(CHAPTERS.values())
    earlier = tuple(f"labkit.{m}" for m in order[:order.index(chapter)]) if chapter in order else ()
    own = (f"labkit.{chapter}",)
    return STDLIB + TOOLS + earlier + own + ("torch",) + EXTRA_IMPORTS.get(chapter, ())


def module_filename(name: str, sources: dict[str, str] | None = None) -> str:
    """``labkit/pp.py``, ``labkit/compress/powersgd.py``, or ``labkit/compress/__init__.py``
    for a chapter package (one with files among ``sources``)."""
    if "." in name:
        return "labkit/" + name.replace(".", "/") + ".py"
    if any(k.startswith(name + ".") for k in sources or {}):
        return f"labkit/{name}/__init__.py"
    return f"labkit/{name}.py"


# ----------------------------------------------------------------------------- the check


def violations(module: str, source: str, filename: str = "", sources: dict[str, str] | None = None) -> list[Violation]:
    """Every breach of the policy in ``source``, the exercise module ``module`` (its chapter's
    allow-list; ``compress.powersgd`` names a file of a chapter package), sorted by line.
    ``sources``: other exercise modules' sources by dotted name (to resolve ``labkit.tp.torch``
    and the like through what those modules import)."""
    filename = filename or module_filename(module, sources)
    try:
        tree = ast.parse(source)
    except SyntaxError as error:
        return [Violation(filename, error.lineno or 0, f"does not parse: {error.msg}")]
    return sorted(set(_Checker(module, filename, sources or {}).run(tree)), key=lambda v: (v.line, v.what))


@functools.lru_cache(maxsize=256)
def _cached(module: str, source: str, filename: str, sources: tuple) -> tuple:
    return tuple(violations(module, source, filename, dict(sources)))


def check_tree(module: str, source, package) -> list[Violation]:
    """Violations of chapter module ``module`` (``source``: its text, or ``{dotted name: text}``
    of a chapter package's files) and of every exercise module it imports, directly or not,
    read from ``package`` (the ``labkit`` folder of the tree being graded)."""
    sources = all_sources(package)
    own = {module: source} if isinstance(source, str) else dict(source)
    sources = {k: v for k, v in sources.items() if k.split(".")[0] != module} | own
    found, todo, seen = [], sorted(own), set()
    key = tuple(sorted(sources.items()))
    while todo:
        name = todo.pop()
        if name in seen or name not in sources:
            continue
        seen.add(name)
        found += _cached(name, sources[name], module_filename(name, sources), key)
        todo += _exercise_imports(sources[name], sources)
    return found


def all_sources(package) -> dict[str, str]:
    """``{dotted name: source}`` of every exercise file under ``package`` (a ``labkit`` folder)."""
    from pathlib import Path

    from labkit.course.chapters import exercise_sources
    return {name: text for m in CHAPTERS.values() for name, text in exercise_sources(Path(package), m).items()}


def exercise_module(name: str, sources) -> str:
    """The exercise module a dotted name below ``labkit`` lives in: ``compress.powersgd`` for
    ``labkit.compress.powersgd.after`` when that is a file of the package, else the chapter."""
    parts = name.split(".")
    for end in range(len(parts), 2, -1):
        if ".".join(parts[1:end]) in sources:
            return ".".join(parts[1:end])
    return parts[1]


def _exercise_imports(source: str, sources) -> list[str]:
    names = [*_source_aliases(source).values(), *re.findall(r"^\s*import (labkit\.[\w.]+)", source, re.M)]
    return [exercise_module(name, sources) for name in names if is_exercise(name)]


def check(module: str, source: str, filename: str = "", sources: dict[str, str] | None = None) -> None:
    """Raise AssertionError listing every violation (the graded tests call this)."""
    found = violations(module, source, filename, sources)
    if found:
        raise AssertionError(POLICY_BROKEN + " " + "; ".join(map(str, found)))


def is_exercise(name: str) -> bool:
    return name.startswith("labkit.") and name.split(".")[1] in CHAPTERS.values()


def _under(name: str, roots) -> bool:
    return any(name == r or name.startswith(r + ".") for r in roots)


class _Checker:
    def __init__(self, module: str, filename: str, sources: dict[str, str]):
        self.module, self.filename, self.sources = module, filename, sources
        self.chapter = module.split(".")[0]   # a chapter package's file keeps its chapter's tables
        self.allowed = allowed_imports(module)
        self.private_ok = PRIVATE_OK + EXTRA_PRIVATE.get(self.chapter, ())
        self.patch_ok = EXTRA_PATCH.get(self.chapter, ())
        self.os_ok = EXTRA_OS.get(self.chapter, ())
        self.files = self.chapter in FILE_CHAPTERS
        self.found: list[Violation] = []
        self.aliases: dict[str, str] = {}

    def flag(self, node, what: str) -> None:
        self.found.append(Violation(self.filename, getattr(node, "lineno", 0), what))

    def run(self, tree: ast.AST) -> list[Violation]:
        self.parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        self.locals = {fn: _bound_names(fn) for fn in ast.walk(tree)
                       if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))}
        self.constants = _constant_strings(tree, self.parents)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                self.visit_import(node)
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                self.visit_name(node)
            elif isinstance(node, ast.Attribute):
                self.visit_attribute(node)
            elif isinstance(node, ast.Call):
                self.visit_call(node)
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
                self.visit_store(node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.name in DEFS_BANNED or (node.name == "__getattr__" and isinstance(self.parents.get(node), ast.Module)):
                    self.flag(node, f"defines {node.name} (an object that lies to a comparison or runs code "
                                    "where the grader handles it)")
            elif isinstance(node, ast.ClassDef):
                if any(kw.arg == "metaclass" for kw in node.keywords):
                    self.flag(node, "a class with a metaclass")
            elif isinstance(node, (ast.Global, ast.Nonlocal)):
                hit = [n for n in node.names if n in self.aliases or n in BUILTINS_BANNED | CALL_ONLY]
                if hit:
                    self.flag(node, f"rebinds {', '.join(hit)} (global)")
        return self.found

    def imported(self, node: ast.Name) -> str | None:
        """What ``node`` names when it is an import (not shadowed by a local of an enclosing function)."""
        if node.id not in self.aliases:
            return None
        scope = self.parents.get(node)
        while scope is not None:
            if scope in self.locals and node.id in self.locals[scope]:
                return None
            scope = self.parents.get(scope)
        return self.aliases[node.id]

    def builtin(self, node: ast.Name) -> bool:
        """``node`` names the builtin of that name (no import or local of ours shadows it)."""
        if node.id in self.aliases:
            return False
        scope = self.parents.get(node)
        while scope is not None:
            if scope in self.locals and node.id in self.locals[scope]:
                return False
            scope = self.parents.get(scope)
        return True

    # -- imports

    def visit_import(self, node) -> None:
        if isinstance(node, ast.Import):
            for a in node.names:
                self.aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                self.check_import(node, a.name)
            return
        if node.level > 1 or (node.level == 1 and node.module):
            self.flag(node, "a relative import outside labkit's top level")
            return
        base = "labkit" if node.level == 1 else node.module
        for a in node.names:
            if a.name == "*":
                self.flag(node, f"from {base} import *")
                continue
            full = f"{base}.{a.name}"
            self.aliases[a.asname or a.name] = full
            self.check_import(node, full if base != "__future__" else base)

    def check_import(self, node, name: str) -> None:
        if not _under(name, self.allowed):
            roots = dict.fromkeys(r.split(".")[0] if not r.startswith("labkit") else r for r in self.allowed)
            self.flag(node, f"imports {name}, which chapter {self.chapter} may not use (allowed: "
                            f"{', '.join(r for r in roots if r != '__future__')})")
            return
        self.check_name(node, self.canonical(name))

    # -- names and attributes

    def resolve(self, node) -> str | None:
        """The dotted name an attribute chain stands for, through the imports; None when its
        root is not an imported name."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        root = self.imported(node) if isinstance(node, ast.Name) else None
        if root is None:
            return None
        return ".".join([root, *reversed(parts)])

    def canonical(self, name: str) -> str:
        return _canonical(name, tuple(sorted(self.sources.items())))

    def check_name(self, node, name: str) -> None:
        from labkit.course import rules
        if rules.forbidden_uses(self.chapter, f"import {name}") and not name.startswith("labkit."):
            self.flag(node, f"uses {name}, PyTorch's own implementation of what the chapter builds")
            return
        if _under(name, self.private_ok):
            return
        if _under(name, BANNED) or (not self.files and _under(name, FILE_IO)):
            self.flag(node, f"uses {name} (internals, I/O or the grader's own code)")
            return
        parts = name.split(".")
        if parts[0] == "os" and len(parts) > 1 and OS_PROCESS.fullmatch(parts[1]) and not _under(name, self.os_ok):
            self.flag(node, f"uses {name} (process control, raw files or the environment)")
            return
        if parts[0] in ("torch", "numpy", "labkit"):
            tail = parts[2:] if is_exercise(name) else parts[1:]
            private = [p for p in tail if p.startswith("_") and not (p.startswith("__") and p.endswith("__"))]
            if private:
                self.flag(node, f"uses {name}, a private name ({private[0]})")

    def visit_name(self, node: ast.Name) -> None:
        parent = self.parents.get(node)
        if node.id in GIVEN_ONLY.get(self.chapter, ()) and isinstance(node.ctx, ast.Load):
            self.flag(node, f"calls the given {node.id}, which solves a graded task: write the task's own code")
        elif node.id in NAMES_BANNED:
            self.flag(node, f"uses {node.id}")
        elif node.id in BUILTINS_BANNED and self.builtin(node):
            self.flag(node, f"uses {node.id}() (code or names made at run time)")
        elif node.id == "open" and not self.files and self.builtin(node):
            self.flag(node, "opens a file (only chapter 09 works with files)")
        elif node.id == "vars" and self.builtin(node):
            if not (isinstance(parent, ast.Call) and parent.func is node and len(parent.args) == 1
                    and isinstance(parent.args[0], ast.Name) and self.imported(parent.args[0]) is None):
                self.flag(node, "vars() of anything but a local object")
        elif node.id in CALL_ONLY and self.builtin(node):
            if not (isinstance(parent, ast.Call) and parent.func is node and len(parent.args) >= 2
                    and self.attribute_names(parent.args[1]) is not None):
                self.flag(node, f"{node.id} with a computed attribute name (name it: x.attr, or use a "
                                "module-level string constant)")
        elif isinstance(node.ctx, ast.Load) and not isinstance(parent, ast.Attribute):
            name = self.imported(node)
            if name is not None:
                self.check_value_use(node, self.canonical(name))

    def attribute_names(self, node) -> set[str] | None:
        """The strings an attribute-name argument can hold: a constant, or a name every binding of
        which is a constant (``UNIT_ATTR = "_unit"``; ``for f in ("a", "b")``); else None."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if not isinstance(node, ast.Name):
            return None
        scope = _scope_of(node, self.parents)
        while scope is not None:  # the innermost scope that binds the name decides
            if (scope, node.id) in self.constants:
                return self.constants[(scope, node.id)]
            if isinstance(scope, ast.Module) or (scope in self.locals and node.id in self.locals[scope]):
                return None
            scope = _scope_of(scope, self.parents)
        return None

    def check_value_use(self, node, name: str) -> None:
        """A module object may only be reached through (its attributes): never held or passed."""
        parent = self.parents.get(node)
        if (isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name) and parent.func.id in CALL_ONLY
                and parent.args and parent.args[0] is node):
            return  # getattr(torch, "float32"): checked as torch.float32
        if isinstance(_lookup(name), types.ModuleType) or is_exercise(name) and (
                len(name.split(".")) == 2 or name.split(".", 1)[1] in self.sources):
            self.flag(node, f"uses the module {name} as a value (reach its functions as {name.split('.')[-1]}.f)")

    def check_attribute_name(self, node, attr: str, on_local: bool, how: str) -> None:
        if attr.startswith("__") and attr.endswith("__"):
            if not (attr in DUNDER_OK or attr in DUNDER_ON_LOCALS and on_local):
                self.flag(node, f"uses {how}{attr} (another object's insides)")
        elif attr in FRAME_ATTRS:
            self.flag(node, f"uses {how}{attr} (frames, code or torch's internals)")

    def visit_attribute(self, node: ast.Attribute) -> None:
        top = node
        while isinstance(self.parents.get(top), ast.Attribute):
            top = self.parents[top]
        name = self.resolve(top)
        if name is None or not _under(self.canonical(name), self.private_ok):
            on_local = isinstance(node.value, ast.Name) and self.imported(node.value) is None
            self.check_attribute_name(node, node.attr, on_local, ".")
        if top is not node or name is None:
            return  # the whole chain is checked once, at its end
        name = self.canonical(name)
        self.check_name(node, name)
        if isinstance(node.ctx, ast.Load):
            self.check_value_use(node, name)

    def visit_call(self, node: ast.Call) -> None:
        func = node.func
        if not (isinstance(func, ast.Name) and func.id in CALL_ONLY and self.builtin(func)):
            return
        names = self.attribute_names(node.args[1]) if len(node.args) >= 2 else None
        if names is None:
            return  # flagged by visit_name
        on_local = isinstance(node.args[0], ast.Name) and self.imported(node.args[0]) is None
        for attr in sorted(names):
            self.check_attribute_name(node, attr, on_local, f"{func.id}(..., ")
        base = self.resolve(node.args[0])
        if base is not None:
            for attr in sorted(names):
                full = self.canonical(f"{base}.{attr}")
                self.check_name(node, full)
                if func.id in ("setattr", "delattr") and not _under(full, self.patch_ok):
                    self.flag(node, f"{func.id} on {base}: changes code the exercise did not write")

    def visit_store(self, node) -> None:
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
        for target in targets:
            for t in ast.walk(target) if isinstance(target, (ast.Tuple, ast.List)) else [target]:
                base = t
                while isinstance(base, (ast.Attribute, ast.Subscript)):
                    base = base.value
                if base is t:
                    continue
                if isinstance(base, ast.Name) and self.imported(base) is not None:
                    name = self.resolve(t) if isinstance(t, ast.Attribute) else None
                    if name is None or not _under(self.canonical(name), self.patch_ok):
                        self.flag(node, f"assigns to {self.imported(base)}'s attributes (monkeypatching code "
                                        "it did not write)")
                elif isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "type":
                    self.flag(node, "assigns to an attribute of type(...) (patching a class)")


def _bound_names(fn) -> set[str]:
    """Names a function binds itself: its parameters and what its body assigns (not nested functions')."""
    args = fn.args
    names = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg] if a}
    body = fn.body if isinstance(fn.body, list) else [fn.body]
    stack = list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue
        if isinstance(node, ast.Lambda):
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        stack.extend(ast.iter_child_nodes(node))
    return names


def _scope_of(node, parents):
    scope = parents.get(node)
    while scope is not None and not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.Module)):
        scope = parents.get(scope)
    return scope


def _constant_strings(tree, parents) -> dict[tuple, set[str]]:
    """(scope, name) -> the strings it can hold, for names whose every binding in that scope is a
    string constant or a loop over a literal collection of them (or over a module-level tuple of
    them bound once): ``UNIT_ATTR = "_unit"``, ``for field in ("a", "b")``."""
    bindings: dict[tuple, list] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bindings.setdefault((_scope_of(node, parents), node.id), []).append(node)
        elif isinstance(node, ast.arg):
            bindings.setdefault((parents.get(parents.get(node)), node.arg), []).append(None)  # any value
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            for n in node.names:
                bindings.setdefault((_scope_of(node, parents), n), []).append(None)
                bindings.setdefault((tree, n), []).append(None)

    def strings(value) -> list | None:
        if isinstance(value, (ast.Tuple, ast.List, ast.Set)) and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.elts):
            return [e.value for e in value.elts]
        return None

    collections: dict[str, list] = {}  # module-level tuples of strings, bound once
    for (scope, name), stores in bindings.items():
        if scope is tree and len(stores) == 1 and stores[0] is not None:
            parent = parents.get(stores[0])
            if isinstance(parent, (ast.Assign, ast.AnnAssign)) and parent.value is not None \
                    and strings(parent.value) is not None:
                collections[name] = strings(parent.value)
    found: dict[tuple, set[str]] = {}
    for key, stores in bindings.items():
        values: set[str] = set()
        for store in stores:
            parent = parents.get(store) if store is not None else None
            if isinstance(parent, (ast.Assign, ast.AnnAssign)) and isinstance(parent.value, ast.Constant) \
                    and isinstance(parent.value.value, str) and store in (parent.targets if isinstance(parent, ast.Assign) else [parent.target]):
                values.add(parent.value.value)
            elif isinstance(parent, (ast.For, ast.comprehension)) and parent.target is store:
                items = collections.get(parent.iter.id) if isinstance(parent.iter, ast.Name) else strings(parent.iter)
                if items is None:
                    break
                values.update(items)
            else:
                break
        else:
            found[key] = values
    return found


# ----------------------------------------------------------------------------- resolving


_MISSING = object()


def _lookup(name: str):
    """The object a trusted dotted name stands for (torch, numpy, stdlib, the course's tools),
    or None. Exercise modules are never imported."""
    parts = name.split(".")
    if is_exercise(name) or parts[0] not in ("torch", "numpy", "labkit", *STDLIB, *FILES):
        return None
    try:
        obj = importlib.import_module(parts[0])
    except ImportError:
        return None
    for i, part in enumerate(parts[1:], start=1):
        value = getattr(obj, part, _MISSING) if not (part.startswith("__") and part.endswith("__")) else _MISSING
        if value is _MISSING and isinstance(obj, types.ModuleType):
            prefix = ".".join(parts[:i + 1])
            if is_exercise(prefix) or _under(prefix, BANNED):
                return None
            try:
                value = importlib.import_module(prefix)
            except Exception:  # noqa: BLE001 - no such module: the name stays unresolved
                return None
        if value is _MISSING:
            return None
        obj = value
    return obj


@functools.lru_cache(maxsize=4096)
def _canonical(name: str, sources: tuple = ()) -> str:
    """``name`` with every module it passes through replaced by that module's own name:
    ``labkit.models.torch.distributed.all_reduce`` -> ``torch.distributed.all_reduce``;
    through an exercise module, by what that module imports (its source in ``sources``)."""
    parts = name.split(".")
    if is_exercise(name) and len(parts) > 2:
        known = dict(sources)
        module = exercise_module(name, known)
        rest = parts[1 + len(module.split(".")):]
        imported = _source_aliases(known.get(module, ""))
        if rest and rest[0] in imported:
            return _canonical(".".join([imported[rest[0]], *rest[1:]]), sources)
        return name
    if parts[0] not in ("torch", "numpy", "labkit", *STDLIB, *FILES):
        return name
    done = parts[0]
    for i in range(1, len(parts)):
        obj = _lookup(".".join(parts[:i + 1]))
        if isinstance(obj, types.ModuleType) and obj.__name__ != ".".join(parts[:i + 1]):
            return _canonical(".".join([obj.__name__, *parts[i + 1:]]), sources)
        if obj is None or not isinstance(obj, types.ModuleType):
            return name if done == parts[0] else name
        done = obj.__name__
    return name


@functools.lru_cache(maxsize=64)
def _source_aliases(source: str) -> dict[str, str]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}
    found: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                found[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                found[a.asname or a.name] = f"{node.module}.{a.name}"
    return found


def check_task(task_id: str, source) -> None:
    """What every graded test runs first: no PyTorch implementation of the technique in the
    task's module (``rules.check``), then every breach of this policy in it or in an exercise
    module it imports: a module that breaks the policy earns none of its tasks' points.
    ``source``: the module's text, or ``{dotted name: text}`` of a chapter package's files."""
    from labkit.course import rules, workspace
    module = task_id.split(".")[0]
    files = {module: source} if isinstance(source, str) else source
    for name, text in files.items():
        rules.check(task_id, text, module_filename(name, files))
    broken = check_tree(module, source, workspace.package_dir())
    if broken:
        raise AssertionError(f"{task_id}: not graded: {POLICY_BROKEN} " + "; ".join(map(str, broken)))
