"""The chapters of the course: number -> exercise module, in order.

An exercise module is one file, ``labkit/<module>.py``, or a package of one file per idea,
``labkit/<module>/`` (its ``__init__`` re-exports the names, so ``from labkit.<module> import
f`` holds either way). Everything that reads a chapter's code (grading, the policy, the
judge, the workspace's stubs, the mutants) asks ``exercise_files`` which files those are.

A chapter's files follow from it (ARCHITECTURE.md): ``chapters/NN_*.ipynb``,
``labs/NN_*.ipynb`` and ``labs/NN_*.py``, ``tests/grading/test_<module>.py``,
``tests/mutants/<module>.py``. Read by grading, ``labkit tasks`` and the layout tests;
it imports nothing but re and pathlib, so the quick commands stay quick.
"""

import re
from pathlib import Path

CHAPTERS = {"00": "collectives", "01": "dp", "02": "ddp", "03": "zero", "04": "fsdp",
            "05": "tp", "06": "pp", "07": "sp", "08": "mesh", "09": "elastic",
            "10": "moe", "11": "compress", "12": "recompute", "13": "rpc",
            "14": "perf"}

# What else a learner may call a chapter: the README's chapter titles and the lab files'
# names (labs/NN_<name>.py), besides its number and module name.
ALIASES = {
    "01": ("data parallelism", "data parallel"), "05": ("tensor parallelism", "tensor"),
    "06": ("pipeline parallelism", "pipeline"), "07": ("sequence parallelism", "sequence"),
    "08": ("hybrid",), "09": ("fault tolerance",), "10": ("expert parallelism",),
    "11": ("comm", "communication efficiency", "communication"), "12": ("memory",),
    "13": ("rpc-based training",), "14": ("scale", "performance at scale", "performance"),
}


def _key(name: str) -> str:
    return "_".join(name.lower().replace("-", " ").replace("_", " ").split())


def chapter_names() -> dict[str, str]:
    """Every name a chapter answers to (normalised: lower case, words joined by _) -> its number."""
    names = {}
    for number, module in CHAPTERS.items():
        for name in (number, str(int(number)), module, *ALIASES.get(number, ())):
            names[_key(name)] = number
    return names


def chapter_number(name: str) -> str | None:
    """``"12"`` for ``12``, ``memory``, ``recompute``, ``12_memory``, ``labs/12_memory.py``,
    ``chapters/12_memory.ipynb`` (any case, - _ or spaces between words); else None."""
    stem = name.rstrip("/").rsplit("/", 1)[-1]
    for ext in (".py", ".ipynb"):
        stem = stem.removesuffix(ext)
    names = chapter_names()
    key = _key(stem)
    if key in names:
        return names[key]
    number, _, rest = key.partition("_")   # 12_memory, 08_hybrid: the number and its name agree
    if number in names and rest and names.get(rest) == names[number]:
        return names[number]
    return None


def chapter_module(name: str) -> str | None:
    """The exercise module of the chapter ``name`` names (see ``chapter_number``), else None."""
    number = chapter_number(name)
    return CHAPTERS[number] if number else None


def exercise_files(package: Path, module: str) -> list[Path]:
    """The files of exercise module ``module`` under ``package`` (a ``labkit`` folder):
    ``[labkit/<module>.py]``, or the ``.py`` files of the package ``labkit/<module>/``:
    ``__init__.py``, then its files in the order it imports them (the chapter's order), then
    any other; ``[]`` when it has neither."""
    single = Path(package) / f"{module}.py"
    if single.is_file():
        return [single]
    init = Path(package) / module / "__init__.py"
    if not init.is_file():
        return []
    imported = re.findall(rf"^from labkit\.{module}\.(\w+) import", init.read_text(), re.M)
    order = {name: i for i, name in enumerate(dict.fromkeys(imported))}
    return sorted(init.parent.glob("*.py"), key=lambda p: (p != init, order.get(p.stem, len(order)), p.name))


def dotted_name(package: Path, path: Path) -> str:
    """``compress.powersgd`` for ``labkit/compress/powersgd.py``, ``compress`` for its
    ``__init__.py`` and ``pp`` for ``labkit/pp.py``: the module's name below ``labkit``."""
    parts = list(Path(path).relative_to(package).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def exercise_sources(package: Path, module: str) -> dict[str, str]:
    """``{dotted name: source}`` of every file of exercise module ``module`` (``exercise_files``)."""
    return {dotted_name(package, p): p.read_text() for p in exercise_files(package, module)}


def relative_path(package: Path, path: Path) -> str:
    """``labkit/compress/powersgd.py``: how messages and task lists name an exercise file."""
    return str(Path("labkit") / Path(path).relative_to(package))


def file_label(package: Path, module: str) -> str:
    """``pp.py``, or ``compress/`` for a chapter package: how a message names a module's files."""
    return f"{module}/" if (Path(package) / module / "__init__.py").is_file() else f"{module}.py"
