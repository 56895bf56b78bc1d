"""Chapter 02 exercises: DistributedDataParallel, built from autograd hooks.

Every rank holds a full replica of the model and trains on its own slice of the batch.
The replicas stay identical if (a) they start identical and (b) every rank applies the same
gradient: the average over ranks. DDP gets there with four moves:

1. Broadcast. At construction, copy rank 0's parameters and buffers to every rank.
2. Hooks. ``Tensor.register_post_accumulate_grad_hook`` calls us the moment autograd has
   finished a parameter's ``.grad`` (once, even for a tied parameter used twice). We start an
   *asynchronous* all-reduce right there and let autograd go on with the earlier layers:
   communication overlaps with the rest of backward.
3. Buckets. One all-reduce per parameter pays the per-message latency (alpha, chapter 00)
   hundreds of times. So the gradients are packed into flat buckets of about
   ``bucket_cap_mb`` each, filled in *reverse* registration order (roughly the order backward
   produces them, last layer first), and each bucket is all-reduced once, when it is full.
   Buckets are launched in index order on every rank: ranks match collectives by the order
   they are issued, so a rank must never launch bucket 2 before bucket 1.
4. Wait. A callback queued on the autograd engine runs after backward's last node: it waits
   for the outstanding all-reduces, so when ``loss.backward()`` returns every ``.grad`` is
   the average, exactly as with ``torch.nn.parallel.DistributedDataParallel``.

Communication hooks. What "launch a bucket" means is given code, ``DDP._communicate``: by
default it divides the bucket by the group size and starts an async all-reduce, which is
what the built-in's default hook does. ``register_comm_hook(state, hook)`` replaces that, as
in the built-in: ``hook(state, bucket) -> torch.futures.Future[Tensor]`` gets a
``BucketView`` (``index()``, ``is_last()``, ``buffer()``, ``parameters()``, ``gradients()``,
the methods of torch's ``dist.GradBucket``), must leave the average in the future's value,
and the value lands in the bucket's buffer when the launch is waited on. So the same hook
(chapter 11's fp16 or PowerSGD, or torch's own) runs on this DDP and on the built-in.

``no_sync()`` skips 2-4 for gradient accumulation: gradients of several micro-batches add up
locally in ``.grad``, and the first backward outside it averages the accumulated sum.

Choosing the mode: ``DDP(module, bucket_cap_mb=25.0)`` buckets (the default, like the
built-in); ``bucket_cap_mb=None`` is the per-parameter mode: one all-reduce per gradient
(no buckets, so no communication hooks).

Unused parameters. A trainable parameter that gets no gradient would leave its bucket
waiting forever. As in the built-in, that is an error unless ``find_unused_parameters=True``;
then, at the end of backward, the missing ones are marked ready (contributing zeros, or the
gradient they accumulated under ``no_sync``), one small all-reduce tells every rank which
parameters *some* rank used, and a parameter that no rank used keeps its ``.grad`` as it was
(``None``), so the optimizer skips it. Frozen parameters are never hooked nor bucketed.
(The built-in finds unused parameters right after forward by walking the autograd graph, so
their buckets need not wait for the end of backward; we keep it simple.) Bucketed mode is safe
when ranks use different parameters; per-parameter mode launches in hook order, which then
differs between ranks, so it needs every rank to use the same parameters.

Tasks (run ``labkit grade ddp``; tests in ``tests/grading/test_ddp.py``):
    ddp.broadcast       broadcast_tensors
    ddp.per_parameter   DDP._all_reduce_parameter, DDP._finish_per_parameter
    ddp.bucketed        assign_buckets, DDP._add_to_bucket, DDP._finish_buckets
    ddp.no_sync         DDP.no_sync
The rest of ``DDP`` (hook registration, ``_communicate`` and communication hooks, the
end-of-backward callback, unused parameters) is given: read it first, it calls your methods.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable

MB = 2 ** 20  # bucket_cap_mb counts mebibytes, like the built-in


def broadcast_tensors(tensors: list[torch.Tensor], group=None) -> None:
    """Overwrite every tensor, in place, with its value on the group's first rank.

    Send one message per dtype, not one per tensor: flatten the tensors of a dtype into one
    buffer, broadcast it from group rank 0 (``dist.broadcast(..., group_src=0)``), and copy
    the slices back. Parameters require grad: write them under ``torch.no_grad()``.
    """
    # BEGIN SOLUTION ddp.broadcast: one broadcast per dtype from group rank 0: flatten, broadcast, copy the slices back in place
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for same in by_kind.values():
            flat = torch.cat([t.reshape(-1) for t in same])
            dist.broadcast(flat, group=group, group_src=0)
            offset = 0
            for t in same:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
    # END SOLUTION


def assign_buckets(params: list[nn.Parameter], cap_bytes: int) -> list[list[nn.Parameter]]:
    """Split ``params`` (in registration order) into buckets, listed in launch order.

    Walk the parameters in REVERSE order, appending each to the open bucket; close the bucket
    as soon as it holds at least ``cap_bytes`` bytes (so a bucket may pass the cap by one
    parameter, and a parameter bigger than the cap gets a bucket of its own). A parameter
    whose dtype differs from the open bucket's starts a new bucket: a bucket is one flat
    tensor. Example, sizes [4, 4, 4] bytes, cap 6: buckets [[p2, p1], [p0]].
    """
    # BEGIN SOLUTION ddp.bucketed: walk the parameters in reverse; close a bucket once it holds >= cap_bytes (or the dtype changes)
    buckets: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in reversed(params):
        if current and p.dtype != current[0].dtype:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets
    # END SOLUTION


@dataclass
class Bucket:
    params: list[nn.Parameter]     # in bucket order (reverse registration)
    slots: list[torch.Tensor]      # views of ``buffer``, one per parameter, shaped like it
    buffer: torch.Tensor           # flat gradients of all ``params``: one all-reduce per step
    index: int = 0                 # its place in the launch order
    waiting: int = 0               # gradients not yet copied in during this backward
    work: object = None            # once launched: what ``DDP._communicate`` returned (has .wait())


def make_bucket(params: list[nn.Parameter], index: int = 0) -> Bucket:
    buffer = params[0].new_zeros(sum(p.numel() for p in params))
    slots, offset = [], 0
    for p in params:  # made once: slicing a view per gradient per step would cost Python time
        slots.append(buffer[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    return Bucket(params, slots, buffer, index, waiting=len(params))


class BucketView:
    """What a communication hook sees of a bucket: the methods of torch's ``dist.GradBucket``
    (and of chapter 11's ``FlatBucket``). ``gradients()`` are views of ``buffer()``."""

    def __init__(self, bucket: Bucket, last: bool):
        self._bucket, self._last = bucket, last

    def index(self) -> int:
        return self._bucket.index

    def is_last(self) -> bool:
        return self._last

    def buffer(self) -> torch.Tensor:
        return self._bucket.buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._bucket.slots

    def parameters(self) -> list[nn.Parameter]:
        return self._bucket.params


class HookResult:
    """A hook's future, waited like a ``dist.Work``: ``wait()`` puts its value in the buffer."""

    def __init__(self, future: torch.futures.Future, buffer: torch.Tensor, name: str):
        self.future, self.buffer, self.name = future, buffer, name

    def wait(self) -> None:
        value = self.future.wait()
        if isinstance(value, (list, tuple)) and len(value) == 1:  # e.g. a bare all_reduce's future
            value = value[0]
        if not isinstance(value, torch.Tensor) or value.numel() != self.buffer.numel():
            raise RuntimeError(f"DDP: the communication hook {self.name}'s future must hold one tensor of the "
                               f"bucket's {self.buffer.numel()} elements, got {_describe(value)}")
        if value.data_ptr() != self.buffer.data_ptr():  # a hook may return a new tensor
            self.buffer.copy_(value.view_as(self.buffer))


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of {value.numel()} elements"
    return type(value).__name__


class DDP(nn.Module):
    """A drop-in for ``torch.nn.parallel.DistributedDataParallel`` (CPU or one device per rank).

    ``bucket_cap_mb``: bucket size in MiB; ``None`` = one all-reduce per parameter.
    ``process_group``: the ranks that share this model (default: all).
    ``find_unused_parameters``: allow trainable parameters that get no gradient in a step.
    ``broadcast_buffers``: broadcast rank 0's buffers at every forward, like the built-in.
    ``init_sync``: broadcast rank 0's parameters and buffers at construction.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = 25.0, process_group=None, *,
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 init_sync: bool = True):
        super().__init__()
        self.module = module
        # None means the default group, looked up at each call: holding the group object
        # would keep gloo's threads alive after destroy_process_group(), and a process that
        # exits with them alive can abort (SIGABRT) while the interpreter shuts down.
        self.group = process_group
        self.world_size = dist.get_world_size(self.group)
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.module_buffers = list(module.buffers())  # listed once: walking the modules costs time
        # module.parameters() yields a tied Parameter once: one hook, one slot, one average.
        # Frozen parameters never get a gradient: nothing to hook or to bucket.
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.names = {p: name for name, p in module.named_parameters()}
        if init_sync:
            broadcast_tensors([*module.parameters(), *self.module_buffers], self.group)
        self.buckets: list[Bucket] | None = None
        self.bucket_of: dict[nn.Parameter, tuple[Bucket, torch.Tensor]] = {}  # param -> (bucket, slot)
        if bucket_cap_mb is not None:
            self.buckets = [make_bucket(ps, i) for i, ps in
                            enumerate(assign_buckets(self.params, int(bucket_cap_mb * MB)))]
            for bucket in self.buckets:
                for p, slot in zip(bucket.params, bucket.slots):
                    self.bucket_of[p] = (bucket, slot)
        self.require_backward_grad_sync = True  # no_sync() turns it off for its block
        self._sync_now = True           # decided at forward: does the coming backward average?
        self._works: list[dist.Work] = []   # per-parameter mode: all-reduces in flight
        self._next_bucket = 0           # bucketed mode: the next bucket to launch
        self._ready: set[nn.Parameter] = set()  # hooks fired in this (synchronised) backward
        self._used: set[nn.Parameter] = set()   # got a gradient since the last synchronisation
        self._callback_queued = False
        self._comm_hook: tuple | None = None  # (state, hook) once registered
        self._backward_seen = False     # a hook must be registered before the first backward
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def forward(self, *inputs, **kwargs):
        if self.broadcast_buffers and self.module_buffers:
            broadcast_tensors(self.module_buffers, self.group)
        # Like the built-in, the forward decides: a forward run inside no_sync() gets a local
        # backward even if backward is called after the with-block ends.
        self._sync_now = self.require_backward_grad_sync
        if self._sync_now:
            self._start_step()
        return self.module(*inputs, **kwargs)

    def register_comm_hook(self, state: object, hook) -> None:
        """Run ``hook(state, bucket) -> torch.futures.Future[Tensor]`` on every bucket instead
        of the default divide-and-all-reduce; torch's rules: once, before the first backward,
        and (here) bucketed mode only. The hook divides by the group size itself."""
        if self.buckets is None:
            raise RuntimeError("DDP.register_comm_hook: communication hooks run on buckets; this DDP is in "
                               "per-parameter mode (bucket_cap_mb=None): pass a bucket_cap_mb")
        if not callable(hook):
            raise TypeError(f"DDP.register_comm_hook: the hook must be callable, got {type(hook).__name__}")
        if self._comm_hook is not None:
            raise RuntimeError("DDP.register_comm_hook can only be called once")
        if self._backward_seen:
            raise RuntimeError("DDP.register_comm_hook must be called before the first backward")
        self._comm_hook = (state, hook)

    def _start_step(self) -> None:
        """Forget the last backward's bookkeeping (also after an exception cut one short)."""
        self._callback_queued = False
        self._works.clear()
        self._ready.clear()
        self._next_bucket = 0
        for bucket in self.buckets or []:
            bucket.waiting, bucket.work = len(bucket.params), None

    # ------------------------------------------------------------------ during backward

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        """The hook: autograd has finished ``param.grad`` for this backward."""
        self._used.add(param)
        self._backward_seen = True
        if not self._sync_now:
            return  # inside no_sync(): the gradient stays local and accumulates in .grad
        if not self._callback_queued:
            # Autograd runs queued callbacks once this backward has run its last node: the
            # place to wait for the communication we are about to start.
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)
        self._ready.add(param)
        self._grad_ready(param)

    def _grad_ready(self, param: nn.Parameter) -> None:
        if self.buckets is None:
            self._all_reduce_parameter(param)
        else:
            self._add_to_bucket(param)

    def _all_reduce_parameter(self, param: nn.Parameter) -> None:
        """Per-parameter mode: start averaging ``param.grad`` now, without waiting for it.

        Divide by the world size first (the sum of the quotients is the average), start
        ``dist.all_reduce(..., group=self.group, async_op=True)`` on the gradient in place
        and keep the returned work in ``self._works``.
        """
        # BEGIN SOLUTION ddp.per_parameter: pre-divide the gradient by the world size, start an async all-reduce of it, keep the work
        param.grad.div_(self.world_size)
        self._works.append(dist.all_reduce(param.grad, group=self.group, async_op=True))
        # END SOLUTION

    def _add_to_bucket(self, param: nn.Parameter) -> None:
        """Bucketed mode: copy ``param.grad`` into its bucket; launch every bucket now ready.

        ``self.bucket_of[param]`` is ``(bucket, slot)``, ``slot`` the view of the bucket's
        buffer that holds this parameter's gradient. Once a bucket has all its
        gradients (``waiting`` reaches 0), it may be launched, but only in index order:
        launch ``self.buckets[self._next_bucket]`` while it is complete, then move on.
        Launching = ``self._communicate(bucket)`` (given: divide and async all-reduce, or the
        registered hook); keep what it returns in ``bucket.work``.
        """
        # BEGIN SOLUTION ddp.bucketed: copy the gradient into its slot; launch complete buckets strictly in index order with self._communicate
        bucket, slot = self.bucket_of[param]
        slot.copy_(param.grad)
        bucket.waiting -= 1
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].waiting == 0:
            ready = self.buckets[self._next_bucket]
            ready.work = self._communicate(ready)
            self._next_bucket += 1
        # END SOLUTION

    def _communicate(self, bucket: Bucket):
        """Start averaging a complete bucket; returns a handle whose ``wait()`` leaves the
        average in ``bucket.buffer``. Without a hook, torch's default hook: divide by the group
        size (the sum of the quotients is the average), async all-reduce. With one, the hook
        on a ``BucketView``; its future's value is copied into the buffer when waited on."""
        if self._comm_hook is None:
            bucket.buffer.div_(self.world_size)
            return dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
        state, hook = self._comm_hook
        name = getattr(hook, "__qualname__", repr(hook))
        future = hook(state, BucketView(bucket, last=bucket.index == len(self.buckets) - 1))
        if not isinstance(future, torch._C.Future):  # torch.futures.Future, or what its .then() returns
            raise TypeError(f"DDP: the communication hook {name} must return a torch.futures.Future, "
                            f"got {type(future).__name__}")
        return HookResult(future, bucket.buffer, name)

    # ------------------------------------------------------------------ end of backward

    def _end_of_backward(self) -> None:
        """Runs once per synchronised backward, after autograd's last node."""
        missing = [p for p in self.params if p not in self._ready]
        if missing and not self.find_unused_parameters:
            raise RuntimeError(
                f"DDP: parameters {[self.names[p] for p in missing]} got no gradient in this "
                "backward; pass find_unused_parameters=True if some are not used in every step")
        restore = self._mark_unused_ready(missing) if self.find_unused_parameters else []
        if self.buckets is None:
            self._finish_per_parameter()
        else:
            self._finish_buckets()
        for p, grad in restore:
            p.grad = grad
        self._used.clear()
        self._start_step()

    def _mark_unused_ready(self, missing: list[nn.Parameter]) -> list[tuple]:
        """find_unused_parameters: the parameters this backward did not reach become ready now.

        Bucketed mode first completes its buckets (a missing parameter contributes its current
        .grad, or zeros): every rank then issues the same all-reduces in the same order, even
        if the ranks used different parameters. Next, every rank, every step, joins one small
        all-reduce that counts the ranks that used each parameter. One that no rank used gets
        its old .grad back afterwards (None stays None), like the built-in. Returns those
        (parameter, old .grad) pairs.
        """
        old = {p: p.grad for p in missing}
        if self.buckets is not None:
            for p in missing:  # a fresh tensor: the copy back must not overwrite the old .grad
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad.clone()
                self._ready.add(p)
                self._add_to_bucket(p)
        used = torch.tensor([p in self._used for p in self.params], dtype=torch.int32,
                            device=self.params[0].device)  # NCCL needs it on the GPU
        dist.all_reduce(used, group=self.group)
        used_somewhere = {p for p, count in zip(self.params, used.tolist()) if count}
        restore = []
        for p in missing:
            if p not in used_somewhere:
                if self.buckets is not None:
                    restore.append((p, old[p]))
                continue  # per-parameter mode: no rank all-reduces it
            if self.buckets is None:
                # Used on other ranks only: join their average with zeros (or what we accumulated).
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self._ready.add(p)
                self._all_reduce_parameter(p)
        return restore

    def _finish_per_parameter(self) -> None:
        """Per-parameter mode: wait for every all-reduce in ``self._works``, then forget them."""
        # BEGIN SOLUTION ddp.per_parameter: wait for every all-reduce you started during backward, then forget them
        for work in self._works:
            work.wait()
        self._works.clear()
        # END SOLUTION

    def _finish_buckets(self) -> None:
        """Bucketed mode: wait for each bucket's launch (``bucket.work``), then copy its slots
        (the average, once waited on) into the parameters' ``.grad``."""
        # BEGIN SOLUTION ddp.bucketed: wait for each bucket's launch, then copy its slots back into the parameters' .grad
        for bucket in self.buckets:
            bucket.work.wait()
            for p, slot in zip(bucket.params, bucket.slots):
                p.grad.copy_(slot)
        # END SOLUTION

    # ------------------------------------------------------------------ gradient accumulation

    @contextmanager
    def no_sync(self):
        """Within this block, forward/backward keep gradients local (they accumulate in .grad).

        Turn ``self.require_backward_grad_sync`` off for the body of the ``with`` block and
        restore the previous value afterwards, even if the body raises.
        """
        # BEGIN SOLUTION ddp.no_sync: switch require_backward_grad_sync off for the with-block; restore it even if the block raises
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous
        # END SOLUTION
