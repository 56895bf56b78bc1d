"""Wrong implementations of chapter 04 (FSDP) that the grader must fail (see labkit.course.mutants)."""

from labkit.course.mutants import Mutant

_FORWARD_PREFETCH = """        order = self.schedule.last_forward_order
        if self in order and order.index(self) + 1 < len(order):
            nxt = order[order.index(self) + 1]
            if nxt.full is None and nxt.pending is None:
                nxt.start_all_gather()"""
_BACKWARD_PREFETCH = """        order = self.schedule.post_forward_order[::-1]
        if self in order and order.index(self) + 1 < len(order):
            nxt = order[order.index(self) + 1]
            if nxt.full is None and nxt.pending is None:
                nxt.start_all_gather()"""

MUTANTS = [
    # fsdp.shard
    Mutant("fsdp.shard", "world_rank_and_size",
           "cuts the shard of the global rank among all ranks, not of the group rank among the unit's group",
           find="shard_param(original.detach(), self.rank, self.world)",
           replace="shard_param(original.detach(), dist.get_rank(), dist.get_world_size())"),
    Mutant("fsdp.shard", "global_rank_mod_group_size",
           "global rank modulo the group's size: the group rank of contiguous groups ({0,1},{2,3}) only",
           find="shard_param(original.detach(), self.rank, self.world)",
           replace="shard_param(original.detach(), dist.get_rank() % self.world, self.world)"),
    Mutant("fsdp.shard", "floor_rows", "R = rows // N (floor): the last rows of a parameter are lost",
           find="    rows = rows_per_rank(full.shape[0], world)\n    shard = full.new_zeros(",
           replace="    rows = max(full.shape[0] // world, 1)\n    shard = full.new_zeros("),
    Mutant("fsdp.shard", "padding_not_zeroed", "allocates the shard with new_empty: the padding rows hold garbage",
           find="    shard = full.new_zeros((rows, *full.shape[1:]))",
           replace="    shard = full.new_empty((rows, *full.shape[1:]))"),
    Mutant("fsdp.shard", "frozen_becomes_trainable",
           "wraps each shard in nn.Parameter without passing requires_grad: frozen parameters train",
           find="            p.shard = nn.Parameter(shard_param(original.detach(), self.rank, self.world),\n"
                "                                   requires_grad=original.requires_grad)",
           replace="            p.shard = nn.Parameter(shard_param(original.detach(), self.rank, self.world))"),
    Mutant("fsdp.shard", "first_place_only",
           "points only the first place of each parameter at its shard: a tied weight stays full at the other",
           find="                                   requires_grad=original.requires_grad)\n        self.use(self.shards)",
           replace="                                   requires_grad=original.requires_grad)\n"
                   "            module, name = p.places[0]\n"
                   "            module._parameters[name] = p.shard"),
    Mutant("fsdp.shard", "broadcasts_rank0_first",
           "broadcasts rank 0's parameters before sharding, as DDP does at start: an extra collective per parameter",
           find="        for p, original in zip(self.params, originals):\n            p.shard = nn.Parameter(",
           replace="        for p, original in zip(self.params, originals):\n"
                   "            dist.broadcast(original.data, 0, group=self.group)\n"
                   "            p.shard = nn.Parameter("),
    Mutant("fsdp.shard", "builtin_distribute_tensor", "shards with DTensor's distribute_tensor (what FSDP2 uses)",
           find="    rows = rows_per_rank(full.shape[0], world)\n    shard = full.new_zeros(",
           replace="    from torch.distributed.device_mesh import init_device_mesh\n"
                   "    from torch.distributed.tensor import Shard, distribute_tensor\n"
                   "    return distribute_tensor(full, init_device_mesh('cpu', (world,)), [Shard(0)]).to_local()\n"
                   "    rows = rows_per_rank(full.shape[0], world)\n    shard = full.new_zeros("),
    Mutant("fsdp.shard", "builtin_fully_shard", "hands the unit's module to torch's fully_shard to shard it",
           find="        self.use(self.shards)\n        # END SOLUTION",
           replace="        from torch.distributed.fsdp import fully_shard as torch_fully_shard\n"
                   "        torch_fully_shard(self.module)\n"
                   "        # END SOLUTION"),
    # fsdp.forward
    Mutant("fsdp.forward", "no_reshard_after_forward",
           "only frees the full parameters under no_grad: they stay alive from forward to backward",
           find="        if self.reshard_after_forward or not torch.is_grad_enabled():",
           replace="        if not torch.is_grad_enabled():"),
    Mutant("fsdp.forward", "autograd_saves_full_params",
           "saves every tensor as it is (no SavedParam notes): autograd keeps the full parameters alive",
           find="        index = self.storage_index.get(storage_key(tensor))",
           replace="        index = None"),
    Mutant("fsdp.forward", "one_all_gather_per_parameter",
           "all-gathers each parameter on its own instead of the unit's packed shards in one collective",
           find="        flat = pack_shards(self.params)\n"
                "        buffer = flat.new_empty(self.world * flat.numel())\n"
                "        work = dist.all_gather_single(buffer, flat, group=self.group, async_op=True)\n",
           replace="        flats = [p.shard.detach().reshape(-1).to(p.param_dtype or p.shard.dtype) for p in self.params]\n"
                   "        buffer = flats[0].new_empty(self.world * sum(f.numel() for f in flats))\n"
                   "        offset = 0\n"
                   "        for f in flats:\n"
                   "            part = f.new_empty(self.world * f.numel())\n"
                   "            work = dist.all_gather_single(part, f, group=self.group, async_op=True)\n"
                   "            work.wait()\n"
                   "            buffer.view(self.world, -1)[:, offset:offset + f.numel()].copy_(part.view(self.world, -1))\n"
                   "            offset += f.numel()\n"),
    Mutant("fsdp.forward", "gathers_twice",
           "all-gathers once to have the parameters, then again through AllGatherParams for autograd",
           find="        self.full = list(AllGatherParams.apply(self, *self.shards))",
           replace="        self.all_gather()\n        self.full = list(AllGatherParams.apply(self, *self.shards))"),
    Mutant("fsdp.forward", "default_group", "all-gathers over every rank, ignoring the unit's process group",
           find="        work = dist.all_gather_single(buffer, flat, group=self.group, async_op=True)",
           replace="        work = dist.all_gather_single(buffer, flat, async_op=True)"),
    Mutant("fsdp.forward", "builtin_dtensor_gather",
           "gathers each parameter with DTensor's full_tensor() instead of its own all-gather",
           find="        flat = pack_shards(self.params)\n        buffer = flat.new_empty(",
           replace="        from torch.distributed.tensor import DTensor, Shard\n"
                   "        from torch.distributed.device_mesh import init_device_mesh\n"
                   "        mesh = init_device_mesh('cpu', (self.world,))\n"
                   "        self.dtensor_fulls = [DTensor.from_local(p.shard, mesh, [Shard(0)]).full_tensor() for p in self.params]\n"
                   "        flat = pack_shards(self.params)\n        buffer = flat.new_empty("),
    # fsdp.backward
    Mutant("fsdp.backward", "all_reduce_then_slice",
           "all-reduces the packed gradients and keeps its own block: DDP's traffic, not a reduce-scatter",
           find="        dist.reduce_scatter_single(mine, flat, group=self.group)",
           replace="        dist.all_reduce(flat, group=self.group)\n        mine.copy_(flat.view(self.world, -1)[self.rank])"),
    Mutant("fsdp.backward", "default_group", "reduce-scatters over every rank, ignoring the unit's process group",
           find="        dist.reduce_scatter_single(mine, flat, group=self.group)",
           replace="        dist.reduce_scatter_single(mine, flat)"),
    Mutant("fsdp.backward", "missing_scale", "forgets to divide by N: the shards get the sum of the ranks' gradients",
           find="        mine /= self.world  # the sum of per-rank means -> the mean over the global batch",
           replace="        pass"),
    Mutant("fsdp.backward", "reshards_only_at_the_end",
           "does not free the unit in its backward (the end-of-backward clean-up frees it later)",
           find="        ctx.unit.reshard()  # the unit's backward is over: free its parameters before reducing",
           replace="        pass"),
    Mutant("fsdp.backward", "reduces_zeros_for_missing_grads",
           "reduce-scatters every parameter of the unit, zeros for the frozen and unused ones",
           find="        params = [self.params[i] for i in have]\n"
                "        flat = pack_grads([full_grads[i] for i in have], params, self.world)\n"
                "        mine = flat.new_empty(flat.numel() // self.world)\n"
                "        dist.reduce_scatter_single(mine, flat, group=self.group)\n"
                "        mine /= self.world  # the sum of per-rank means -> the mean over the global batch\n"
                "        for i, g in zip(have, unpack_shard_grads(mine, params)):\n"
                "            shard_grads[i] = g\n",
           replace="        like = full_grads[have[0]]\n"
                   "        grads = [torch.zeros(p.shape, dtype=like.dtype) if g is None else g\n"
                   "                 for g, p in zip(full_grads, self.params)]\n"
                   "        flat = pack_grads(grads, self.params, self.world)\n"
                   "        mine = flat.new_empty(flat.numel() // self.world)\n"
                   "        dist.reduce_scatter_single(mine, flat, group=self.group)\n"
                   "        mine /= self.world\n"
                   "        for i, g in enumerate(unpack_shard_grads(mine, self.params)):\n"
                   "            if full_grads[i] is not None:\n"
                   "                shard_grads[i] = g\n"),
    Mutant("fsdp.backward", "always_regathers",
           "re-gathers in pre_backward even when the unit kept its parameters from forward",
           find="        if self.full is None:\n            self.full = self.all_gather()",
           replace="        if True:\n            self.full = self.all_gather()"),
    Mutant("fsdp.backward", "reduces_in_param_dtype",
           "reduce-scatters the gradients in the dtype they arrive in (param_dtype), ignoring reduce_dtype",
           find="        flat = pack_grads([full_grads[i] for i in have], params, self.world)",
           replace="        flat = pack_grads([full_grads[i] for i in have], params, self.world).to(full_grads[have[0]].dtype)"),
    # fsdp.prefetch
    Mutant("fsdp.prefetch", "prefetches_one_too_far", "prefetches the unit after the next one in forward",
           find=_FORWARD_PREFETCH,
           replace=_FORWARD_PREFETCH.replace("order.index(self) + 1", "order.index(self) + 2")),
    Mutant("fsdp.prefetch", "waits_right_away", "starts the next unit's all-gather in forward and waits for it at once",
           find=_FORWARD_PREFETCH,
           replace=_FORWARD_PREFETCH + "\n                nxt.pending[1].wait()"),
    Mutant("fsdp.prefetch", "this_steps_forward_order",
           "looks up the next unit in this step's forward order, which does not know it yet",
           find="        order = self.schedule.last_forward_order\n",
           replace="        order = self.schedule.forward_order\n"),
    Mutant("fsdp.prefetch", "forward_order_cached",
           "keeps the first forward order it sees (the order of units is the model's, so it never changes)",
           find="        order = self.schedule.last_forward_order\n",
           replace="        if not getattr(self, '_order', None):\n"
                   "            self._order = list(self.schedule.last_forward_order)\n"
                   "        order = self._order\n"),
    Mutant("fsdp.prefetch", "backward_in_forward_order",
           "prefetches in backward along the forward order instead of its reverse",
           find="        order = self.schedule.post_forward_order[::-1]",
           replace="        order = self.schedule.post_forward_order"),
    Mutant("fsdp.prefetch", "backward_waits_right_away",
           "starts the next unit's re-gather in backward and waits for it at once",
           find=_BACKWARD_PREFETCH,
           replace=_BACKWARD_PREFETCH + "\n                nxt.pending[1].wait()"),
    # Issue 39: what the drawn configurations (tests/grading/test_fsdp.py, drawn_on_rank) kill
    Mutant("fsdp.backward", "caches_which_params_have_grads",
           "decides once, at the first backward, which parameters get a gradient: a layer used only on "
           "some steps then gets none (or a stale slot) later",
           find="        have = [i for i, g in enumerate(full_grads) if g is not None]",
           replace="        if not hasattr(self, '_have'):\n"
                   "            self._have = [i for i, g in enumerate(full_grads) if g is not None]\n"
                   "        have = self._have"),
    Mutant("fsdp.shard", "float64_shards",
           "allocates every shard in float64 (the dtype of the examples), not the parameter's dtype",
           find="    shard = full.new_zeros((rows, *full.shape[1:]))",
           replace="    shard = torch.zeros((rows, *full.shape[1:]), dtype=torch.float64)"),
]
