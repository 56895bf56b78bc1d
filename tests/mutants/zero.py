"""Wrong implementations of chapter 03 (ZeRO) that the grader must fail (see labkit.course.mutants)."""

from labkit.course.mutants import Mutant

MUTANTS = [
    # zero.partition
    Mutant("zero.partition", "in_given_order",
           "gives each parameter to the least loaded rank in the given order, not largest first",
           find="for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):  # stable sort",
           replace="for i in range(len(params)):"),
    Mutant("zero.partition", "smallest_first", "sorts the parameters smallest first",
           find="for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):  # stable sort",
           replace="for i in sorted(range(len(params)), key=lambda i: params[i].numel()):"),
    Mutant("zero.partition", "bytes_not_elements", "balances bytes, not elements: right while every parameter "
           "has one dtype", find="loads[rank] += params[i].numel()\n",
           replace="loads[rank] += params[i].numel() * params[i].element_size()\n"),
    Mutant("zero.partition", "ties_to_the_highest_rank", "on a tie gives the parameter to the highest rank",
           find="rank = loads.index(min(loads))", replace="rank = len(loads) - 1 - loads[::-1].index(min(loads))"),
    Mutant("zero.partition", "most_loaded_rank", "picks the rank with the most elements: unbalanced",
           find="rank = loads.index(min(loads))", replace="rank = loads.index(max(loads))"),
    Mutant("zero.partition", "broadcast_from_rank0",
           "computes the partition on rank 0 and broadcasts it, to be sure every rank agrees: an extra collective",
           find="    return [[p for p, o in zip(params, owner) if o == rank] for rank in range(world_size)]",
           replace="    if dist.is_initialized() and world_size == dist.get_world_size():\n"
                   "        shared = [owner]\n"
                   "        dist.broadcast_object_list(shared, src=0)\n"
                   "        owner = shared[0]\n"
                   "    return [[p for p, o in zip(params, owner) if o == rank] for rank in range(world_size)]"),
    # zero.stage1
    Mutant("zero.stage1", "optimizer_over_every_param",
           "builds the local optimizer over every parameter group: no optimizer state is sharded",
           find="        self.optimizer = optimizer_cls(local_groups, **optimizer_kwargs) if local_groups else None",
           replace="        self.optimizer = optimizer_cls([dict(g) for g in groups], **optimizer_kwargs)"),
    Mutant("zero.stage1", "all_reduces_grads_again",
           "all-reduces (and averages) the gradients in step() before updating, to be safe: an extra collective",
           find="        if self.optimizer is not None:\n            self.optimizer.step()",
           replace="        for p in self.params:\n"
                   "            if p.grad is not None:\n"
                   "                dist.all_reduce(p.grad, group=self.group)\n"
                   "                p.grad.div_(self.world_size)\n"
                   "        if self.optimizer is not None:\n            self.optimizer.step()"),
    Mutant("zero.stage1", "pads_to_the_total",
           "pads every shard to the total number of elements instead of the largest shard: N x Φ gathered",
           find="        width = max(self.shard_numels)", replace="        width = sum(self.shard_numels)"),
    Mutant("zero.stage1", "builtin_zero_redundancy_optimizer",
           "wraps torch's ZeroRedundancyOptimizer as the local optimizer",
           find="        self.optimizer = optimizer_cls(local_groups, **optimizer_kwargs) if local_groups else None",
           replace="        from torch.distributed.optim import ZeroRedundancyOptimizer\n"
                   "        self.optimizer = ZeroRedundancyOptimizer([p for g in local_groups for p in g['params']],\n"
                   "                                                 optimizer_cls, **optimizer_kwargs)"),
    # zero.stage2
    Mutant("zero.stage2", "world_group",
           "reduce-scatters over every rank, ignoring the optimizer's group: right on the world only",
           find="        dist.reduce_scatter(shard, list(self.flat_grads.split(self.shard_numels)), group=self.group)",
           replace="        dist.reduce_scatter(shard, list(self.flat_grads.split(self.shard_numels)))"),
    Mutant("zero.stage2", "global_rank_shard",
           "sizes its shard by the global rank, not the group rank: right on the world only",
           find="        shard = torch.empty(self.shard_numels[self.rank], dtype=self.flat_grads.dtype,",
           replace="        shard = torch.empty(self.shard_numels[dist.get_rank() % self.world_size], dtype=self.flat_grads.dtype,"),
    Mutant("zero.stage2", "divides_by_world_size",
           "averages over every rank of the world, not over the group's ranks",
           find="        shard.div_(self.world_size)",
           replace="        shard.div_(dist.get_world_size())"),
    Mutant("zero.stage2", "all_reduce_then_slice",
           "all-reduces the whole flat gradient and keeps its own slice: DDP's traffic, not a reduce-scatter",
           find="        dist.reduce_scatter(shard, list(self.flat_grads.split(self.shard_numels)), group=self.group)",
           replace="        dist.all_reduce(self.flat_grads, group=self.group)\n"
                   "        start = sum(self.shard_numels[:self.rank])\n"
                   "        shard.copy_(self.flat_grads[start:start + shard.numel()])"),
    Mutant("zero.stage2", "missing_scale", "forgets to divide the reduced gradients by N: a sum, not a mean",
           find="        shard.div_(self.world_size)\n", replace=""),
    Mutant("zero.stage2", "keeps_full_grads",
           "copies each gradient into the flat buffer but leaves param.grad set: every rank keeps Φ of gradients",
           find="        param.grad = None  # owned or not: the full-size gradient lives in the flat buffer now",
           replace="        pass"),
    Mutant("zero.stage2", "grad_for_unused_params",
           "gives every owned parameter a gradient, also those no backward reached",
           find="            if id(p) in self.arrived:  # a parameter no backward reached keeps grad None",
           replace="            if True:"),
    # issue 39: param groups, dtypes, repeated steps
    Mutant("zero.stage1", "one_group_default_options",
           "one local group over every owned parameter, with the constructor's options: the groups' lr and "
           "weight decay are lost (the first owned parameter's group wins)",
           find="        local_groups = [dict(g, params=[p for p in g[\"params\"] if id(p) in mine]) for g in groups]",
           replace="        local_groups = [{\"params\": list(self.owned)}]"),
    Mutant("zero.stage1", "group0_options", "every owned parameter in one group with group 0's options",
           find="        local_groups = [dict(g, params=[p for p in g[\"params\"] if id(p) in mine]) for g in groups]",
           replace="        local_groups = [dict(groups[0], params=list(self.owned))]"),
    Mutant("zero.stage1", "gathers_in_float32", "flattens the shard to float32 for the all-gather: float64 params lose bits",
           find="            mine = flatten(self.owned, width, like=self.params[0])",
           replace="            mine = flatten(self.owned, width, like=self.params[0]).float()"),
    Mutant("zero.stage2", "float32_flat_grads", "the flat gradient buffer in float32 whatever the parameters' dtype",
           find="            self.flat_grads = torch.zeros(sum(self.shard_numels), dtype=param.dtype, device=param.device)",
           replace="            self.flat_grads = torch.zeros(sum(self.shard_numels), dtype=torch.float32, device=param.device)"),
]
