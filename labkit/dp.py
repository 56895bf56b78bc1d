"""Chapter 01 exercises: data parallelism, four ways.

Every replica holds the whole model; the global batch is split between them; each replica
computes the gradient of its share; the gradients are combined so that every replica takes
the same step. With a mean loss and equal shards, the mean of the replicas' gradients IS the
gradient of the global batch, so N replicas train exactly like one process on N times the
batch. Four designs differ in who splits, who combines, and who waits for whom:

* sampler sharding: each rank reads its own slice of an epoch, the way
  ``torch.utils.data.DistributedSampler`` cuts it (shuffle by seed + epoch, pad or drop);
* gradient averaging after backward: N processes, one all-reduce per gradient (the manual
  ancestor of DDP, chapter 02);
* single-process DataParallel: one process drives K replicas on threads (replicate,
  scatter, parallel apply, gather), the design of ``torch.nn.DataParallel``;
* a parameter server: rank 0 holds the parameters, the other ranks pull them, compute a
  gradient and push it; a staleness bound s lets fast workers run up to s versions ahead
  (s = 0 is synchronous SGD).

Tasks (run ``labkit grade dp``; tests in ``tests/grading/test_dp.py``):
    dp.sampler            shard_size, shard_indices (ShardSampler uses them)
    dp.grad_average       average_gradients
    dp.data_parallel      replicate, scatter, parallel_apply, gather (data_parallel chains them)
    dp.parameter_server   serve (rank 0) and work (ranks 1..N-1); run_parameter_server runs them
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

# ----------------------------------------------------------------------------- dp.sampler


def shard_size(dataset_len: int, num_replicas: int, drop_last: bool = False) -> int:
    """How many indices each rank gets per epoch: ``len(DistributedSampler)``.

    Every rank must get the same number (a rank with fewer batches would skip the last
    all-reduce and leave the others waiting). Without ``drop_last`` the epoch is padded up
    to a multiple of ``num_replicas``; with it, the ragged tail is dropped instead.
    """
    # BEGIN SOLUTION dp.sampler: ceil(len / replicas), or with drop_last (and a ragged tail) ceil((len - replicas) / replicas)
    if drop_last and dataset_len % num_replicas != 0:
        return math.ceil((dataset_len - num_replicas) / num_replicas)
    return math.ceil(dataset_len / num_replicas)
    # END SOLUTION


def shard_indices(dataset_len: int, num_replicas: int, rank: int, shuffle: bool = True,
                  seed: int = 0, epoch: int = 0, drop_last: bool = False) -> list[int]:
    """The dataset indices rank ``rank`` visits in epoch ``epoch``, in order.

    Exactly ``list(DistributedSampler(dataset, num_replicas, rank, shuffle, seed, drop_last))``
    after ``set_epoch(epoch)``: every rank draws the SAME permutation (``torch.randperm``
    with a generator seeded by ``seed + epoch``), pads it by repeating it from the start
    (or cuts it) to ``shard_size(...) * num_replicas`` indices, and keeps every
    ``num_replicas``-th one starting at ``rank``.
    """
    # BEGIN SOLUTION dp.sampler: randperm(len) seeded with seed + epoch (or range); pad by repeating from the start, or cut; then [rank::num_replicas]
    if shuffle:
        gen = torch.Generator().manual_seed(seed + epoch)
        order = torch.randperm(dataset_len, generator=gen).tolist()
    else:
        order = list(range(dataset_len))
    total = shard_size(dataset_len, num_replicas, drop_last) * num_replicas
    if total > len(order):  # pad: repeat the order (several times if the dataset is tiny)
        order = (order * math.ceil(total / len(order)))[:total]
    else:  # drop the ragged tail (a no-op when the length divides evenly)
        order = order[:total]
    # Interleaved, not contiguous: rank r takes positions r, r + N, r + 2N, ...
    return order[rank:total:num_replicas]
    # END SOLUTION


class ShardSampler(torch.utils.data.Sampler):
    """A drop-in ``DistributedSampler``: ``DataLoader(ds, batch_size, sampler=ShardSampler(ds))``.

    Rank and replica count default to the process group's. Call ``set_epoch(e)`` before
    each epoch, or every epoch repeats the same order.
    """

    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0, drop_last=False):
        self.dataset_len = len(dataset)
        self.num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
        self.rank = dist.get_rank() if rank is None else rank
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank {self.rank} is not in [0, {self.num_replicas - 1}]")
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(shard_indices(self.dataset_len, self.num_replicas, self.rank, self.shuffle,
                                  self.seed, self.epoch, self.drop_last))

    def __len__(self) -> int:
        return shard_size(self.dataset_len, self.num_replicas, self.drop_last)


# ----------------------------------------------------------------------------- dp.grad_average


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer would update, each once (a tied Parameter appears once)."""
    return [p for p in model.parameters() if p.requires_grad]


def average_gradients(model: nn.Module, group=None, num_samples: int | None = None) -> None:
    """After ``loss.backward()`` on every rank: make each ``.grad`` the mean over the ranks.

    Then every rank holds the same gradient and, with the same optimizer, takes the same
    step. Call it on every rank, the same number of times (it issues collectives).

    * Frozen parameters (``requires_grad=False``) are skipped: they have no gradient.
    * A parameter that got no gradient on SOME ranks (not used in their forward) counts as
      zero there; one with no gradient on ANY rank keeps ``.grad = None``, as a single
      process would. Ranks must first agree on which parameters have one: if each rank
      just skipped its own ``None``s, their all-reduces would no longer line up.
    * ``num_samples``: this rank's number of samples behind its (mean) loss. If given, each
      rank's gradient is weighted by its share, sum_r n_r g_r / sum_r n_r, which is the
      global-batch gradient even when the shards are unequal. If not, the plain mean over
      ranks (what DDP does), which is right only for equal shards.
    """
    # BEGIN SOLUTION dp.grad_average: all-reduce per-parameter "has a grad" flags (+ the weight) first; then all-reduce each grad some rank has (None -> zeros) and divide by the total weight
    params = trainable_parameters(model)
    if not params:
        return
    weight = 1.0 if num_samples is None else float(num_samples)
    # One small all-reduce first: which parameters have a gradient on ANY rank, and the
    # total weight (the number of ranks, or of samples).
    meta = torch.tensor([float(p.grad is not None) for p in params] + [weight],
                        dtype=torch.float64, device=params[0].device)
    dist.all_reduce(meta, group=group)
    total = meta[-1].item()
    for p, ranks_with_grad in zip(params, meta[:-1].tolist()):
        if ranks_with_grad == 0:
            continue  # unused everywhere: stays None on every rank
        if p.grad is None:
            p.grad = torch.zeros_like(p)  # unused here but used elsewhere: contributes 0
        if num_samples is not None:
            p.grad.mul_(weight)
        dist.all_reduce(p.grad, group=group)
        p.grad.div_(total)
    # END SOLUTION


# ----------------------------------------------------------------------------- dp.data_parallel


def module_skeleton(module: nn.Module) -> tuple[nn.Module, dict[nn.Module, nn.Module]]:
    """A copy of the module tree that still holds the ORIGINAL tensors.

    Every submodule becomes a new object of the same class with its own ``_parameters``,
    ``_buffers`` and ``_modules`` dicts, so that replacing an entry of a copy leaves the
    original alone (everything else, hooks included, is shared). Returns the copied root
    and ``{original submodule: its copy}`` (a submodule reachable twice is copied once).
    """
    copies: dict[nn.Module, nn.Module] = {}

    def copy_tree(m: nn.Module) -> nn.Module:
        if m in copies:
            return copies[m]
        c = m.__new__(type(m))
        c.__dict__ = m.__dict__.copy()
        c._parameters, c._buffers, c._modules = dict(m._parameters), dict(m._buffers), {}
        copies[m] = c
        for name, child in m._modules.items():
            c._modules[name] = None if child is None else copy_tree(child)
        return c

    return copy_tree(module), copies


def replicate(module: nn.Module, devices: list) -> list[nn.Module]:
    """One replica of ``module`` per device, its tensors copied there.

    A replica's parameters are NOT new leaves: they are differentiable copies
    (``p.to(device, copy=True)``) of the master's Parameters, so a backward through any
    replica accumulates into ``master.grad`` — that sum over replicas is the reduce step.
    A Parameter used in two places (tied) must stay one tensor in each replica; frozen
    parameters and buffers are copied too, but carry no autograd history.
    """
    # BEGIN SOLUTION dp.data_parallel: per device: module_skeleton(module), then put p.to(device, copy=True) in every _parameters/_buffers slot, one copy per tensor (ties)
    replicas = []
    for device in devices:
        copied: dict[int, torch.Tensor] = {}  # id(master tensor) -> its copy on this device

        def copy(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in copied:  # a tied Parameter: copied once, used in both places
                copied[id(t)] = t.to(device, copy=True)  # keeps the graph back to t
            return copied[id(t)]

        root, copies = module_skeleton(module)
        for original, replica in copies.items():
            for slots, source in ((replica._parameters, original._parameters),
                                  (replica._buffers, original._buffers)):
                for name, t in source.items():
                    if t is not None:
                        slots[name] = copy(t)
        replicas.append(root)
    return replicas
    # END SOLUTION


def scatter(inputs: tuple, devices: list) -> list[tuple]:
    """Split the batch: chunk i of every tensor argument (along dim 0) goes to ``devices[i]``.

    Chunks follow ``torch.chunk`` (a batch of 10 on 4 devices: 3, 3, 3, 1; a batch of 2
    on 4: only 2 chunks, so only 2 replicas run). All tensor arguments must have the same
    batch size; other arguments are passed unchanged to every replica. Returns one
    argument tuple per chunk.
    """
    # BEGIN SOLUTION dp.data_parallel: torch.chunk every tensor along dim 0 into len(devices) pieces, move piece i to devices[i]; repeat non-tensors
    tensors = [a for a in inputs if isinstance(a, torch.Tensor)]
    if not tensors:
        raise ValueError("scatter needs at least one tensor argument to split")
    sizes = {t.shape[0] for t in tensors}
    if len(sizes) > 1:
        raise ValueError(f"tensor arguments have different batch sizes {sorted(sizes)}")
    num_chunks = len(tensors[0].chunk(len(devices)))
    per_arg = [[c.to(d) for c, d in zip(a.chunk(len(devices)), devices)]
               if isinstance(a, torch.Tensor) else [a] * num_chunks
               for a in inputs]
    return [tuple(arg[i] for arg in per_arg) for i in range(num_chunks)]
    # END SOLUTION


def parallel_apply(replicas: list[nn.Module], inputs: list[tuple]) -> list:
    """``replicas[i](*inputs[i])`` for every i, each on its own thread, all at once.

    Returns the outputs in order. Grad mode is per thread (a new thread starts with it
    on), so carry the caller's into every thread; if a replica raises, re-raise its
    exception here, in the caller's thread.
    """
    # BEGIN SOLUTION dp.data_parallel: one threading.Thread per replica under torch.set_grad_enabled(caller's mode); join all; re-raise the first exception caught
    grad_enabled = torch.is_grad_enabled()
    outputs: list = [None] * len(inputs)
    errors: list = [None] * len(inputs)

    def run(i: int) -> None:
        try:
            with torch.set_grad_enabled(grad_enabled):
                outputs[i] = replicas[i](*inputs[i])
        except BaseException as error:  # noqa: BLE001 - handed to the caller below
            errors[i] = error

    threads = [threading.Thread(target=run, args=(i,), name=f"replica-{i}") for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for error in errors:
        if error is not None:
            raise error
    return outputs
    # END SOLUTION


def gather(outputs: list, device) -> object:
    """Concatenate the replicas' outputs along dim 0 on ``device`` (differentiably).

    Outputs may be tensors, tuples or lists of them, or None; 0-dim tensors (a per-replica
    loss) are stacked into a vector with one entry per replica.
    """
    # BEGIN SOLUTION dp.data_parallel: torch.cat the i-th pieces on device (torch.stack for 0-dim); recurse into tuples/lists; None stays None
    first = outputs[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        moved = [o.to(device) for o in outputs]
        return torch.stack(moved) if first.dim() == 0 else torch.cat(moved)
    if isinstance(first, (tuple, list)):
        return type(first)(gather([o[i] for o in outputs], device) for i in range(len(first)))
    raise TypeError(f"cannot gather outputs of type {type(first).__name__}")
    # END SOLUTION


def data_parallel(module: nn.Module, inputs: tuple, num_replicas: int | None = None,
                  devices: list | None = None, output_device=None):
    """``torch.nn.parallel.data_parallel`` on threads: scatter, replicate, apply, gather.

    ``devices`` defaults to ``num_replicas`` times the CPU; the output lands on
    ``output_device`` (default ``devices[0]``), where the caller computes the loss. Its
    backward runs through every replica and sums their gradients into ``module``'s.
    """
    if devices is None:
        if not num_replicas or num_replicas < 1:
            raise ValueError("give num_replicas >= 1 or a list of devices")
        devices = [torch.device("cpu")] * num_replicas
    output_device = devices[0] if output_device is None else output_device
    chunks = scatter(inputs, devices)
    replicas = replicate(module, devices[:len(chunks)])
    return gather(parallel_apply(replicas, chunks), output_device)


# ----------------------------------------------------------------------------- dp.parameter_server
#
# Rank 0 is the server: it alone holds the live parameters and the optimizer. Ranks 1..W
# are workers; in iteration i, worker w computes the gradient of its shard of global batch
# i. Parameters have VERSIONS: version v is the model after v updates, and update v (the
# step from version v to v + 1) averages the W gradients of iteration v. A worker starting
# iteration i asks for the parameters; the server answers with its current version v as
# soon as v >= i - s. So the gradient of iteration i was computed on parameters at most s
# versions old, its staleness i - v, when update i applies it. s = 0: every worker waits
# for update i - 1 before iteration i, which is synchronous SGD on the averaged gradient;
# s > 0: fast workers run ahead of slow ones, on stale parameters (stale synchronous
# parallel, Ho et al. 2013).
#
# Messages go to rank 0 as a header (kind, iteration, version, samples, loss) then, for a
# push, the flat gradient; the server receives headers from any source, in arrival order.
# That needs gloo: NCCL has no receive-from-any-source.

PULL, PUSH = 0, 1
HEADER_TAG, GRAD_TAG, PARAM_TAG = 11, 12, 13


@dataclass
class ServerLog:
    """What the server saw. ``applied``: one ``(worker, iteration, version)`` per gradient,
    in arrival order (``version`` = the parameters it was computed on); ``losses``: per
    update, the workers' sample-weighted loss of that iteration."""
    staleness_bound: int
    applied: list[tuple[int, int, int]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    @property
    def staleness(self) -> list[int]:
        """Per applied gradient: how many updates its parameters were behind its iteration."""
        return [iteration - version for _, iteration, version in self.applied]


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in trainable_parameters(model)])


@torch.no_grad()
def load_flat_params(model: nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    for p in trainable_parameters(model):
        p.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


def flat_grads(model: nn.Module) -> torch.Tensor:
    """All trainable gradients in one vector; zeros where ``.grad`` is None (unused)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in trainable_parameters(model)])


def set_flat_grads(model: nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    for p in trainable_parameters(model):
        p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()


def send_header(kind: int, iteration: int, version: int = -1, samples: int = 0, loss: float = 0.0) -> None:
    """Worker -> server: a PULL (give me parameters for ``iteration``) or a PUSH (here is
    the gradient of ``iteration``, computed on ``version`` over ``samples`` samples)."""
    header = torch.tensor([kind, iteration, version, samples, loss], dtype=torch.float64)
    dist.send(header, dst=0, tag=HEADER_TAG)


def recv_header() -> tuple[int, int, int, int, int, float]:
    """Server: the next header from ANY worker: ``(sender, kind, iteration, version, samples, loss)``."""
    header = torch.empty(5, dtype=torch.float64)
    sender = dist.recv(header, tag=HEADER_TAG)
    kind, iteration, version, samples, loss = header.tolist()
    return sender, int(kind), int(iteration), int(version), int(samples), loss


def send_params(model: nn.Module, version: int, worker: int) -> None:
    dist.send(torch.tensor([version], dtype=torch.float64), dst=worker, tag=PARAM_TAG)
    dist.send(flat_params(model), dst=worker, tag=PARAM_TAG)


def recv_params(model: nn.Module) -> int:
    """Worker: load the parameters the server sent into ``model``; return their version."""
    version = torch.empty(1, dtype=torch.float64)
    dist.recv(version, src=0, tag=PARAM_TAG)
    flat = flat_params(model).clone()
    dist.recv(flat, src=0, tag=PARAM_TAG)
    load_flat_params(model, flat)
    return int(version.item())


def serve(model: nn.Module, optimizer, num_workers: int, num_steps: int, staleness: int) -> ServerLog:
    """Rank 0: answer pulls, collect pushes, apply ``num_steps`` updates; return the log.

    Loop on ``recv_header()`` until every update is applied:
    * a PULL for iteration i is answered (``send_params(model, version, sender)``) once
      ``version >= i - staleness``; until then it waits in a list;
    * a PUSH brings a flat gradient (receive it from that sender with ``tag=GRAD_TAG``)
      for iteration i; record ``(sender, i, version it was computed on)`` in the log.
    Update v applies when all ``num_workers`` gradients of iteration v are in: the
    sample-weighted mean, ``sum n_w g_w / sum n_w``, as ``.grad`` (``set_flat_grads``),
    then ``optimizer.step()``. Updates apply in order; after each one, answer the pulls
    it unblocked. Gradients of later iterations may arrive first: keep them until then.
    """
    # BEGIN SOLUTION dp.parameter_server: loop recv_header(); buffer pushes per iteration (weighted sum, samples, count); apply update `version` when all workers' grads are in; answer pulls once version >= iteration - staleness
    log = ServerLog(staleness)
    like = flat_params(model)  # the shape and dtype of every pushed gradient
    version = 0
    rounds: dict[int, list] = {}          # iteration -> [sum n*g, samples, sum n*loss, pushes]
    waiting: list[tuple[int, int]] = []   # pulls not answered yet: (worker, iteration)
    while version < num_steps:
        sender, kind, iteration, read_version, samples, loss = recv_header()
        if kind == PULL:
            waiting.append((sender, iteration))
        else:
            grad = torch.empty_like(like)
            dist.recv(grad, src=sender, tag=GRAD_TAG)
            acc = rounds.setdefault(iteration, [torch.zeros_like(grad), 0, 0.0, 0])
            acc[0] += samples * grad
            acc[1] += samples
            acc[2] += samples * loss
            acc[3] += 1
            log.applied.append((sender, iteration, read_version))
        # Update `version` needs every worker's gradient of iteration `version`.
        while version in rounds and rounds[version][3] == num_workers:
            grad_sum, total, loss_sum, _ = rounds.pop(version)
            set_flat_grads(model, grad_sum / total)
            optimizer.step()
            log.losses.append(loss_sum / total)
            version += 1
        # Answer every pull the parameters are now fresh enough for.
        still_waiting = []
        for worker, iteration in waiting:
            if version >= iteration - staleness:
                send_params(model, version, worker)
            else:
                still_waiting.append((worker, iteration))
        waiting = still_waiting
    return log
    # END SOLUTION


def work(model: nn.Module, loss_fn, shards: list[tuple], delays: list[float]) -> None:
    """Ranks 1..W: for each iteration i, with ``(x, y) = shards[i]``: pull (``send_header``
    PULL, then ``recv_params``), compute ``loss_fn(model, x, y)`` and its gradient, sleep
    ``delays[i]`` seconds (a slow worker), push (header with the version you computed on,
    the sample count and the loss; then ``flat_grads`` with ``tag=GRAD_TAG``)."""
    # BEGIN SOLUTION dp.parameter_server: per shard i: send_header(PULL, i); version = recv_params(model); zero grads, loss_fn(...).backward(); sleep(delays[i]); send_header(PUSH, i, version, len(x), loss); dist.send(flat_grads(model), 0, tag=GRAD_TAG)
    for iteration, ((x, y), delay) in enumerate(zip(shards, delays)):
        send_header(PULL, iteration)
        version = recv_params(model)
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, x, y)
        loss.backward()
        if delay:
            time.sleep(delay)
        send_header(PUSH, iteration, version, len(x), loss.item())
        dist.send(flat_grads(model), dst=0, tag=GRAD_TAG)
    # END SOLUTION


def run_parameter_server(model: nn.Module, optimizer, loss_fn, batches: list[tuple],
                         staleness: int = 0, delays: dict | None = None) -> ServerLog | None:
    """Train ``model`` on ``batches`` (one global ``(x, y)`` per iteration) with a parameter server.

    Call on every rank with the same arguments (``optimizer`` is used on rank 0 only).
    Worker w (rank w >= 1) trains on part w - 1 of each global batch, split by
    ``torch.tensor_split``. ``delays[rank]``: seconds that worker sleeps per iteration
    (a number, or a list with one entry per iteration), to make it a straggler.
    Afterwards every rank's ``model`` holds the final parameters; rank 0 returns the
    ``ServerLog``, the workers None. Needs at least 2 ranks: one server, one worker.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        raise ValueError("a parameter server needs at least 2 ranks: rank 0 serves, the others work")
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    workers = world - 1
    if any(len(x) < workers for x, _ in batches):
        raise ValueError(f"every global batch needs at least {workers} samples, one per worker")
    log = None
    if rank == 0:
        log = serve(model, optimizer, workers, len(batches), staleness)
    else:
        shards = [(x.tensor_split(workers)[rank - 1], y.tensor_split(workers)[rank - 1]) for x, y in batches]
        delay = (delays or {}).get(rank, 0.0)
        work(model, loss_fn, shards, [delay] * len(batches) if isinstance(delay, (int, float)) else list(delay))
    final = flat_params(model).clone()
    dist.broadcast(final, src=0)  # the server's parameters are the result
    load_flat_params(model, final)
    return log
