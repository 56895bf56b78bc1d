"""Chapter 03 exercises: ZeRO, a sharded optimizer (stages 1 and 2).

Data parallelism keeps N full copies of the training state. With fp32 Adam each of the Φ
parameters costs 4 bytes of weight, 4 of gradient and 8 of optimizer state (two moments),
and every rank holds all 16Φ bytes. ZeRO (Rajbhandari et al., 2020) observes that only the
weights are needed everywhere, all the time:

* stage 1 (optimizer state sharding): each rank owns a shard of the parameters, keeps
  optimizer state for that shard only and updates only it; then the updated shards are
  all-gathered, so every rank holds the same full parameters again. State per rank: 8Φ/N.
* stage 2 (+ gradient sharding): gradients are reduce-scattered instead of all-reduced:
  each rank receives the summed gradient of its own shard only and drops the rest, so
  gradients cost 4Φ/N bytes per rank after backward.

Communication per step stays that of DDP: a reduce-scatter of the gradients plus an
all-gather of the parameters, each (N-1)/N of P = 4Φ bytes per rank, is what one ring
all-reduce sends, 2(N-1)/N * P (chapter 00).

A shard here is a set of whole parameters, as in ``ZeroRedundancyOptimizer``, so any
``torch.optim`` optimizer runs unchanged on it (FSDP, chapter 04, splits every tensor instead).
For the collectives we lay every trainable parameter out in one flat, rank-major order:
rank 0's parameters, then rank 1's, ... (``ShardedOptimizer.layout``).

Conventions (tested):
* frozen parameters (``requires_grad=False``) are not sharded: no state, never sent;
* an unused parameter (trainable, but no gradient this step) stays in the partition, since a
  later step may use it; its owner skips it as any torch optimizer skips ``grad is None``,
  so it gets no state and no update, exactly like single-process AdamW. Stage 2 assumes
  every rank's backward reaches the same parameters (as DDP does by default);
* stage 1 does not touch gradients: like ``ZeroRedundancyOptimizer`` it expects them already
  averaged over ranks (DDP, or an all-reduce). Stage 2 averages them itself: no DDP.

Tasks (run ``labkit grade zero``; tests in ``tests/grading/test_zero.py``):
    zero.partition   partition_parameters
    zero.stage1      ShardedOptimizer: the local optimizer (__init__) and step
    zero.stage2      ShardedOptimizer(..., shard_gradients=True): _on_grad_ready, _reduce_scatter_grads
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def partition_parameters(params: list[torch.Tensor], world_size: int) -> list[list[torch.Tensor]]:
    """Assign each parameter to one rank so that ranks hold about the same number of elements.

    Greedy, largest first (as ``ZeroRedundancyOptimizer`` does): visit the parameters from
    the largest to the smallest (equal sizes in the given order) and give each to the rank
    that holds the fewest elements so far (on a tie, the lowest rank). No rank then holds
    more than one parameter's worth above any other. Returns one list per rank, each in the
    order of ``params``. Deterministic: every rank computes the same answer on its own.
    """
    # BEGIN SOLUTION zero.partition: visit params largest first (stable), give each to the rank with the fewest elements so far (lowest on ties); return per-rank lists in the original order
    loads = [0] * world_size
    owner = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):  # stable sort
        rank = loads.index(min(loads))  # index() finds the lowest rank among the least loaded
        owner[i] = rank
        loads[rank] += params[i].numel()
    return [[p for p, o in zip(params, owner) if o == rank] for rank in range(world_size)]
    # END SOLUTION


# ----------------------------------------------------------------------------- flat buffers


def flatten(tensors: list[torch.Tensor], numel: int, like: torch.Tensor | None = None) -> torch.Tensor:
    """The tensors one after another in a 1-D buffer of ``numel`` elements (zero-padded).
    ``like``: whose dtype and device the buffer takes when ``tensors`` is empty (a rank that
    owns nothing still sends a buffer of the others' dtype: float32 would not match)."""
    model = tensors[0] if tensors else like
    flat = torch.zeros(numel, dtype=model.dtype if model is not None else torch.float32,
                       device=model.device if model is not None else None)
    if tensors:
        flat[: sum(t.numel() for t in tensors)] = torch.cat([t.detach().reshape(-1) for t in tensors])
    return flat


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` into ``tensors`` (the inverse of ``flatten``)."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset: offset + t.numel()].view_as(t))
            offset += t.numel()


def _param_groups(params) -> list[dict]:
    """``params`` as torch optimizers take them (tensors, or dicts of options), as groups;
    a parameter listed twice (a tied weight) is kept once."""
    groups = list(params)
    if not groups:
        raise ValueError("ShardedOptimizer got an empty parameter list")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    seen: set[int] = set()
    return [dict(g, params=[p for p in g["params"] if not (id(p) in seen or seen.add(id(p)))]) for g in groups]


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1 (and with ``shard_gradients=True`` ZeRO-2) around any ``torch.optim`` class.

        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
        loss.backward(); <average gradients: DDP or all-reduce>; opt.step(); opt.zero_grad()

    Used like ``torch.distributed.optim.ZeroRedundancyOptimizer``: construct it on every
    rank of ``group`` with the same parameters in the same order. It is a real
    ``torch.optim.Optimizer``: ``param_groups`` hold every parameter with its options (LR
    schedulers change them there, and ``step`` passes them on), ``add_param_group`` works
    before training starts, ``state_dict()`` (a collective) gathers the whole state in
    torch's format on every rank and ``load_state_dict`` takes one back (at any world size).
    ``self.optimizer`` is this rank's ``optimizer_cls`` over the parameters it owns (``None``
    if it owns none), and ``state`` is that optimizer's: this rank's shard only.

    With ``shard_gradients=True`` (ZeRO-2) the optimizer also averages the gradients: hooks
    collect them during backward and one reduce-scatter at the end of backward leaves each
    rank the averaged gradients of its own parameters; all others end with ``grad=None``.
    One backward per step: call ``zero_grad()`` before the next one.
    """

    def __init__(self, params, optimizer_cls, *, shard_gradients: bool = False, group=None,
                 **optimizer_kwargs):
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.optimizer_cls, self.optimizer_kwargs = optimizer_cls, optimizer_kwargs
        self.shard_gradients = shard_gradients
        self._ready = False  # add_param_group repartitions only once __init__ is done
        # The groups carry every option of optimizer_cls (an LR scheduler needs "lr" there).
        defaults = optimizer_cls([torch.nn.Parameter(torch.zeros(1))], **optimizer_kwargs).defaults
        super().__init__(_param_groups(params), defaults)
        self._ready = True
        self._partition()

        # ZeRO-2 bookkeeping (see _grad_hook); the hooks fire once per parameter per backward.
        self.flat_grads: torch.Tensor | None = None   # during backward: all grads, rank-major
        self.arrived: set[int] = set()                # ids of the params whose grad arrived
        self._in_backward = False
        self._grads_reduced = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_hook)
                       for p in self.params] if shard_gradients else []

    def _partition(self) -> None:
        """Assign the trainable parameters to ranks and build this rank's local optimizer."""
        groups = self.param_groups
        # Trainable parameters, each once (a tied weight may be listed twice), in given order.
        seen: set[int] = set()
        self.params = [p for g in groups for p in g["params"]
                       if p.requires_grad and not (id(p) in seen or seen.add(id(p)))]
        if len({(p.dtype, p.device) for p in self.params}) > 1:
            raise ValueError("ShardedOptimizer needs all trainable parameters on one dtype and device")

        self.partition = partition_parameters(self.params, self.world_size)
        self.owned = self.partition[self.rank]
        self.shard_numels = [sum(p.numel() for p in ps) for ps in self.partition]
        # Where each parameter starts in the flat, rank-major layout of all trainable params.
        self.layout: dict[int, int] = {}
        offset = 0
        for ps in self.partition:
            for p in ps:
                self.layout[id(p)] = offset
                offset += p.numel()

        optimizer_cls, optimizer_kwargs = self.optimizer_cls, self.optimizer_kwargs
        self.optimizer: torch.optim.Optimizer | None = None
        # BEGIN SOLUTION zero.stage1: set self.optimizer = optimizer_cls over only the params in self.owned (keep each group's options), or None if this rank owns none
        mine = {id(p) for p in self.owned}
        local_groups = [dict(g, params=[p for p in g["params"] if id(p) in mine]) for g in groups]
        local_groups = [g for g in local_groups if g["params"]]
        self.optimizer = optimizer_cls(local_groups, **optimizer_kwargs) if local_groups else None
        # END SOLUTION
        self.state = self.optimizer.state if self.optimizer is not None else {}

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (on every rank, the same). Parameters are repartitioned, so do it before
        the first step: moving optimizer state between ranks is refused."""
        super().add_param_group(param_group)
        if not self._ready:
            return
        if any(self.state.values()):
            raise RuntimeError("ShardedOptimizer.add_param_group after a step would move optimizer "
                               "state between ranks; add every group before training starts")
        if self.shard_gradients:
            seen = {id(p) for p in self.params}
            self._hooks += [p.register_post_accumulate_grad_hook(self._grad_hook)
                            for p in param_group["params"] if p.requires_grad and id(p) not in seen]
        self._partition()

    def _sync_options(self) -> None:
        """Copy the groups' options (lr after a scheduler, ...) to the local optimizer's groups."""
        if self.optimizer is None:
            return
        by_param = {id(p): g for g in self.param_groups for p in g["params"]}
        for local in self.optimizer.param_groups:
            source = by_param[id(local["params"][0])]
            local.update({k: v for k, v in source.items() if k != "params"})

    # ------------------------------------------------------------------------- state dicts

    def _indices(self) -> dict[int, int]:
        """Parameter id -> its index in torch's state-dict numbering (groups in order)."""
        order = [p for g in self.param_groups for p in g["params"]]
        return {id(p): i for i, p in reversed(list(enumerate(order)))}

    def state_dict(self) -> dict:
        """The whole optimizer state in ``torch.optim.Optimizer.state_dict()``'s format, gathered
        from every rank's shard. A collective: every rank of the group must call it."""
        index = self._indices()
        mine = {index[id(p)]: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
                for p, state in self.state.items()}
        shards = [None] * self.world_size
        dist.all_gather_object(shards, mine, group=self.group)
        merged = {k: v for shard in shards for k, v in shard.items()}
        groups = [dict({k: v for k, v in g.items() if k != "params"},
                       params=sorted({index[id(p)] for p in g["params"]})) for g in self.param_groups]
        return {"state": merged, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Take a state dict of ``state_dict()``'s format (from any world size): every group's
        options, and the state of the parameters this rank owns."""
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(f"the state dict has {len(state_dict['param_groups'])} parameter groups, "
                             f"this optimizer {len(self.param_groups)}")
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        index = self._indices()
        for p in self.owned:
            saved = state_dict["state"].get(index[id(p)])
            if saved is not None:
                self.state[p] = {k: v.clone().to(p.device) if isinstance(v, torch.Tensor) and v.dim()
                                 else (v.clone() if isinstance(v, torch.Tensor) else v)
                                 for k, v in saved.items()}
        self._sync_options()

    # ------------------------------------------------------------------------- stage 1

    @torch.no_grad()
    def step(self, closure=None):
        """Update this rank's shard, then give every rank every updated parameter."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_options()  # an LR scheduler changed self.param_groups: pass it on
        # BEGIN SOLUTION zero.stage1: step self.optimizer (if any), then all-gather every rank's flattened shard (padded to the largest: dist.all_gather_single) and unflatten_into the other ranks' params
        if self.optimizer is not None:
            self.optimizer.step()
        width = max(self.shard_numels)
        if self.world_size > 1 and width > 0:
            # all_gather_single needs equal pieces: pad every shard to the largest.
            mine = flatten(self.owned, width, like=self.params[0])
            everything = torch.empty(self.world_size * width, dtype=mine.dtype, device=mine.device)
            dist.all_gather_single(everything, mine, group=self.group)
            for rank, row in enumerate(everything.view(self.world_size, width)):
                if rank != self.rank:
                    unflatten_into(row, self.partition[rank])
        # END SOLUTION
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is not None:
                if set_to_none or self.shard_gradients:  # ZeRO-2's grads are views: drop them
                    p.grad = None
                else:
                    p.grad.zero_()
        self._grads_reduced = False
        self._in_backward = False

    # ------------------------------------------------------------------------- stage 2

    def _grad_hook(self, param: torch.Tensor) -> None:
        """Runs when ``param.grad`` is complete (tied uses summed). The first one of a backward
        pass schedules the reduce-scatter for the end of that pass."""
        if not self._in_backward:
            if self._grads_reduced:
                raise RuntimeError("ShardedOptimizer(shard_gradients=True) takes one backward per "
                                   "step: call zero_grad() before the next backward")
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._on_grad_ready(param)

    def _end_of_backward(self) -> None:
        self._in_backward = False
        self._reduce_scatter_grads()
        self._grads_reduced = True

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        """Move ``param.grad`` into its slot of ``self.flat_grads`` and free it."""
        # BEGIN SOLUTION zero.stage2: on the first grad allocate self.flat_grads (zeros, all shards); copy param.grad into its slot (self.layout), record id(param) in self.arrived, set param.grad = None
        if self.flat_grads is None:  # the first gradient of this backward pass
            self.flat_grads = torch.zeros(sum(self.shard_numels), dtype=param.dtype, device=param.device)
        start = self.layout[id(param)]
        self.flat_grads[start: start + param.numel()].copy_(param.grad.reshape(-1))
        self.arrived.add(id(param))
        param.grad = None  # owned or not: the full-size gradient lives in the flat buffer now
        # END SOLUTION

    def _reduce_scatter_grads(self) -> None:
        """End of backward: sum each shard onto its owner, average, hand owners their grads."""
        # BEGIN SOLUTION zero.stage2: dist.reduce_scatter your shard from self.flat_grads.split(self.shard_numels), divide by world size, set .grad of your arrived params to views of it; reset flat_grads and arrived
        shard = torch.empty(self.shard_numels[self.rank], dtype=self.flat_grads.dtype,
                            device=self.flat_grads.device)
        # Piece r of the list is rank r's shard: uneven pieces, no padding needed.
        dist.reduce_scatter(shard, list(self.flat_grads.split(self.shard_numels)), group=self.group)
        shard.div_(self.world_size)
        offset = 0
        for p in self.owned:
            if id(p) in self.arrived:  # a parameter no backward reached keeps grad None
                p.grad = shard[offset: offset + p.numel()].view_as(p)
            offset += p.numel()
        self.flat_grads = None  # frees the full-size buffer: only the shard stays
        self.arrived.clear()
        # END SOLUTION
