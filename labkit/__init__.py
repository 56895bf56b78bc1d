"""labkit: the package behind Parallelism Labs.

At the top level: one exercise module per chapter (``collectives``, ``dp``, ``ddp``,
``zero``, ``fsdp``, ...) and the tools the labs use beside them (``launch``, ``comm``,
``memory``, ``models``, ``data``, ``check``, ``timing``, ``viz``, ``oracles``). The process
runtime behind ``launch`` (rank server, worker, deadlock detection) lives in
``labkit.runtime``; the course machinery (grading, rules, mutants, the learner workspace,
the autograder, benchmarks, the ``labkit`` command) in ``labkit.course``. ARCHITECTURE.md
says which may import which.
"""

import os as _os
import warnings as _warnings

_LAUNCH_NAMES = ("launch", "restart_count", "LaunchError", "LaunchTimeout", "Deadlock", "WorkerError")


def __getattr__(name):
    """``labkit.launch`` and its errors, imported on first use: the ``labkit`` command's
    quick subcommands (``labkit tasks``) then never pay for importing torch."""
    if name in _LAUNCH_NAMES:
        import importlib
        module = importlib.import_module("labkit.launch")
        # Importing the submodule bound ``labkit.launch`` to it: bind the function instead.
        globals().update({n: getattr(module, n) for n in _LAUNCH_NAMES})
        return globals()[name]
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")


def _warn_if_another_tree() -> None:
    """A learner who forgot ``pip install -e .`` in their workspace would run the reference
    solutions from its notebooks without knowing it: say so once, at import."""
    if "LABKIT_RANK" in _os.environ or "LABKIT_RANK_SERVER" in _os.environ:
        return  # a rank of a launch, or its rank server: the caller already checked
    import sys as _sys
    if _os.path.basename(_sys.argv[0] if _sys.argv else "") == "labkit":
        return  # the labkit command: it runs itself again on the tree you are in, and says so
    from labkit.trees import find_course_root, package_dir
    here, mine = find_course_root(), package_dir().parent
    if here is not None and here != mine:
        _warnings.warn(f"labkit is imported from {mine}, but you are working in {here}: this "
                       f"process and every rank it launches run {mine}'s labkit, not {here}'s. "
                       f"To use {here}'s, activate its own environment (in {here}: "
                       "python3 -m venv .venv && . .venv/bin/activate && pip install -e .).",
                       stacklevel=2)


_warn_if_another_tree()

__all__ = ["launch", "restart_count", "LaunchError", "LaunchTimeout", "Deadlock", "WorkerError"]
__version__ = "0.1.0"
