"""The rank server: imports torch once, then forks a rank per request (never run by hand).

Starting a Python process and importing torch takes seconds; forking one that already has
torch loaded takes milliseconds, so every launch after the first is nearly free. Each
caller process (a notebook kernel, a pytest run) gets its own server; it dies with it.

Started by ``labkit.runtime.launcher`` with the caller's labkit tree first on the path (not
with ``python -m``, which would put the working directory first), so the ranks run the same
labkit as their caller, whichever tree the caller stands in.

Protocol on stdin/stdout, one JSON object per line:
    request  {"spec": <path of the rank's spec file>}   reply  {"pid": <the rank's pid>}
When a rank exits, its exit status is written to the ``exit_file`` named in its spec.
No threads here: forking a process that has other threads running is unsafe.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import select
import sys

from labkit.runtime import deadlock, worker  # imports torch: the whole point of this process

# Imported once here rather than in every rank. torch._dynamo is the big one: the first
# TorchDispatchMode (our tracer, DTensor, FSDP2) pulls it in, at ~2 s a rank. Exercise
# modules are NOT preloaded: each rank imports the learner's latest code from disk.
PRELOAD = ["torch._dynamo", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.optim", "torch.distributed.pipelining", "torch.nn.parallel",
           "labkit.comm", "labkit.memory", "labkit.check"]
if os.environ.get("LABKIT_COVERAGE") and importlib.util.find_spec("coverage"):
    PRELOAD += ["coverage", "labkit.runtime.taskcov"]  # a measured run's ranks record (labkit.runtime.taskcov)


def _reap(children: dict[int, str]) -> None:
    """Collect exited ranks and publish their exit status."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = children.pop(pid, None)
        if path:
            with open(path + ".tmp", "w") as f:
                f.write(str(os.waitstatus_to_exitcode(status)))
            os.replace(path + ".tmp", path)


def _fork_rank(spec_path: str) -> int:
    pid = os.fork()
    if pid == 0:  # the rank: never returns into this loop
        try:
            worker.run_forked(spec_path)
        finally:
            os._exit(1)
    return pid


def _preload(caller: int) -> None:
    """Import PRELOAD, and exit at once if the caller dies meanwhile (a Ctrl-C, a killed
    pytest): the imports take seconds, and nothing else here would notice. The watcher is a
    thread, so it is stopped and joined before the first fork."""
    import threading
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.05):
            if os.getppid() != caller:
                os._exit(0)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        for module in PRELOAD:
            importlib.import_module(module)
    finally:
        done.set()
        watcher.join()


def main(tree: str | None = None) -> None:
    """Serve the caller; ``tree``: the folder holding the caller's labkit (ours must be it)."""
    if tree is not None:
        mine = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        if os.path.realpath(mine) != os.path.realpath(tree):
            sys.stderr.write(f"labkit rank server: imported labkit from {mine}, but its caller "
                             f"uses {tree}'s; refusing to run ranks on another tree's code\n")
            sys.exit(3)
    # No PR_SET_PDEATHSIG here: it fires when the *thread* that started us exits, and a
    # caller may launch from a short-lived thread. The loop below watches the caller instead.
    caller = os.getppid()
    _preload(caller)
    deadlock.install_journal()  # every rank forked from here journals its blocking calls
    children: dict[int, str] = {}
    stdin, buffered = sys.stdin.fileno(), b""
    while True:
        ready, _, _ = select.select([stdin], [], [], 0.05)
        _reap(children)
        if os.getppid() != caller:
            return  # the caller died; the ranks follow us (PR_SET_PDEATHSIG)
        if not ready:
            continue
        data = os.read(stdin, 65536)
        if not data:
            return  # the caller closed the pipe: it has exited
        buffered += data
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            spec_path = json.loads(line)["spec"]
            with open(spec_path) as f:
                exit_file = json.load(f)["exit_file"]
            pid = _fork_rank(spec_path)
            children[pid] = exit_file
            sys.stdout.write(json.dumps({"pid": pid}) + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
