"""Mutation testing of the grader: plausible wrong implementations that must lose their task.

A mutant is the reference exercise module with one edit a learner could plausibly make
(an off-by-one, a missing scale, the wrong group, waiting before computing, one collective
too many, PyTorch's built-in in place of the exercise). The mutants live beside the tests,
one file per chapter (``tests/mutants/<module>.py``, each defining ``MUTANTS``), and never
travel into a learner workspace: they quote the solutions.

    Mutant("collectives.all_reduce", "floor_chunks", "chunks of floor(S/N): the tail is lost",
           find="chunk = -(-flat.numel() // n)", replace="chunk = flat.numel() // n")

``pytest tests/grading --mutants`` (the grading plugin) runs every graded test once per
mutant of its task, with the mutated module swapped in (in the test process and, through
``LABKIT_MODULE_OVERRIDES``, in every rank it launches), and stops a mutant at its first
failing test: since a task's points need every one of its tests, one failure costs the
mutant all of them. It prints ``mutants killed: K of M``; a survivor is a hole in the grader.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from labkit.course.chapters import CHAPTERS, dotted_name, exercise_files, exercise_sources, relative_path
from labkit.runtime.worker import OVERRIDES_ENV  # noqa: F401 - {module: source file}, read by every rank

GENERATED_ENV = "LABKIT_MUTANTS_FILE"   # a JSON list of mutants the grading plugin runs instead (labkit mutate's)


class StaleMutant(ValueError):
    """A mutant whose ``find`` text is not (or not once) in its module: it no longer mutates
    anything, so the error it raises while grading is never a kill."""


@dataclass(frozen=True)
class Mutant:
    task: str          # the task whose points it must lose, e.g. "pp.1f1b"
    name: str          # short and unique within the chapter, e.g. "warmup_off_by_one"
    why: str           # what is wrong, in a learner's terms
    find: str          # text of the reference module, present exactly once
    replace: str       # what the learner wrote instead

    @property
    def module(self) -> str:
        return self.task.split(".")[0]

    @property
    def id(self) -> str:
        return f"{self.task}/{self.name}"

    def locate(self, root: Path) -> Path:
        """The exercise file whose text holds ``find``; refuses a ``find`` that is missing or
        ambiguous across the module's files (a chapter package has several)."""
        package = root / "labkit"
        files = exercise_files(package, self.module)
        counts = {path: path.read_text().count(self.find) for path in files}
        if sum(counts.values()) != 1:
            where = relative_path(package, files[0]) if len(files) == 1 else f"labkit/{self.module}/"
            raise StaleMutant(f"mutant {self.id}: its 'find' text occurs {sum(counts.values())} times in "
                              f"{where} (must be exactly once); update the mutant")
        return next(path for path, count in counts.items() if count)

    def source(self, root: Path, path: Path | None = None) -> str:
        """The mutated text of ``path``, by default the file ``locate`` finds."""
        path = path or self.locate(root)
        mutated = path.read_text().replace(self.find, self.replace)
        compile(mutated, relative_path(root / "labkit", path), "exec")
        return mutated

    def sources(self, root: Path) -> dict[str, str]:
        """``{dotted name: source}`` of the whole exercise module, this mutant's file mutated."""
        package, path = root / "labkit", self.locate(root)
        found = exercise_sources(package, self.module)
        found[dotted_name(package, path)] = self.source(root, path)
        return found


def load(root: Path, modules=None) -> list[Mutant]:
    """Every mutant in ``root/tests/mutants`` (of the named chapter modules, or all)."""
    found = []
    for path in sorted((root / "tests" / "mutants").glob("*.py")):
        if path.stem.startswith("_") or (modules is not None and path.stem not in modules):
            continue
        spec = importlib.util.spec_from_file_location(f"labkit_mutants_{path.stem}", path)
        namespace = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(namespace)
        for mutant in namespace.MUTANTS:
            if mutant.module != path.stem:
                raise ValueError(f"{path.name}: mutant {mutant.id} belongs in tests/mutants/{mutant.module}.py")
            found.append(mutant)
    ids = [m.id for m in found]
    duplicated = {i for i in ids if ids.count(i) > 1}
    if duplicated:
        raise ValueError(f"mutants defined twice: {sorted(duplicated)}")
    return found


def load_file(path: str) -> list[Mutant]:
    """The mutants of a ``LABKIT_MUTANTS_FILE`` (``labkit mutate`` writes it for the grading plugin)."""
    import json
    return [Mutant(**m) for m in json.loads(Path(path).read_text())]


def write_source(mutant: Mutant, root: Path) -> Path:
    """The mutated module on disk (ranks import it from there), in a folder named by its
    content: ``<module>.py``, or for a chapter package the package's folder with this
    mutant's file mutated, given as its ``__init__.py``."""
    package = root / "labkit"
    sources = mutant.sources(root)
    text = "\n".join(f"{name}\n{source}" for name, source in sorted(sources.items()))
    folder = Path(tempfile.gettempdir()) / "labkit-mutants" / hashlib.sha1(text.encode()).hexdigest()[:12]
    files = {folder / p.relative_to(package): sources[dotted_name(package, p)]
             for p in exercise_files(package, mutant.module)}
    for path, source in files.items():
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")   # whole or absent: ranks of other runs may read it
            tmp.write_text(source)
            os.replace(tmp, path)
    return next(iter(files)) if len(files) == 1 else folder / mutant.module / "__init__.py"


# ----------------------------------------------------------------------------- the last run's record
#
# A mutant dies at its first failing test, so its cost is the tests it passes first. The last
# run's killers (``tests/mutants/first.json``: the test that killed each mutant, and the seconds
# its tests took) let the next run try that test first and split the chapters into processes of
# equal cost. Only the order changes: a mutant is killed when any test of its task fails, as
# before; a stale record makes a run slower, never another verdict.

FIRST_FILE = Path("tests") / "mutants" / "first.json"


def load_record(root: Path) -> dict:
    """``{"first": {mutant id: test}, "seconds": {mutant id: s}}`` of the last recorded run."""
    import json
    path = root / FIRST_FILE
    record = json.loads(path.read_text()) if path.exists() else {}
    return {"first": record.get("first", {}), "seconds": record.get("seconds", {})}


def record_of(fates: list[dict]) -> dict:
    """What ``load_record`` reads, from a run's fates (the ``--mutants-report`` JSON)."""
    return {"first": {f["mutant"]: f["by"] for f in sorted(fates, key=lambda f: f["mutant"]) if f["killed"]},
            "seconds": {f["mutant"]: round(f.get("seconds", 0.0), 1)
                        for f in sorted(fates, key=lambda f: f["mutant"])}}


def balance(modules: list[str], mutants: list[Mutant], seconds: dict[str, float], parts: int) -> list[list[str]]:
    """The chapter modules in ``parts`` groups of about equal recorded cost (largest first, each
    to the cheapest group); a mutant with no record counts as the median one."""
    known = sorted(seconds.values())
    typical = known[len(known) // 2] if known else 1.0
    cost = {m: 0.0 for m in modules}
    for mutant in mutants:
        if mutant.module in cost:
            cost[mutant.module] += seconds.get(mutant.id, typical)
    groups = [[] for _ in range(parts)]
    load = [0.0] * parts
    for module in sorted(modules, key=lambda m: -cost[m]):
        cheapest = load.index(min(load))
        groups[cheapest].append(module)
        load[cheapest] += cost[module]
    return [g for g in groups if g]


# ----------------------------------------------------------------------------- swapping in


def install_overrides(overrides: dict[str, str]) -> dict[str, object]:
    """In the test process: import each ``labkit.<module>`` from the given file instead of
    the package; return what ``sys.modules`` held before, for ``restore``. Every exercise
    module is dropped from ``sys.modules`` first, so modules that import the swapped one
    see the mutant. (Ranks do the same from ``LABKIT_MODULE_OVERRIDES`` as they start.)"""
    from labkit.runtime.worker import import_overrides
    packaged = [name for name in sys.modules if _packaged(name)]
    saved = {name: sys.modules.pop(name, None) for name in [f"labkit.{m}" for m in CHAPTERS.values()] + packaged}
    import_overrides(overrides)
    return saved


def restore(saved: dict[str, object]) -> None:
    import labkit
    for name in [n for n in sys.modules if _packaged(n) and n not in saved]:
        del sys.modules[name]   # a mutant package's files: the next import reads the course's again
    for name, mod in saved.items():
        if mod is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = mod
        short = name.split(".", 1)[1]
        if "." in short:
            continue   # a chapter package's file: its package (restored too) holds it
        if mod is None and short in vars(labkit):
            delattr(labkit, short)
        elif mod is not None:
            setattr(labkit, short, mod)


def _packaged(name: str) -> bool:
    """``labkit.compress.powersgd``: a file of a chapter that is a package."""
    return name.count(".") == 2 and name.startswith("labkit.") and name.split(".")[1] in CHAPTERS.values()
