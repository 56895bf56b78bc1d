"""One rank of a ``labkit.launch`` (never run by hand).

The rank server (``rankserver``) forks this code with a spec file describing the rank: its
number, the run directory, the caller's environment, ``sys.path`` and working directory.
The rank writes its output to ``out_<rank>.log`` (the caller relays it) and its outcome to
``result_<rank>.pkl`` (``result_<rank>.pt`` under the judge: ``torch.save`` of plain data and
the launch's nonce, see ``labkit.runtime.sandbox``) or ``error_<rank>.json``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import cloudpickle
import torch
import torch.distributed as dist

from labkit.runtime import agents, contracts, deadlock, sandbox

OVERRIDES_ENV = "LABKIT_MODULE_OVERRIDES"  # JSON {exercise module: source file} (mutation testing)
COURSE_DIR = os.path.dirname(os.path.abspath(__file__))  # frames from here are ours, not the user's


def die_with_parent(parent_pid: int) -> None:
    """Never outlive ``parent_pid``, even if it is SIGKILLed."""
    if sys.platform.startswith("linux"):
        import ctypes
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # it died before prctl took effect
        os._exit(1)

    def watcher():  # also covers macOS, which has no PR_SET_PDEATHSIG
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watcher, name="labkit-parent-watch", daemon=True).start()


def run_forked(spec_path: str) -> None:
    """Entry point in the freshly forked rank: become the caller's twin, then run."""
    os.setsid()  # our own process group: the caller stops us and our children with killpg
    with open(spec_path) as f:
        spec = json.load(f)
    if spec.get("nonce"):  # the judge's: read once, then gone before any submitted code runs
        os.unlink(spec_path)
        sandbox.become_student()
    die_with_parent(spec["server_pid"])
    _redirect_output(spec["out_file"])
    os.environ.clear()
    os.environ.update(spec["env"])
    sys.path[:] = spec["sys_path"]
    os.chdir(spec["cwd"])
    torch.set_num_threads(spec["threads"])  # ranks share the cores; don't oversubscribe
    run_rank(spec)


def _redirect_output(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for target in (1, 2):
        os.dup2(fd, target)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)


def run_rank(spec: dict) -> None:
    rank, rundir = spec["rank"], spec["rundir"]
    # On SIGUSR1 (at the timeout, or when the deadlock detector asks) write every thread's
    # Python stack to a file. Append mode: the caller empties the file before each request.
    stack_file = open(os.path.join(rundir, f"stack_{rank}.txt"), "a")
    deadlock.open_journal(os.path.join(rundir, f"journal_{rank}.bin"))
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    faulthandler.enable()  # a crash in C still prints a Python stack to the relayed output
    cov = _start_coverage()
    try:
        import_overrides(json.loads(os.environ.get(OVERRIDES_ENV, "{}")))
        contracts.install_from_env()  # while grading: every exercise call keeps its contracts
        with open(os.path.join(rundir, "payload.pkl"), "rb") as f:
            fn, args, kwargs = cloudpickle.load(f)
        _init_process_group(rank, spec["world_size"], spec["backend"], spec["timeout"])
        check_peers()
        if spec.get("rpc"):  # launch(..., rpc=True): an RPC agent beside the process group
            agents.start_rpc(rank, spec["world_size"], spec["rpc"]["rpc_timeout"])
        result = _run_user_function(fn, args, kwargs)
        if spec.get("rpc"):
            # Graceful: wait until every rank's fn returned and the RPCs and RRef messages in
            # flight are done (a rank serves the others after its own fn returned).
            agents.stop_rpc(graceful=True)
        _save_coverage(cov)
        _flush()
        if spec.get("nonce"):
            sandbox.save_result(os.path.join(rundir, f"result_{rank}.pt"), spec["nonce"], result)
        else:
            _write_atomically(os.path.join(rundir, f"result_{rank}.pkl"), result)
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the caller
        report = dict(rank=rank, time=time.time(), exc_type=type(exc).__name__,
                      message=str(exc), traceback=_user_traceback(exc))
        _save_coverage(cov)
        _flush()
        sandbox.write_json(os.path.join(rundir, f"error_{rank}.json"), report)  # plain data, never a pickle
        # Skip interpreter teardown (and, in an RPC job, the agent's shutdown): a peer may be
        # blocked talking to us, and our closing sockets tell it at once.
        os._exit(1)
    _wait_for_peers()


def _start_coverage():
    """Under ``labkit coverage`` (or CI), a graded test's ranks record which lines of the
    exercise modules they run, under the test's task (``labkit.runtime.taskcov``)."""
    if not os.environ.get("LABKIT_COVERAGE_TASK"):
        return None
    from labkit.runtime import taskcov
    return taskcov.start_rank()


def _save_coverage(cov) -> None:
    if cov is not None:
        from labkit.runtime import taskcov
        taskcov.save(cov)


def _init_process_group(rank: int, world_size: int, backend: str, timeout: float) -> None:
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=timeout + 60))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # Our own timeout fires first, so a hang is reported with stacks, not a gloo error.
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout + 60))


def import_overrides(overrides: dict[str, str]) -> None:
    """Import ``labkit.<name>`` from the file given for it instead of the package (the
    grader's mutation testing swaps a wrong implementation in this way)."""
    import importlib.util

    package = sys.modules["labkit"]  # loaded already: this module lives in it
    for name, path in overrides.items():
        for stale in [m for m in sys.modules if m.startswith(f"labkit.{name}.")]:
            del sys.modules[stale]   # a chapter package's files come from the override's folder
        # A chapter package (labkit/compress/) comes as its __init__.py: its files are found beside it.
        search = [str(Path(path).parent)] if Path(path).name == "__init__.py" else None
        spec = importlib.util.spec_from_file_location(f"labkit.{name}", path, submodule_search_locations=search)
        module = importlib.util.module_from_spec(spec)
        sys.modules[f"labkit.{name}"] = module
        spec.loader.exec_module(module)
        if contracts.active():
            contracts.wrap_module(module)
        setattr(package, name, module)


def check_peers() -> None:
    """A send or receive whose peer is not in its group gets the course's explanation before
    any transport sees it (gloo crashes the process on a rank outside the world, and torch
    names the group only by its address). Every point-to-point call of torch.distributed
    (send, recv, isend, irecv, P2POp) turns its peer into a group rank here."""
    c10d = dist.distributed_c10d
    original = c10d._canonicalize_group_rank
    if getattr(original, "_labkit_checked", False):
        return

    def canonicalize(group, global_rank=None, group_rank=None, return_global=False):
        ranks = dist.get_process_group_ranks(group)
        if global_rank is not None and group_rank is None and global_rank not in ranks:
            raise ValueError(
                f"rank {dist.get_rank()} names rank {global_rank} as the peer of a send or receive, "
                f"but its group holds global ranks {ranks}: peers are global ranks, so the "
                f"group's r-th rank is dist.get_global_rank(group, r) (or pass group_peer=r)")
        if group_rank is not None and not 0 <= group_rank < len(ranks):
            raise ValueError(
                f"rank {dist.get_rank()} names group rank {group_rank} as the peer of a send or "
                f"receive, but its group has {len(ranks)} ranks (global ranks {ranks})")
        return original(group, global_rank, group_rank, return_global)

    canonicalize._labkit_checked = True
    c10d._canonicalize_group_rank = canonicalize


def _run_user_function(fn, args, kwargs):
    return fn(*args, **kwargs)


def _wait_for_peers() -> None:
    """Stay connected until the caller stops us once every rank is done.

    Exiting at once would reset our connections, turning a peer's hang (say, a recv we
    never send to) into a confusing "connection reset" error instead of a reported hang.
    """
    while True:
        signal.pause()


def _user_traceback(exc: BaseException) -> str:
    """The traceback from the user's code down, without the launcher's own frames."""
    tb = traceback.TracebackException.from_exception(exc)
    tb.stack = traceback.StackSummary.from_list(
        [f for f in tb.stack if os.path.dirname(os.path.abspath(f.filename)) != COURSE_DIR])
    return "".join(tb.format())


def _write_atomically(path: str, obj) -> None:
    with open(path + ".tmp", "wb") as f:
        cloudpickle.dump(obj, f)
    os.replace(path + ".tmp", path)


def _flush() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
