"""Chapter 09 exercises: fault tolerance — sharded checkpoints, resharding, exact resume.

At scale, failures are routine: with thousands of GPUs something breaks every few hours.
A run survives by checkpointing often and resuming exactly. Exactly means the *whole*
training state: the model's and the optimizer's shards, the position in the data, the RNG
states and the step; miss one and the resumed run drifts from the one that never stopped.

A sharded checkpoint is a directory: every rank writes its own pieces in parallel, one
file per rank, and rank 0 writes ``metadata.json`` describing every tensor (its full shape
and which file holds which rows) and every file (its size and SHA-256). Because the
metadata speaks of *full* tensors and row ranges, another world size can load it: each rank
reads the rows its new shard needs, from whichever files hold them (resharding).

Atomicity: the files go into ``step_<n>.partial/``; only when every rank has written and rank
0 has written the metadata is the directory renamed to ``step_<n>`` (one atomic rename).
A crash at any moment leaves either the previous checkpoint or a ``.partial`` directory that
no loader considers; a damaged checkpoint (missing or truncated file) fails its checksum
and is reported by name, never half-loaded.

Pieces (given): ``Piece(shape, start, tensor)`` is rows [start, start + len(tensor)) of the
full tensor of ``shape``. ``model_pieces`` describes a model as this rank holds it (FSDP's
dim-0 shards from chapter 04 as row ranges, anything else whole), ``optimizer_pieces`` its
optimizer state the same way (ZeRO's owned parameters from chapter 03 whole, on their owner);
``put_model_rows``/``put_optimizer_rows`` write assembled rows back.

Tasks (run ``labkit grade elastic``; tests in ``tests/grading/test_elastic.py``):
    elastic.state    capture_state, restore_state
    elastic.save     save_checkpoint
    elastic.load     validate_checkpoint, latest_checkpoint, load_checkpoint
    elastic.resume   resume_training
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

METADATA = "metadata.json"
STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: the message names the file and what is wrong."""


# ----------------------------------------------------------------------------- pieces (given)


@dataclass
class Piece:
    shape: tuple            # the full tensor's shape
    start: int              # first row (dim 0) this piece holds; 0 for a scalar
    tensor: torch.Tensor    # rows [start, start + len(tensor))


def _fsdp_layout(model: nn.Module) -> dict[int, tuple]:
    """id(shard parameter) -> (full shape, first row, valid rows) for FSDP-sharded parameters."""
    from labkit.fsdp import units_of
    layout = {}
    for unit in units_of(model):
        for p in unit.params:
            rows = p.shape[0]
            start = min(unit.rank * p.rows, rows)
            layout[id(p.shard)] = (tuple(p.shape), start, max(0, min(p.rows, rows - start)))
    return layout


def model_pieces(model: nn.Module) -> dict[str, Piece]:
    """This rank's piece of every parameter (and buffer) of ``model``, by name."""
    layout = _fsdp_layout(model)
    pieces = {}
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        if id(p) in layout:
            shape, start, valid = layout[id(p)]
            pieces[name] = Piece(shape, start, p.detach()[:valid].clone())
        else:
            pieces[name] = Piece(tuple(p.shape), 0, p.detach().clone())
    return pieces


def optimizer_pieces(optimizer, model: nn.Module) -> dict[str, Piece]:
    """This rank's optimizer state, by "<parameter name>::<state key>", laid out like the
    parameter (a moment of an FSDP shard is the same rows); scalars (Adam's step) whole."""
    layout = _fsdp_layout(model)
    names = {id(p): name for name, p in model.named_parameters()}
    pieces = {}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            name = f"{names[id(p)]}::{key}"
            if value.dim() == 0:
                pieces[name] = Piece((), 0, value.detach().clone())
            elif id(p) in layout:
                shape, start, valid = layout[id(p)]
                pieces[name] = Piece(shape, start, value.detach()[:valid].clone())
            else:
                pieces[name] = Piece(tuple(value.shape), 0, value.detach().clone())
    return pieces


def needed_rows(model: nn.Module) -> dict[str, tuple]:
    """What this rank must load for each parameter/buffer: name -> (full shape, first row,
    rows) of the current layout (FSDP: this rank's shard; otherwise the whole tensor)."""
    layout = _fsdp_layout(model)
    need = {}
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        need[name] = layout.get(id(p), (tuple(p.shape), 0, p.shape[0] if p.dim() else 0))
    return need


@torch.no_grad()
def put_model_rows(model: nn.Module, rows: dict[str, torch.Tensor]) -> None:
    """Write ``rows[name]`` (this rank's valid rows of each tensor) into the model; the padding
    rows of an FSDP shard stay zero."""
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        value = rows[name]
        if p.dim() == 0:
            p.copy_(value)
        else:
            p.zero_()
            p[:len(value)].copy_(value)


def held_params(optimizer) -> list[nn.Parameter]:
    """The parameters whose state this rank's optimizer keeps: all of them, or for a ZeRO
    optimizer (chapter 03) the ones this rank owns."""
    owned = getattr(optimizer, "owned", None)
    return list(owned) if owned is not None else [p for g in optimizer.param_groups for p in g["params"]]


@torch.no_grad()
def put_optimizer_rows(optimizer, model: nn.Module, rows: dict[str, torch.Tensor]) -> None:
    """Rebuild ``optimizer.state`` from "<name>::<key>" rows for the parameters it holds."""
    params = {id(p) for p in held_params(optimizer)}
    for name, p in model.named_parameters():
        if id(p) not in params:
            continue
        state = {}
        for key in [k.split("::", 1)[1] for k in rows if k.startswith(f"{name}::")]:
            value = rows[f"{name}::{key}"]
            if value.dim() == 0:
                state[key] = value.clone()
            else:
                full = torch.zeros_like(p)
                full[:len(value)] = value
                state[key] = full
        if state:
            optimizer.state[p] = state


def put_group_options(optimizer, options: list[dict]) -> None:
    """Set each param group's options back (``group_options``' list; the parameters stay)."""
    if len(options) != len(optimizer.param_groups):
        raise CheckpointError(f"the checkpoint has {len(options)} param groups, this optimizer "
                              f"{len(optimizer.param_groups)}: a checkpoint of another optimizer")
    for group, saved in zip(optimizer.param_groups, options):
        group.update(saved)


def file_digest(path: Path) -> dict:
    """Size and SHA-256 of a file, read in blocks (shards can be gigabytes)."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
            size += len(block)
    return dict(bytes=size, sha256=digest.hexdigest())


# ----------------------------------------------------------------------------- the state of a rank


@dataclass
class Progress:
    """Where training is: the next step, the data position, and the loss curve so far."""
    step: int = 0
    epoch: int = 0
    position: int = 0                       # samples of this epoch already consumed
    losses: list = field(default_factory=list)


def group_options(optimizer) -> list[dict]:
    """Each param group's options (lr, weight decay, betas...; everything but its parameters):
    an LR schedule changes them as training goes, so an exact resume needs them too."""
    return [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]


def capture_state(model: nn.Module, optimizer, progress: Progress) -> dict:
    """Everything this rank needs to continue exactly: {"model": model_pieces, "optimizer":
    optimizer_pieces, "groups": group_options, "progress": progress as a dict, "rng":
    {"torch": ..., "python": ...}}."""
    # BEGIN SOLUTION elastic.state: model_pieces, optimizer_pieces, group_options, vars(progress) (copy the list), and torch.get_rng_state() / random.getstate()
    return dict(model=model_pieces(model), optimizer=optimizer_pieces(optimizer, model),
                groups=group_options(optimizer),
                progress=dict(vars(progress), losses=list(progress.losses)),
                rng=dict(torch=torch.get_rng_state(), python=random.getstate()))
    # END SOLUTION


def restore_state(state: dict, model: nn.Module, optimizer) -> Progress:
    """The inverse of ``capture_state`` on the same layout: write the pieces back into the
    model and optimizer (its state and every group's options), restore both RNGs, return the
    ``Progress``. ``state`` is left as it was, so it can be restored again: the returned
    progress owns its loss list."""
    # BEGIN SOLUTION elastic.state: put_model_rows / put_optimizer_rows with each piece's tensor; put_group_options; torch.set_rng_state, random.setstate; Progress(**state["progress"]) with a copy of its loss list
    put_model_rows(model, {name: piece.tensor for name, piece in state["model"].items()})
    put_optimizer_rows(optimizer, model, {name: piece.tensor for name, piece in state["optimizer"].items()})
    put_group_options(optimizer, state["groups"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    return Progress(**dict(state["progress"], losses=list(state["progress"]["losses"])))
    # END SOLUTION


# ----------------------------------------------------------------------------- save


def checkpoint_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def save_checkpoint(state: dict, root, step: int, keep: int = 2, crash_at: str | None = None) -> Path:
    """Write ``state`` (``capture_state``'s, on every rank) as ``root/step_<step>``, atomically;
    keep the ``keep`` newest checkpoints. A collective. Returns the directory.

    1. every rank writes ``rank<r>.pt`` (its pieces, progress and RNG, ``torch.save``) into
       ``step_<step>.partial/``;
    2. every rank's file digest (``file_digest``) and piece index ({name: (shape, start,
       rows)}) go to rank 0 (``dist.gather_object``), which writes ``metadata.json``:
       {"step", "world_size", "files": {file: digest}, "tensors": {name: {"shape",
       "pieces": [[file, start, rows], ...]}}};
    3. rank 0 renames ``step_<step>.partial`` to ``step_<step>`` and deletes older ones;
    4. a barrier, so that no rank goes on before the checkpoint exists.
    ``crash_at`` (for tests): "write", "metadata" or "rename": rank 0 dies (SIGKILL) just
    before that stage, or halfway through writing its file ("write").
    """
    # BEGIN SOLUTION elastic.save: staging dir; rank file via a .tmp and os.replace; gather (digest, index) to rank 0; metadata via .tmp + os.replace; os.rename staging -> final; prune; barrier
    rank, world = dist.get_rank(), dist.get_world_size()
    final = checkpoint_dir(root, step)
    staging = final.with_name(final.name + ".partial")
    if rank == 0 and staging.exists():
        shutil.rmtree(staging)  # left by a save that died: none of its files may slip in
    dist.barrier()
    staging.mkdir(parents=True, exist_ok=True)
    name = f"rank{rank}.pt"
    _maybe_crash(crash_at, "write", rank, staging / (name + ".tmp"))
    torch.save(state, staging / (name + ".tmp"))
    os.replace(staging / (name + ".tmp"), staging / name)
    index = {key: (list(piece.shape), piece.start, len(piece.tensor) if piece.tensor.dim() else 0)
             for section in ("model", "optimizer") for key, piece in
             ((f"{section}/{k}", v) for k, v in state[section].items())}
    gathered = [None] * world if rank == 0 else None
    dist.gather_object((name, file_digest(staging / name), index), gathered, dst=0)
    if rank == 0:
        _maybe_crash(crash_at, "metadata", rank)
        tensors: dict = {}
        for file, _, pieces in gathered:
            for key, (shape, start, rows) in pieces.items():
                tensors.setdefault(key, dict(shape=shape, pieces=[]))["pieces"].append([file, start, rows])
        metadata = dict(step=step, world_size=world, files={file: digest for file, digest, _ in gathered},
                        tensors=tensors)
        (staging / (METADATA + ".tmp")).write_text(json.dumps(metadata))
        os.replace(staging / (METADATA + ".tmp"), staging / METADATA)
        _maybe_crash(crash_at, "rename", rank)
        replaced = final.with_name(final.name + ".replaced")
        if final.exists():  # an older save of this very step: keep it until the new one is in place
            os.rename(final, replaced)
        os.rename(staging, final)  # the one atomic step: from here on the checkpoint exists
        shutil.rmtree(replaced, ignore_errors=True)
        for old in sorted(_step_dirs(root))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final
    # END SOLUTION


def _maybe_crash(crash_at: str | None, stage: str, rank: int, half_written: Path | None = None) -> None:
    """Fault injection for the atomicity tests: rank 0 dies at ``stage``."""
    if crash_at != stage or rank != 0:
        return
    if half_written is not None:  # a torn write (of the .tmp file it writes first), then death
        half_written.write_bytes(b"\x80\x02partial")
    os.kill(os.getpid(), 9)


def _step_dirs(root) -> list[Path]:
    root = Path(root)
    return [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)] if root.exists() else []


# ----------------------------------------------------------------------------- load


def validate_checkpoint(path) -> dict:
    """The metadata of a complete, undamaged checkpoint at ``path``, or ``CheckpointError``
    naming the file that is missing, unreadable, truncated or altered."""
    # BEGIN SOLUTION elastic.load: read metadata.json (missing/unparsable -> error naming it); for every file in it: exists, file_digest equals the recorded one (else error naming the file)
    path = Path(path)
    meta_file = path / METADATA
    try:
        metadata = json.loads(meta_file.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{meta_file}: not a readable checkpoint metadata file ({error})") from None
    for file, digest in metadata["files"].items():
        if not (path / file).exists():
            raise CheckpointError(f"{path / file}: missing (the checkpoint lists it)")
        found = file_digest(path / file)
        if found != digest:
            raise CheckpointError(f"{path / file}: {found['bytes']} bytes, sha256 {found['sha256'][:12]}..., "
                                  f"but the metadata records {digest['bytes']} bytes, sha256 "
                                  f"{digest['sha256'][:12]}...: the file is truncated or damaged")
    return metadata
    # END SOLUTION


def latest_checkpoint(root) -> Path | None:
    """The newest checkpoint under ``root`` that validates; ``.partial`` directories are never
    considered, and a damaged checkpoint is reported (printed) and skipped."""
    # BEGIN SOLUTION elastic.load: for step_* dirs newest first: validate_checkpoint; return the first that passes; print the error of any that fails
    for path in sorted(_step_dirs(root), reverse=True):
        try:
            validate_checkpoint(path)
            return path
        except CheckpointError as error:
            print(f"skipping a damaged checkpoint: {error}")
    return None
    # END SOLUTION


def load_checkpoint(path, model: nn.Module, optimizer) -> Progress:
    """Load the checkpoint at ``path`` into this rank's ``model`` and ``optimizer``, whatever
    world size wrote it: for every tensor, the rows the current layout needs
    (``needed_rows``; the optimizer state follows its parameter), read from the files that
    hold them and written back with ``put_model_rows``/``put_optimizer_rows``; every param
    group's options (``put_group_options``). RNG states are restored when the world size is
    unchanged. Returns the ``Progress``.
    ``CheckpointError`` (naming the file) for a damaged checkpoint or one whose tensors do not
    have this model's shapes or names."""
    # BEGIN SOLUTION elastic.load: metadata = validate_checkpoint(path); for each needed name check the shape, assemble rows [start, start + rows) from the pieces (torch.load their files once); put the rows; group options, progress and RNG from this rank's file if same world size (else rank 0's)
    path = Path(path)
    metadata = validate_checkpoint(path)
    files: dict[str, dict] = {}

    def read(file: str) -> dict:
        if file not in files:
            files[file] = torch.load(path / file, weights_only=False)
        return files[file]

    def rows_of(key: str, shape: tuple, start: int, rows: int) -> torch.Tensor:
        entry = metadata["tensors"].get(key)
        if entry is None:
            raise CheckpointError(f"{path / METADATA}: no tensor {key!r}: a checkpoint of another model")
        if tuple(entry["shape"]) != tuple(shape):
            raise CheckpointError(f"{path / METADATA}: {key!r} has shape {tuple(entry['shape'])} there, "
                                  f"{tuple(shape)} here: a checkpoint of another model shape")
        section, name = key.split("/", 1)
        parts, cursor = [], start  # rows [start, cursor) assembled so far; copies may overlap
        for file, first, count in sorted(entry["pieces"], key=lambda p: p[1]):
            if not shape:  # a scalar: any copy will do
                return read(file)[section][name].tensor
            lo, hi = max(cursor, first), min(start + rows, first + count)
            if lo == cursor and lo < hi:
                parts.append(read(file)[section][name].tensor[lo - first:hi - first])
                cursor = hi
        if cursor != start + rows:
            raise CheckpointError(f"{path / METADATA}: rows {start}..{start + rows} of {key!r} are not all there")
        return torch.cat(parts) if parts else torch.empty((0, *shape[1:]))

    need = needed_rows(model)
    put_model_rows(model, {name: rows_of(f"model/{name}", *spec) for name, spec in need.items()})
    names = {id(p): name for name, p in model.named_parameters()}
    held = held_params(optimizer)
    optimizer_rows = {}
    for p in held:
        name = names[id(p)]
        shape, start, rows = need[name]
        for key in [k for k in metadata["tensors"] if k.startswith(f"optimizer/{name}::")]:
            scalar = not metadata["tensors"][key]["shape"]
            optimizer_rows[key.split("/", 1)[1]] = rows_of(key, (), 0, 0) if scalar else rows_of(key, shape, start, rows)
    put_optimizer_rows(optimizer, model, optimizer_rows)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = read(f"rank{rank}.pt" if metadata["world_size"] == world else "rank0.pt")
    put_group_options(optimizer, mine["groups"])  # the same on every rank
    if metadata["world_size"] == world:
        torch.set_rng_state(mine["rng"]["torch"])
        random.setstate(mine["rng"]["python"])
    return Progress(**mine["progress"])
    # END SOLUTION


# ----------------------------------------------------------------------------- resume


@dataclass
class Job:
    """A small training run that can be killed and resumed. ``build()`` -> (model, optimizer)
    for this rank (e.g. the GPT under your FSDP, or under DDP with your ZeRO optimizer);
    ``batch(step)`` -> this rank's (x, y) of global step ``step``; ``loss(model, x, y)`` -> the
    global-batch loss (averaged over ranks: what is logged); ``fail_at`` = (rank, step): that
    rank SIGKILLs itself just before that step in the first attempt (restart_count() == 0)."""
    build: object
    batch: object
    loss: object
    steps: int
    root: str
    save_every: int = 2
    samples_per_step: int = 1
    fail_at: tuple | None = None


def maybe_fail(job: Job, step: int) -> None:
    from labkit.launch import restart_count
    if job.fail_at is not None and restart_count() == 0 and job.fail_at == (dist.get_rank(), step):
        os.kill(os.getpid(), 9)


def resume_training(job: Job) -> list[float]:
    """Train ``job`` to ``job.steps``, resuming from the latest valid checkpoint under
    ``job.root`` if there is one; save every ``save_every`` steps (and at the end). Before each
    step call ``maybe_fail(job, step)``. Returns the loss of every step, resumed ones included."""
    model, optimizer = job.build()
    # BEGIN SOLUTION elastic.resume: progress = load_checkpoint(latest) or Progress(); loop from progress.step: maybe_fail, batch, loss/backward/step/zero_grad, log loss, advance position; save_checkpoint(capture_state(...)) every save_every steps and at the end
    latest = latest_checkpoint(job.root)
    progress = load_checkpoint(latest, model, optimizer) if latest is not None else Progress()
    for step in range(progress.step, job.steps):
        maybe_fail(job, step)
        x, y = job.batch(step)
        loss = job.loss(model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        dist.all_reduce(value)
        progress.losses.append(value.item() / dist.get_world_size())
        progress.step, progress.position = step + 1, progress.position + job.samples_per_step
        if progress.step % job.save_every == 0 or progress.step == job.steps:
            save_checkpoint(capture_state(model, optimizer, progress), job.root, progress.step)
    return progress.losses
    # END SOLUTION
