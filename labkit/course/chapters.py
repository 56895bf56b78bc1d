"""The chapters of the course: number -> exercise module (``labkit/<module>.py``), in order.

A chapter's files follow from it (ARCHITECTURE.md): ``chapters/NN_*.ipynb``,
``labs/NN_*.ipynb`` and ``labs/NN_*.py``, ``tests/grading/test_<module>.py``,
``tests/mutants/<module>.py``. Read by grading, ``labkit tasks`` and the layout tests;
it imports nothing, so the quick commands stay quick.
"""

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
