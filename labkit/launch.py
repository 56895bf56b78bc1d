"""Run one function on N ranks: the launcher every lab, test and grader relies on.

    results = labkit.launch(fn, world_size, *args, backend="auto", timeout=120, **kwargs)

Each rank is its own process with the default process group initialised; it runs
``fn(*args, **kwargs)`` and its return value comes back in rank order. Ranks are forked by
a per-caller rank server (``_zygote``) that imported torch once, so a launch costs about a
tenth of a second instead of seconds. What the launcher promises, and how:

* notebook functions work: ``fn`` is serialised with cloudpickle, which ships functions
  defined in ``__main__`` by value, and each rank sees the caller's ``sys.path``, cwd, env;
* output: each rank writes to a file in the run directory, which the caller relays line
  by line as ``[rank r] ...``;
* a rank that raises: ``WorkerError`` naming the first rank that failed, with its remote
  traceback; the other ranks are killed at once;
* a hang: at ``timeout`` seconds every rank dumps its Python stack (faulthandler on
  SIGUSR1) and ``LaunchTimeout`` carries those stacks, so you see who waits where;
* no orphans: ranks are killed on every way out of this function (including Ctrl-C);
  ranks die with the rank server and the server with the caller (PR_SET_PDEATHSIG, plus
  a watchdog), so even a SIGKILLed caller leaves nothing behind;
* no port collisions: the rendezvous store is a TCPStore the caller binds on port 0
  (the OS picks a free port while we hold it), so concurrent launches cannot clash;
* under ``torchrun`` the same call runs ``fn`` in-process on this rank instead.
"""

from __future__ import annotations

import os
import pickle
import re
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import cloudpickle
import torch
import torch.distributed as dist

BACKENDS = ("auto", "gloo", "nccl")
STACK_DUMP_WAIT = 2.0   # seconds we give the ranks to write their stacks after SIGUSR1
KILL_GRACE = 2.0        # seconds between SIGTERM and SIGKILL when stopping ranks


class LaunchError(RuntimeError):
    """Base class of what ``launch`` raises when the ranks did not all finish cleanly."""


class WorkerError(LaunchError):
    """A rank raised (or died). ``rank``, ``exc_type``, ``message``, ``remote_traceback``."""

    def __init__(self, rank: int, exc_type: str, message: str, remote_traceback: str):
        self.rank, self.exc_type, self.message = rank, exc_type, message
        self.remote_traceback = remote_traceback
        super().__init__(
            f"rank {rank} raised {exc_type}: {message}\n\n"
            f"--- remote traceback (rank {rank}) ---\n{remote_traceback.rstrip()}"
        )


class LaunchTimeout(LaunchError, TimeoutError):
    """The ranks did not finish within ``timeout``; ``stacks[rank]`` is where each one was."""

    def __init__(self, timeout: float, stacks: dict[int, str]):
        self.timeout, self.stacks = timeout, stacks
        parts = [f"ranks did not finish within {timeout:g} s; where each rank was:"]
        for rank, stack in sorted(stacks.items()):
            parts.append(f"--- rank {rank} ---\n{stack.rstrip()}")
        super().__init__("\n".join(parts))


# ----------------------------------------------------------------------------- checks


def resolve_backend(backend: str, world_size: int) -> str:
    """'auto' means NCCL when CUDA has a GPU for every rank, else gloo."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise ValueError(
            f"backend='nccl' needs one CUDA GPU per rank: world_size={world_size}, "
            f"but this machine has {gpus} GPU(s). Use backend='gloo' (CPU) or 'auto'."
        )
    return backend


def _check_arguments(fn, world_size) -> int:
    if not callable(fn):
        raise TypeError(f"launch() needs a callable to run on every rank, got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    return world_size


def under_torchrun() -> bool:
    """True inside a process started by torchrun (and not inside one of our own ranks)."""
    env = os.environ
    return "TORCHELASTIC_RUN_ID" in env and "RANK" in env and "LABKIT_RANK" not in env


# ----------------------------------------------------------------------------- launch


def launch(fn, world_size, *args, backend="auto", timeout=120.0, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return their results in rank order."""
    world_size = _check_arguments(fn, world_size)
    if "LABKIT_RANK" in os.environ:
        raise RuntimeError("launch() was called from inside a rank; launches do not nest")
    if under_torchrun():
        return _run_under_torchrun(fn, world_size, args, kwargs, backend)
    backend = resolve_backend(backend, world_size)
    if not timeout or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    payload = cloudpickle.dumps((fn, args, kwargs))  # fails here, before any process starts

    with tempfile.TemporaryDirectory(prefix="labkit-") as rundir:
        with open(os.path.join(rundir, "payload.pkl"), "wb") as f:
            f.write(payload)
        # The caller holds the store's socket, so the port is ours until the launch ends.
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=_as_timedelta(timeout + 60))
        server, ranks = _RankServer.get(), []
        try:
            for rank in range(world_size):
                ranks.append(_start_rank(server, rank, world_size, backend, store.port, rundir, timeout))
            return _supervise(server, ranks, timeout)
        finally:
            _stop(ranks)
            del store


@dataclass
class _Rank:
    rank: int
    pid: int
    rundir: str
    read_offset: int = 0   # how much of the rank's output file has been relayed
    pending: bytes = b""   # a partial output line not yet relayed

    def path(self, what: str, ext: str) -> str:
        return os.path.join(self.rundir, f"{what}_{self.rank}.{ext}")

    def poll(self) -> int | None:
        """The rank's exit status (negative: killed by that signal), or None if running."""
        try:
            with open(self.path("exit", "txt")) as f:
                return int(f.read())
        except FileNotFoundError:
            return None


class _RankServer:
    """Handle on this process's rank server (see ``_zygote``), started on first use."""

    _instance: "_RankServer | None" = None
    _lock = threading.Lock()

    def __init__(self):
        env = dict(os.environ, PYTHONPATH=_caller_path())
        self.owner = os.getpid()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "labkit._zygote"], env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, start_new_session=True,  # survives the notebook's Ctrl-C
        )

    @classmethod
    def get(cls) -> "_RankServer":
        with cls._lock:
            server = cls._instance
            if server is None or server.owner != os.getpid() or server.proc.poll() is not None:
                server = cls._instance = cls()
            return server

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork(self, spec_path: str) -> int:
        with self._lock:
            self.proc.stdin.write((json.dumps({"spec": spec_path}) + "\n").encode())
            self.proc.stdin.flush()
            reply = self.proc.stdout.readline()
        if not reply:
            raise LaunchError(f"the rank server died (status {self.proc.wait()}) before starting a rank")
        return json.loads(reply)["pid"]


def _caller_path() -> str:
    """The ranks import what the caller can import (notebook folder, test modules, ...)."""
    return os.pathsep.join(p or os.getcwd() for p in sys.path)


def _start_rank(server, rank, world_size, backend, port, rundir, timeout) -> _Rank:
    env = dict(os.environ)
    env.update(
        LABKIT_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=_caller_path(),
    )
    rank_info = _Rank(rank, -1, rundir)
    spec = dict(
        rank=rank, world_size=world_size, backend=backend, timeout=timeout, rundir=rundir,
        env=env, sys_path=[p or os.getcwd() for p in sys.path], cwd=os.getcwd(),
        threads=max(1, (os.cpu_count() or 1) // world_size), server_pid=server.proc.pid,
        out_file=rank_info.path("out", "log"), exit_file=rank_info.path("exit", "txt"),
    )
    spec_path = rank_info.path("spec", "json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    rank_info.pid = server.fork(spec_path)
    return rank_info


def _supervise(server: _RankServer, ranks: list[_Rank], timeout: float) -> list:
    """Relay output until every rank is done, one fails, or the deadline passes."""
    deadline = time.monotonic() + timeout
    error = None
    while True:
        for r in ranks:
            _relay(r)
        # A rank that succeeded waits to be stopped, so any exit so far is a failure.
        failed = [r for r in ranks if r.poll() is not None]
        if failed:
            error = _first_failure(ranks, failed)
            break
        if all(os.path.exists(r.path("result", "pkl")) for r in ranks):
            break
        if time.monotonic() > deadline:
            error = LaunchTimeout(timeout, _dump_stacks(ranks))
            break
        if not server.alive():
            error = LaunchError("the rank server died; its ranks died with it")
            break
        time.sleep(0.02)
    _stop(ranks)  # also ends finished ranks, which wait for this (_worker._wait_for_peers)
    for r in ranks:
        _relay(r, final=True)
    if error is not None:
        raise error
    return [_load(r.path("result", "pkl")) for r in ranks]


def _relay(r: _Rank, final: bool = False) -> None:
    """Print the rank's new complete output lines, prefixed with its rank."""
    try:
        with open(r.path("out", "log"), "rb") as f:
            f.seek(r.read_offset)
            chunk = f.read()
    except FileNotFoundError:
        chunk = b""
    r.read_offset += len(chunk)
    lines = (r.pending + chunk).split(b"\n")
    r.pending = lines.pop()
    if final and r.pending:
        lines.append(r.pending)
        r.pending = b""
    for line in lines:
        sys.stdout.write(f"[rank {r.rank}] {line.decode(errors='replace')}\n")
    if lines:
        sys.stdout.flush()


def _first_failure(ranks: list[_Rank], failed: list[_Rank]) -> WorkerError:
    """The rank whose exception came first is the cause; later ones are knock-on errors."""
    reports = []
    for r in ranks:
        if os.path.exists(r.path("error", "pkl")):
            reports.append(_load(r.path("error", "pkl")))
        elif r in failed:  # died without reporting: a signal, os._exit, a crash in C
            code = r.poll()
            why = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
            reports.append(dict(rank=r.rank, time=float("inf"), exc_type="ProcessExit",
                                message=f"the rank's process {why} without raising",
                                traceback="(no Python traceback: the process died)"))
    first = min(reports, key=lambda e: (e["time"], e["rank"]))
    return WorkerError(first["rank"], first["exc_type"], first["message"], first["traceback"])


def _dump_stacks(ranks: list[_Rank]) -> dict[int, str]:
    """Ask every live rank for its Python stack (see _worker: faulthandler on SIGUSR1)."""
    stacks, waiting = {}, []
    for r in ranks:
        if r.poll() is not None:
            stacks[r.rank] = f"(already exited with status {r.poll()})"
        elif os.path.exists(r.path("result", "pkl")):
            stacks[r.rank] = "(finished; waiting for the other ranks)"
        else:
            _signal(r, signal.SIGUSR1, group=False)
            waiting.append(r)
    end = time.monotonic() + STACK_DUMP_WAIT
    while time.monotonic() < end and not all(_nonempty(r.path("stack", "txt")) for r in waiting):
        time.sleep(0.05)
    time.sleep(0.1)  # let the last lines land
    for r in waiting:
        path = r.path("stack", "txt")
        text = open(path, errors="replace").read() if _nonempty(path) else ""
        stacks[r.rank] = _main_thread_stack(text) or "(the rank did not report its stack)"
    return stacks


def _main_thread_stack(dump: str) -> str:
    """faulthandler dumps every thread; keep the one running the user's function."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump.strip())
    mains = [b for b in blocks if "_run_user_function" in b]
    stack = mains[0] if mains else dump
    # Drop the thread's address and our own frames: what matters is the user's code.
    lines = [ln for ln in stack.splitlines()[1:] 
             if not any(own in ln for own in ("labkit/_worker.py", "labkit/_zygote.py", "<frozen runpy>"))]
    return "Stack (most recent call first):\n" + "\n".join(lines)


def _stop(ranks: list[_Rank]) -> None:
    """Terminate, then kill, every rank and its children; wait until they are gone."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [r for r in ranks if r.pid > 0 and r.poll() is None]
        for r in alive:
            _signal(r, sig)
        end = time.monotonic() + KILL_GRACE
        while any(r.poll() is None for r in alive) and time.monotonic() < end:
            time.sleep(0.02)


def _signal(r: _Rank, sig: int, group: bool = True) -> None:
    try:
        if group:
            try:
                os.killpg(r.pid, sig)  # the rank leads its own group (see _worker.run_forked)
                return
            except ProcessLookupError:
                pass  # not yet its own group leader
        os.kill(r.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ----------------------------------------------------------------------------- torchrun


def _run_under_torchrun(fn, world_size, args, kwargs, backend) -> list:
    """torchrun already started the ranks: run here, then share the results with every rank."""
    env_world = int(os.environ["WORLD_SIZE"])
    if world_size != env_world:
        raise ValueError(f"launch(fn, {world_size}) under torchrun with WORLD_SIZE={env_world}: "
                         f"start torchrun with --nproc-per-node {world_size} (or pass world_size from the env)")
    if not dist.is_initialized():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        backend = resolve_backend(backend, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend)
    result = fn(*args, **kwargs)
    results = [None] * world_size
    dist.all_gather_object(results, result)
    return results


# ----------------------------------------------------------------------------- helpers


def _as_timedelta(seconds: float):
    from datetime import timedelta
    return timedelta(seconds=seconds)


def _nonempty(path: str) -> bool:
    return os.path.exists(path) and os.path.getsize(path) > 0


def _load(path: str):
    with open(path, "rb") as f:
        return pickle.load(f)
