"""compress.hierarchical: all-reduce by topology: reduce-scatter inside each node, all-reduce
across nodes, all-gather inside (the overview: ``labkit/compress/__init__.py``).
"""

import torch
import torch.distributed as dist

from labkit.hooks import after, average_future, completed, future_of, in_turn  # noqa: F401 - the hooks' plumbing (given)


class NodeGroups:
    """The world as ``nodes x ranks_per_node``, node-major (rank = node * L + local, as
    ``labkit.mesh.RankGrid(world, dp=nodes, tp=ranks_per_node)`` lays it out): ``inside`` is
    this rank's node (L consecutive ranks), ``across`` the ranks with its local index on
    every node. Raises ValueError, before any communication, unless nodes x L is the world.
    A collective (``dist.new_group``): every rank builds it, in the same order."""

    def __init__(self, nodes: int, ranks_per_node: int):
        world = dist.get_world_size()
        for name, value in (("nodes", nodes), ("ranks_per_node", ranks_per_node)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"hierarchical all-reduce: {name} must be a positive integer, got {value!r}")
        if nodes * ranks_per_node != world:
            raise ValueError(f"hierarchical all-reduce: {nodes} nodes x {ranks_per_node} ranks per node = "
                             f"{nodes * ranks_per_node} ranks, but the world has {world}")
        self.nodes, self.ranks_per_node = nodes, ranks_per_node
        rank = dist.get_rank()
        for node in range(nodes):
            members = list(range(node * ranks_per_node, (node + 1) * ranks_per_node))
            group = dist.new_group(members)
            if rank in members:
                self.inside, self.inside_ranks = group, members
        for local in range(ranks_per_node):
            members = list(range(local, world, ranks_per_node))
            group = dist.new_group(members)
            if rank in members:
                self.across, self.across_ranks = group, members


def hierarchical_all_reduce(tensor: torch.Tensor, groups: NodeGroups, async_op: bool = False):
    """Sum ``tensor`` (contiguous, any shape) over the world, in place, in three steps:

    1. pad its flat view with zeros to a multiple of L = ``groups.ranks_per_node`` and
       reduce-scatter it inside the node (``dist.reduce_scatter_single``, ``groups.inside``):
       this rank holds the node's sum of its 1/L shard;
    2. all-reduce that shard across nodes (``groups.across``);
    3. all-gather the shards inside the node (``dist.all_gather_single``) and copy the
       first numel values back into ``tensor``.

    Each step needs the one before: start the reduce-scatter (``async_op=True``; its future:
    ``future_of(work)``, gloo's reduce-scatter has no ``get_future``) and chain the next two on
    it with ``after``, the copy back with ``.then`` (reading the value it chains on, so that a
    step that failed fails the call instead of leaving the tensor half summed). With ``async_op`` return that
    future at once (pending while the steps are in flight; its value is ``tensor``), else wait
    for it and return None.
    """
    # BEGIN SOLUTION compress.hierarchical: pad to a multiple of L, start the reduce-scatter inside; after it the all-reduce of the shard across; after that the all-gather inside; then copy back
    flat = tensor.reshape(-1)
    shard = -(-flat.numel() // groups.ranks_per_node)
    padded = flat.new_zeros(shard * groups.ranks_per_node)
    padded[:flat.numel()] = flat
    part = flat.new_empty(shard)
    scattered = future_of(dist.reduce_scatter_single(part, padded, group=groups.inside, async_op=True))
    summed = after(scattered, lambda _: dist.all_reduce(part, group=groups.across, async_op=True).get_future())
    gathered = after(summed, lambda _: dist.all_gather_single(padded, part, group=groups.inside,
                                                              async_op=True).get_future())

    def copy_back(done):
        done.value()  # a step that failed fails the call, not a tensor left half summed
        tensor.copy_(padded[:flat.numel()].view_as(tensor))
        return tensor

    future = gathered.then(copy_back)
    if async_op:
        return future
    future.wait()
    # END SOLUTION


def hierarchical_hook(groups: NodeGroups, bucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: the bucket averaged by your hierarchical all-reduce, started
    at once and returned pending (buckets in turn: see ``in_turn``)."""
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    return in_turn(groups, lambda: hierarchical_all_reduce(buffer, groups, async_op=True))


def hierarchical_bytes(numel: int, element_size: int, nodes: int, ranks_per_node: int) -> dict[str, float]:
    """Bytes one rank sends on each link class for a hierarchical all-reduce of ``numel``
    elements, ring algorithms at both levels (chapter 00): inside the node, a reduce-scatter and
    an all-gather of the padded buffer S, (L-1)/L S each; across nodes, an all-reduce of the
    shard S/L, 2 (M-1)/M S/L."""
    shard = -(-numel // ranks_per_node) * element_size
    padded = shard * ranks_per_node
    inside = 2 * (ranks_per_node - 1) / ranks_per_node * padded
    across = 2 * (nodes - 1) / nodes * shard
    return {"inside": inside, "across": across}
