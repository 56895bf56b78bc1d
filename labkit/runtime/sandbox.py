"""The launcher's side of the judge (``labkit.course.judge``): what a rank hands back is plain
data, and, when the judge runs as root, the ranks run as another user.

Set by the judge in the environment of its pytest process (never on a command line):

* ``LABKIT_JUDGE=1``: every rank's result travels as ``torch.save`` of ``{"nonce", "value"}``
  and is read with ``torch.load(weights_only=True)`` (tensors, numbers, strings, lists, dicts,
  and classes of the test modules: nothing else is constructed); the nonce is a fresh random
  token per rank and launch, in the rank's spec file, which the rank deletes before any
  submitted code runs. A result without it, or that does not load as plain data, fails the
  test and is flagged. Error reports are JSON, checked field by field (never unpickled).
* ``LABKIT_JUDGE_USER=<name>`` (only honoured as root): each rank drops to that user right
  after the rank server forks it (the rank server itself, which imports no submission, stays
  root); the run directory is handed to that user; when a launch ends every process of that
  user is killed (a detached grandchild included), before anything reads the outcome.

Without root the ranks run as the grader's own user: see README ("Autograding") for what is
then not isolated.
"""

from __future__ import annotations

import importlib
import json
import os
import secrets
import signal
import sys
import time

JUDGE_ENV = "LABKIT_JUDGE"
USER_ENV = "LABKIT_JUDGE_USER"
FLAG = "flagged for the instructor:"  # the autograder lists every test whose output has it


# The course's tools, whose classes a rank may return (never an exercise module's: its code).
TOOL_MODULES = ("labkit.comm", "labkit.memory", "labkit.models", "labkit.budget", "labkit.check",
                "labkit.data", "labkit.timing", "labkit.trees", "labkit.oracles")


NUMPY_REBUILD = ("numpy.core.multiarray.scalar", "numpy._core.multiarray.scalar",
                 "numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct")


class Tampered(RuntimeError):
    """What a rank handed back is not what the launcher's own code writes."""


def judging() -> bool:
    return os.environ.get(JUDGE_ENV) == "1"


def new_nonce() -> str:
    return secrets.token_hex(16) if judging() else ""


def student() -> tuple[int, int] | None:
    """(uid, gid) of the user the ranks run as, when the judge runs as root; else None."""
    name = os.environ.get(USER_ENV)
    if not (judging() and name and os.geteuid() == 0):
        return None
    import pwd
    entry = pwd.getpwnam(name)
    return entry.pw_uid, entry.pw_gid


def unreadable_by(uid: int, gid: int, paths: list[str]) -> list[str]:
    """Which of ``paths`` (those that exist) user ``uid`` cannot read, checked as that user in a
    forked child: a folder under a 0700 parent (pytest's tmp, /root) is unreadable too."""
    paths = [p for p in dict.fromkeys(paths) if p and os.path.exists(p)]
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            os.write(write_end, json.dumps([p for p in paths if not os.access(p, os.R_OK)]).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        answer = pipe.read()
    os.waitpid(pid, 0)
    return json.loads(answer) if answer else list(paths)


def check_student_can_run() -> None:
    """Before any rank starts: a rank drops to the student's user after it is forked (Python and
    torch already loaded), then imports the course's modules, the submission among them. That
    user must read the folder ``labkit`` lives in, or every rank dies at that import."""
    ids = student()
    if ids is None:
        return
    course = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../labkit
    if unreadable_by(*ids, [course]):
        raise PermissionError(
            f"the ranks run as user {os.environ[USER_ENV]!r} (LABKIT_JUDGE_USER), which cannot read "
            f"{course}: put the course where that user can read it (not under /root or a 0700 "
            "folder), or unset LABKIT_JUDGE_USER")


def hand_over(rundir: str) -> None:
    ids = student()
    if ids is not None:
        os.chown(rundir, *ids)


def become_student() -> None:
    """In a freshly forked rank: drop root for good (real, effective and saved ids)."""
    ids = student()
    if ids is None:
        return
    uid, gid = ids
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    os.environ["HOME"] = "/tmp"


def kill_student(wait: float = 5.0) -> None:
    """Kill every process of the student's user; return once none is left (or ``wait`` passed)."""
    ids = student()
    if ids is None:
        return
    uid, gid = ids
    end = time.monotonic() + wait
    while True:
        pid = os.fork()
        if pid == 0:  # as that user, kill(-1) reaches exactly its processes
            try:
                os.setgroups([])
                os.setgid(gid)
                os.setuid(uid)
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        if not processes_of(uid) or time.monotonic() > end:
            return
        time.sleep(0.02)


def adopt_orphans() -> None:
    """Under the judge, this process becomes the subreaper of everything it starts: a rank's
    detached grandchild (double fork + setsid) is reparented here, not to init, so
    ``kill_strays`` finds it, with or without root."""
    if judging() and sys.platform.startswith("linux"):
        import ctypes
        PR_SET_CHILD_SUBREAPER = 36
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)


def after_launch(keep: set[int]) -> None:
    """Under the judge, when a launch ends: kill the student's user's processes (as root) and
    every other descendant of this process except ``keep`` (the rank server)."""
    if not judging():
        return
    kill_student()
    end = time.monotonic() + 5.0
    while time.monotonic() < end:
        strays = [p for p in _descendants(os.getpid()) if p not in keep]
        if not strays:
            return
        for pid in strays:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.02)


def _parents() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) of every process."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                found[int(entry)] = (int(fields[1]), fields[0])
            except (OSError, IndexError, ValueError):
                pass
    return found


def _descendants(root: int) -> list[int]:
    """Live (not zombie) descendants of ``root``, and of its threads' children."""
    table = _parents()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if table[pid][1] != "Z":
            found.append(pid)
        todo += children.get(pid, [])
    return found


def processes_of(uid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                status = f.read()
        except OSError:
            continue
        uids = next((line.split()[1:] for line in status.splitlines() if line.startswith("Uid:")), [])
        state = next((line.split()[1] for line in status.splitlines() if line.startswith("State:")), "")
        if str(uid) in uids and state != "Z":
            found.append(int(entry))
    return found


# ----------------------------------------------------------------------------- results


def save_result(path: str, nonce: str, value) -> None:
    import torch
    torch.save({"nonce": nonce, "value": value}, path + ".tmp")
    os.replace(path + ".tmp", path)


def load_result(path: str, rank: int, nonce: str):
    """The value rank ``rank`` returned, read as plain data; Tampered unless it carries ``nonce``."""
    import torch
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        allowed = [_trusted_class(name, rank) for name in unsafe]
        if any(name.startswith("numpy.") for name in unsafe):  # a dtype's class is built, not named
            import numpy
            allowed += [c for c in vars(numpy.dtypes).values() if isinstance(c, type)]
        with torch.serialization.safe_globals(allowed):
            data = torch.load(path, weights_only=True)
    except Tampered:
        raise
    except Exception as error:  # noqa: BLE001 - anything that is not our own file
        raise Tampered(f"rank {rank}'s result does not load as plain data ({type(error).__name__}: "
                       f"{str(error)[:300]}); {FLAG} a result file the launcher did not write") from None
    if not isinstance(data, dict) or set(data) != {"nonce", "value"} or data["nonce"] != nonce:
        raise Tampered(f"rank {rank}'s result was not written by the launcher's own code (no valid "
                       f"token); {FLAG} a forged result file")
    return data["value"]


def _trusted_class(name: str, rank: int):
    """A class a result may hold: one defined by the tests or the course's tools, never by an
    exercise module (a submission's class would run its code in the judge)."""
    module, _, attr = name.rpartition(".")
    ok = (module.split(".")[0] == "tests" or module in TOOL_MODULES or module == "numpy.dtypes"
          or name in ("types.SimpleNamespace", "collections.defaultdict", "collections.Counter", "numpy.dtype",
                      "numpy.ndarray"))
    if name in NUMPY_REBUILD:  # numpy's own rebuilders of arrays and scalars (torch's docs allow them)
        return getattr(importlib.import_module(module), attr)
    obj = getattr(sys.modules.get(module) or importlib.import_module(module), attr, None) if ok else None
    if not isinstance(obj, type):
        raise Tampered(f"rank {rank} returned a {name}, which the judge does not construct "
                       f"(only tensors, numbers, strings, containers and the tests' own classes)")
    return obj


def write_json(path: str, obj: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


_ERROR_FIELDS = {"rank": int, "time": (int, float), "exc_type": str, "message": str, "traceback": str}


def read_error(path: str, rank: int) -> dict | None:
    """A rank's error report, checked field by field; None when it wrote none. A report that is
    not what the worker writes counts as the rank's failure, and is flagged."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            report = json.load(f)
        good = (isinstance(report, dict) and set(report) == set(_ERROR_FIELDS) and report["rank"] == rank
                and all(isinstance(report[k], t) for k, t in _ERROR_FIELDS.items()))
    except (OSError, ValueError):
        good = False
    if good:
        return report
    return dict(rank=rank, time=os.path.getmtime(path), exc_type="Tampered",
                message=f"the rank's error report is not what the launcher's worker writes; {FLAG} "
                        "a forged error file", traceback="")
