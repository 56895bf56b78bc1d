"""Chapter 04 exercises: fully sharded data parallelism (FSDP, ZeRO-3) from scratch.

DDP keeps the whole model on every rank. FSDP keeps 1/N of every parameter on each rank
(and therefore 1/N of the gradients and optimizer state), and rebuilds a full parameter
only for the moment a layer needs it. Applied like torch's ``fully_shard`` (FSDP2)::

    for block in model.blocks:
        fully_shard(block)       # one *unit* per block: gathered, used, freed together
    fully_shard(model)           # the root unit: what is left (wte/lm_head, wpe, ln_f)
    opt = torch.optim.AdamW(model.parameters())   # the shards: each rank updates its 1/N

One training step, for every unit:

    forward   all-gather the unit's shards -> run it -> free the full parameters
    backward  all-gather again -> run its backward -> reduce-scatter the gradients into
              the shards' ``.grad`` (averaged over ranks) -> free

so each rank sends 2 x (N-1)/N x Phi bytes of all-gather and (N-1)/N x Phi of
reduce-scatter per step: 3 Phi (N-1)/N, where Phi is the parameter bytes, padding
included (frozen parameters are gathered but not reduce-scattered; see
``step_bytes``). Only all-gathers and reduce-scatters: never an all-reduce.

Layout (FSDP2-style, per parameter): every parameter is cut along dim 0 into N blocks of
R = ceil(rows / N) rows; rank r keeps block r, zero-padded to R rows. We shard each
parameter on its own rather than one flat buffer per unit (FSDP1) because then
``model.parameters()`` is still one tensor per original parameter, with its name and
``requires_grad``: a frozen shard simply has no gradient, an unused one keeps ``grad=None``,
and per-parameter optimizer options keep working. To still pay one collective per unit,
the unit's shards are copied into one flat buffer before the all-gather and out of it
after (``pack_shards``/``unpack_full``; the same for gradients): that copy is the price.

Freeing the full parameters after forward only frees memory if autograd does not keep
them for backward. So while a unit runs forward it registers saved-tensor hooks: a tensor
autograd wants to save that is (a view of) one of the unit's gathered parameters is saved
as a note (``SavedParam``: which parameter, which view); backward turns the note back
into a tensor from the re-gathered parameters.

Tasks (run ``labkit grade fsdp``; tests in ``tests/grading/test_fsdp.py``):
    fsdp.shard      shard_param, and FSDPUnit.shard_parameters (replace the parameters by shards)
    fsdp.forward    start_all_gather, all_gather, AllGatherParams.forward, pre_forward,
                    pack, post_forward (gather before forward, free after it)
    fsdp.backward   PreBackward's re-gather (pre_backward), unpack, reduce_scatter_grads,
                    AllGatherParams.backward
    fsdp.prefetch   prefetch_forward, prefetch_backward (issue the next unit's all-gather early)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

UNIT_ATTR = "_fsdp_unit"  # where fully_shard leaves the unit on its module


# ----------------------------------------------------------------------------- layout


def rows_per_rank(rows: int, world: int) -> int:
    """R = ceil(rows / N): every rank keeps R rows, the last ones padded with zeros."""
    return -(-rows // world)


def shard_param(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full``: rows [rank*R, (rank+1)*R) along dim 0,
    R = ``rows_per_rank(full.shape[0], world)``, zero-padded to R rows; a new tensor
    (not a view: the full tensor must be free to go)."""
    # BEGIN SOLUTION fsdp.shard: take rows [rank*R, (rank+1)*R) of full (R = ceil(rows/N)) into a zero tensor of R rows
    rows = rows_per_rank(full.shape[0], world)
    shard = full.new_zeros((rows, *full.shape[1:]))
    mine = full[rank * rows:(rank + 1) * rows]  # fewer than R rows (maybe none) at the end
    shard[:mine.shape[0]] = mine
    return shard
    # END SOLUTION


@dataclass
class ShardedParam:
    """One original parameter of a unit, as this rank keeps it."""
    shape: torch.Size                        # the full (unpadded) shape
    places: list[tuple[nn.Module, str]]      # (module, attribute name): two for a tied weight
    shard: nn.Parameter | None = None        # this rank's rows, padded: what the optimizer sees
    param_dtype: torch.dtype | None = None   # mixed precision: gathered and used in this dtype
    reduce_dtype: torch.dtype | None = None  # mixed precision: gradients reduced in this dtype

    @property
    def rows(self) -> int:
        return self.shard.shape[0]


def pack_shards(params: list[ShardedParam]) -> torch.Tensor:
    """The unit's shards back to back in one flat buffer: this rank's all-gather input. With
    mixed precision the shards are cast to ``param_dtype`` here, so the all-gather moves (and
    the full parameters take) 2 bytes per value instead of 4; the shards stay fp32 masters."""
    return torch.cat([p.shard.detach().reshape(-1).to(p.param_dtype or p.shard.dtype) for p in params])


def unpack_full(gathered: torch.Tensor, params: list[ShardedParam], world: int) -> list[torch.Tensor]:
    """Full parameters from an all-gathered flat buffer [rank 0's pack | rank 1's | ...].

    Parameter p's rows from rank r sit in block r at p's offset; stacking the blocks of
    all ranks gives the padded full tensor. Each full parameter gets its own storage (a
    copy), so the unit can free them and autograd can tell them apart.
    """
    per_rank = gathered.view(world, -1)
    fulls, offset = [], 0
    for p in params:
        k = p.shard.numel()
        padded = gathered.new_empty((world * p.rows, *p.shape[1:]))
        padded.view(world, k).copy_(per_rank[:, offset:offset + k])
        fulls.append(padded[:p.shape[0]])  # a view without the padding rows
        offset += k
    return fulls


def pack_grads(grads: list[torch.Tensor], params: list[ShardedParam], world: int) -> torch.Tensor:
    """Full gradients as the flat reduce-scatter input: block r holds, parameter after
    parameter, the (zero-padded) rows that rank r keeps, so block r lands on rank r.
    Copied straight into place: no padded copy of each gradient on the way."""
    # Mixed precision: the reduce-scatter runs in reduce_dtype (default: the gradients' dtype).
    dtype = params[0].reduce_dtype or grads[0].dtype
    flat = grads[0].new_zeros(world, sum(p.shard.numel() for p in params), dtype=dtype)
    offset = 0
    for g, p in zip(grads, params):
        k = p.shard.numel()
        rows = g.reshape(g.shape[0], -1)                           # [rows, rest]
        blocks = flat[:, offset:offset + k].view(world, p.rows, -1)  # rank r's rows of p, a view
        whole, part = divmod(g.shape[0], p.rows)  # ranks whose rows are all real; then a partial one
        blocks[:whole].copy_(rows[:whole * p.rows].reshape(whole, p.rows, -1))
        if part:
            blocks[whole, :part].copy_(rows[whole * p.rows:])
        offset += k
    return flat.view(-1)


def unpack_shard_grads(flat: torch.Tensor, params: list[ShardedParam]) -> list[torch.Tensor]:
    """This rank's reduce-scatter output, cut into one gradient per shard (in the shard's
    dtype: with mixed precision the gradient lands on the fp32 master shard)."""
    grads, offset = [], 0
    for p in params:
        grads.append(flat[offset:offset + p.shard.numel()].view_as(p.shard).to(p.shard.dtype))
        offset += p.shard.numel()
    return grads


# ----------------------------------------------------------------------------- autograd glue


@dataclass
class SavedParam:
    """What autograd saves instead of (a view of) a gathered parameter."""
    unit: "FSDPUnit"
    index: int                  # which of the unit's parameters
    shape: torch.Size           # the view autograd wanted: as_strided(shape, stride, offset)
    stride: tuple[int, ...]
    offset: int


def storage_key(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without a plain storage
        return None


class AllGatherParams(torch.autograd.Function):
    """Forward: all-gather the unit's shards into full parameters. Backward: the adjoint
    of an all-gather is a reduce-scatter, so the full parameters' gradients (summed over
    every use in the unit, tied weights included) are reduce-scattered into the shards'
    gradients. Autograd calls backward once all those gradients exist: exactly when the
    unit's backward is done."""

    @staticmethod
    def forward(ctx, unit, *shards):
        ctx.unit = unit
        ctx.set_materialize_grads(False)  # an unused parameter's gradient stays None
        # BEGIN SOLUTION fsdp.forward: all-gather (unit.all_gather()); mark the full tensors of frozen shards non-differentiable
        fulls = unit.all_gather()
        ctx.mark_non_differentiable(*[f for f, s in zip(fulls, shards) if not s.requires_grad])
        return tuple(fulls)
        # END SOLUTION

    @staticmethod
    def backward(ctx, *full_grads):
        # BEGIN SOLUTION fsdp.backward: free the unit (reshard), reduce-scatter the full grads into shard grads, return (None, *shard_grads)
        ctx.unit.reshard()  # the unit's backward is over: free its parameters before reducing
        return (None, *ctx.unit.reduce_scatter_grads(full_grads))
        # END SOLUTION


class PreBackward(torch.autograd.Function):
    """Identity on a unit's outputs. Its backward runs when their gradients arrive, i.e.
    just before the unit's own backward: the moment to re-gather the unit."""

    @staticmethod
    def forward(ctx, unit, *outputs):
        ctx.unit = unit
        ctx.set_materialize_grads(False)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.pre_backward()
        return (None, *grads)


def register_pre_backward(unit: "FSDPUnit", output):
    """Route the gradients of the unit's outputs (any nesting) through ``PreBackward``."""
    flat, spec = tree_flatten(output)
    where = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not where:
        return output
    routed = PreBackward.apply(unit, *[flat[i] for i in where])
    for i, t in zip(where, routed):
        flat[i] = t
    return tree_unflatten(flat, spec)


# ----------------------------------------------------------------------------- units


class Schedule:
    """What the units of one model share: the order they ran in, for prefetching, and
    the clean-up at the end of backward. The root is the outermost unit."""

    def __init__(self, root: "FSDPUnit"):
        self.root = root
        self.units = [root]
        self.forward_order: list[FSDPUnit] = []       # forward started, this step
        self.last_forward_order: list[FSDPUnit] = []  # ... in the previous step
        self.post_forward_order: list[FSDPUnit] = []  # forward finished, this step
        self.backward_running = False

    def record_pre_forward(self, unit: "FSDPUnit") -> None:
        if unit is self.root:  # a new step begins
            self.last_forward_order = self.forward_order or self.last_forward_order
            self.forward_order, self.post_forward_order = [], []
        self.forward_order.append(unit)

    def record_post_forward(self, unit: "FSDPUnit") -> None:
        self.post_forward_order.append(unit)
        if unit is self.root:  # forward is over: a prefetch nobody used holds stale data
            for u in self.units:
                u.drop_pending()

    def backward_started(self) -> None:
        if not self.backward_running:
            self.backward_running = True
            # Runs once the whole backward pass is done (DDP and FSDP use the same hook).
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def finish_backward(self) -> None:
        """Free what backward left gathered: units with no trainable parameter have no
        reduce-scatter to free them after, and a prefetch may have gone unused."""
        for unit in self.units:
            unit.drop_pending()
            if unit.full is not None:
                unit.reshard()
        self.backward_running = False


def unit_modules(module: nn.Module):
    """``module`` and its descendants, except those inside another unit."""
    yield module
    for child in module.children():
        if not hasattr(child, UNIT_ATTR):
            yield from unit_modules(child)


class FSDPUnit:
    """The state ``fully_shard`` attaches to a module: shards, gathered parameters, hooks."""

    def __init__(self, module: nn.Module, group, reshard_after_forward: bool, prefetch: bool,
                 mp_policy=None, replicate_params=()):
        self.module = module
        self.name = type(module).__name__
        self.group = group  # None: the default group (never hold it: see ddp.DDP.__init__)
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.reshard_after_forward = reshard_after_forward
        self.prefetch = prefetch
        self.full: list[torch.Tensor] | None = None   # the gathered parameters, while needed
        self.pending = None                           # (buffer, work): an all-gather in flight
        self.saving = None                            # the saved-tensor hooks during forward
        self.storage_index: dict[int, int] = {}       # storage of a full parameter -> its index

        # The unit takes the parameters of its module that no unit below has taken, except
        # the ones to keep whole (replicate_params: averaged like DDP instead; see below).
        below = [m for m in module.modules() if m is not module and hasattr(m, UNIT_ATTR)]
        taken = set().union(*(getattr(m, UNIT_ATTR).original_ids for m in below))
        self.replicated = list({id(p): p for p in replicate_params}.values())
        whole = {id(p) for p in self.replicated}
        owned: dict[int, ShardedParam] = {}
        originals = []
        self.whole_places = []  # (module, name, parameter) of every use of a replicated parameter
        for m in unit_modules(module):
            for name, p in m._parameters.items():
                if p is not None and id(p) in whole:
                    self.whole_places.append((m, name, p))
                if p is None or id(p) in whole:
                    continue
                if id(p) in taken:
                    raise ValueError(f"fully_shard({self.name}): parameter {type(m).__name__}.{name} is "
                                     "also used inside a unit below it; shard the module that holds "
                                     "all its uses (keep tied weights in a common parent unit)")
                if p.dim() == 0:
                    raise ValueError(f"fully_shard({self.name}): {name} is a scalar; dim-0 sharding needs dim >= 1")
                if id(p) not in owned:
                    owned[id(p)] = ShardedParam(p.shape, [], None, *policy_dtypes(mp_policy))
                    originals.append(p)
                owned[id(p)].places.append((m, name))
        dtypes = {str(p.dtype).removeprefix("torch.") for p in originals}
        if len(dtypes) > 1 and policy_dtypes(mp_policy)[0] is None:  # one flat buffer has one dtype
            raise ValueError(f"fully_shard({self.name}): its parameters mix dtypes {sorted(dtypes)}; one unit "
                             "gathers them in one buffer: give each dtype its own unit, or an mp_policy")
        self.params = list(owned.values())
        self.original_ids = set(owned)  # ids only: holding the originals would keep them alive
        self.shard_parameters(originals)

        self.schedule = Schedule(self)
        for m in below:  # this unit becomes the root of every unit below it
            unit = getattr(m, UNIT_ATTR)
            unit.schedule = self.schedule
            self.schedule.units.append(unit)

        self.param_dtype = policy_dtypes(mp_policy)[0]
        if self.param_dtype is not None and getattr(mp_policy, "cast_forward_inputs", True):
            module.register_forward_pre_hook(self.cast_inputs)  # before pre_forward: hooks run in order
        if self.param_dtype is not None and self.whole_places:
            # Replicated parameters compute in param_dtype too: a cast copy for the forward
            # (its gradient flows back through the cast onto the fp32 parameter).
            module.register_forward_pre_hook(self.cast_replicated)
            module.register_forward_hook(self.uncast_replicated, always_call=True)
        module.register_forward_pre_hook(self.pre_forward)
        module.register_forward_hook(self.post_forward, always_call=True)
        for p in self.replicated:  # whole on every rank: average their gradients, as DDP does
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self.average_replicated)

    def cast_inputs(self, module, args):
        """Mixed precision: floating-point inputs enter the unit in ``param_dtype``."""
        return tree_map_only(torch.Tensor, lambda t: t.to(self.param_dtype) if t.is_floating_point() else t, args)

    def cast_replicated(self, module, args):
        for m, name, p in self.whole_places:
            m._parameters[name] = p.to(self.param_dtype)

    def uncast_replicated(self, module, args, output):
        for m, name, p in self.whole_places:
            m._parameters[name] = p

    def average_replicated(self, param: torch.Tensor) -> None:
        """A parameter kept whole (``replicate_params``): its gradient, just accumulated, is
        averaged over the group, so every rank applies the same update and they stay equal."""
        param.grad /= self.world
        dist.all_reduce(param.grad, group=self.group)

    @property
    def shards(self) -> list[nn.Parameter]:
        return [p.shard for p in self.params]

    def shard_parameters(self, originals: list[nn.Parameter]) -> None:
        """Replace every parameter of the unit (``originals[i]`` is ``self.params[i]``'s), at
        every place it is registered, by this rank's shard: a new ``nn.Parameter`` with the
        original's ``requires_grad``."""
        # BEGIN SOLUTION fsdp.shard: for each ShardedParam: p.shard = nn.Parameter(shard_param(...), requires_grad=...); point all its places at it
        for p, original in zip(self.params, originals):
            p.shard = nn.Parameter(shard_param(original.detach(), self.rank, self.world),
                                   requires_grad=original.requires_grad)
        self.use(self.shards)
        # END SOLUTION

    def use(self, tensors: list[torch.Tensor]) -> None:
        """Point every module of the unit at ``tensors`` (the full parameters, or the shards)."""
        for p, t in zip(self.params, tensors):
            for module, name in p.places:
                module._parameters[name] = t

    def reshard(self) -> None:
        """Free the full parameters: drop our references, point the modules at the shards."""
        self.full = None
        self.storage_index = {}
        self.use(self.shards)

    # --------------------------------------------------------------- gather

    def start_all_gather(self) -> None:
        """Issue the all-gather of this unit's shards (``async_op=True``); keep
        ``(buffer, work)`` in ``self.pending`` without waiting."""
        # BEGIN SOLUTION fsdp.forward: pack_shards, then dist.all_gather_single(buffer of N x that size, ..., async_op=True)
        flat = pack_shards(self.params)
        buffer = flat.new_empty(self.world * flat.numel())
        work = dist.all_gather_single(buffer, flat, group=self.group, async_op=True)
        self.pending = (buffer, work)
        # END SOLUTION

    def all_gather(self) -> list[torch.Tensor]:
        """The unit's full parameters: finish the all-gather in flight (a prefetch), or
        start one and wait for it."""
        if not self.params:
            return []
        # BEGIN SOLUTION fsdp.forward: start_all_gather() unless one is pending; wait on it; unpack_full the buffer
        if self.pending is None:
            self.start_all_gather()
        buffer, work = self.pending
        self.pending = None
        work.wait()
        return unpack_full(buffer, self.params, self.world)
        # END SOLUTION

    def drop_pending(self) -> None:
        """Finish and discard an all-gather nobody used (collectives cannot be cancelled)."""
        if self.pending is not None:
            self.pending[1].wait()
            self.pending = None

    # --------------------------------------------------------------- forward

    def pre_forward(self, module, args):
        self.schedule.record_pre_forward(self)
        # BEGIN SOLUTION fsdp.forward: self.full = AllGatherParams.apply(self, *shards); use() them; index their storages; enter saved_tensors_hooks(self.pack, self.unpack)
        self.full = list(AllGatherParams.apply(self, *self.shards))
        self.use(self.full)
        self.storage_index = {storage_key(f): i for i, f in enumerate(self.full)}
        self.saving = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self.saving.__enter__()
        # END SOLUTION
        if self.prefetch:
            self.prefetch_forward()

    def pack(self, tensor: torch.Tensor):
        """Saved-tensor pack hook (runs in forward): a view of one of our full parameters
        is saved as a ``SavedParam`` note, so autograd does not keep the parameter alive."""
        # BEGIN SOLUTION fsdp.forward: look the tensor's storage up in self.storage_index; if found, return a SavedParam note
        index = self.storage_index.get(storage_key(tensor))
        if index is None:
            return tensor
        return SavedParam(self, index, tensor.shape, tensor.stride(), tensor.storage_offset())
        # END SOLUTION

    @staticmethod
    def unpack(saved):
        """Saved-tensor unpack hook (runs in backward): a note becomes a view of the
        re-gathered parameter it stands for; anything else comes back as it was."""
        if not isinstance(saved, SavedParam):
            return saved
        # BEGIN SOLUTION fsdp.backward: the unit re-gathered its parameters before its backward: rebuild the view with as_strided
        full = saved.unit.full
        if full is None:
            raise RuntimeError(f"fsdp: backward needs a parameter of {saved.unit.name}, which is not "
                               "gathered; its pre-backward should have all-gathered it")
        return full[saved.index].as_strided(saved.shape, saved.stride, saved.offset)
        # END SOLUTION

    def post_forward(self, module, args, output):
        # Runs even if forward raised (always_call=True), so the hooks are always popped.
        # BEGIN SOLUTION fsdp.forward: leave the saved-tensor hooks; reshard (free) unless reshard_after_forward is off and grad is enabled
        if self.saving is not None:
            self.saving.__exit__(None, None, None)
            self.saving = None
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self.reshard()
        # END SOLUTION
        self.schedule.record_post_forward(self)
        return register_pre_backward(self, output)

    # --------------------------------------------------------------- backward

    def pre_backward(self) -> None:
        """The unit's outputs have their gradients: its backward is next."""
        self.schedule.backward_started()
        # BEGIN SOLUTION fsdp.backward: if the full parameters were freed after forward, all-gather them again (plain, no autograd)
        if self.full is None:
            self.full = self.all_gather()
        # END SOLUTION
        if self.prefetch:
            self.prefetch_backward()

    def reduce_scatter_grads(self, full_grads) -> list[torch.Tensor | None]:
        """One reduce-scatter for the unit: shard gradients averaged over the ranks, None
        where a parameter got no gradient (frozen or unused: the same on every rank)."""
        # BEGIN SOLUTION fsdp.backward: pack_grads the non-None grads, dist.reduce_scatter_single, divide by N, unpack_shard_grads
        have = [i for i, g in enumerate(full_grads) if g is not None]
        shard_grads = [None] * len(full_grads)
        if not have:
            return shard_grads  # coverage: the guard above (listed in tests/coverage_exclusions.txt)
        params = [self.params[i] for i in have]
        flat = pack_grads([full_grads[i] for i in have], params, self.world)
        mine = flat.new_empty(flat.numel() // self.world)
        dist.reduce_scatter_single(mine, flat, group=self.group)
        mine /= self.world  # the sum of per-rank means -> the mean over the global batch
        for i, g in zip(have, unpack_shard_grads(mine, params)):
            shard_grads[i] = g
        return shard_grads
        # END SOLUTION

    # --------------------------------------------------------------- prefetch

    def prefetch_forward(self) -> None:
        """Start the all-gather of the unit that ran after this one in the last forward."""
        # BEGIN SOLUTION fsdp.prefetch: the unit after self in schedule.last_forward_order: start_all_gather() it unless gathered or pending
        order = self.schedule.last_forward_order
        if self in order and order.index(self) + 1 < len(order):
            nxt = order[order.index(self) + 1]
            if nxt.full is None and nxt.pending is None:
                nxt.start_all_gather()
        # END SOLUTION

    def prefetch_backward(self) -> None:
        """Start the all-gather of the unit whose backward comes next: backward runs the
        units in the reverse order of their forward *ends* (post_forward_order)."""
        # BEGIN SOLUTION fsdp.prefetch: the unit after self in reversed(schedule.post_forward_order): start_all_gather() it unless gathered or pending
        order = self.schedule.post_forward_order[::-1]
        if self in order and order.index(self) + 1 < len(order):
            nxt = order[order.index(self) + 1]
            if nxt.full is None and nxt.pending is None:
                nxt.start_all_gather()
        # END SOLUTION


# ----------------------------------------------------------------------------- API


def policy_dtypes(mp_policy) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(param_dtype, reduce_dtype) of a mixed-precision policy (torch's ``MixedPrecisionPolicy``
    or anything with those two attributes); reduce_dtype defaults to param_dtype, as in FSDP2."""
    if mp_policy is None:
        return None, None
    param_dtype = getattr(mp_policy, "param_dtype", None)
    return param_dtype, getattr(mp_policy, "reduce_dtype", None) or param_dtype


def fully_shard(module: nn.Module, process_group=None, *, reshard_after_forward: bool = True,
                prefetch: bool = True, mp_policy=None, replicate_params=()) -> nn.Module:
    """Shard ``module``'s parameters (those not in a unit below it) over ``process_group``
    (default: all ranks) and gather/free them around its forward and backward.

    Call it on the blocks first, then on the root. Afterwards ``module.parameters()`` are
    this rank's shards: hand them to any elementwise optimizer (SGD, Adam, AdamW...).
    ``reshard_after_forward=False`` keeps the full parameters from forward to backward
    (one all-gather less per step, more memory: ZeRO-2-like).

    ``mp_policy``: mixed precision as FSDP2 does it, e.g. torch's
    ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``: the
    shards (and the optimizer state built on them) stay in their dtype, fp32 masters; the
    parameters are all-gathered and used in ``param_dtype``; gradients are reduce-scattered in
    ``reduce_dtype`` and land on the fp32 shards; floating inputs are cast to ``param_dtype``.
    ``replicate_params``: parameters of ``module`` to keep whole on every rank (small ones,
    such as norms); their gradients are averaged over the group during backward, like DDP's
    (in their own dtype; with ``mp_policy`` they compute in ``param_dtype`` like the rest).
    (torch's ``ignored_params`` also leaves parameters whole, but does not reduce their
    gradients.) The parameters of one unit share one dtype (ValueError otherwise, as in
    FSDP2), unless ``mp_policy`` casts them all to ``param_dtype``; units may differ. Returns
    ``module``.
    """
    if hasattr(module, UNIT_ATTR):
        raise ValueError(f"{type(module).__name__} is already sharded")
    unit = FSDPUnit(module, process_group, reshard_after_forward, prefetch, mp_policy, replicate_params)
    setattr(module, UNIT_ATTR, unit)
    return module


def units_of(model: nn.Module) -> list[FSDPUnit]:
    """The FSDP units inside ``model``, outermost first."""
    return [getattr(m, UNIT_ATTR) for m in model.modules() if hasattr(m, UNIT_ATTR)]


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every parameter full size (unpadded), on every rank.
    A collective: every rank of the group must call it."""
    units = units_of(model)
    dtypes = {id(p): p.param_dtype for unit in units for p in unit.params}
    for unit in units:  # gather the fp32 masters, not their low-precision copies
        for p in unit.params:
            p.param_dtype = None
    try:
        for unit in units:
            unit.use(unit.all_gather())
    finally:
        for unit in units:
            for p in unit.params:
                p.param_dtype = dtypes[id(p)]
    try:  # clone: a gathered parameter is a view of a padded buffer (torch.save would keep it)
        return {name: value.clone() for name, value in model.state_dict().items()}
    finally:
        for unit in units:
            unit.use(unit.shards if unit.full is None else unit.full)


def step_bytes(model: nn.Module) -> dict[str, float]:
    """What one training step should send per rank (ring model), from the shard sizes:
    every parameter is all-gathered twice (forward, backward; once if the unit keeps it
    from forward to backward), every trainable one reduce-scattered once; each x (N-1)/N.
    Phi counts the padding and a tied weight once. (A trainable parameter that gets no
    gradient, like ToyModel's ``unused``, is not reduce-scattered: subtract it yourself.)
    With mixed precision the all-gathers move ``param_dtype`` and the reduce-scatters
    ``reduce_dtype``; parameters kept whole (``replicate_params``) are all-reduced, 2 (N-1)/N.
    """
    sent = dict(all_gather=0.0, reduce_scatter=0.0, all_reduce=0.0)
    for unit in units_of(model):
        share = (unit.world - 1) / unit.world
        for p in unit.params:
            elements = unit.world * p.shard.numel()
            gathered = elements * _itemsize(p.param_dtype or p.shard.dtype)
            reduced = elements * _itemsize(p.reduce_dtype or p.param_dtype or p.shard.dtype)
            sent["all_gather"] += gathered * share * (2 if unit.reshard_after_forward else 1)
            sent["reduce_scatter"] += reduced * share * p.shard.requires_grad
        for p in unit.replicated:
            sent["all_reduce"] += 2 * share * p.numel() * p.element_size() * p.requires_grad
    return dict(sent, total=sum(sent.values()))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
