"""Where the course lives on disk: the ``labkit`` package imported, and the course tree (a
clone or a learner workspace) that contains a folder. Used by ``labkit`` itself (to warn
when you work in one tree with another tree's code) and by the course machinery."""

from __future__ import annotations

from pathlib import Path


def package_dir() -> Path:
    """The ``labkit`` package Python imported."""
    return Path(__file__).resolve().parent


def is_course_root(path: Path) -> bool:
    """A clone of the course or a learner workspace: labkit/, tests/grading/, pyproject.toml."""
    return ((path / "labkit" / "__init__.py").is_file() and (path / "tests" / "grading").is_dir()
            and (path / "pyproject.toml").is_file())


def find_course_root(start: Path | None = None) -> Path | None:
    """The course tree that contains ``start`` (default: the working directory), or None."""
    here = Path(start or Path.cwd()).resolve()
    for candidate in (here, *here.parents):
        if is_course_root(candidate):
            return candidate
    return None
