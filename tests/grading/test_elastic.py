"""Graded tests for chapter 09: fault tolerance (labkit/elastic.py).

Every task is certified by its technique, not only by its numbers:

* elastic.state: what the state holds (every piece of the model and optimizer, both RNGs,
  a copy of the progress) and that training continues exactly after restore_state, twice from
  the same state; no communication. Besides the listed case, drawn ones (a new seed each run):
  the optimizer (AdamW, SGD with momentum, Adam with AMSGrad: other state keys), the steps
  before and after the capture, the progress, and a restore into a fresh model and optimizer.
* elastic.save: faults injected from outside the learner's code (``CrashImages``): the
  file-system calls of a save are wrapped and, at every one of them, the disk is imaged as a
  crash there would leave it (and every file written, as a crash halfway through it would);
  every image must hold the previous checkpoint or the new one complete, and be what
  latest_checkpoint/load_checkpoint find. A save restarted over a crashed one's leftovers
  must succeed. Its communication is exactly gather_object's (an all-gather of the N object
  sizes, one gather of the small digest and piece index to rank 0) and two barriers. Drawn
  runs of saves (a new seed each run): ``keep`` from 1 to 3, step numbers with drawn gaps, a
  root that does not exist yet given as a str or a Path; the root holds the ``keep`` newest.
* elastic.load: damaged, foreign and half-written checkpoints are refused by name (also by
  latest_checkpoint, which skips them); a checkpoint saved at world size 2 loads at 1, 3
  and 4 and training continues on the same loss curve (float64 tolerance); the same state
  as a torch.distributed.checkpoint (DCP) checkpoint of fully_shard; loading communicates
  nothing (each rank reads the rows it needs).
* elastic.resume: a rank (drawn from the run's seed) SIGKILLed before a drawn step after the
  first checkpoint (after the second in the four-rank run, so that two are there) and ``launch(...,
  max_restarts=1)`` end with the same losses and the same final checkpoint, bit for bit, as
  an uninterrupted run (FSDP and ZeRO from chapters 03-04, float64); the final progress is
  the run's; besides training's own communication, a run issues one all-reduce of the loss
  per step it trains and one save's ops per checkpoint it writes, from the checkpoint's step
  on.
"""

import contextlib
import functools
import hashlib
import io
import json
import os
import pickle
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from labkit.check import assert_close
from labkit.comm import CommTracer, Op, assert_ops
from labkit.course.grading import run_graded, task
from tests.grading import configs

STEPS = 6
BATCH = 12  # global batch: divides by 1, 2, 3 and 4


def gpt_config():
    from labkit.models import GPTConfig
    return GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


@functools.cache
def tokens():
    from labkit.data import markov_tokens
    return markov_tokens(STEPS * BATCH * 2, 8, 32, seed=9)


def my_batch(step):
    rank, n = dist.get_rank(), dist.get_world_size()
    x, y = tokens()
    share = BATCH // n
    first = step * BATCH + rank * share
    return x[first:first + share], y[first:first + share]


OPTIMIZERS = {  # name -> (class, options): each keeps other state (AMSGrad a third moment)
    "AdamW": (torch.optim.AdamW, dict(lr=1e-2)),
    "SGD with momentum": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9)),
    "Adam with AMSGrad": (torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
}


def build(kind: str, optimizer: str = "AdamW"):
    """(model, optimizer) for this rank: the GPT under the learner's FSDP (per block + root),
    or replicated with the learner's ZeRO-2 optimizer (which averages the gradients)."""
    from labkit.fsdp import fully_shard
    from labkit.models import GPT
    from labkit.zero import ShardedOptimizer
    torch.set_num_threads(1)
    model = GPT(gpt_config()).double()
    cls, options = OPTIMIZERS[optimizer]
    if kind == "fsdp":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model, cls(param_groups(model), **options)
    return model, ShardedOptimizer(param_groups(model), cls, shard_gradients=True, **options)


def param_groups(model) -> list[dict]:
    """Two groups with their own options: matrices (weight decay 0.1), biases and LayerNorms
    (another lr, no decay); ``train_steps`` decays every group's lr each step (a schedule), so the
    options are state too: a resume that rebuilds them from the constructor drifts."""
    return [dict(params=[p for p in model.parameters() if p.dim() > 1], weight_decay=0.1),
            dict(params=[p for p in model.parameters() if p.dim() <= 1], lr=3e-2, weight_decay=0.0)]


def gpt_loss(model, x, y):
    return model(x, y)[1]


def train_steps(model, opt, first: int, count: int) -> list[float]:
    """``count`` steps from global step ``first``; the global-batch losses (all ranks' mean)."""
    losses = []
    for step in range(first, first + count):
        loss = gpt_loss(model, *my_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        for group in opt.param_groups:  # an LR schedule: the options change as training goes
            group["lr"] *= 0.8
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / dist.get_world_size())
    return losses


def step_name(step: int) -> str:
    return f"step_{step:08d}"


# ----------------------------------------------------------------------------- signatures


def no_communication(events, what: str) -> None:
    assert_ops(events, [], what)


def save_ops(events, rank: int, n: int, state: dict | None, what: str, saves: int = 1) -> None:
    """The communication of ``saves`` saves (chapter 09, save_checkpoint steps 2 and 4):
    per save, ``dist.gather_object`` of this rank's (file, digest, piece index) to rank 0,
    which is an all-gather of the N pickled sizes (N int64: N x 8 B) and one gather of the
    largest pickled object M (M B from each rank, N x M B arriving at rank 0); one barrier
    once a crashed save's leftover staging directory is cleared, and one at the end, so
    that no rank goes on before the checkpoint exists. Nothing else.

    M is a pickled object whose size no formula fixes; it is taken from the trace, after
    checking that it is the metadata the chapter sends (at most 3 times the pickled
    digest and index of this rank's ``state``), not the tensors."""
    sizes = torch.empty((), dtype=torch.long).element_size() * n
    gathers = [e for e in events if e.kind == "gather"]
    if state is not None:
        index = {f"{section}/{name}": (list(p.shape), p.start, len(p.tensor) if p.tensor.dim() else 0)
                 for section in ("model", "optimizer") for name, p in state[section].items()}
        digest = dict(bytes=10 ** 6, sha256="0" * 64)
        metadata = len(pickle.dumps((f"rank{rank}.pt", digest, index)))
        tensors = sum(p.tensor.numel() * p.tensor.element_size()
                      for section in ("model", "optimizer") for p in state[section].values())
        for e in gathers:
            each = e.bytes // n if rank == 0 else e.bytes
            assert each <= 3 * metadata + 1024, (
                f"{what}: rank {rank} gathered {each} B per rank to rank 0, but this rank's digest "
                f"and piece index pickle to about {metadata} B (its tensors are {tensors} B): "
                "send rank 0 the metadata, not the state; every rank writes its own file")
    expected = []
    for k in range(saves):
        m = gathers[k].bytes if k < len(gathers) else (gathers[0].bytes if gathers else 0)
        expected += [Op("all_gather", sizes), Op("gather", m), Op("barrier", 0), Op("barrier", 0)]
    assert_ops(events, expected, what)


# ----------------------------------------------------------------------------- elastic.state


def state_on_rank(kind: str, run_seed: int):
    """The listed case (AdamW, capture after two steps, restore into the model that went on),
    then drawn ones (``draw_state``)."""
    check_state(kind, dict(optimizer="AdamW", before=2, after=2, fresh=False, step=2, epoch=1,
                           position=2 * BATCH, history=[]), f"elastic.state: {kind}")
    draw = configs.stream(run_seed, f"elastic.state/{kind}")
    first = draw.randrange(len(OPTIMIZERS))
    for case in range(2):
        c = draw_state(draw, case, first)
        check_state(kind, c, f"elastic.state: {kind}, drawn: {c} [LABKIT_SEED={run_seed} replays it]")


def draw_state(draw: random.Random, case: int, first: int) -> dict:
    """An optimizer (its state keys differ), the steps trained before the capture and after it,
    the progress (any step, epoch, position and earlier losses), and where the state is restored:
    the model that trained on, or a fresh model and optimizer (a new process's resume). The two
    cases of a launch take two different optimizers (so one is not AdamW) and restore into one
    of each."""
    before = draw.randint(1, 3)
    names = sorted(OPTIMIZERS)
    return dict(optimizer=names[(first + case) % len(names)], before=before, after=draw.randint(1, 3),
                fresh=(case + draw.randrange(2)) % 2 == 1, step=before + draw.randrange(50),
                epoch=draw.randrange(5), position=draw.randrange(1000),
                history=[round(draw.uniform(0, 5), 3) for _ in range(draw.randrange(4))])


def options_of(opt) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def check_state(kind: str, c: dict, what: str) -> None:
    from labkit.elastic import Progress, capture_state, model_pieces, optimizer_pieces, restore_state
    what = f"{what}: rank {dist.get_rank()}"
    model, opt = build(kind, c["optimizer"])
    losses = c["history"] + train_steps(model, opt, 0, c["before"])
    progress = Progress(step=c["step"], epoch=c["epoch"], position=c["position"], losses=list(losses))
    with CommTracer() as captured:
        state = capture_state(model, opt, progress)
    for key in ("model", "optimizer", "progress", "rng"):
        assert key in state, f"{what}: capture_state's state has no {key!r} (it has {sorted(state)})"
    for section, pieces in (("model", model_pieces(model)), ("optimizer", optimizer_pieces(opt, model))):
        held = state[section]
        assert set(held) == set(pieces), \
            f"{what}: state[{section!r}] holds {sorted(held)[:4]}...; expected every piece {sorted(pieces)[:4]}..."
        for name, piece in pieces.items():
            assert torch.equal(held[name].tensor, piece.tensor), \
                f"{what}: state[{section!r}][{name!r}] is not this rank's piece at capture time"
    assert set(state["rng"]) >= {"torch", "python"}, \
        f"{what}: state['rng'] holds {sorted(state['rng'])}; both RNG states (torch, python) are needed"
    state_options = options_of(opt)
    progress.losses.append(99.0)  # the caller's run goes on: the captured state may not
    progress.step = 99
    draw = (torch.rand(3), random.random())
    first_run = train_steps(model, opt, c["before"], c["after"])
    options = options_of(opt)
    if c["fresh"]:
        model, opt = build(kind, c["optimizer"])  # a new process: its own init, no optimizer state yet
    captured_progress = (c["step"], c["epoch"], c["position"], losses)
    events = captured.events
    for attempt in ("restored", "restored again from the same state (the first resume's run went on)"):
        with CommTracer() as restored:
            back = restore_state(state, model, opt)
        events = events + restored.events
        now = options_of(opt)
        assert now == state_options and [g["lr"] for g in now] != [g["lr"] for g in options], \
            (f"{what}: {attempt}: the param groups' options are {now}; at capture they were {state_options} "
             "(an LR schedule changed them since: capture and restore every group's options)")
        got = (back.step, back.epoch, back.position, back.losses)
        assert got == captured_progress, \
            (f"{what}: {attempt}: progress (step, epoch, position, losses) = {got}, captured "
             f"{captured_progress} (copy the loss list: the run appends to its own)")
        again = (torch.rand(3), random.random())
        assert torch.equal(draw[0], again[0]), f"{what}: {attempt}: the torch RNG state was not restored"
        assert draw[1] == again[1], f"{what}: {attempt}: the python RNG state (random) was not restored"
        second_run = train_steps(model, opt, c["before"], c["after"])
        assert first_run == second_run, \
            f"{what}: {attempt}: the next steps give {second_run}, not {first_run}"
        back.losses.append(98.0)  # the resumed run goes on: the state it came from may not
        back.step += 1
    no_communication(events, f"{what}: capture_state and restore_state are local (no communication)")


@task("elastic.state", points=2)
@pytest.mark.parametrize("kind", ["fsdp", "zero"])
def test_capture_and_restore_continue_exactly(kind):
    run_graded("elastic.state", state_on_rank, 2, kind, configs.announce("elastic.state"))



# ----------------------------------------------------------------------------- elastic.save


class CrashImages:
    """Crashes injected from outside the learner's code, at every file-system step of a save.

    While active, every file-system call a save can make on the thread that saves is
    wrapped: ``open`` for writing (builtins, io, os, ``Path.open``), ``os.replace/rename/
    renames/link/symlink/remove/unlink/rmdir/removedirs/mkdir/makedirs/truncate/fsync/
    fdatasync``, ``shutil.move/copy/copy2/copyfile/copytree/rmtree``, ``Path.write_bytes/
    write_text/touch/unlink/rmdir/rename/replace/mkdir/hardlink_to/symlink_to`` and
    ``torch.save`` (also where ``labkit.elastic`` imported them by name). Before each call,
    the rank copies ``root`` as it is on disk: the image that a crash there (SIGKILL of the
    rank, os._exit, a power cut) leaves behind, which is what a crash at the k-th call for
    every k would leave, from one save. After each file it writes, the same with that file
    cut in half: a crash halfway through writing it. A call made inside a single operation
    (the ``open`` inside ``Path.write_text``) is part of it; the calls inside a composite one
    (each file of ``shutil.copytree``, each deletion of ``rmtree``, each directory of
    ``makedirs``) are steps of their own, since a crash can fall between them. Every rank
    does this for its own calls, under one lock shared by the ranks, so an image is a state
    the disk really passed through. An image that equals the previous one is not kept.

    Judged afterwards (``judge_image``): an atomic save leaves, in every image, the previous
    checkpoint or the new one complete, and that is what latest_checkpoint/load_checkpoint
    find; a save written in place, moved file by file, copied, or renamed before its
    metadata is in leaves a torn checkpoint directory in some image, whatever calls it makes
    and whatever crash hooks of its own it has.
    """

    OPS = ("replace", "rename", "link", "symlink", "remove", "unlink", "rmdir", "mkdir", "truncate",
           "fsync", "fdatasync")
    COMPOSITES = ("makedirs", "renames", "removedirs")
    SHUTIL = ("move", "copy", "copy2", "copyfile", "copytree", "rmtree")
    PATH_OPS = ("touch", "unlink", "rmdir", "rename", "replace", "hardlink_to", "symlink_to")
    WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def __init__(self, root, images, lock):
        self.root = os.path.abspath(root)
        self.images = Path(images)
        self.lock_path = str(lock)
        self.rank = dist.get_rank()
        self.thread = None              # the thread that saves: other threads' calls pass through
        self.stack: list[str] = []      # kinds of the wrapped calls in progress
        self.busy = False               # copying an image: our own calls pass straight through
        self.steps: list[str] = []      # what each file-system step was
        self.shots: list[tuple] = []    # (image dir, step number, description, torn file or None)
        self.pending: list[str] = []    # files opened for writing by the last step: torn next
        self.saved: list[tuple] = []
        self.listing = None

    # -- patching

    def _targets(self):
        import builtins
        import io
        import pathlib
        import shutil
        P = pathlib.Path
        yield builtins, "open", "open", "open"
        yield io, "open", "open", "open"
        yield os, "open", "os_open", "os.open"
        for name in self.OPS:
            if hasattr(os, name):
                yield os, name, "op", f"os.{name}"
        for name in self.COMPOSITES:
            yield os, name, "composite", f"os.{name}"
        for name in self.SHUTIL:
            yield shutil, name, "composite", f"shutil.{name}"
        yield P, "write_bytes", "write", "Path.write_bytes"
        yield P, "write_text", "write", "Path.write_text"
        yield P, "open", "open", "Path.open"
        yield P, "mkdir", "composite", "Path.mkdir"
        for name in self.PATH_OPS:
            yield P, name, "op", f"Path.{name}"
        yield torch, "save", "save", "torch.save"
        yield torch.serialization, "save", "save", "torch.save"

    def __enter__(self):
        import threading
        import labkit.elastic as elastic
        self.thread = threading.get_ident()
        self.images.mkdir(parents=True, exist_ok=True)
        self.lock = open(self.lock_path, "a")
        originals = {}
        for owner, name, kind, label in self._targets():
            original = owner.__dict__.get(name, getattr(owner, name)) if isinstance(owner, type) \
                else getattr(owner, name)
            wrapper = originals.get(id(original), (None, None))[1] or self._wrap(original, kind, label)
            originals[id(original)] = (original, wrapper)
            self.saved.append((owner, name, original))
            setattr(owner, name, wrapper)
        for name, value in list(vars(elastic).items()):  # `from os import replace` and the like
            if id(value) in originals and originals[id(value)][0] is value:
                self.saved.append((elastic, name, value))
                setattr(elastic, name, originals[id(value)][1])
        return self

    def __exit__(self, *exc):
        try:
            with self._locked():
                self._flush_pending()
        finally:
            for owner, name, original in reversed(self.saved):
                setattr(owner, name, original)
            self.lock.close()

    def _wrap(self, original, kind, label):
        harness = self

        def wrapper(*args, **kwargs):
            return harness._call(original, kind, label, args, kwargs)
        wrapper.__name__ = getattr(original, "__name__", label)
        return wrapper

    # -- one call

    def _classify(self, kind, args, kwargs):
        """(step kind, file written) or None for a call that changes nothing on disk."""
        if kind == "open":  # open(file, mode) / Path.open(self, mode)
            file = args[0] if args else kwargs.get("file")
            mode = args[1] if len(args) > 1 else kwargs.get("mode", "r")
            if isinstance(file, int) or not any(c in str(mode) for c in "wax+"):
                return None
            return "open", os.path.abspath(file)
        if kind == "os_open":
            flags = args[1] if len(args) > 1 else kwargs.get("flags", 0)
            if not flags & self.WRITE_FLAGS:
                return None
            return ("open", os.path.abspath(args[0])) if kwargs.get("dir_fd") is None else ("op", None)
        if kind == "save":  # torch.save(obj, f): a path is written here; a file object was opened
            file = args[1] if len(args) > 1 else kwargs.get("f")
            return ("write", os.path.abspath(file)) if isinstance(file, (str, os.PathLike)) else None
        if kind == "write":
            return "write", os.path.abspath(args[0])
        return kind, None

    def _call(self, original, kind, label, args, kwargs):
        import threading
        mine = threading.get_ident() == self.thread and not self.busy
        step = self._classify(kind, args, kwargs) if mine else None
        if step is None or (self.stack and self.stack[-1] != "composite"):
            return original(*args, **kwargs)  # a read, or part of an operation already counted
        with self._locked():
            self._flush_pending()
            shown = [step[1]] if step[1] and kind != "os_open" else \
                [a for a in args[:2] if isinstance(a, (str, os.PathLike))]
            self.steps.append(f"{label}({', '.join(self._rel(a) for a in shown)})")
            self._image(len(self.steps), f"just before {self.steps[-1]}")
            self.stack.append(step[0])
            try:
                result = original(*args, **kwargs)
            finally:
                self.stack.pop()
            if step[0] == "write":
                self._image(len(self.steps), f"halfway through {self.steps[-1]}", torn=step[1])
            elif step[0] == "open":
                self.pending.append(step[1])
            return result

    def _locked(self):
        import contextlib
        import fcntl

        @contextlib.contextmanager
        def held():
            outer = not self.stack
            if outer:
                fcntl.flock(self.lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                if outer:
                    fcntl.flock(self.lock.fileno(), fcntl.LOCK_UN)
        return held()

    def _flush_pending(self):
        """A file opened for writing by the previous step is written by now: image it torn."""
        pending, self.pending = self.pending, []
        for file in pending:
            self._image(len(self.steps), f"halfway through writing {self._rel(file)} "
                        f"(opened by {self.steps[-1] if self.steps else '?'})", torn=file)

    def _rel(self, path) -> str:
        path = os.path.abspath(path)
        parent = os.path.dirname(self.root)
        return os.path.relpath(path, parent) if path.startswith(parent + os.sep) else os.path.basename(path)

    # -- images

    def _image(self, step: int, description: str, torn: str | None = None) -> None:
        """Copy ``root`` as it is (``torn``: with that file cut to half its bytes)."""
        if torn is not None and not (torn.startswith(self.root + os.sep) and os.path.isfile(torn)):
            return
        self.busy = True
        try:
            listing = []
            for folder, dirs, files in os.walk(self.root):
                dirs.sort()
                for name in sorted(files):
                    try:
                        info = os.stat(os.path.join(folder, name))
                    except FileNotFoundError:
                        continue
                    listing.append((os.path.relpath(os.path.join(folder, name), self.root),
                                    info.st_size, info.st_mtime_ns))
                listing.append((os.path.relpath(folder, self.root), -1, 0))
            if torn is None and listing == self.listing:
                return  # the disk has not changed since the last image: the same crash state
            self.listing = listing if torn is None else None
            target = self.images / f"{len(self.shots):03d}"
            for rel, size, _ in listing:
                source, copy = os.path.join(self.root, rel), target / rel
                if size < 0:
                    copy.mkdir(parents=True, exist_ok=True)
                    continue
                try:
                    with open(source, "rb") as f:
                        data = f.read()
                except FileNotFoundError:
                    continue
                if torn is not None and os.path.abspath(source) == torn:
                    if len(data) < 2:
                        return
                    data = data[:len(data) // 2]
                copy.parent.mkdir(parents=True, exist_ok=True)
                with open(copy, "wb") as f:
                    f.write(data)
            self.shots.append((target, step, description, torn))
        finally:
            self.busy = False


def checkpoint_problem(folder: Path, step: int, n: int, rank: int, state: dict) -> str | None:
    """Why ``folder`` is not the complete checkpoint of ``state`` at ``step`` (this rank's
    file checked piece by piece), judged by the format the chapter specifies; None if it is."""
    meta = folder / "metadata.json"
    if not meta.is_file():
        return "metadata.json is missing"
    try:
        metadata = json.loads(meta.read_text())
    except ValueError:
        return "metadata.json is torn (not valid JSON)"
    if metadata.get("step") != step or metadata.get("world_size") != n:
        return f"metadata.json says step {metadata.get('step')}, world size {metadata.get('world_size')}"
    files = metadata.get("files", {})
    if set(files) != {f"rank{r}.pt" for r in range(n)}:
        return f"metadata.json lists the files {sorted(files)}, not rank0.pt..rank{n - 1}.pt"
    for file, digest in sorted(files.items()):
        if not (folder / file).is_file():
            return f"{file} is missing"
        data = (folder / file).read_bytes()
        if digest != dict(bytes=len(data), sha256=hashlib.sha256(data).hexdigest()):
            return f"{file} has {len(data)} B, not the {digest.get('bytes')} B and SHA-256 metadata.json records"
    mine = torch.load(folder / f"rank{rank}.pt", weights_only=False)
    for section in ("model", "optimizer"):
        if set(mine[section]) != set(state[section]):
            return f"rank{rank}.pt's {section} pieces are not the state's"
        for name, piece in state[section].items():
            if not torch.equal(mine[section][name].tensor, piece.tensor):
                return f"rank{rank}.pt's {section} piece {name!r} is not the state saved"
    return None


def judge_image(image: Path, n: int, rank: int, states: dict, previous: int, new: int, model, opt,
                what: str) -> None:
    """An image of the disk after a crash: the new checkpoint complete, or else the previous
    one; and latest_checkpoint/load_checkpoint find that one."""
    from labkit.elastic import latest_checkpoint, load_checkpoint, model_pieces
    torn = checkpoint_problem(image / step_name(new), new, n, rank, states[new]) \
        if (image / step_name(new)).exists() else "absent"
    if torn != "absent" and torn is not None:
        raise AssertionError(
            f"{what} leaves {step_name(new)} torn: {torn}. A checkpoint directory may exist only "
            f"complete: write into {step_name(new)}.partial/ and rename it to {step_name(new)} once every "
            "rank's file and the metadata are in (one atomic rename)")
    holds = new if torn is None else previous
    if torn == "absent":
        gone = checkpoint_problem(image / step_name(previous), previous, n, rank, states[previous]) \
            if (image / step_name(previous)).exists() else "it is gone"
        if gone is not None:
            raise AssertionError(f"{what} leaves neither {step_name(new)} nor the previous checkpoint "
                                 f"{step_name(previous)} complete ({gone}): remove old checkpoints only after "
                                 "the new one is in place")
    with contextlib.redirect_stdout(io.StringIO()):
        found = latest_checkpoint(image)
    assert found is not None and Path(found).name == step_name(holds), \
        f"{what}: {step_name(holds)} is complete there, but latest_checkpoint returns {found}"
    progress = load_checkpoint(found, model, opt)
    loaded = model_pieces(model)
    same = all(torch.equal(loaded[k].tensor, p.tensor) for k, p in states[holds]["model"].items())
    assert progress.step == holds and same, \
        f"{what}: load_checkpoint({step_name(holds)}) does not give back the state saved at step {holds}"


def crash_everywhere_on_rank(tmp: str, run_seed: int):
    """Saves at steps 2 and 4; then the step-6 save under ``CrashImages``: every image of the
    disk it passes through is judged; then a save restarted over the leftovers of a crash, and one
    over the staging directory a crash at a larger world size left (foreign files must not slip
    in); then drawn runs of saves (``drawn_saves``)."""
    from labkit.elastic import Progress, capture_state, save_checkpoint
    rank, n = dist.get_rank(), dist.get_world_size()
    root, tmp = Path(tmp) / "ckpt", Path(tmp)
    model, opt = build("fsdp")
    states, traces = {}, []
    for step in (2, 4, 6):
        train_steps(model, opt, step - 2, 1)
        states[step] = capture_state(model, opt, Progress(step=step, position=step * BATCH))
        faults = CrashImages(root, tmp / f"images{rank}", tmp / "fs.lock") if step == 6 else contextlib.nullcontext()
        with CommTracer() as tracer, faults:
            save_checkpoint(states[step], root, step)
        traces.append(tracer)
    dist.barrier()
    fresh, fresh_opt = build("fsdp")
    total = len(faults.steps)
    assert total, (f"elastic.save: world size {n}: rank {rank}'s save made no file-system call that can be seen "
                   "(open, torch.save, os.replace, ...): write the checkpoint with Python's file API")
    for image, k, description, _ in faults.shots:
        judge_image(image, n, rank, states, 4, 6, fresh, fresh_opt,
                    f"elastic.save: world size {n}: a crash {description} (file-system step {k} of {total} "
                    f"of rank {rank}'s save at step 6)")
    left = sorted(p.name for p in root.iterdir())
    assert left == [step_name(4), step_name(6)], \
        (f"elastic.save: world size {n}: after saves at steps 2, 4 and 6 (keep=2) the checkpoint root "
         f"holds {left}; expected [{step_name(4)}, {step_name(6)}] (the new one, the newest old one, no leftovers)")
    for step in (4, 6):
        problem = checkpoint_problem(root / step_name(step), step, n, rank, states[step])
        assert problem is None, f"elastic.save: world size {n}: after the saves, {step_name(step)}: {problem}"
    # a crash left step_6.partial behind (rank 0's latest image of one); the restarted run saves again
    leftover = [None]
    if rank == 0:
        partial = [shot for shot in faults.shots
                   if shot[3] is None and any((shot[0] / f"{step_name(6)}.partial").glob("*"))]
        if partial:
            import shutil
            shutil.copytree(partial[-1][0], tmp / "restarted")
            leftover[0] = partial[-1][2]
    dist.broadcast_object_list(leftover, src=0)
    if leftover[0] is not None:
        with CommTracer() as tracer:
            save_checkpoint(states[6], tmp / "restarted", 6)
        traces.append(tracer)
        dist.barrier()
        for step in (4, 6):
            problem = checkpoint_problem(tmp / "restarted" / step_name(step), step, n, rank, states[step])
            assert problem is None, \
                (f"elastic.save: world size {n}: a crash {leftover[0]} left {step_name(6)}.partial behind; "
                 f"saving step 6 again after the restart leaves {step_name(step)} incomplete: {problem}")
    # A crash at a LARGER world size left its staging directory behind, holding files of ranks this
    # job does not have; a save of that step must start from an empty one: none may slip in.
    foreign = tmp / "foreign"
    if rank == 0:
        stale = foreign / f"{step_name(8)}.partial"
        stale.mkdir(parents=True)
        for file in (f"rank{n + 1}.pt", "metadata.json.tmp", "rank0.pt"):
            (stale / file).write_bytes(b"left by a save that died at a larger world size")
    dist.barrier()
    save_checkpoint(states[6], foreign, 8)
    dist.barrier()
    listing = sorted(p.name for p in (foreign / step_name(8)).iterdir())
    want = sorted(["metadata.json"] + [f"rank{r}.pt" for r in range(n)])
    assert listing == want and sorted(p.name for p in foreign.iterdir()) == [step_name(8)], \
        (f"elastic.save: world size {n}: saving step 8 where a crashed save at a larger world size left "
         f"{step_name(8)}.partial/ (rank{n + 1}.pt, metadata.json.tmp, rank0.pt) gives {listing} in "
         f"{step_name(8)} and {sorted(p.name for p in foreign.iterdir())} in the root; expected {want} alone: "
         f"clear a leftover staging directory before writing into it")
    problem = checkpoint_problem(foreign / step_name(8), 8, n, rank, states[6])
    assert problem is None, f"elastic.save: world size {n}: saved over a crashed save's leftovers: {problem}"
    for step, tracer in zip((2, 4, 6, "6 again after a crash"), traces):
        save_ops(tracer.events, rank, n, states[step if step in states else 6],
                 f"elastic.save: world size {n}: rank {rank}: the save at step {step}")
    # Step 6 saved again over the complete one (a job that trained on and saved under the same
    # step number): the new checkpoint replaces the old, and nothing of the old is left.
    train_steps(model, opt, 6, 1)
    again = capture_state(model, opt, Progress(step=6, position=7 * BATCH))
    with CommTracer() as tracer:
        save_checkpoint(again, root, 6)
    dist.barrier()
    left = sorted(p.name for p in root.iterdir())
    assert left == [step_name(4), step_name(6)], \
        (f"elastic.save: world size {n}: step 6 saved a second time over a complete {step_name(6)} leaves {left}; "
         f"expected [{step_name(4)}, {step_name(6)}] (the old step 6 replaced, no leftovers)")
    problem = checkpoint_problem(root / step_name(6), 6, n, rank, again)
    assert problem is None, (f"elastic.save: world size {n}: step 6 saved a second time (the state one step "
                             f"later): {step_name(6)} is not the new save: {problem}")
    save_ops(tracer.events, rank, n, again, f"elastic.save: world size {n}: rank {rank}: step 6 saved again")
    drawn_saves(tmp, run_seed, model, opt)
    return total


def drawn_saves(tmp: Path, run_seed: int, model, opt) -> None:
    """Drawn runs of saves: ``keep`` from 1 to 3 (the two runs of a launch take different values,
    so one is not the default), 2 to 4 more saves than kept at increasing step numbers with
    drawn gaps, into a root that does not exist yet, given as a str or a Path. After each save
    the root holds exactly the ``keep`` newest checkpoints, each complete, and the save returns
    its directory; the communication is one save's, every time."""
    from labkit.elastic import Progress, capture_state, save_checkpoint
    rank, n = dist.get_rank(), dist.get_world_size()
    draw = configs.stream(run_seed, "elastic.save")
    first = draw.randrange(3)
    for run in range(2):
        keep = 1 + (first + run) % 3
        steps = [0]
        for _ in range(keep + draw.randint(2, 4)):
            steps.append(steps[-1] + draw.randint(1, 40))
        steps = steps[1:]
        root = tmp / f"drawn{run}" / "nested" / "checkpoints"
        as_str = draw.random() < 0.5
        what = (f"elastic.save: world size {n}: rank {rank}: saves at steps {steps} with keep={keep} into a new "
                f"root given as {'a str' if as_str else 'a Path'} [LABKIT_SEED={run_seed} replays it]")
        states = {}
        for i, step in enumerate(steps):
            train_steps(model, opt, i % STEPS, 1)
            states[step] = capture_state(model, opt, Progress(step=step, position=draw.randrange(1000)))
            with CommTracer() as tracer:
                got = save_checkpoint(states[step], str(root) if as_str else root, step, keep=keep)
            assert Path(got) == root / step_name(step), f"{what}: the save at step {step} returned {got}, not its directory"
            newest = sorted(states)[-keep:]
            left = sorted(p.name for p in root.iterdir())
            assert left == [step_name(s) for s in newest], \
                f"{what}: after the save at step {step} the root holds {left}; expected the {keep} newest, {newest}"
            for s in newest:
                problem = checkpoint_problem(root / step_name(s), s, n, rank, states[s])
                assert problem is None, f"{what}: after the save at step {step}, {step_name(s)}: {problem}"
            save_ops(tracer.events, rank, n, states[step], f"{what}: the save at step {step}")


@task("elastic.save", points=3)
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_crash_at_any_file_system_step_leaves_a_complete_checkpoint(tmp_path, world_size):
    run_graded("elastic.save", crash_everywhere_on_rank, world_size, str(tmp_path), configs.announce("elastic.save"))


def save_then_crash(root: str, stage: str) -> None:
    """A good save at step 2, then the step-4 save with ``crash_at=stage`` (rank 0 dies in it)."""
    from labkit.elastic import Progress, capture_state, save_checkpoint
    model, opt = build("fsdp")
    for step in (2, 4):
        train_steps(model, opt, step - 2, 1)
        state = capture_state(model, opt, Progress(step=step, position=step * BATCH))
        save_checkpoint(state, root, step, crash_at=stage if step == 4 else None)


# What the step-4 staging directory holds when rank 0 dies before each stage ("write": halfway
# through writing its file), and what it must not hold yet; the step-2 checkpoint stays whole.
CRASH_LEFTOVERS = {
    "write": ({"rank0.pt.tmp"}, {"rank0.pt", "metadata.json"}),
    "metadata": ({"rank0.pt", "rank1.pt"}, {"metadata.json", "metadata.json.tmp", "rank0.pt.tmp"}),
    "rename": ({"rank0.pt", "rank1.pt", "metadata.json"}, {"rank0.pt.tmp", "metadata.json.tmp"}),
}


@task("elastic.save", points=1)
@pytest.mark.parametrize("stage", ["write", "metadata", "rename"])
def test_crash_at_kills_rank_0_just_before_its_stage(tmp_path, stage):
    """The lab's fault injection: ``crash_at`` must reach ``_maybe_crash`` at its place in the save."""
    import labkit
    root = tmp_path / "ckpt"
    what = f"elastic.save: save_checkpoint(..., crash_at={stage!r}) at world size 2"
    try:
        labkit.launch(save_then_crash, 2, str(root), stage, timeout=60)
    except labkit.WorkerError as error:
        assert (error.rank, error.exc_type) == (0, "ProcessExit") and "signal 9" in error.message, \
            f"{what}: rank 0 must die by SIGKILL inside the save; the launch ended with: {str(error)[:1200]}"
    else:
        raise AssertionError(f"{what}: the save finished: crash_at must make rank 0 kill itself (_maybe_crash)")
    assert sorted(p.name for p in root.iterdir()) == [step_name(2), step_name(4) + ".partial"], \
        f"{what}: the root holds {sorted(p.name for p in root.iterdir())}; expected the step-2 checkpoint and the " \
        "step-4 staging directory"
    assert sorted(p.name for p in (root / step_name(2)).iterdir()) == ["metadata.json", "rank0.pt", "rank1.pt"], \
        f"{what}: the step-2 checkpoint must stay whole"
    held = {p.name for p in (root / (step_name(4) + ".partial")).iterdir()}
    present, absent = CRASH_LEFTOVERS[stage]
    assert present <= held and not absent & held, \
        f"{what}: rank 0 died with the staging directory holding {sorted(held)}; a crash just before " \
        f"{stage!r} leaves {sorted(present)} there and not {sorted(absent)}"


# ----------------------------------------------------------------------------- elastic.load: refusals


def save_at(kind: str, root: str, steps: tuple, draws: bool = False):
    """Train and save at each of ``steps`` (keep them all). ``draws``: also return what the
    random generators (torch's, Python's) give right after the last capture."""
    from labkit.elastic import Progress, capture_state, save_checkpoint
    model, opt = build(kind)
    losses, done = [], 0
    for step in steps:
        losses += train_steps(model, opt, done, step - done)
        done = step
        state = capture_state(model, opt, Progress(step=step, position=step * BATCH, losses=list(losses)))
        drawn = (torch.rand(4), random.random())
        save_checkpoint(state, root, step, keep=len(steps))
    return (losses, drawn) if draws else losses


def refused(call, pattern: str, what: str) -> None:
    """``call()`` must raise CheckpointError whose message matches ``pattern`` (names the file)."""
    import re
    from labkit.elastic import CheckpointError
    try:
        result = call()
    except CheckpointError as error:
        assert re.search(pattern, str(error)), \
            f"{what}: refused with CheckpointError({str(error)[:200]!r}), which does not name it (expected /{pattern}/)"
        return
    except Exception as error:  # noqa: BLE001 - reported as the failure it is
        raise AssertionError(f"{what}: {type(error).__name__}: {str(error)[:200]} instead of a CheckpointError "
                             f"naming the file (/{pattern}/): check it before reading it") from None
    raise AssertionError(f"{what}: accepted (returned {str(result)[:80]}); it must be refused with a "
                         f"CheckpointError naming the file (/{pattern}/)")


def bad_checkpoints_on_rank(root: str, drawn: list):
    import shutil
    from labkit.elastic import latest_checkpoint, load_checkpoint, validate_checkpoint
    from labkit.models import GPT, GPTConfig
    rank = dist.get_rank()
    root = Path(root)
    good = root / step_name(4)
    cases = root.parent / "cases"
    if rank == 0:
        meta = validate_checkpoint(good)
        assert (meta["world_size"], meta["step"]) == (2, 4), \
            f"elastic.load: validate_checkpoint({good.name}) gives world size {meta['world_size']}, step {meta['step']}"
        # newer than step 4: a staging directory (complete, never renamed) and a damaged checkpoint
        shutil.copytree(good, root / f"{step_name(10)}.partial")
        shutil.copytree(good, root / step_name(8))
        data = (root / step_name(8) / "rank1.pt").read_bytes()
        (root / step_name(8) / "rank1.pt").write_bytes(data[:len(data) // 2])
        for case in ("truncated", "altered", "missing", "swapped", "no_metadata", "torn_metadata", "rows0", "rows1"):
            shutil.copytree(good, cases / case)
        for r in (0, 1):  # metadata that lists rank r's file but none of its rows (as if it never reported them)
            meta_path = cases / f"rows{r}" / "metadata.json"
            meta_r = json.loads(meta_path.read_text())
            for entry in meta_r["tensors"].values():
                entry["pieces"] = [piece for piece in entry["pieces"] if piece[0] != f"rank{r}.pt"] or entry["pieces"]
            meta_path.write_text(json.dumps(meta_r))
        # a root where nothing validates: the damaged step 8 and a staging directory
        shutil.copytree(root / step_name(8), cases / "nothing" / step_name(8))
        shutil.copytree(good, cases / "nothing" / f"{step_name(10)}.partial")
        data = (good / "rank1.pt").read_bytes()
        (cases / "truncated" / "rank1.pt").write_bytes(data[:len(data) // 2])
        middle = len(data) // 2
        (cases / "altered" / "rank1.pt").write_bytes(data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:])
        (cases / "missing" / "rank1.pt").unlink()
        shutil.copy(root / step_name(2) / "rank1.pt", cases / "swapped" / "rank1.pt")  # another checkpoint's file
        (cases / "no_metadata" / "metadata.json").unlink()
        text = (cases / "torn_metadata" / "metadata.json").read_text()
        (cases / "torn_metadata" / "metadata.json").write_text(text[:len(text) // 2])
    dist.barrier()
    model, opt = build("fsdp")
    with CommTracer() as tracer:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            found = latest_checkpoint(root)
        assert found is not None and Path(found).name == step_name(4), \
            (f"elastic.load: rank {rank}: under {sorted(p.name for p in root.iterdir())} (step 8 with a truncated "
             f"rank1.pt, step 10 never renamed from .partial) latest_checkpoint returns {found}; "
             f"expected {step_name(4)}")
        assert step_name(8) in printed.getvalue() and "rank1.pt" in printed.getvalue(), \
            (f"elastic.load: rank {rank}: latest_checkpoint skipped the damaged {step_name(8)} without reporting it "
             f"by name (printed: {printed.getvalue()[:200]!r}); print the error that names the file")
        with contextlib.redirect_stdout(io.StringIO()):
            nothing = latest_checkpoint(cases / "nothing")
        assert nothing is None, (f"elastic.load: rank {rank}: under {sorted(p.name for p in (cases / 'nothing').iterdir())} "
                                 f"(a damaged step 8, a step 10 never renamed) latest_checkpoint returns {nothing}; "
                                 "expected None (no checkpoint validates)")
        refused(lambda: load_checkpoint(cases / f"rows{rank}", model, opt), r"metadata\.json",
                f"elastic.load: rank {rank}: loading a checkpoint whose metadata lists none of rank{rank}.pt's rows "
                "(the rows this rank needs are in no piece)")
        other = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=24)).double()
        refused(lambda: load_checkpoint(good, other, torch.optim.AdamW(other.parameters())), r"metadata\.json.*shape",
                f"elastic.load: rank {rank}: {good.name} loaded into a GPT of another width (n_embd 24)")
        deeper = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=3, n_head=2, n_embd=16)).double()
        refused(lambda: load_checkpoint(good, deeper, torch.optim.AdamW(deeper.parameters())), r"metadata\.json",
                f"elastic.load: rank {rank}: {good.name} loaded into a GPT with a third block (names it lacks)")
        for case, pattern, how in (("truncated", r"rank1\.pt.*truncated", "rank1.pt cut to half its bytes"),
                                   ("altered", r"rank1\.pt", "one byte of rank1.pt flipped (same size)"),
                                   ("swapped", r"rank1\.pt", "rank1.pt replaced by step 2's"),
                                   ("missing", r"rank1\.pt.*missing", "rank1.pt deleted"),
                                   ("no_metadata", r"metadata\.json", "metadata.json deleted"),
                                   ("torn_metadata", r"metadata\.json", "metadata.json cut in half")):
            refused(lambda folder=cases / case: load_checkpoint(folder, model, opt), pattern,
                    f"elastic.load: rank {rank}: loading a checkpoint with {how}")
            refused(lambda folder=cases / case: validate_checkpoint(folder), pattern,
                    f"elastic.load: rank {rank}: validating a checkpoint with {how}")
        # loaded at the world size that saved it: the random generators continue as after the save
        torch.manual_seed(1000 + rank)
        random.seed(1000 + rank)
        load_checkpoint(good, model, opt)
        after = (torch.rand(4), random.random())
    no_communication(tracer.events, f"elastic.load: rank {rank}: latest_checkpoint, validate_checkpoint and "
                                    "load_checkpoint read files (no communication)")
    drawn = drawn[rank]
    assert torch.equal(after[0], drawn[0]) and after[1] == drawn[1], (
        f"elastic.load: rank {rank}: {good.name} (saved by 2 ranks) loaded at 2 ranks: the random generators "
        f"draw {after[0].tolist()}, {after[1]}; after the save they drew {drawn[0].tolist()}, {drawn[1]}: restore "
        "this rank's torch and Python RNG states when the world size is the same")


@task("elastic.load", points=2)
def test_damaged_or_foreign_checkpoints_are_refused_by_name(tmp_path):
    root = str(tmp_path / "ckpt")
    drawn = [d for _, d in run_graded("elastic.load", save_at, 2, "fsdp", root, (2, 4), True)]
    run_graded("elastic.load", bad_checkpoints_on_rank, 2, root, drawn)


# ----------------------------------------------------------------------------- elastic.load: resharding


def continue_from(kind: str, root: str, more: int):
    from labkit.elastic import latest_checkpoint, load_checkpoint
    rank, n = dist.get_rank(), dist.get_world_size()
    model, opt = build(kind)
    with CommTracer() as tracer:
        progress = load_checkpoint(latest_checkpoint(root), model, opt)
    no_communication(tracer.events, f"elastic.load: {kind}: rank {rank} of {n}: loading a checkpoint of 2 ranks "
                                    "(each rank reads the rows it needs from the files: no communication)")
    assert (progress.step, progress.position) == (STEPS // 2, STEPS // 2 * BATCH), \
        (f"elastic.load: {kind}: rank {rank} of {n}: the progress loaded is step {progress.step}, position "
         f"{progress.position}; saved: step {STEPS // 2}, position {STEPS // 2 * BATCH}")
    return list(progress.losses) + train_steps(model, opt, progress.step, more)


@task("elastic.load", points=3)
@pytest.mark.parametrize("kind", ["fsdp", "zero"])
def test_a_checkpoint_from_two_ranks_loads_at_one_three_and_four(tmp_path, kind):
    uninterrupted = run_graded("elastic.load", save_at, 2, kind, str(tmp_path / "whole"), (STEPS,))[0]
    run_graded("elastic.save", save_at, 2, kind, str(tmp_path / "half"), (STEPS // 2,))
    for world in (3, 4, 1):
        curve = run_graded("elastic.load", continue_from, world, kind, str(tmp_path / "half"), STEPS - STEPS // 2)[0]
        assert_close(torch.tensor(curve), torch.tensor(uninterrupted),
                     f"elastic.load: {kind}: saved at 2 ranks, resumed at {world}: loss curve vs the uninterrupted run")


# ----------------------------------------------------------------------------- elastic.load: vs DCP


def train_both_and_save(root: str, steps: int):
    """The learner's FSDP GPT and torch's fully_shard GPT, trained side by side; saved with
    elastic.save_checkpoint and with DCP."""
    from labkit.elastic import Progress, capture_state, save_checkpoint
    from labkit.models import GPT
    from labkit.oracles import builtin_fully_shard, dcp_save
    model, opt = build("fsdp")
    theirs = builtin_fully_shard(GPT(gpt_config()).double())
    their_opt = torch.optim.AdamW(param_groups(theirs), lr=1e-2)
    for step in range(steps):
        for m, o in ((model, opt), (theirs, their_opt)):
            gpt_loss(m, *my_batch(step)).backward()
            o.step()
            o.zero_grad(set_to_none=True)
    save_checkpoint(capture_state(model, opt, Progress(step=steps)), f"{root}/ours", steps)
    dcp_save(theirs, their_opt, f"{root}/dcp")


def load_both_full(root: str, steps: int):
    """Both checkpoints loaded at this world size; the full model states, on rank 0."""
    from labkit import oracles
    from labkit.elastic import checkpoint_dir, load_checkpoint
    from labkit.fsdp import full_state_dict
    from labkit.models import GPT
    model, opt = build("fsdp")
    load_checkpoint(checkpoint_dir(f"{root}/ours", steps), model, opt)
    ours = full_state_dict(model)
    theirs = oracles.builtin_fully_shard(GPT(gpt_config()).double())
    their_opt = torch.optim.AdamW(param_groups(theirs), lr=1e-2)
    oracles.dcp_load(theirs, their_opt, f"{root}/dcp")
    full = oracles.full_state_dict(theirs)
    return (ours, full) if dist.get_rank() == 0 else None


@task("elastic.load", points=2)
def test_the_same_state_as_a_dcp_checkpoint_of_fully_shard(tmp_path):
    root = str(tmp_path)
    run_graded("elastic.load", train_both_and_save, 2, root, 3)
    ours, theirs = run_graded("elastic.load", load_both_full, 3, root, 3)[0]
    for name, value in theirs.items():
        assert_close(ours[name], value, f"elastic.load: {name}: your checkpoint vs DCP's, both loaded at 3 ranks")


# ----------------------------------------------------------------------------- elastic.resume


class Untraced:
    """Training's own communication (the forward in ``job.loss``, ``loss.backward()``, the
    optimizer step, building the model; and the data) belongs to chapters 02-04: run
    untraced, so that the trace holds resume_training's own ops only (and training runs at
    full speed)."""

    def around(self, fn):
        from torch.utils._python_dispatch import _disable_current_modes

        def inner(*args, **kwargs):
            with _disable_current_modes():
                return fn(*args, **kwargs)
        return inner

    def build(self, build):
        def inner():
            model, opt = self.around(build)()
            opt.step = self.around(opt.step)
            return model, opt
        return inner

    def __enter__(self):
        self.backward = torch.Tensor.backward
        torch.Tensor.backward = self.around(self.backward)
        return self

    def __exit__(self, *exc):
        torch.Tensor.backward = self.backward


def job(kind: str, root: str, steps: int = STEPS, fail_at=None, save_every: int = 2):
    from labkit.elastic import Job
    return Job(build=functools.partial(build, kind), batch=my_batch, loss=gpt_loss, steps=steps, root=root,
               save_every=save_every, samples_per_step=BATCH, fail_at=fail_at)


def train_job(kind, root, steps=STEPS, fail_at=None, save_every=2):
    """resume_training on this rank, traced; its own communication checked against the
    chapter's: from the step it resumes at (0, or the latest checkpoint's after the
    restart), one all-reduce of the loss (a float64 scalar) per step and one save's ops per
    checkpoint written (every ``save_every`` steps and at the end)."""
    from labkit.elastic import resume_training
    from labkit.launch import restart_count
    rank, n = dist.get_rank(), dist.get_world_size()
    untraced = Untraced()
    the_job = job(kind, root, steps, fail_at, save_every)
    the_job.build, the_job.loss = untraced.build(the_job.build), untraced.around(the_job.loss)
    the_job.batch = untraced.around(the_job.batch)
    with CommTracer() as tracer, untraced:
        losses = resume_training(the_job)
    first = 0 if restart_count() == 0 or fail_at is None else fail_at[1] // save_every * save_every
    saves = [s for s in range(first + 1, steps + 1) if s % save_every == 0 or s == steps]
    where = f"elastic.resume: {kind}, world size {n}, rank {rank}" + (
        f", restarted after a kill before step {fail_at[1]} (latest checkpoint: step {first})" if first else "")
    own = [e for e in tracer.events if not e.in_backward]
    loss_bytes = torch.empty((), dtype=torch.float64).element_size()  # the GPT trains in float64
    reduces = [e for e in own if e.kind == "all_reduce"]
    assert_ops(reduces, [Op("all_reduce", loss_bytes)] * (steps - first),
               f"{where}: steps {first}..{steps - 1}: one all-reduce of the {loss_bytes}-byte loss per step trained "
               "(resume from the latest checkpoint's step, not before it)")
    save_ops([e for e in own if e.kind != "all_reduce"], rank, n, None,
             f"{where}: saves at steps {saves} (every {save_every} steps and at the end), each gather_object and "
             "two barriers", saves=len(saves))
    final = torch.load(Path(root) / step_name(steps) / f"rank{rank}.pt", weights_only=False)["progress"]
    assert (final["step"], final["epoch"], final["position"], final["losses"]) == (steps, 0, steps * BATCH, losses), \
        (f"{where}: the final checkpoint's progress is step {final['step']}, epoch {final['epoch']}, position "
         f"{final['position']}, {len(final['losses'])} losses; expected step {steps}, epoch 0, position "
         f"{steps * BATCH} ({BATCH} samples per step) and the {len(losses)} losses returned")
    return losses


@task("elastic.resume", points=3)
@pytest.mark.parametrize("world_size, kind, save_every, saved", [(2, "zero", 4, 1), (4, "fsdp", 2, 2), (2, "fsdp", 2, 1)])
def test_a_killed_rank_resumes_exactly(tmp_path, world_size, kind, save_every, saved):
    import labkit
    # Drawn from the run's seed (tests/grading/configs.py): which rank dies, and before which
    # step after the first ``saved`` checkpoints (after two, a resume can take the wrong one).
    draw = configs.rng(f"elastic.resume:{world_size}:{kind}")
    step, victim = draw.randrange(saved * save_every + 1, STEPS), draw.randrange(world_size)
    configs.announce(f"elastic.resume: rank {victim} killed before step {step}")
    clean = run_graded("elastic.resume", train_job, world_size, kind, str(tmp_path / "clean"), STEPS, None, save_every)
    try:
        resumed = labkit.launch(train_job, world_size, kind, str(tmp_path / "killed"), STEPS, (victim, step),
                                save_every, max_restarts=1, timeout=120)
    except labkit.LaunchError as error:
        raise AssertionError(f"elastic.resume: the restarted run failed: {str(error)[:1500]}") from None
    for rank in range(world_size):
        assert resumed[rank] == clean[rank], \
            (f"elastic.resume: {kind}, world size {world_size}, rank {victim} killed before step {step}: "
             f"rank {rank}'s losses {resumed[rank]} differ from the uninterrupted run's {clean[rank]} "
             f"{configs.replay()}")
    # The checkpoints are the submission's files (their pieces are its classes): read in a rank,
    # never unpickled in the process that records the grade (the judge).
    differ = run_graded("elastic.resume", final_states_differ, 1, str(tmp_path / "killed"), str(tmp_path / "clean"))[0]
    assert not differ, f"elastic.resume: {', '.join(differ[:5])} differ from the uninterrupted run's"


def final_states_differ(killed: str, clean: str) -> list[str]:
    """In a rank: what differs between the two runs' final checkpoints (names; [] if nothing)."""
    ours, theirs = final_state(killed), final_state(clean)
    if ours.keys() != theirs.keys():
        return [f"the tensors held ({sorted(ours.keys() ^ theirs.keys())[:3]} in one only)"]
    return [name for name in ours if not torch.equal(ours[name], theirs[name])]


def final_state(root: str) -> dict:
    """Every tensor of the newest checkpoint under ``root``, read directly from its files."""
    latest = max(p for p in Path(root).iterdir() if p.name.startswith("step_") and not p.name.endswith(".partial"))
    out = {}
    for file in sorted(latest.glob("rank*.pt")):
        state = torch.load(file, weights_only=False)
        for section in ("model", "optimizer"):
            for name, piece in state[section].items():
                out[f"{file.name}/{section}/{name}"] = piece.tensor
    return out
