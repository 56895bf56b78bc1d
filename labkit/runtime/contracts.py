"""The contracts every call of an exercise keeps, checked around the call itself.

A numerical library promises things that no single test states: it leaves the caller's
tensors alone unless it says it writes them, it does not reseed or draw from the global
random generators unless it says so, and a documented in-place result is written into the
caller's tensor, not into a new one. The grader holds every exercise module to those
promises by wrapping each public function and method as the module is imported, in the
test process and in every rank (``install``), so that no test author has to remember them:

* a tensor argument (or a tensor in a list, tuple or dict argument) that the callable does
  not declare as written must come back with the same values and the same ``_version``
  (an in-place op that is undone later still shows in the version counter);
* torch's global CPU generator (and CUDA's, once initialised), Python's ``random`` and
  numpy's global generator must be in the same state after the call, unless the callable
  declares it consumes them;
* a generator function is checked around each item it yields.

Only the outermost exercise call is checked: what it calls of other exercises works on its
own temporaries, and the outer call answers to its caller for all of it (this also keeps
the cost of the checks off a search that calls a pricing function a million times).

What is declared comes from the course (``labkit.course.contracts`` turns its catalogue
into the ``LABKIT_CONTRACTS`` environment variable that ranks inherit): this module only
enforces it, so it knows nothing of tasks or chapters.

    {"modules": ["collectives", ...],
     "declared": {"collectives.ring_all_reduce": {"writes": ["tensor"], "consumes": []}},
     "init_may_consume": true, "mode": "raise" | "record:<path>"}
"""

from __future__ import annotations

import functools
import importlib.abc
import inspect
import json
import os
import random
import sys
import threading

import torch

CONTRACTS_ENV = "LABKIT_CONTRACTS"
LARGE = 1 << 26   # bytes: larger arguments are checked by version counter only, not by value


class ContractError(AssertionError):
    """A call broke a contract it never declared an exception to."""


_spec: dict | None = None
_local = threading.local()


# ----------------------------------------------------------------------------- installing


def install_from_env() -> bool:
    """Install the contracts named by ``LABKIT_CONTRACTS`` (ranks call this as they start)."""
    text = os.environ.get(CONTRACTS_ENV)
    if not text:
        return False
    install(json.loads(text))
    return True


def install(spec: dict) -> None:
    """Wrap the exercise modules imported from now on, and those imported already."""
    global _spec
    _spec = spec
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    for name, module in sorted(sys.modules.items(), key=lambda item: -item[0].count(".")):  # files before packages
        if name.startswith("labkit.") and name.count(".") in (1, 2) and name.split(".")[1] in spec["modules"]:
            wrap_module(module)


def active() -> bool:
    return _spec is not None


class _Finder(importlib.abc.MetaPathFinder):
    """Lets the normal finders find an exercise module, then wraps it once it has run."""

    def find_spec(self, fullname, path, target=None):
        # An exercise module, or a file of a chapter package (labkit.compress.powersgd).
        if _spec is None or not fullname.startswith("labkit.") or fullname.count(".") not in (1, 2) \
                or fullname.split(".")[1] not in _spec["modules"]:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _WrappingLoader(spec.loader)
                return spec
        return None


class _WrappingLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        wrap_module(module)

    def __getattr__(self, name):  # get_source, get_code... for coverage and tracebacks
        return getattr(self.loader, name)


# ----------------------------------------------------------------------------- wrapping


def wrap_module(module) -> None:
    """Wrap every public function and every method of the public classes defined in
    ``module`` (not names it imported from elsewhere). Idempotent."""
    if getattr(module, "__labkit_contracts__", False) or _spec is None:
        return
    if hasattr(module, "__path__"):   # a chapter package: what it re-exports from its files, wrapped there
        for name, value in list(vars(module).items()):
            home = sys.modules.get(getattr(value, "__module__", None) or "")
            if inspect.isfunction(value) and home is not None and home.__name__.startswith(module.__name__ + "."):
                wrap_module(home)
                setattr(module, name, getattr(home, name, value))
    short = module.__name__.split(".")[1]   # the chapter: compress.powersgd_hook, from labkit/compress/powersgd.py too
    for name, value in list(vars(module).items()):
        if name.startswith("_") or getattr(value, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(value):
            setattr(module, name, _wrap(value, f"{short}.{name}"))
        elif inspect.isclass(value):
            _wrap_class(value, f"{short}.{name}")
    module.__labkit_contracts__ = True


_DUNDERS = {"__init__", "__call__", "__iter__", "__next__"}


def _wrap_class(cls, qualname: str) -> None:
    is_module = issubclass(cls, torch.nn.Module)
    for name, value in list(vars(cls).items()):
        if name.startswith("_") and name not in _DUNDERS:
            continue
        key = f"{qualname}.{name}"
        may_init = is_module and name == "__init__" and _spec.get("init_may_consume", True)
        if isinstance(value, staticmethod):
            setattr(cls, name, staticmethod(_wrap(value.__func__, key)))
        elif isinstance(value, classmethod):
            setattr(cls, name, classmethod(_wrap(value.__func__, key, skip_first=True)))
        elif inspect.isfunction(value):
            setattr(cls, name, _wrap(value, key, skip_first=True, consumes_rng=may_init))


def _wrap(fn, key: str, skip_first: bool = False, consumes_rng: bool = False):
    if getattr(fn, "__labkit_contract__", None):
        return fn
    declared = _spec["declared"].get(key, {})
    writes = set(declared.get("writes", ()))
    consumes = set(declared.get("consumes", ())) | ({"rng"} if consumes_rng else set())
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        signature = None

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        if getattr(_local, "off", False) or getattr(_local, "depth", 0):
            # inside another exercise call: the outer call answers to its caller for both
            return fn(*args, **kwargs)
        watched = _watched_arguments(signature, args, kwargs, writes, skip_first)
        rng = None if "rng" in consumes else _rng_state()
        state = None if "globals" in consumes else _call_state(fn, args, skip_first)
        _local.depth = 1
        try:
            result = fn(*args, **kwargs)
        finally:
            _local.depth = 0
        _check(key, watched, rng)
        _check_module_state(key, fn, args, skip_first, state)
        if "dtype" not in consumes:
            _check_dtype(key, signature, args, kwargs, skip_first, result)
        if rng is not None and inspect.isgenerator(result):
            return _checked_generator(key, result)
        return result

    checked.__labkit_contract__ = key
    return checked


def _checked_generator(key, gen):
    while True:
        rng = _rng_state()
        try:
            _local.depth = 1
            item = next(gen)
        except StopIteration as stop:
            _local.depth = 0
            _check(key, [], rng)
            return stop.value
        finally:
            _local.depth = 0
        _check(key, [], rng)
        yield item


# ----------------------------------------------------------------------------- checking


def _tensors_in(value, depth: int = 2):
    if isinstance(value, torch.Tensor):
        yield "", value
    elif depth and isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            for where, t in _tensors_in(item, depth - 1):
                yield f"[{i}]{where}", t
    elif depth and isinstance(value, dict):
        for k, item in value.items():
            for where, t in _tensors_in(item, depth - 1):
                yield f"[{k!r}]{where}", t


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse, meta, functional tensors
        return -1


def _watched_arguments(signature, args, kwargs, writes, skip_first) -> list:
    """(name, tensor, version, copy or None) for each tensor the call may not change."""
    try:
        bound = signature.bind(*args, **kwargs) if signature is not None else None
    except TypeError:  # the call itself is wrong: let the function raise its own error
        return []
    if bound is None:
        return []
    items = list(bound.arguments.items())
    if skip_first:
        items = items[1:]
    watched, written_storages = [], set()
    for name, value in items:
        kind = signature.parameters[name].kind
        flat = list(_tensors_in(value, 2 if kind not in (inspect.Parameter.VAR_POSITIONAL,
                                                         inspect.Parameter.VAR_KEYWORD) else 3))
        if name in writes:
            written_storages.update(_storage(t) for _, t in flat)
            # written in place: the caller's tensor itself, same memory, same shape
            watched += [(name + where, t, None, (t.data_ptr(), t.shape)) for where, t in flat]
            continue
        for where, t in flat:
            if t.is_meta or t.layout != torch.strided or getattr(t, "_is_view_of_dtensor", False):
                continue
            copy = None
            if t.numel() * t.element_size() <= LARGE:
                copy = t.detach().clone()
            watched.append((name + where, t, t._version, copy))
    # An argument that shares memory with one the call writes (an in-place collective's
    # input inside its output) changes with it: that is the write, not a breach.
    return [w for w in watched if w[2] is None or _storage(w[1]) not in written_storages or _storage(w[1]) == -1]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return bool(torch.equal(a, b))


def _rng_state():
    if threading.current_thread() is not threading.main_thread():
        return None  # another thread's draws (a DataLoader, autograd) are not this call's
    state = [torch.get_rng_state(), random.getstate()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state.append(torch.cuda.get_rng_state_all())
    numpy = sys.modules.get("numpy")
    state.append(numpy.random.get_state()[1].tobytes() if numpy is not None else None)
    return state


def _rng_changed(before) -> str | None:
    after = _rng_state()
    if before is None or after is None:
        return None
    if not torch.equal(before[0], after[0]):
        return "torch's global generator (torch.manual_seed, or a draw such as torch.randperm/rand without generator=)"
    if before[1] != after[1]:
        return "Python's random module"
    if len(before) == len(after) and len(before) == 4 and \
            any(not torch.equal(x, y) for x, y in zip(before[2], after[2])):
        return "CUDA's global generator"
    if before[-1] != after[-1]:
        return "numpy's global generator"
    return None


def _check(key: str, watched: list, rng) -> None:
    problems = []
    for name, t, version, copy in watched:
        if version is None:   # a declared in-place result: written into the caller's memory
            if (t.data_ptr(), t.shape) != copy:
                problems.append(f"replaced the memory or shape of {name!r}, which it writes in place: the "
                                f"caller's tensor must receive the result (copy_ into it, or write its views)")
            continue
        changed_values = copy is not None and not _same(t.detach(), copy)
        if changed_values or t._version != version:
            how = "its values changed" if changed_values else "it was written in place (values restored)"
            problems.append(f"changed its argument {name!r} ({how}); it is not declared as written: "
                            f"the caller's tensors must come back untouched (work on a copy or a new tensor)")
    generator = _rng_changed(rng) if rng is not None else None
    if generator:
        problems.append(f"changed the state of {generator}; it is not declared as consuming it: "
                        f"every later dropout mask and initialisation would change (use a torch.Generator of your own)")
    if problems:
        _report(key, problems)


def _report(key: str, problems: list[str]) -> None:
    message = f"contract broken by labkit.{key}: " + "; ".join(problems)
    mode = _spec.get("mode", "raise")
    if mode.startswith("record:"):
        with open(mode.removeprefix("record:"), "a") as log:
            log.write(json.dumps(dict(call=key, problems=problems, pid=os.getpid())) + "\n")
        return
    raise ContractError(message)


def _module_state(namespace: dict) -> dict:
    """What a call could leave behind in a namespace: each name's identity, and the size of
    each container (a cache filled on the first call changes it)."""
    return {name: (id(value), len(value) if isinstance(value, (dict, list, set)) else None)
            for name, value in namespace.items()
            if not name.startswith("__") and not inspect.ismodule(value)}


def _call_state(fn, args, skip_first) -> dict:
    """The module's globals, the function's mutable defaults and, for a method, its class's
    attributes: every place a call could keep state that outlives it, besides the object."""
    state = {"": _module_state(fn.__globals__)}
    defaults = list(fn.__defaults__ or ()) + list((fn.__kwdefaults__ or {}).values())
    state["default argument"] = _module_state({str(i): v for i, v in enumerate(defaults)})
    if skip_first and args:
        # a class's containers (a cache shared by every instance); not its functions, which
        # torch itself rebinds (torch.optim.Optimizer wraps a class's step on first use)
        owner = args[0] if isinstance(args[0], type) else type(args[0])
        state[f"class attribute of {owner.__name__}"] = {
            name: len(value) for name, value in vars(owner).items() if isinstance(value, (dict, list, set))}
    return state


def _check_module_state(key: str, fn, args, skip_first, before: dict | None) -> None:
    if before is None:
        return
    after = _call_state(fn, args, skip_first)
    changed = []
    for place, names in before.items():
        now = after.get(place, {})
        changed += [f"{place} {name}".strip() for name in sorted(names.keys() | now.keys())
                    if names.get(name) != now.get(name)]
    if changed:
        _report(key, [f"changed state that outlives the call ({', '.join(changed)}): a call must not leave "
                      f"state behind for the next one (a cache of the first call's shapes, groups or "
                      f"options); keep state in an object the caller holds"])


def _float_dtypes(value, depth=2) -> set:
    return {t.dtype for _, t in _tensors_in(value, depth) if t.is_floating_point()}


def _check_dtype(key, signature, args, kwargs, skip_first, result) -> None:
    """Floating results keep the one floating dtype of the floating tensor arguments, and of
    a module's parameters for its methods (a function fed bf16 returns bf16): casting to
    float32 and back is the caller's choice. With several dtypes in play, no rule applies."""
    if signature is None or not _float_dtypes(result, 1):
        return
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return
    values = list(bound.arguments.values())
    owner = values[0] if skip_first and values else None
    values = values[1 if skip_first else 0:]
    given = set().union(*(_float_dtypes(v) for v in values)) if values else set()
    if isinstance(owner, torch.nn.Module):   # a module's output follows its parameters too
        given |= {p.dtype for p in owner.parameters() if p.is_floating_point()}
    if len(given) != 1:
        return
    (dtype,) = given
    wrong = sorted(str(d) for d in _float_dtypes(result, 1) - given)
    if wrong:
        _report(key, [f"returned {', '.join(wrong)} for {dtype} inputs: floating results keep the "
                      f"inputs' dtype (compute in a wider type inside if you like, then cast back)"])


class suspended:
    """``with contracts.suspended():`` calls inside are not checked (a test that sets up
    state through an exercise's own API on purpose, e.g. a reference built from given code)."""

    def __enter__(self):
        self.before = getattr(_local, "off", False)
        _local.off = True

    def __exit__(self, *exc):
        _local.off = self.before
