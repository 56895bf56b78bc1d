"""``labkit.launch``: run one function on N ranks, from a notebook, a script, a test or
under torchrun. The public entry of the process runtime (``labkit.runtime``: the launcher,
the rank server, the rank's own side, deadlock detection, restarts)::

    results = labkit.launch(fn, world_size, *args, backend="auto", timeout=120, **kwargs)
    results = labkit.launch(fn, world_size, *args, rpc=True, **kwargs)  # + torch.distributed.rpc

See ``labkit.runtime.launcher`` for what it promises and how.
"""

import sys

from labkit.runtime.agents import release_process_groups
from labkit.runtime.launcher import (  # noqa: F401 - the public names, and the rank server for tests
    Deadlock, LaunchError, LaunchTimeout, WorkerError, _RankServer, launch, restart_count, rpc_name,
    under_torchrun)

__all__ = ["launch", "restart_count", "rpc_name", "release_process_groups", "under_torchrun",
           "LaunchError", "LaunchTimeout", "Deadlock", "WorkerError"]


class _CallableModule(type(sys)):
    """``labkit.launch`` names both this module and its function (``labkit`` imports it
    lazily, so ``labkit tasks`` never imports torch): whichever one the attribute holds,
    calling it launches."""

    def __call__(self, *args, **kwargs):
        return launch(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
