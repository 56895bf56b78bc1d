"""Run one function on N ranks: the launcher every lab, test and grader relies on
(``labkit.launch`` is its public face).

    results = labkit.launch(fn, world_size, *args, backend="auto", timeout=120, **kwargs)

Each rank is its own process with the default process group initialised; it runs
``fn(*args, **kwargs)`` and its return value comes back in rank order. Ranks are forked by
a per-caller rank server (``labkit.runtime.rankserver``) that imported torch once, so a
launch costs about a tenth of a second instead of seconds. What the launcher promises, and how:

* notebook functions work: ``fn`` is serialised with cloudpickle, which ships functions
  defined in ``__main__`` by value, and each rank sees the caller's ``sys.path``, cwd, env;
* output: each rank writes to a file in the run directory, which the caller relays line
  by line as ``[rank r] ...``;
* a rank that raises: ``WorkerError`` naming the first rank that failed, with its remote
  traceback; the other ranks are killed at once;
* a deadlock: when every rank sits blocked in communication and none moves for a couple
  of seconds, ``Deadlock`` (a ``LaunchTimeout``) says in one line who waits for what, where,
  followed by every rank's stack (``labkit.runtime.deadlock``; ``detect_deadlock=False``
  turns it off);
* any other hang: at ``timeout`` seconds every rank dumps its Python stack (faulthandler on
  SIGUSR1) and ``LaunchTimeout`` carries those stacks, so you see who waits where;
* no orphans: ranks are killed on every way out of this function (including Ctrl-C);
  ranks die with the rank server and the server with the caller (PR_SET_PDEATHSIG, plus
  a watchdog), so even a SIGKILLed caller leaves nothing behind;
* no port collisions: the rendezvous store is a TCPStore the caller binds on port 0
  (the OS picks a free port while we hold it), so concurrent launches cannot clash;
* under ``torchrun`` the same call runs ``fn`` in-process on this rank instead, and the
  process group it made is destroyed at exit (a gloo group left alive can abort the
  process while the interpreter shuts down). That side, and the RPC agents of both kinds of
  launch, live in ``labkit.runtime.agents``.

RPC jobs (``launch(fn, n, rpc=True)``, chapter 13): every rank also joins
``torch.distributed.rpc`` (TensorPipe) as ``rpc_name(rank)``, "worker0" .. "worker{n-1}",
before ``fn`` runs; the default (gloo) process group stays available too (it costs ~0.03 s
and lets a test compare an RPC design with a collective one in the same job). RPC agents
rendezvous through the process group's store, under a prefix of their own, so no second port
is needed, and torchrun's round store serves the same purpose there. ``rpc_timeout``
(default ``timeout + 60``, like the process group's: our own timeout should fire first) is the
agents' default per-call timeout. Exits, each one kept:

* ``fn`` returns: ``rpc.shutdown()`` (graceful: a barrier that waits until every rank's
  ``fn`` returned and every outstanding RPC and RRef message is done), then the result is
  written; a rank may still be serving others while its own ``fn`` has returned;
* ``fn`` raises: the rank reports and exits at once (no graceful shutdown: its peers would
  be waited for); its sockets close, so a peer's pending RPC to it fails at once with a
  connection error rather than at the RPC timeout;
* a rank dies (``os._exit``, a signal): the same for its peers; ``WorkerError`` names the dead
  rank, and for RPC jobs the launcher waits up to ``PEER_REPORT_WAIT`` seconds for the
  others' view of it (a server's "trainer 2 died mid-step"), kept in ``error.peer_errors``;
* a hang: ``LaunchTimeout`` with stacks, as for any job; the ranks are killed, not shut down.
"""

from __future__ import annotations

import json
import os
import pickle
import re
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

from labkit.runtime import deadlock, sandbox
from labkit.runtime.agents import rpc_name, run_under_torchrun  # noqa: F401 - rpc_name is public (labkit.launch)

BACKENDS = ("auto", "gloo", "nccl")
STACK_DUMP_WAIT = 2.0   # seconds we give the ranks to write their stacks after SIGUSR1
KILL_GRACE = 2.0        # seconds between SIGTERM and SIGKILL when stopping ranks
REAP_SLACK = 0.5        # seconds a death may precede the rank server's record of it
PEER_REPORT_WAIT = 5.0  # RPC jobs: seconds the other ranks get to report a failure they saw (the wait
                        # ends as soon as every rank has exited: usually in milliseconds)
OWN_FRAMES = ("labkit/runtime/worker.py", "labkit/runtime/rankserver.py", "labkit/runtime/deadlock.py",
              "<frozen runpy>")  # the launcher's frames: never what the learner wants to see


class LaunchError(RuntimeError):
    """Base class of what ``launch`` raises when the ranks did not all finish cleanly."""


class WorkerError(LaunchError):
    """A rank raised (or died). ``rank``, ``exc_type``, ``message``, ``remote_traceback``."""

    def __init__(self, rank: int, exc_type: str, message: str, remote_traceback: str,
                 peer_errors: dict[int, str] | None = None):
        self.rank, self.exc_type, self.message = rank, exc_type, message
        self.remote_traceback = remote_traceback
        # What the other ranks raised after it (RPC jobs): "ExcType: message" by rank.
        self.peer_errors = dict(peer_errors or {})
        seen = "".join(f"\n  rank {r}: {what.splitlines()[0] if what else ''}"
                       for r, what in sorted(self.peer_errors.items()))
        super().__init__(
            f"rank {rank} raised {exc_type}: {message}\n\n"
            f"--- remote traceback (rank {rank}) ---\n{remote_traceback.rstrip()}"
            + (f"\n\n--- what the other ranks then raised ---{seen}" if seen else "")
        )


class LaunchTimeout(LaunchError, TimeoutError):
    """The ranks did not finish within ``timeout``; ``stacks[rank]`` is where each one was."""

    def __init__(self, timeout: float, stacks: dict[int, str], headline: str | None = None):
        self.timeout, self.stacks = timeout, stacks
        parts = [headline or f"ranks did not finish within {timeout:g} s; where each rank was:"]
        for rank, stack in sorted(stacks.items()):
            parts.append(f"--- rank {rank} ---\n{stack.rstrip()}")
        super().__init__("\n".join(parts))


class Deadlock(LaunchTimeout):
    """Every rank was blocked in communication, and none moved: they never would.

    ``waits[rank]`` says what each rank waited in ("recv from rank 1 of (4,) float32",
    "finished, waiting for the others"), ``where[rank]`` the learner's line, ``elapsed``
    the seconds from the launch to the verdict; the message starts with the one-line verdict.
    """

    def __init__(self, timeout: float, snapshots: list, elapsed: float):
        self.elapsed = elapsed
        self.waits = {s.rank: s.wait for s in snapshots}
        self.where = {s.rank: s.where for s in snapshots}
        stacks = {s.rank: s.stack or "(finished; waiting for the other ranks)" for s in snapshots}
        super().__init__(timeout, stacks, deadlock.diagnosis(snapshots, elapsed)
                         + "\n\nwhere each rank was:")


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


def _check_rpc(rpc, rpc_timeout, backend: str) -> None:
    if not isinstance(rpc, bool):
        raise TypeError(f"rpc must be True or False, got {rpc!r}")
    if rpc_timeout is not None and (isinstance(rpc_timeout, bool) or not isinstance(rpc_timeout, (int, float))
                                    or rpc_timeout <= 0):
        raise ValueError(f"rpc_timeout must be a positive number of seconds, got {rpc_timeout!r}")
    if rpc_timeout is not None and not rpc:
        raise ValueError("rpc_timeout is the RPC agents' timeout: pass it with rpc=True")
    if rpc and backend == "nccl":
        raise ValueError("rpc=True runs on CPU: RRefs, distributed autograd and DistributedOptimizer "
                         "take CPU tensors only, so the job's process group is gloo. "
                         "Use backend='gloo' or 'auto'.")


def under_torchrun() -> bool:
    """True inside a process started by torchrun (and not inside one of our own ranks)."""
    env = os.environ
    return "TORCHELASTIC_RUN_ID" in env and "RANK" in env and "LABKIT_RANK" not in env


# ----------------------------------------------------------------------------- launch


def launch(fn, world_size, *args, backend="auto", timeout=120.0, detect_deadlock=True, max_restarts=0,
           rpc=False, rpc_timeout=None, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return their results in rank order.

    ``backend``: "auto" (NCCL with a GPU per rank, else gloo), "gloo" or "nccl".
    ``timeout``: seconds before a hang is reported with every rank's stack.
    ``detect_deadlock``: report ranks that all wait on each other within seconds, not at
    the timeout (see ``labkit.runtime.deadlock``).
    ``max_restarts``: like torchrun's: when a rank fails (raises, or dies: SIGKILL, a crash;
    not a stub's NotImplementedError), stop every rank and start them all again, up to this
    many times (under torchrun, restarts are torchrun's own). The ranks of attempt k
    see ``restart_count() == k`` (env ``LABKIT_RESTART_COUNT`` and, as under torchrun,
    ``TORCHELASTIC_RESTART_COUNT``): resuming from a checkpoint is theirs to do (chapter 09).
    ``rpc``: also start ``torch.distributed.rpc`` on every rank, named ``rpc_name(rank)``,
    and shut it down after ``fn`` (see the module docstring); the process group is gloo.
    ``rpc_timeout``: the RPC agents' default timeout per call (default ``timeout + 60``).
    """
    world_size = _check_arguments(fn, world_size)
    _check_rpc(rpc, rpc_timeout, backend)
    if "LABKIT_RANK" in os.environ:
        raise RuntimeError("launch() was called from inside a rank; launches do not nest")
    if under_torchrun():    # torchrun's agents started the ranks: run here
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        return run_under_torchrun(fn, world_size, args, kwargs, "gloo" if rpc else resolve_backend(backend, local),
                                  rpc, rpc_timeout or timeout + 60)
    backend = "gloo" if rpc else resolve_backend(backend, world_size)
    if not timeout or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be a non-negative int, got {max_restarts!r}")
    payload = _serialise(fn, args, kwargs)  # fails here, before any process starts
    sandbox.check_student_can_run()
    rpc_options = dict(rpc_timeout=rpc_timeout or timeout + 60) if rpc else None
    for restart in range(max_restarts + 1):
        try:
            return _launch_once(payload, world_size, backend, timeout, detect_deadlock, restart, rpc_options)
        except WorkerError as error:
            if restart == max_restarts or error.exc_type == "NotImplementedError":
                raise  # a stub fails the same way every time: restarting would only repeat it
            print(f"[launch] rank {error.rank} failed ({error.exc_type}: {error.message.splitlines()[0]}); "
                  f"restarting every rank ({restart + 1} of {max_restarts})", flush=True)
    raise AssertionError("unreachable")


def _serialise(fn, args, kwargs) -> bytes:
    try:
        return cloudpickle.dumps((fn, args, kwargs))
    except Exception as error:  # noqa: BLE001 - re-raised with what to do about it
        raise TypeError(
            f"launch() cannot send {getattr(fn, '__name__', fn)!r} and its arguments to the ranks: {error}. "
            "A function defined in a notebook or script travels with the globals it names, and a "
            "name used as an attribute (x.config, self.ops) counts too: if a global of that name "
            "holds something unpicklable (a lock, a module object), rename it, or define the "
            "function in a module.") from error


def restart_count() -> int:
    """Which attempt this rank belongs to: 0 at first, k after k restarts (``launch(...,
    max_restarts=...)`` or torchrun's ``--max-restarts``)."""
    env = os.environ
    return int(env.get("LABKIT_RESTART_COUNT", env.get("TORCHELASTIC_RESTART_COUNT", 0)))


def _launch_once(payload: bytes, world_size: int, backend: str, timeout: float, detect_deadlock: bool,
                 restart: int, rpc_options: dict | None = None) -> list:
    with tempfile.TemporaryDirectory(prefix="labkit-") as rundir:
        sandbox.hand_over(rundir)  # judge as root: the ranks (another user) write their files here
        with open(os.path.join(rundir, "payload.pkl"), "wb") as f:
            f.write(payload)
        # The caller holds the store's socket, so the port is ours until the launch ends.
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=_as_timedelta(timeout + 60))
        ranks, interrupted, server = [], False, None
        try:
            server = _RankServer.get()
            for rank in range(world_size):
                ranks.append(_start_rank(server, rank, world_size, backend, store.port, rundir, timeout, restart,
                                         rpc_options))
            detector = deadlock.Detector(ranks, _dump_stacks, backend) if detect_deadlock else None
            return _supervise(server, ranks, timeout, detector, PEER_REPORT_WAIT if rpc_options else 0.0)
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            _stop(ranks)
            if interrupted:   # Ctrl-C: nothing of ours may outlive the caller, not even the server
                _RankServer.shutdown()
            # judge: nothing of the submission outlives its launch
            sandbox.after_launch({server.proc.pid} if server is not None else set())
            del store


@dataclass
class _Rank:
    rank: int
    pid: int
    rundir: str
    nonce: str = ""        # under the judge: the token its result must carry (sandbox)
    read_offset: int = 0   # how much of the rank's output file has been relayed
    pending: bytes = b""   # a partial output line not yet relayed

    def path(self, what: str, ext: str) -> str:
        return os.path.join(self.rundir, f"{what}_{self.rank}.{ext}")

    @property
    def journal_path(self) -> str:
        return self.path("journal", "bin")

    def poll(self) -> int | None:
        """The rank's exit status (negative: killed by that signal), or None if running."""
        try:
            with open(self.path("exit", "txt")) as f:
                return int(f.read())
        except FileNotFoundError:
            return None

    def finished(self) -> bool:
        """The rank returned and waits to be stopped (see worker._wait_for_peers); under the
        judge its result is only believed once it loads with the launch's nonce (``sandbox``)."""
        return os.path.exists(self.path("result", "pt" if sandbox.judging() else "pkl"))


class _RankServer:
    """Handle on this process's rank server (see ``labkit.runtime.rankserver``), started on first use."""

    _instance: "_RankServer | None" = None
    _lock = threading.Lock()

    def __init__(self):
        env = dict(os.environ, PYTHONPATH=_caller_path(), LABKIT_RANK_SERVER="1")
        # OpenMP threads that spin while they wait steal the cores from the other ranks: on a
        # busy 2-core machine a tiny GPT step took 10x longer with 2 spinning threads. The
        # ranks inherit this from the server, which loads torch (and OpenMP) once.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        self.owner = os.getpid()
        # Not ``python -m labkit.runtime.rankserver``: -m puts the working directory first on
        # the path, so from another course tree's root the ranks would import that tree's
        # labkit while this process runs its own. The server imports labkit from the tree
        # this process imported it from, and refuses to start otherwise.
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER_BOOT, _labkit_tree()], env=env, stdin=subprocess.PIPE,
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

    @classmethod
    def shutdown(cls) -> None:
        """End this process's rank server now (its ranks are stopped first, by ``_stop``); the
        next launch starts a new one. The server leads its own session: kill that group."""
        with cls._lock:
            server, cls._instance = cls._instance, None
        if server is None or server.owner != os.getpid() or not server.alive():
            return
        try:
            os.killpg(server.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            server.proc.kill()
        server.proc.wait()

    def fork(self, spec_path: str) -> int:
        with self._lock:
            self.proc.stdin.write((json.dumps({"spec": spec_path}) + "\n").encode())
            self.proc.stdin.flush()
            reply = self.proc.stdout.readline()
        if not reply:
            raise LaunchError(f"the rank server died (status {self.proc.wait()}) before starting a rank")
        return json.loads(reply)["pid"]


# sys.argv[1]: the folder holding the caller's labkit package. It replaces the '' that -c
# puts first on the path (the working directory), so labkit resolves to the caller's tree.
_SERVER_BOOT = ("import sys; sys.path[0] = sys.argv[1]; "
                "from labkit.runtime import rankserver; rankserver.main(sys.argv[1])")


def _labkit_tree() -> str:
    """The folder that holds the ``labkit`` package this process imported."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _caller_path() -> str:
    """The ranks import what the caller can import (notebook folder, test modules, ...)."""
    return os.pathsep.join(p or os.getcwd() for p in sys.path)


def _start_rank(server, rank, world_size, backend, port, rundir, timeout, restart=0, rpc_options=None) -> _Rank:
    env = dict(os.environ)
    env.update(
        LABKIT_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=_caller_path(),
        LABKIT_RESTART_COUNT=str(restart), TORCHELASTIC_RESTART_COUNT=str(restart),
    )
    rank_info = _Rank(rank, -1, rundir, sandbox.new_nonce())
    spec = dict(
        rank=rank, world_size=world_size, backend=backend, timeout=timeout, rundir=rundir,
        env=env, sys_path=[p or os.getcwd() for p in sys.path], cwd=os.getcwd(),
        threads=max(1, (os.cpu_count() or 1) // world_size), server_pid=server.proc.pid,
        out_file=rank_info.path("out", "log"), exit_file=rank_info.path("exit", "txt"),
        rpc=rpc_options, nonce=rank_info.nonce,
    )
    spec_path = rank_info.path("spec", "json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    rank_info.pid = server.fork(spec_path)
    return rank_info


def _supervise(server: _RankServer, ranks: list[_Rank], timeout: float, detector,
               peer_report_wait: float = 0.0) -> list:
    """Relay output until every rank is done, one fails, they deadlock, or the deadline passes."""
    start = time.monotonic()
    deadline = start + timeout
    error = None
    while True:
        for r in ranks:
            _relay(r)
        # A rank that succeeded waits to be stopped, so any exit so far is a failure.
        failed = [r for r in ranks if r.poll() is not None]
        if failed:
            if peer_report_wait:  # RPC: give the others a moment to say what they saw
                _wait_for_reports(ranks, peer_report_wait)
                failed = [r for r in ranks if r.poll() is not None]
            error = _first_failure(ranks, failed)
            break
        if all(r.finished() for r in ranks):
            break
        stuck = detector.check() if detector is not None else None
        if stuck is not None:
            error = Deadlock(timeout, stuck, time.monotonic() - start)
            break
        if time.monotonic() > deadline:
            error = LaunchTimeout(timeout, _timeout_stacks(ranks))
            break
        if not server.alive():
            error = LaunchError("the rank server died; its ranks died with it")
            break
        time.sleep(0.02)
    _stop(ranks)  # also ends finished ranks, which wait for this (worker._wait_for_peers)
    for r in ranks:
        _relay(r, final=True)
    if error is not None:
        raise error
    if sandbox.judging():
        return [sandbox.load_result(r.path("result", "pt"), r.rank, r.nonce) for r in ranks]
    return [_load(r.path("result", "pkl")) for r in ranks]


# C++ warnings that tell a learner nothing and read as errors: a peer's RPC agent closing as
# its rank leaves (tensorpipe's "eof"; the launcher reports why that rank left), and a reverse
# lookup of a 127.0.0.1 socket that the machine's resolver cannot answer (c10d).
QUIET_LINES = re.compile(r"tensorpipe_agent\.cpp.*encountered error when reading incoming (request|response) from \S+: eof"
                         r"|\[c10d\] The hostname of the client socket cannot be retrieved")


def _relay(r: _Rank, final: bool = False) -> None:
    """Print the rank's new complete output lines, prefixed with its rank (not QUIET_LINES)."""
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
        text = line.decode(errors="replace")
        if not QUIET_LINES.search(text):
            sys.stdout.write(f"[rank {r.rank}] {text}\n")
    if lines:
        sys.stdout.flush()


def _first_failure(ranks: list[_Rank], failed: list[_Rank]) -> WorkerError:
    """The rank whose exception came first is the cause; later ones are knock-on errors."""
    reports = []
    for r in ranks:
        report = sandbox.read_error(r.path("error", "json"), r.rank)  # JSON: never unpickled
        if report is not None:
            reports.append(report)
        elif r in failed:  # died without reporting: a signal, os._exit, a crash in C
            code = r.poll()
            why = (f"was killed by signal {-code} ({signal.Signals(-code).name})" if code < 0
                   else f"exited with status {code}")
            # When it died: a peer's "connection reset" that follows is a consequence, not the
            # cause. The exit file is written when the rank server reaps it (it polls every
            # 50 ms, later on a busy machine) while the peer raises at once: count the death
            # REAP_SLACK earlier than the file says.
            died = os.path.getmtime(r.path("exit", "txt")) - REAP_SLACK
            reports.append(dict(rank=r.rank, time=died, exc_type="ProcessExit",
                                message=f"the rank's process {why} without raising",
                                traceback=_crash_report(r)))
    first = min(reports, key=lambda e: (e["time"], e["rank"]))
    later = {e["rank"]: f"{e['exc_type']}: {e['message']}" for e in reports if e is not first}
    return WorkerError(first["rank"], first["exc_type"], first["message"], first["traceback"], later)


def _wait_for_reports(ranks: list[_Rank], seconds: float) -> None:
    """Until every rank has exited or finished, or ``seconds`` passed: in an RPC job a peer's
    pending call to a dead rank fails at once, and its report says what the failure meant."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if all(r.poll() is not None or r.finished() for r in ranks):
            return
        time.sleep(0.02)


def _crash_report(r: _Rank) -> str:
    """What a rank that died in C printed: the C++ message and the Python stack faulthandler
    wrote (``faulthandler.enable()`` in the worker), from its output file."""
    try:
        with open(r.path("out", "log"), errors="replace") as f:
            text = f.read()
    except FileNotFoundError:
        return "(no Python traceback: the process died)"
    start = text.find("Fatal Python error")
    if start < 0:
        return "(no Python traceback: the process died)"
    cause = [ln for ln in text[:start].splitlines()[-4:] if "terminate" in ln or "what()" in ln]
    return "\n".join(cause + [_main_thread_stack(text[start:])])


def _timeout_stacks(ranks: list[_Rank]) -> dict[int, str]:
    """Where every rank is, for a timeout report: live ranks dump their stacks."""
    stacks = {}
    for r in ranks:
        if r.poll() is not None:
            stacks[r.rank] = f"(already exited with status {r.poll()})"
        elif r.finished():
            stacks[r.rank] = "(finished; waiting for the other ranks)"
    live = [r for r in ranks if r.rank not in stacks]
    return stacks | _dump_stacks(live)


def _dump_stacks(ranks: list[_Rank]) -> dict[int, str]:
    """Ask each rank for its Python stack (see worker: faulthandler on SIGUSR1)."""
    for r in ranks:
        open(r.path("stack", "txt"), "w").close()  # the rank appends: start from empty
        _signal(r, signal.SIGUSR1, group=False)
    end = time.monotonic() + STACK_DUMP_WAIT
    while time.monotonic() < end and not all(_nonempty(r.path("stack", "txt")) for r in ranks):
        time.sleep(0.02)
    time.sleep(0.05)  # let the last lines land
    stacks = {}
    for r in ranks:
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
             if ln.strip() and not ln.startswith("Extension modules")
             and not any(own in ln for own in OWN_FRAMES)]
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
                os.killpg(r.pid, sig)  # the rank leads its own group (see worker.run_forked)
                return
            except ProcessLookupError:
                pass  # not yet its own group leader
        os.kill(r.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ----------------------------------------------------------------------------- helpers


def _as_timedelta(seconds: float):
    from datetime import timedelta
    return timedelta(seconds=seconds)


def _nonempty(path: str) -> bool:
    return os.path.exists(path) and os.path.getsize(path) > 0


def _load(path: str):
    with open(path, "rb") as f:
        return pickle.load(f)

