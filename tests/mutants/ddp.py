"""Wrong implementations of chapter 02 that the grader must fail (see labkit.course.mutants)."""

from pathlib import Path

from labkit.course.mutants import Mutant

# Per-parameter mode's two regions and the given code between them: a mutant that moves the
# all-reduces from the hook to the end of backward edits both.
_REFERENCE = (Path(__file__).resolve().parents[2] / "labkit" / "ddp.py").read_text()
_PER_PARAMETER_SPAN = _REFERENCE[_REFERENCE.index("        # BEGIN SOLUTION ddp.per_parameter: pre-divide"):
                                 _REFERENCE.index("        self._works.clear()\n        # END SOLUTION")]

MUTANTS = [
    # ddp.broadcast
    Mutant("ddp.broadcast", "one_per_tensor", "broadcasts every tensor on its own instead of one message per dtype",
           find="            flat = torch.cat([t.reshape(-1) for t in same])\n"
                "            dist.broadcast(flat, group=group, group_src=0)\n",
           replace="            for t in same:\n"
                   "                dist.broadcast(t, group=group, group_src=0)\n"
                   "            flat = torch.cat([t.reshape(-1) for t in same])\n"),
    Mutant("ddp.broadcast", "global_rank_0", "broadcasts from global rank 0 instead of the group's first rank",
           find="dist.broadcast(flat, group=group, group_src=0)", replace="dist.broadcast(flat, src=0, group=group)"),
    Mutant("ddp.broadcast", "contiguous_group_source",
           "takes the source as my global rank minus my group rank: the first rank only of a contiguous group",
           find="dist.broadcast(flat, group=group, group_src=0)",
           replace="dist.broadcast(flat, src=dist.get_rank() - dist.get_rank(group), group=group)"),
    Mutant("ddp.broadcast", "world_group", "ignores the group: broadcasts over every rank",
           find="dist.broadcast(flat, group=group, group_src=0)", replace="dist.broadcast(flat, src=0)"),
    Mutant("ddp.broadcast", "one_flat_float_buffer", "casts everything into one float64 buffer: one broadcast for all dtypes",
           find="        by_kind.setdefault((t.dtype, t.device), []).append(t)",
           replace="        by_kind.setdefault(t.device, []).append(t)"),
    # ddp.per_parameter
    Mutant("ddp.per_parameter", "no_predivide", "all-reduces the sum and never divides by the world size",
           find="        param.grad.div_(self.world_size)\n        self._works.append(", replace="        self._works.append("),
    Mutant("ddp.per_parameter", "global_world_size", "divides by the global world size, not the group's",
           find="        param.grad.div_(self.world_size)\n        self._works.append(",
           replace="        param.grad.div_(dist.get_world_size())\n        self._works.append("),
    Mutant("ddp.per_parameter", "world_group", "all-reduces over every rank, not over process_group",
           find="self._works.append(dist.all_reduce(param.grad, group=self.group, async_op=True))",
           replace="self._works.append(dist.all_reduce(param.grad, async_op=True))"),
    Mutant("ddp.per_parameter", "waits_in_hook", "a blocking all-reduce in the hook: nothing overlaps",
           find="self._works.append(dist.all_reduce(param.grad, group=self.group, async_op=True))",
           replace="dist.all_reduce(param.grad, group=self.group)"),
    Mutant("ddp.per_parameter", "counts_ranks_by_all_reduce", "all-reduces a 1 per rank to learn how many ranks to divide by",
           find="        param.grad.div_(self.world_size)\n        self._works.append(",
           replace="        ranks = torch.ones(1)\n        dist.all_reduce(ranks, group=self.group)\n"
                   "        param.grad.div_(ranks.item())\n        self._works.append("),
    Mutant("ddp.per_parameter", "all_reduce_at_the_end",
           "the hook only divides; the all-reduces are started after backward, then waited for",
           find=_PER_PARAMETER_SPAN,
           replace=_PER_PARAMETER_SPAN
           .replace("        self._works.append(dist.all_reduce(param.grad, group=self.group, async_op=True))\n", "")
           .replace("        for work in self._works:\n            work.wait()\n",
                    "        for p in self.params:\n"
                    "            if p.grad is not None and p in self._ready:\n"
                    "                self._works.append(dist.all_reduce(p.grad, group=self.group, async_op=True))\n"
                    "        for work in self._works:\n            work.wait()\n")),
    # ddp.bucketed
    Mutant("ddp.bucketed", "forward_order", "fills the buckets in registration (forward) order",
           find="    for p in reversed(params):\n        if current and", replace="    for p in params:\n        if current and"),
    Mutant("ddp.bucketed", "cap_strict", "closes a bucket only once it holds MORE than the cap",
           find="        if size >= cap_bytes:", replace="        if size > cap_bytes:"),
    Mutant("ddp.bucketed", "cap_off_by_one_bucket", "closes the bucket before the parameter that would pass the cap",
           find="        current.append(p)\n        size += p.numel() * p.element_size()\n        if size >= cap_bytes:\n"
                "            buckets.append(current)\n            current, size = [], 0\n",
           replace="        if current and size + p.numel() * p.element_size() > cap_bytes:\n"
                   "            buckets.append(current)\n            current, size = [], 0\n"
                   "        current.append(p)\n        size += p.numel() * p.element_size()\n"),
    Mutant("ddp.bucketed", "waits_in_hook", "waits for each bucket's all-reduce right after launching it",
           find="            ready.work = self._communicate(ready)\n",
           replace="            ready.work = self._communicate(ready)\n"
                   "            ready.work.wait()\n"),
    Mutant("ddp.bucketed", "launch_when_all_full", "launches the buckets only once every bucket is full",
           find="while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].waiting == 0:",
           replace="while self._next_bucket < len(self.buckets) and all(b.waiting == 0 for b in self.buckets):"),
    Mutant("ddp.bucketed", "out_of_order", "launches each bucket as soon as it is full, whatever its index",
           find="        bucket.waiting -= 1\n"
                "        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].waiting == 0:\n"
                "            ready = self.buckets[self._next_bucket]\n",
           replace="        bucket.waiting -= 1\n"
                   "        if bucket.waiting == 0:\n"
                   "            ready = bucket\n"),
    Mutant("ddp.bucketed", "bypasses_communicate",
           "divides and all-reduces the bucket itself, as before the hook point: a registered hook never runs",
           find="            ready.work = self._communicate(ready)\n",
           replace="            ready.buffer.div_(self.world_size)\n"
                   "            ready.work = dist.all_reduce(ready.buffer, group=self.group, async_op=True)\n"),
    Mutant("ddp.bucketed", "launch_incomplete", "launches the next bucket as soon as its first gradient is in",
           find="while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].waiting == 0:",
           replace="while self._next_bucket < len(self.buckets) and "
                   "self.buckets[self._next_bucket].waiting < len(self.buckets[self._next_bucket].params):"),
    Mutant("ddp.bucketed", "wait_for_none", "copies the slots back without waiting for the bucket's launch",
           find="            bucket.work.wait()\n            for p, slot in zip(bucket.params, bucket.slots):",
           replace="            for p, slot in zip(bucket.params, bucket.slots):"),
    Mutant("ddp.bucketed", "no_copy_back", "waits for every bucket but never copies the averages into .grad",
           find="            for p, slot in zip(bucket.params, bucket.slots):\n                p.grad.copy_(slot)\n",
           replace=""),
    Mutant("ddp.bucketed", "builtin_assignment", "takes torch's own bucket assignment instead of writing the rule",
           find="    # BEGIN SOLUTION ddp.bucketed: walk",
           replace="    order = list(reversed(params))\n"
                   "    indices, _ = dist._compute_bucket_assignment_by_size(order, [cap_bytes])\n"
                   "    return [[order[i] for i in bucket] for bucket in indices]\n"
                   "    # BEGIN SOLUTION ddp.bucketed: walk"),
    # ddp.no_sync
    Mutant("ddp.no_sync", "not_restored_on_error", "restores the flag after the block, but not if the block raises",
           find="        try:\n            yield\n        finally:\n            self.require_backward_grad_sync = previous\n",
           replace="        yield\n        self.require_backward_grad_sync = previous\n"),
    Mutant("ddp.no_sync", "restores_true", "sets the flag back to True instead of the value it had",
           find="            self.require_backward_grad_sync = previous\n",
           replace="            self.require_backward_grad_sync = True\n"),
    Mutant("ddp.no_sync", "wrong_flag", "turns off _sync_now, which the next forward overwrites",
           find="        previous = self.require_backward_grad_sync\n        self.require_backward_grad_sync = False\n",
           replace="        previous = self.require_backward_grad_sync\n        self._sync_now = False\n"),
    Mutant("ddp.no_sync", "does_nothing", "a context manager that only yields",
           find="        self.require_backward_grad_sync = False\n        try:", replace="        try:"),
Mutant("ddp.broadcast", "builtin_coalesced", "calls torch's _broadcast_coalesced, what the built-in DDP uses",
           find="    # BEGIN SOLUTION ddp.broadcast:",
           replace="    dist._broadcast_coalesced(group if group is not None else dist.group.WORLD,\n"
                   "                              [t.detach() for t in tensors], 2 ** 28,\n"
                   "                              0)\n"
                   "    return\n"
                   "    # BEGIN SOLUTION ddp.broadcast:"),
    # issue 39: the caller's tensors
    Mutant("ddp.broadcast", "rebinds_data",
           "sets t.data to its slice of the received buffer: right values, but every tensor now lives in "
           "the flat buffer (views held elsewhere, an optimizer's or a bucket's, go stale)",
           find="                t.copy_(flat[offset:offset + t.numel()].view_as(t))",
           replace="                t.data = flat[offset:offset + t.numel()].view_as(t)"),
    # issue 39: configurations nobody listed (only the drawn ones reach these)
    Mutant("ddp.broadcast", "one_message_for_all_integers",
           "puts every integer and bool tensor into one message (torch.cat promotes them to int64): right values, "
           "one broadcast where int8, int32, int64 and bool need one each",
           find="        by_kind.setdefault((t.dtype, t.device), []).append(t)",
           replace="        by_kind.setdefault((t.dtype if t.is_floating_point() else 'integers', t.device), []).append(t)"),
    Mutant("ddp.bucketed", "dtype_change_keeps_the_size",
           "starts a new bucket where the dtype changes but keeps counting the closed bucket's bytes",
           find="        if current and p.dtype != current[0].dtype:\n            buckets.append(current)\n"
                "            current, size = [], 0\n",
           replace="        if current and p.dtype != current[0].dtype:\n            buckets.append(current)\n"
                   "            current = []\n"),
]
