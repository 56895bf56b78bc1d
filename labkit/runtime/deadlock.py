"""Deadlock detection for ``labkit.launch``: tell a stuck job from a slow one in seconds.

A deadlock leaves every rank asleep in a communication call that no other rank will ever
answer. A slow job always has some rank doing something: computing, sleeping, moving
bytes. So the launcher calls it a deadlock only when, for ``window`` seconds in a row,

1. no rank that has not finished used CPU time (``/proc/<pid>/task/*/schedstat``: gloo's
   threads copying a large message count too) and none has a thread runnable at two samples
   in a row;
2. every such rank is blocked in communication: its wait journal (below) names the call,
   or its Python stack's innermost frame is inside ``torch.distributed``;
3. every rank's Python stack and journal are the same at the end of the window as at its
   start (two dumps, ``window`` apart).

Ranks that finished count as waiting for the others. A rank that sleeps, reads a file or
waits on anything but a peer breaks condition 2, so a parameter server whose workers sleep,
or a pipeline stage waiting for a busy neighbour, is never called deadlocked. What the
detector cannot see: a hang inside a GPU kernel (NCCL), where the CPU thread keeps polling
or has not blocked yet; the launch timeout remains the backstop for those.

The wait journal, rank side: the rank server wraps the ``torch.distributed`` calls that can
block (``install_journal``); while one runs, the rank's journal (a small memory-mapped file)
says what it is: "recv from rank 1", "all_reduce of 4 float32 on group [1, 2, 3]". Async
calls are remembered with their ``Work``, and ``Work.wait`` journals "wait for isend to rank
1". The caller reads the journals only when the ranks have gone quiet.
"""

from __future__ import annotations

import functools
import inspect
import mmap
import os
import re
import time
import weakref
from dataclasses import dataclass

JOURNAL_BYTES = 1024
WINDOW = {"gloo": 2.0, "nccl": 10.0}  # seconds of stillness before we call it a deadlock
SAMPLE_EVERY = 0.25                    # seconds between /proc samples
IDLE_CPU_NS = 5_000_000                # CPU time per sample that still counts as asleep

# The torch.distributed calls that can block, and the names of their peer argument.
P2P = {"send": "dst", "recv": "src", "isend": "dst", "irecv": "src",
       "send_object_list": "dst", "recv_object_list": "src"}
COLLECTIVES = ["broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor",
               "all_gather_single", "reduce_scatter", "reduce_scatter_tensor",
               "reduce_scatter_single", "all_to_all", "all_to_all_single", "gather", "scatter",
               "barrier", "monitored_barrier", "all_gather_object", "broadcast_object_list",
               "gather_object", "scatter_object_list", "all_reduce_coalesced",
               "all_gather_coalesced"]
ALWAYS_ASYNC = {"isend", "irecv", "batch_isend_irecv"}


# ----------------------------------------------------------------------------- rank side


class _Journal:
    """What this rank is blocked in right now, in a memory-mapped file the caller can read."""

    def __init__(self):
        self.map: mmap.mmap | None = None
        self.current = ""
        self.pending: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Work -> what

    def open(self, path: str) -> None:
        with open(path, "wb") as f:
            f.write(b"\0" * JOURNAL_BYTES)
        with open(path, "r+b") as f:
            self.map = mmap.mmap(f.fileno(), JOURNAL_BYTES)

    def write(self, text: str) -> None:
        self.current = text
        if self.map is not None:
            data = text.encode()[: JOURNAL_BYTES - 1] + b"\0"
            self.map[: len(data)] = data

    def waiting(self, what: str, call, *args, **kwargs):
        if self.current:  # nested (recv waits on its own irecv): the outer call is what the user wrote
            return call(*args, **kwargs)
        self.write(what)
        try:
            return call(*args, **kwargs)
        finally:
            self.write("")


JOURNAL = _Journal()


def install_journal() -> None:
    """Wrap the blocking calls of ``torch.distributed`` (once, in the rank server)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    for name in [*P2P, *COLLECTIVES, "batch_isend_irecv"]:
        fn = getattr(c10d, name, None)
        if fn is not None and not hasattr(fn, "_labkit_journal"):
            # Both namespaces: c10d checks identities (P2POp(dist.isend, ...) must be its isend).
            wrapped = _journaled(name, fn)
            setattr(c10d, name, wrapped)
            if getattr(dist, name, None) is fn:
                setattr(dist, name, wrapped)
    wait = dist.Work.wait
    if not hasattr(wait, "_labkit_journal"):
        def journaled_wait(work, *args, **kwargs):
            what = JOURNAL.pending.get(work, "an async operation")
            return JOURNAL.waiting(f"wait for {what}", wait, work, *args, **kwargs)
        journaled_wait._labkit_journal = True
        dist.Work.wait = journaled_wait


def open_journal(path: str) -> None:
    """Start journaling this rank's waits into ``path`` (in the forked rank)."""
    JOURNAL.open(path)


def _journaled(name: str, fn):
    params = list(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = dict(zip(params, args), **kwargs)
        what = _describe(name, bound)
        if name in ALWAYS_ASYNC or bound.get("async_op"):
            work = fn(*args, **kwargs)
            for w in work if isinstance(work, list) else [work]:
                if w is not None:
                    JOURNAL.pending[w] = what
            return work
        return JOURNAL.waiting(what, fn, *args, **kwargs)

    wrapper._labkit_journal = True
    return wrapper


def _describe(name: str, bound: dict) -> str:
    """'recv from rank 1', 'all_reduce of (4,) float32 on group [1, 2, 3]', ..."""
    if name == "batch_isend_irecv":
        ops = bound.get("p2p_op_list") or []
        parts = [f"{'isend to' if 'send' in op.op.__name__ else 'irecv from'} rank {op.peer}" for op in ops]
        return "batch_isend_irecv(" + ", ".join(parts) + ")"
    text = name
    if name in P2P:
        key = P2P[name]
        peer, group_peer = bound.get(key), bound.get(f"group_{key}")
        direction = "to" if key == "dst" else "from"
        if peer is not None:
            text += f" {direction} rank {peer}"
        elif group_peer is not None:
            text += f" {direction} group rank {group_peer}"
        else:
            text += f" {direction} any rank"
    for value in bound.values():  # the first tensor argument: its shape and dtype
        shape = _shape(value)
        if shape:
            text += f" of {shape}"
            break
    group = bound.get("group")
    if group is not None:
        text += f" on group {_group_ranks(group)}"
    return text


def _shape(value) -> str:
    import torch
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        value = value[0]
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    return ""


@functools.lru_cache(maxsize=64)
def _ranks_of(group_id: int, group) -> str:
    import torch.distributed as dist
    try:
        return str(dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 - a description must never break the call it describes
        return "?"


def _group_ranks(group) -> str:
    import torch.distributed as dist
    if group is dist.group.WORLD:
        return "WORLD"
    try:
        return _ranks_of(id(group), group)
    except TypeError:  # not hashable
        return "?"


# ----------------------------------------------------------------------------- caller side


@dataclass
class Snapshot:
    """One rank at one moment, as the detector saw it."""
    rank: int
    finished: bool
    journal: str = ""
    stack: str = ""

    @property
    def frames(self) -> list[tuple[str, int, str]]:
        """(file, line, function) of the stack, innermost first; the communication tracer's
        own wrapper (``Work.wait`` seen through ``labkit.comm``) is left out."""
        return [(f, int(n), fn) for f, n, fn in FRAME.findall(self.stack) if not f.endswith(TRACER_FILE)]

    @property
    def in_communication(self) -> bool:
        if self.finished or self.journal:
            return True
        frames = self.frames
        return bool(frames) and "/torch/distributed/" in frames[0][0]

    @property
    def where(self) -> str:
        """file:line of the innermost frame outside torch: the learner's line."""
        for file, line, _ in self.frames:
            if "/torch/" not in file:
                return location(file, line)
        return "?"

    @property
    def wait(self) -> str:
        if self.finished:
            return "finished, waiting for the others"
        if self.journal:
            return self.journal
        torch_frames = [fn for f, _, fn in self.frames if "/torch/distributed/" in f and fn != "wrapper"]
        return torch_frames[-1] if torch_frames else "an unknown call"

    def describe(self) -> str:
        if self.finished:
            return f"rank {self.rank} finished and waits for the others"
        return f"rank {self.rank} waits in {self.wait} at {self.where}"


FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')
TRACER_FILE = os.path.join("labkit", "comm.py")  # wraps Work.wait while tracing: never the learner's line
NOTEBOOK_CELL = re.compile(r"/ipykernel_\d+/\d+\.py$")  # where IPython keeps a cell's code


def location(file: str, line: int) -> str:
    """'collectives.py:85', or 'a notebook cell, line 10' for code defined in a cell."""
    if NOTEBOOK_CELL.search(file):
        return f"line {line} of a notebook cell"
    return f"{os.path.basename(file)}:{line}"


def cpu_ns(pid: int) -> tuple[int, bool] | None:
    """(CPU nanoseconds used by all of ``pid``'s threads, whether any thread is runnable);
    None if the process is gone."""
    total, runnable = 0, False
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                runnable |= f.read().rsplit(") ", 1)[1][0] == "R"
        except (OSError, IndexError, ValueError):
            continue  # the thread just ended
    return total, runnable


def read_journal(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(JOURNAL_BYTES).split(b"\0", 1)[0].decode(errors="replace")
    except OSError:
        return ""


class Detector:
    """Fed the live ranks every supervision tick; says when they are deadlocked.

    ``ranks``: objects with ``rank``, ``pid``, ``finished()``, ``journal_path``;
    ``dump_stacks(ranks) -> {rank: stack}`` asks ranks for their Python stacks.
    """

    def __init__(self, ranks, dump_stacks, backend: str = "gloo"):
        self.ranks, self.dump_stacks = ranks, dump_stacks
        self.window = WINDOW.get(backend, WINDOW["nccl"])
        self.last_sample = 0.0
        self.last_cpu: dict[int, int] = {}
        self.last_runnable: dict[int, bool] = {}
        self.quiet_since: float | None = None
        self.first: list[Snapshot] | None = None

    def check(self, now: float | None = None) -> list[Snapshot] | None:
        """The deadlocked ranks' snapshots, or None (not deadlocked, or not sure yet)."""
        now = time.monotonic() if now is None else now
        if now - self.last_sample < SAMPLE_EVERY:
            return None
        self.last_sample = now
        if not self._all_asleep():
            self.quiet_since, self.first = None, None
            return None
        if self.quiet_since is None:
            self.quiet_since, self.first = now, self._snapshots()
            return None
        if now - self.quiet_since < self.window:
            return None
        second = self._snapshots()
        if second == self.first and all(s.in_communication for s in second) \
                and not all(s.finished for s in second):
            return second
        self.quiet_since, self.first = now, second  # still, but not (yet) a deadlock
        return None

    def _all_asleep(self) -> bool:
        """No unfinished rank used CPU since the last sample, nor has had a runnable thread at
        this sample and the one before. (One runnable sighting alone is not progress: a thread
        that wakes for a moment, a timer or a watchdog, waits in the run queue for a while on a
        busy machine. A rank starved of CPU mid-computation stays runnable, sample after sample.)"""
        asleep = True
        for r in self.ranks:
            if r.finished():
                continue
            sample = cpu_ns(r.pid)
            if sample is None:
                return False  # exiting: the supervisor reports that
            used, runnable = sample
            previous = self.last_cpu.get(r.rank)
            was_runnable = self.last_runnable.get(r.rank, True)
            self.last_cpu[r.rank], self.last_runnable[r.rank] = used, runnable
            if previous is None or used - previous > IDLE_CPU_NS or (runnable and was_runnable):
                asleep = False
        return asleep

    def _snapshots(self) -> list[Snapshot]:
        waiting = [r for r in self.ranks if not r.finished()]
        stacks = self.dump_stacks(waiting) if waiting else {}
        for r in waiting:  # writing the stack cost the rank CPU time: that is not progress
            sample = cpu_ns(r.pid)
            if sample is not None:
                self.last_cpu[r.rank] = sample[0]
        return [Snapshot(r.rank, r.finished(), read_journal(r.journal_path), stacks.get(r.rank, ""))
                for r in self.ranks]


def diagnosis(snapshots: list[Snapshot], elapsed: float) -> str:
    """The one-line verdict, then a line if the ranks wait in different calls."""
    line = f"deadlock after {elapsed:.1f} s: " + "; ".join(s.describe() for s in snapshots)
    calls = {_call_name(s.wait) for s in snapshots if not s.finished}
    kinds = {s.wait for s in snapshots if not s.finished}
    if len(calls) > 1 or (len(kinds) > 1 and all(_is_collective(s.wait) for s in snapshots if not s.finished)):
        line += "\nthe ranks disagree: they wait in different calls, which can never match up"
    finished = [s.rank for s in snapshots if s.finished]
    if finished and any(_is_collective(s.wait) for s in snapshots if not s.finished):
        line += (f"\nrank(s) {finished} returned without joining the collective the others wait in")
    return line


def _call_name(wait: str) -> str:
    return wait.split(" ", 1)[0].split("(", 1)[0]


def _is_collective(wait: str) -> bool:
    return _call_name(wait) in COLLECTIVES
