"""Per-rank memory accounting: what parameters, gradients and optimizer state hold, and the
peak of live tensor bytes during a step.

Static accounting counts each storage once (tied weights share one), and for a sharded
(DTensor) parameter counts only this rank's local shard: that is what the rank holds.

``PeakMemory`` measures the peak during a block of code. On CUDA it reads the caching
allocator's statistics. On CPU there is no allocator counter to read, so it watches every
tensor op (a dispatch mode), tracks the storages that ops produce until they are freed,
and adds the tensors you hand it (model, optimizer) that exist before the block starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard on this rank


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a tensor, or any nested container)."""
    seen, total = set(), 0
    for t in tree_leaves(tensors):
        if isinstance(t, torch.Tensor):
            storage = _local(t).untyped_storage()
            if storage._cdata not in seen:  # the storage itself, not its address: meta ones share 0
                seen.add(storage._cdata)
                total += storage.nbytes()
    return total


def param_bytes(module: torch.nn.Module) -> int:
    return tensor_bytes(list(module.parameters()))


def grad_bytes(module: torch.nn.Module) -> int:
    return tensor_bytes([p.grad for p in module.parameters() if p.grad is not None])


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's per-parameter state (Adam's moments, step counters...).

    Wrappers that keep the real state in an inner optimizer (``ZeroRedundancyOptimizer``
    holds its shard's state in ``.optim``) are counted through it.
    """
    inner = getattr(optimizer, "optim", None)
    if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
        return optimizer_state_bytes(inner) + tensor_bytes(_state_tensors(optimizer))
    return tensor_bytes(_state_tensors(optimizer))


def _state_tensors(optimizer: torch.optim.Optimizer) -> list:
    return [list(state.values()) for state in optimizer.state.values()]


@dataclass
class MemoryReport:
    params: int
    grads: int
    optimizer_state: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_state

    def __str__(self) -> str:
        mib = 2 ** 20
        return (f"params {self.params / mib:.3f} MiB, grads {self.grads / mib:.3f} MiB, "
                f"optimizer state {self.optimizer_state / mib:.3f} MiB")


def memory_report(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> MemoryReport:
    return MemoryReport(param_bytes(module), grad_bytes(module),
                        optimizer_state_bytes(optimizer) if optimizer is not None else 0)


class PeakMemory(TorchDispatchMode):
    """Peak of live tensor bytes while the block runs::

        with PeakMemory(model, optimizer) as mem:
            loss = model(x).sum(); loss.backward(); optimizer.step()
        mem.peak_bytes

    Pass what is alive before the block (model, optimizer, inputs) so it is counted.
    On CPU every op goes through Python while active, so do not time code under it.
    """

    def __init__(self, *alive, device: torch.device | str | None = None):
        super().__init__()
        self.device = torch.device(device) if device is not None else _device_of(alive)
        self.alive = alive
        self.peak_bytes = 0
        self._live: dict[int, StorageWeakRef] = {}

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return self  # the allocator keeps count; no need to watch ops
        for t in _tensors_of(self.alive):
            self._track(t)
        self.peak_bytes = self.live_bytes()
        return super().__enter__()

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
            return False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes())
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = _local(t).untyped_storage()
        known = self._live.get(storage._cdata)  # views share their base's storage: count it once
        if known is None or known.expired():  # (an expired entry: a freed storage's address reused)
            self._live[storage._cdata] = StorageWeakRef(storage)

    def live_bytes(self) -> int:
        """Bytes of the tracked storages still alive, at their current size: storages can be
        resized in place (FSDP frees unsharded parameters with ``resize_(0)``)."""
        total = 0
        for key, ref in list(self._live.items()):
            if ref.expired():
                del self._live[key]  # freed; a new storage may reuse its address (and key)
            else:
                total += torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
        return total


def _tensors_of(things) -> list[torch.Tensor]:
    """Parameters, gradients, buffers and optimizer state reachable from ``things``."""
    tensors = []
    for thing in things:
        if isinstance(thing, torch.nn.Module):
            tensors += [p for p in thing.parameters()] + list(thing.buffers())
            tensors += [p.grad for p in thing.parameters() if p.grad is not None]
        elif isinstance(thing, torch.optim.Optimizer):
            tensors += [t for s in thing.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        else:
            tensors += [t for t in tree_leaves(thing) if isinstance(t, torch.Tensor)]
    return tensors


def _device_of(things) -> torch.device:
    for t in _tensors_of(things):
        return t.device
    return torch.device("cpu")


class SavedBytes:
    """Bytes autograd saves for backward while active (``with SavedBytes(module) as saved``):
    each storage once, the module's parameters left out (they exist anyway). Read
    ``saved.bytes`` after the forward pass."""

    def __init__(self, module):
        self.params = {p.untyped_storage()._cdata for p in module.parameters()}
        self.storages = {}

    def pack(self, t):
        storage = t.untyped_storage()
        if storage._cdata not in self.params:
            self.storages[storage._cdata] = storage.nbytes()
        return t

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    @property
    def bytes(self):
        return sum(self.storages.values())


class SavedPeak:
    """The peak of the bytes autograd holds for backward, over forward AND backward (``with
    peak.hooks(): loss = model(x).sum(); loss.backward()``; read ``peak.peak``): every tensor
    saved through ``saved_tensors_hooks`` is followed by a weak reference to its storage (each
    storage once, the given modules' parameters left out) until it is freed; the live bytes are
    sampled at every save, which is where they grow: in forward and in the recomputations of
    backward. ``live_bytes()``: those alive now."""

    def __init__(self, *exclude: torch.nn.Module):
        self.skip = {p.untyped_storage()._cdata for m in exclude for p in m.parameters()}
        self.live: dict[int, StorageWeakRef] = {}
        self.peak = 0

    def pack(self, t):
        storage = t.untyped_storage()
        if storage._cdata not in self.skip:
            known = self.live.get(storage._cdata)
            if known is None or known.expired():
                self.live[storage._cdata] = StorageWeakRef(storage)
            self.peak = max(self.peak, self.live_bytes())
        return t

    def live_bytes(self) -> int:
        total = 0
        for key, ref in list(self.live.items()):
            if ref.expired():
                del self.live[key]
            else:
                total += torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
        return total

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
