"""labkit: the package behind Parallelism Labs.

At the top level: one exercise module per chapter (``collectives``, ``dp``, ``ddp``,
``zero``, ``fsdp``, ...) and the tools the labs use beside them (``launch``, ``comm``,
``memory``, ``models``, ``data``, ``check``, ``timing``, ``viz``). The course machinery
(grading, the learner workspace, the autograder, benchmarks, the ``labkit`` command and
the launcher's rank server) lives in ``labkit.course``.
"""

from labkit.launch import Deadlock, LaunchError, LaunchTimeout, WorkerError, launch

__all__ = ["launch", "LaunchError", "LaunchTimeout", "Deadlock", "WorkerError"]
__version__ = "0.1.0"
