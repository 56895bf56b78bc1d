"""labkit: the package behind Parallelism Labs.

Infrastructure (``launch``, ``comm``, ``memory``, ``models``, ``data``, ``viz``, ``grading``,
``workspace``, ``bench``, ``cli``) sits beside one exercise module per chapter
(``collectives``, ``dp``, ``ddp``, ...).
"""

from labkit.launch import LaunchError, LaunchTimeout, WorkerError, launch

__all__ = ["launch", "LaunchError", "LaunchTimeout", "WorkerError"]
__version__ = "0.1.0"
