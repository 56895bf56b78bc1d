"""Wrong implementations of chapter 00 that the grader must fail (see labkit.course.mutants)."""

from labkit.course.mutants import Mutant

MUTANTS = [
    # collectives.reduce_scatter
    Mutant("collectives.reduce_scatter", "starts_with_own_chunk",
           "starts the running sum with its own chunk: every rank ends with the wrong chunk",
           find="partial = chunks[(me - 1) % n].clone()", replace="partial = chunks[me].clone()"),
    Mutant("collectives.reduce_scatter", "one_step_short", "N-2 steps: the last contribution never arrives",
           find="    for step in range(1, n):\n        exchange(partial, incoming, to_rank, from_rank)",
           replace="    for step in range(1, max(n - 1, 1)):\n        exchange(partial, incoming, to_rank, from_rank)"),
    Mutant("collectives.reduce_scatter", "builtin", "calls dist.reduce_scatter_single instead of the ring",
           find="    chunks = input.reshape(n, -1)\n    if n == 1:",
           replace="    dist.reduce_scatter_single(output, input, group=group)\n    return\n"
                   "    chunks = input.reshape(n, -1)\n    if n == 1:"),
    Mutant("collectives.reduce_scatter", "global_rank",
           "takes its chunk index from the global rank (dist.get_rank()): right only on the world group",
           find="    me, n = dist.get_rank(group), dist.get_world_size(group)\n    if input.numel() != n * output.numel():",
           replace="    me, n = dist.get_rank(), dist.get_world_size(group)\n    if input.numel() != n * output.numel():"),
    Mutant("collectives.reduce_scatter", "group_rank_as_global",
           "sends to group rank + 1 as if it were a global rank: right only when the group is 0..N-1",
           find="    to_rank, from_rank = ring_neighbours(group)\n    # Start with",
           replace="    to_rank, from_rank = (me + 1) % n, (me - 1) % n\n    # Start with"),
    # collectives.all_gather
    Mutant("collectives.all_gather", "world_ring",
           "ring_neighbours() without the group: the world's ring, right only on the world group",
           find="    to_rank, from_rank = ring_neighbours(group)\n    for step in range(n - 1):",
           replace="    to_rank, from_rank = ring_neighbours()\n    for step in range(n - 1):"),
    Mutant("collectives.all_gather", "global_rank",
           "places its own chunk at its global rank's slot: right only on the world group",
           find="    me, n = dist.get_rank(group), dist.get_world_size(group)\n    if output.numel() != n * input.numel():",
           replace="    me, n = dist.get_rank(), dist.get_world_size(group)\n    if output.numel() != n * input.numel():"),
    Mutant("collectives.all_gather", "forwards_own_chunk_every_step",
           "sends its own chunk at every step instead of forwarding the one it received",
           find="exchange(chunks[(me - step) % n], chunks[(me - step - 1) % n], to_rank, from_rank)",
           replace="exchange(chunks[me], chunks[(me - step - 1) % n], to_rank, from_rank)"),
    Mutant("collectives.all_gather", "gathers_everything_twice", "an extra lap: twice the ring's bytes",
           find="    for step in range(n - 1):\n        # Forward",
           replace="    for step in list(range(n - 1)) * 2:\n        # Forward"),
    Mutant("collectives.all_gather", "builtin", "calls dist.all_gather_single instead of the ring",
           find="    chunks = output.view(n, -1)  # a view",
           replace="    dist.all_gather_single(output, input, group=group)\n    return\n"
                   "    chunks = output.view(n, -1)  # a view"),
    # collectives.all_reduce
    Mutant("collectives.all_reduce", "floor_chunks", "chunks of floor(S/N): the tail of the tensor is never reduced",
           find="chunk = -(-flat.numel() // n)  # ceil", replace="chunk = max(flat.numel() // n, 1)  # ceil"),
    Mutant("collectives.all_reduce", "world_group", "ignores group=: reduces over every rank",
           find="    ring_reduce_scatter(mine, padded, group)\n    ring_all_gather(padded, mine, group)",
           replace="    ring_reduce_scatter(mine, padded)\n    ring_all_gather(padded, mine)"),
    Mutant("collectives.all_reduce", "builtin_all_reduce", "calls dist.all_reduce: no ring at all",
           find="    n = dist.get_world_size(group)\n    flat = tensor.reshape(-1)",
           replace="    dist.all_reduce(tensor, group=group)\n    return\n    n = dist.get_world_size(group)\n"
                   "    flat = tensor.reshape(-1)"),
]
