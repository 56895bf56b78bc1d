"""Coverage recording for ``labkit coverage`` (``labkit.course.coverage``): which lines of
the exercise modules a graded test's ranks run, recorded under the test's task.

Off unless ``LABKIT_COVERAGE`` names a folder: each process that records writes its own
coverage.py data file there, under a context named by the task (``LABKIT_COVERAGE_TASK`` in
a rank), measuring only the files listed in ``LABKIT_COVERAGE_FILES``.
"""

from __future__ import annotations

import os
import sys

DIR_ENV = "LABKIT_COVERAGE"          # folder of the data files
TASK_ENV = "LABKIT_COVERAGE_TASK"    # the graded task running now
FILES_ENV = "LABKIT_COVERAGE_FILES"  # the files to measure (os.pathsep between them)


def start(context: str | None):
    """Start coverage.py (lines and branches) under ``context``; None when not recording."""
    folder, files = os.environ.get(DIR_ENV), os.environ.get(FILES_ENV)
    if not folder or not files or not os.path.isdir(folder):
        return None
    import coverage
    cov = coverage.Coverage(data_file=os.path.join(folder, "cov"), data_suffix=True, branch=True,
                            config_file=False, context=context, include=files.split(os.pathsep))
    cov.set_option("run:disable_warnings", ["no-data-collected", "module-not-measured"])
    cov.start()
    _trace_foreign_threads()
    return cov


def start_rank():
    """In a rank: record while the graded test that launched it runs."""
    task = os.environ.get(TASK_ENV)
    return start(task) if task else None


def save(cov) -> None:
    if cov is not None:
        cov.stop()
        cov.save()


def _trace_foreign_threads() -> None:
    """coverage.py traces the threads ``threading`` starts; gloo's and TensorPipe's threads
    run Python too (a future's ``.then`` callback, an RPC's function): trace those as well."""
    import threading

    import torch
    import torch.distributed.rpc.internal as rpc_internal

    def traced(fn):
        def run(*args, **kwargs):
            if sys.gettrace() is None and threading.gettrace() is not None:
                sys.settrace(threading.gettrace())  # coverage's tracer starts at the next call
            return fn(*args, **kwargs)
        return run

    future = torch._C.Future
    if getattr(future.then, "_labkit_traced", False):
        return
    for name in ("then", "add_done_callback"):
        def patched(self, callback, original=getattr(future, name)):
            return original(self, traced(callback))
        patched._labkit_traced = True
        setattr(future, name, patched)
    rpc_internal._run_function = traced(rpc_internal._run_function)
