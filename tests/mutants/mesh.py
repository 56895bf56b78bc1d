"""Wrong implementations of chapter 08 that the grader must fail (see labkit.course.mutants)."""

from labkit.course.mutants import Mutant

_COORDS_AND_RANK_OF = (
    "        for axis in reversed(AXES):\n"
    "            rank, coords[axis] = divmod(rank, self.degrees[axis])\n"
    "        return {axis: coords[axis] for axis in AXES}\n"
    "        # END SOLUTION\n"
    "\n"
    "    def rank_of(self, coords: dict[str, int]) -> int:\n"
    "        # BEGIN SOLUTION mesh.grid: rank = ((d * pp + p) * cp + c) * tp + t\n"
    "        rank = 0\n"
    "        for axis in AXES:\n")


def _order(fastest_first: str) -> str:
    """coords and rank_of, consistently, for a layout whose axes move in this order."""
    return _COORDS_AND_RANK_OF.replace("reversed(AXES)", fastest_first, 1).replace(
        "        for axis in AXES:\n", f"        for axis in reversed({fastest_first}):\n")


MUTANTS = [
    # mesh.grid
    Mutant("mesh.grid", "dp_fastest",
           "lays the ranks out with DP as the fastest axis (consecutive ranks are replicas), TP the slowest",
           find=_COORDS_AND_RANK_OF, replace=_order("AXES")),
    Mutant("mesh.grid", "pp_inside_cp",
           "puts PP inside CP: (dp, cp, pp, tp) instead of the chapter's (dp, pp, cp, tp)",
           find=_COORDS_AND_RANK_OF, replace=_order("('tp', 'pp', 'cp', 'dp')")),
    Mutant("mesh.grid", "consecutive_groups",
           "builds every axis's group as a block of consecutive ranks, as if each were TP",
           find="        here = self.coords(rank)\n"
                "        return [self.rank_of(here | {axis: i}) for i in range(self.degrees[axis])]\n",
           replace="        size = self.degrees[axis]\n"
                   "        return list(range(rank - rank % size, rank - rank % size + size))\n"),
    Mutant("mesh.grid", "no_positivity_check",
           "only checks that the degrees multiply to the world size: negative degrees pass",
           find="            if not isinstance(size, int) or size < 1:\n",
           replace="            if not isinstance(size, int):\n"),
    Mutant("mesh.grid", "builtin_init_device_mesh",
           "takes each axis's ranks from torch's init_device_mesh",
           find="        here = self.coords(rank)\n",
           replace="        from torch.distributed.device_mesh import init_device_mesh  # noqa: F401\n"
                   "        here = self.coords(rank)\n"),
    # mesh.train_2d
    Mutant("mesh.train_2d", "swapped_groups", "tensor parallelism over the dp group, FSDP over the tp group",
           find="    tensor_parallel(gpt, grid.group(\"tp\"))\n    for block in gpt.blocks:\n"
                "        fully_shard(block, grid.group(\"dp\"))\n    fully_shard(gpt, grid.group(\"dp\"))\n",
           replace="    tensor_parallel(gpt, grid.group(\"dp\"))\n    for block in gpt.blocks:\n"
                   "        fully_shard(block, grid.group(\"tp\"))\n    fully_shard(gpt, grid.group(\"tp\"))\n"),
    Mutant("mesh.train_2d", "one_fsdp_unit",
           "shards only the root: one unit, the whole model gathered at once",
           find="    for block in gpt.blocks:\n        fully_shard(block, grid.group(\"dp\"))\n"
                "    fully_shard(gpt, grid.group(\"dp\"))\n",
           replace="    fully_shard(gpt, grid.group(\"dp\"))\n"),
    Mutant("mesh.train_2d", "tp_over_world",
           "tensor_parallel without its group: TP over every rank, across the replicas",
           find="    tensor_parallel(gpt, grid.group(\"tp\"))\n    for block in gpt.blocks:\n",
           replace="    tensor_parallel(gpt)\n    for block in gpt.blocks:\n"),
    Mutant("mesh.train_2d", "builtin_fully_shard", "torch's fully_shard on the dp sub-mesh in place of the course's",
           find="    from labkit.fsdp import fully_shard\n    from labkit.tp import tensor_parallel\n"
                "    # BEGIN SOLUTION mesh.train_2d",
           replace="    from torch.distributed.fsdp import fully_shard\n    from labkit.tp import tensor_parallel\n"
                   "    # BEGIN SOLUTION mesh.train_2d"),
    # mesh.train_3d
    Mutant("mesh.train_3d", "tp_over_dp_group", "tensor parallelism over the dp group (the replicas) instead of tp",
           find="    tensor_parallel(gpt, grid.group(\"tp\"))\n    stages = split_gpt(",
           replace="    tensor_parallel(gpt, grid.group(\"dp\"))\n    stages = split_gpt("),
    Mutant("mesh.train_3d", "split_before_tp",
           "cuts the stages first, then tensor_parallel: the stages keep the whole embedding and head",
           find="    tensor_parallel(gpt, grid.group(\"tp\"))\n"
                "    stages = split_gpt(gpt, grid.degrees[\"pp\"], balance=\"layers\")\n",
           replace="    stages = split_gpt(gpt, grid.degrees[\"pp\"], balance=\"layers\")\n"
                   "    tensor_parallel(gpt, grid.group(\"tp\"))\n"),
    Mutant("mesh.train_3d", "builtin_pipelining", "torch.distributed.pipelining's split in place of split_gpt",
           find="    from labkit.pp import split_gpt\n",
           replace="    from labkit.pp import split_gpt\n"
                   "    from torch.distributed.pipelining import pipeline  # noqa: F401\n"),
    # mesh.plan
    Mutant("mesh.plan", "unsharded", "counts every parameter whole, whatever the ZeRO stage",
           find="    dp = layout.dp if layout.zero >= 3 else 1\n", replace="    dp = 1\n"),
    Mutant("mesh.plan", "floor_rows", "floor(rows / dp) rows per shard: forgets the padding",
           find="    elements = sum(-(-rows // dp) * cols for rows, cols in tensors)\n",
           replace="    elements = sum(rows // dp * cols for rows, cols in tensors)\n"),
    Mutant("mesh.plan", "shards_from_zero_1", "shards the parameters from ZeRO-1 on",
           find="    dp = layout.dp if layout.zero >= 3 else 1\n", replace="    dp = layout.dp if layout.zero >= 1 else 1\n"),
    Mutant("mesh.plan", "one_moment", "AdamW's optimizer state counted as one value per element",
           find="    return dict(params=elements, grads=elements, optimizer=2 * elements, tensors=len(tensors))\n",
           replace="    return dict(params=elements, grads=elements, optimizer=elements, tensors=len(tensors))\n"),
    # Issue 39, item 2: what the drawn layouts (tests/grading/test_mesh.py) kill
    Mutant("mesh.plan", "shards_over_dp_and_cp",
           "ZeRO-3 shards each tensor over dp x cp (the ranks that hold the same weights, as memory_per_gpu's "
           "state bytes do), but this course's FSDP runs on the dp group only",
           find="    dp = layout.dp if layout.zero >= 3 else 1\n", replace="    dp = layout.dp * layout.cp if layout.zero >= 3 else 1\n"),
]
