"""labkit: the package behind Parallelism Labs.

At the top level: one exercise module per chapter (``collectives``, ``dp``, ``ddp``,
``zero``, ``fsdp``, ...) and the tools the labs use beside them (``launch``, ``comm``,
``memory``, ``models``, ``data``, ``check``, ``timing``, ``viz``). The course machinery
(grading, the learner workspace, the autograder, benchmarks, the ``labkit`` command and
the launcher's rank server) lives in ``labkit.course``.
"""

import os as _os
import warnings as _warnings

from labkit.launch import Deadlock, LaunchError, LaunchTimeout, WorkerError, launch, restart_count


def _warn_if_another_tree() -> None:
    """A learner who forgot ``pip install -e .`` in their workspace would run the reference
    solutions from its notebooks without knowing it: say so once, at import."""
    if "LABKIT_RANK" in _os.environ:
        return  # a rank of a launch: its caller already checked
    from labkit.course.workspace import find_course_root, package_dir
    here, mine = find_course_root(), package_dir().parent
    if here is not None and here != mine:
        _warnings.warn(f"labkit is imported from {mine}, but you are working in {here}: code run "
                       f"here uses {mine}'s labkit. Run `pip install -e .` in {here} to use its own.",
                       stacklevel=2)


_warn_if_another_tree()

__all__ = ["launch", "restart_count", "LaunchError", "LaunchTimeout", "Deadlock", "WorkerError"]
__version__ = "0.1.0"
