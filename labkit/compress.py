"""Chapter 11 exercises: communication efficiency. Send less (compression), route by topology, hide it.

Every chapter so far averaged gradients with one flat all-reduce of full-precision values.
Two levers cut its cost:

* Send fewer bytes. DDP lets you replace the all-reduce of each gradient bucket by a
  *communication hook*, ``hook(state, bucket) -> torch.futures.Future[Tensor]``: the hook gets
  the bucket's flat gradient (``bucket.buffer()``, the per-parameter views in
  ``bucket.gradients()``), must leave the average of every rank's bucket in it, and returns a
  future whose value is that buffer. It returns while its collectives are still in flight (not
  a completed future: DDP's backward goes on with the next buckets meanwhile); a step that
  needs a collective's result is chained on its future (``.then``, ``after``).
  ``ddp.register_comm_hook(state, hook)`` installs one on
  ``torch.nn.parallel.DistributedDataParallel``; ``FlatBucket`` lets you call a hook by hand on
  a list of tensors (``labkit.hooks`` holds it and the futures' plumbing, given; importable
  from here too).

  - fp16/bf16: cast the bucket to 16 bits, divide by N *before* summing (an fp16 sum of N
    large gradients overflows at 65504), all-reduce, cast back. Half the bytes; each value
    carries a relative error of about 2^-11 (fp16) or 2^-8 (bf16). Dividing first trades
    overflow for underflow (quotients below 6.1e-5 lose bits, below 6e-8 vanish): fp16
    training scales the loss (``torch.amp.GradScaler``); bf16 has fp32's range.
  - PowerSGD (Vogels, Karimireddy and Jaggi, 2019, arXiv:1905.13727): view each gradient
    as an n x m matrix M and send a rank-r approximation, r(n + m) numbers instead of nm,
    found by one step of power iteration per training step:
        P = M Q;  all-reduce P;  orthogonalise P;  Q = M^T P;  all-reduce Q, / N;  M ~ P Q^T
    All-reducing P and Q (not M) is what makes the method linear across ranks: the summed
    P is the P of the summed M (for the shared Q). Three details make it work in practice:
      * warm start: this step's Q starts from last step's (orthogonalised), so the power
        iteration continues across steps instead of starting from noise each time;
      * error feedback: what the approximation left out of this rank's gradient, M - P Q^T,
        is added to the next step's gradient, so no part of the gradient is lost, only
        delayed; the sum of the applied gradients differs from the sum of the true ones by
        the last error alone;
      * tensors not worth compressing (biases and other 1-D tensors, any matrix where
        r(n + m) x min_compression_rate >= nm) go through one plain all-reduce.
    ``PowerSGDState`` (given) holds the same state as torch's ``PowerSGDState`` (per bucket:
    the error, P and Q), so the two hooks can be compared step by step. Like torch, lay P
    and Q out (and draw the first random Qs) grouped by matrix shape: on a transformer the
    shapes repeat layer after layer, and bucket order would give each Q other numbers.
  - top-k (Aji and Heafield 2017, arXiv:1704.05021; Lin et al. 2018, arXiv:1712.01887):
    each rank sends only the k = ratio x numel entries of largest magnitude, as (index,
    value) pairs, and keeps the rest as its error for the next step (error feedback,
    Karimireddy et al. 2019, arXiv:1901.09847). Two ranks' top-k sets differ, so the sparse
    sum cannot be built by a ring that adds chunks on the way: every rank all-gathers
    everyone's pairs (N k of them) and adds them up itself.

* Route by topology. Inside a node GPUs talk over NVLink (hundreds of GB/s); across nodes
  over InfiniBand or Ethernet (tens of GB/s per GPU). Both a flat ring and the hierarchical
  scheme send about 2S out of each node; what differs is how many NICs carry it and how many
  latency terms it pays (one ring uses one NIC per node; NCCL's rail-aligned rings use them
  all; chapter 11 section 1 compares the three). Hierarchical all-reduce on
  ``nodes x ranks_per_node`` ranks: reduce-scatter inside the node (each rank holds the
  node's sum of 1/L of the buffer), all-reduce of that shard across nodes (one ring per local
  index, all L at once: each rank sends 1/L of the bytes over its own NIC), all-gather inside
  the node: 2(L - 1) + 2(M - 1) steps instead of the flat ring's 2(N - 1).

* Hide what remains (the last section, "collective matmul"). Sequence parallelism's all-gather
  before a column-parallel matmul, and its reduce-scatter after a row-parallel one, are split
  into their N - 1 ring steps so that each chunk's matmul runs while the next chunk travels
  (Wang et al. 2022, ASPLOS '23; torchtitan's async tensor parallelism).

Tasks (run ``labkit grade compress``; tests in ``tests/grading/test_compress.py``):
    compress.fp16          compress_hook (fp16_compress_hook and bf16_compress_hook call it)
    compress.powersgd      should_compress, orthogonalize, powersgd_compress (powersgd_hook runs it)
    compress.topk          topk_hook
    compress.hierarchical  hierarchical_all_reduce
    compress.ag_matmul     ring_all_gather_matmul, AllGatherMatmul
    compress.matmul_rs     ring_matmul_reduce_scatter, MatmulReduceScatter
    compress.local_sgd     LocalSGD.step (local SGD / DiLoCo: H local steps, then an outer step on the averaged delta)
``NodeGroups`` (given) checks ``nodes x ranks_per_node`` against the world (ValueError before
any communication) and makes the groups; ``hierarchical_hook`` runs your all-reduce as a hook.

The hooks run on torch's ``DistributedDataParallel`` and on the chapter-02 ``labkit.ddp.DDP``
(both: ``model.register_comm_hook(state, hook)``), or by hand on a ``FlatBucket``.
"""

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.hooks import FlatBucket, after, average_future, completed, future_of, in_turn  # noqa: F401 - the hooks' plumbing (given)
from labkit.tp import ColumnParallelLinear, RowParallelLinear


def _group_size(group) -> int:
    return dist.get_world_size(group)


# ----------------------------------------------------------------------------- fp16 / bf16


def compress_hook(dtype: torch.dtype, process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket.buffer()`` over ``process_group`` (None: the world) in ``dtype``.

    Cast the buffer to ``dtype`` and divide it by the group size (in that order: the division
    must happen before the sum, or N large fp16 values overflow), start an asynchronous
    all-reduce of the copy, and return its future chained (``.then``) with a function that
    copies the result back into the buffer (casting back) and returns the buffer.
    """
    # BEGIN SOLUTION compress.fp16: cast to dtype and divide by N, async all-reduce, .then(copy back into the buffer, return it)
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(_group_size(process_group))
    future = dist.all_reduce(compressed, group=process_group, async_op=True).get_future()

    def decompress(done):
        buffer.copy_(done.value()[0])
        return buffer

    return future.then(decompress)
    # END SOLUTION


def fp16_compress_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    return compress_hook(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    # DDP.register_comm_hook refuses a hook of this name unless the backend is NCCL (or XCCL),
    # though gloo sums bf16 fine: on gloo, register a wrapper with another name.
    return compress_hook(torch.bfloat16, process_group, bucket)


# ----------------------------------------------------------------------------- PowerSGD


class PowerSGDState:
    """PowerSGD's settings and state, as in torch's ``PowerSGDState`` (same names, same
    meaning, same random stream for the first Q), so both hooks can run the same steps.

    The first ``start_powerSGD_iter`` steps are plain all-reduces (warm-up; with error
    feedback or warm start it must be > 1, as in torch: DDP rebuilds its buckets after the
    first step). ``iter`` counts steps (it advances on a step's last bucket). Per bucket index:
    ``error_dict`` (this rank's error, flat like the buffer), ``p_memory_dict`` and
    ``q_memory_dict`` (the P and Q of every compressed matrix, flat and concatenated).
    """

    def __init__(self, process_group=None, matrix_approximation_rank: int = 1, start_powerSGD_iter: int = 1_000,
                 min_compression_rate: float = 2, use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0, random_seed: int = 0):
        if matrix_approximation_rank < 1:
            raise ValueError(f"PowerSGD: matrix_approximation_rank must be >= 1, got {matrix_approximation_rank}")
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError("PowerSGD: start_powerSGD_iter must be > 1 with error feedback or warm start "
                             "(DDP rebuilds its buckets after the first step)")
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.rng = np.random.RandomState(random_seed)  # torch's choice: one seed per fresh bucket
        self.error_dict: dict[int, torch.Tensor] = {}
        self.p_memory_dict: dict[int, torch.Tensor] = {}
        self.q_memory_dict: dict[int, torch.Tensor] = {}
        self.iter = 0

    def maybe_increase_iter(self, bucket) -> None:
        if bucket.is_last():
            self.iter += 1

    def random_qs(self, qs: list[torch.Tensor]) -> None:
        """Fill ``qs`` with standard normal numbers, drawn as torch's hook draws them (one seed
        from ``rng`` per call, then the Qs in order), without touching the global RNG."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.rng.randint(1_000_000_000))
            for q in qs:
                q.copy_(torch.randn(*q.shape, dtype=q.dtype))


def should_compress(rows: int, cols: int, rank: int, min_compression_rate: float) -> bool:
    """Worth compressing when rank (rows + cols) x min_compression_rate < rows x cols."""
    # BEGIN SOLUTION compress.powersgd: compressed size r(n + m), times the minimum rate, below the uncompressed n m
    return (rows + cols) * rank * min_compression_rate < rows * cols
    # END SOLUTION


def orthogonalize(matrix: torch.Tensor, epsilon: float = 0) -> None:
    """Gram-Schmidt, in place, on the columns of ``matrix`` [n, r] (r <= n): each column
    divided by its norm (+ epsilon), then its component removed from every later column.
    (Torch's hook uses QR for r > 2; QR's columns may differ in sign, P Q^T does not.)"""
    # BEGIN SOLUTION compress.powersgd: for each column: normalise it (norm + epsilon), subtract its projection from the later columns
    for i in range(matrix.shape[1]):
        column = matrix[:, i:i + 1]
        column /= torch.linalg.vector_norm(column) + epsilon
        rest = matrix[:, i + 1:]
        rest -= column * (column * rest).sum(dim=0, keepdim=True)
    # END SOLUTION


def powersgd_hook(state: "PowerSGDState", bucket) -> torch.futures.Future[torch.Tensor]:
    """PowerSGD as a DDP communication hook (given): the first ``state.start_powerSGD_iter``
    steps a plain average (``average_future``), then your ``powersgd_compress``, each bucket
    in turn (``in_turn``: its Q all-reduce is issued from a callback). Returns a future that is
    still pending while the bucket's collectives are in flight."""
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return average_future(bucket.buffer(), state.process_group)
    return in_turn(state, lambda: powersgd_compress(state, bucket))


def powersgd_compress(state: "PowerSGDState", bucket) -> torch.futures.Future[torch.Tensor]:
    """One compressed step of PowerSGD on ``bucket``, as torch's ``powerSGD_hook`` does it:
    start the collectives and return at once a future (pending while they are in flight) whose
    value is ``bucket.buffer()`` holding the average of the ranks' compressed gradients.
    For bucket ``i = bucket.index()``, over ``state.process_group`` (N ranks):

    1. error feedback (``state.use_error_feedback``): add ``state.error_dict[i]`` (if any) to
       the buffer; keep a copy of the result (the gradient this step tries to send);
    2. split ``bucket.gradients()``: each viewed as ``[shape[0], -1]`` (n x m: a conv weight
       [c_out, c_in, kh, kw] is c_out x c_in kh kw) with rank
       ``r = min(n, m, state.matrix_approximation_rank)`` is compressed if ``should_compress``
       (with ``state.min_compression_rate``), else it joins one flat tensor of the
       uncompressed ones (biases, small matrices): start its all-reduce (issue it even when it
       is empty, as torch does);
    3. group the compressed matrices by shape, in the order each shape first appears (torch's
       layout: on a transformer the shapes repeat interleaved, layer after layer, and the
       order decides which random numbers each Q gets). P and Q live in two flat tensors (sum
       of n r, sum of m r), views [n, r] and [m, r] per matrix in that grouped order. If there
       is no Q for this bucket yet, or not ``state.warm_start``: allocate both (in the bucket's
       dtype, on its device) and fill the Qs with ``state.random_qs`` (in that order); with warm
       start the same two tensors serve every later step, updated in place. Orthogonalise every Q
       (``state.orthogonalization_epsilon``);
    4. P = M Q for each; start the all-reduce of the flat P. When the uncompressed and P
       all-reduces are done (``torch.futures.collect_all``): divide the uncompressed sum by N
       and copy it back; orthogonalise each P; Q = M^T P; start the all-reduce of the flat Q
       (``after``: a collective that needs the previous one's result). When it is done: divide
       Q by N; M = P Q^T, written into the gradient's view; error feedback:
       ``state.error_dict[i]`` = the copy of step 1 minus the buffer now; without warm start,
       forget P and Q; ``state.maybe_increase_iter(bucket)``; the value is the buffer.
    """
    # BEGIN SOLUTION compress.powersgd: error feedback in, split (compress or not), start the plain all-reduce, P and Q grouped by shape, P = MQ, all-reduce; then orthogonalise, Q = M^T P, all-reduce; then / N, M = PQ^T, error out
    group = state.process_group
    world = _group_size(group)
    buffer, index = bucket.buffer(), bucket.index()
    if state.use_error_feedback:
        if index in state.error_dict:
            buffer.add_(state.error_dict[index])
        intended = buffer.clone()
    by_shape, plain = {}, []
    for grad in bucket.gradients():
        matrix = grad.view(grad.shape[0], -1)
        rank = min(*matrix.shape, state.matrix_approximation_rank)
        if should_compress(*matrix.shape, rank, state.min_compression_rate):
            by_shape.setdefault(tuple(matrix.shape), []).append(matrix)
        else:
            plain.append(grad)
    matrices = [matrix for same in by_shape.values() for matrix in same]  # torch's layout: grouped by shape
    ranks = [min(*matrix.shape, state.matrix_approximation_rank) for matrix in matrices]

    # biases, norms and small matrices: one plain all-reduce
    flat = torch.cat([g.reshape(-1) for g in plain]) if plain else buffer.new_empty(0)
    plain_future = dist.all_reduce(flat, group=group, async_op=True).get_future()

    fresh = not state.warm_start or index not in state.q_memory_dict
    if fresh:
        state.p_memory_dict[index] = buffer.new_empty(sum(m.shape[0] * r for m, r in zip(matrices, ranks)))
        state.q_memory_dict[index] = buffer.new_empty(sum(m.shape[1] * r for m, r in zip(matrices, ranks)))
    p_all, q_all = state.p_memory_dict[index], state.q_memory_dict[index]
    ps, qs, p_at, q_at = [], [], 0, 0
    for matrix, rank in zip(matrices, ranks):
        (n, m) = matrix.shape
        ps.append(p_all[p_at:p_at + n * rank].view(n, rank))
        qs.append(q_all[q_at:q_at + m * rank].view(m, rank))
        p_at, q_at = p_at + n * rank, q_at + m * rank
    if fresh:
        state.random_qs(qs)
    for q in qs:
        orthogonalize(q, state.orthogonalization_epsilon)
    for matrix, p, q in zip(matrices, ps, qs):
        torch.matmul(matrix, q, out=p)
    p_future = dist.all_reduce(p_all, group=group, async_op=True).get_future()

    def compute_qs(_):
        flat.div_(world)
        offset = 0
        for grad in plain:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()
        for matrix, p, q in zip(matrices, ps, qs):
            orthogonalize(p, state.orthogonalization_epsilon)
            torch.matmul(matrix.t(), p, out=q)
        return dist.all_reduce(q_all, group=group, async_op=True).get_future()

    def decompress(_):
        q_all.div_(world)
        for matrix, p, q in zip(matrices, ps, qs):
            torch.matmul(p, q.t(), out=matrix)
        if state.use_error_feedback:
            state.error_dict[index] = intended - buffer
        if not state.warm_start:
            state.p_memory_dict.clear()
            state.q_memory_dict.clear()
        state.maybe_increase_iter(bucket)
        return buffer

    both = torch.futures.collect_all([plain_future, p_future])
    return after(both, compute_qs).then(decompress)
    # END SOLUTION


def powersgd_elements(shapes: list[tuple[int, ...]], rank: int, min_compression_rate: float = 2) -> dict[str, int]:
    """What one compressed step of a bucket of tensors of ``shapes`` all-reduces, in elements:
    ``{"uncompressed": ..., "p": sum n r, "q": sum m r}`` (torch's rule for which stay whole)."""
    counts = {"uncompressed": 0, "p": 0, "q": 0}
    for shape in shapes:
        n = shape[0]
        m = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        r = min(n, m, rank)
        if (n + m) * r * min_compression_rate < n * m:
            counts["p"] += n * r
            counts["q"] += m * r
        else:
            counts["uncompressed"] += n * m
    return counts


# ----------------------------------------------------------------------------- top-k


class TopKState:
    """Top-k's setting and state: ``ratio`` (0 < ratio <= 1; each rank sends
    k = max(1, int(ratio x numel)) values of a bucket of numel) and, per bucket index,
    ``error_dict`` (this rank's error, flat like the buffer, dtype of the buffer).
    Caution: torch's DDP rebuilds its buckets after the first step, so with several buckets an
    index may then hold other parameters (PowerSGD's warm-up steps exist for this); the
    models of this chapter's lab fit one bucket."""

    def __init__(self, process_group=None, ratio: float = 0.01):
        if not 0 < ratio <= 1:
            raise ValueError(f"top-k: ratio must be in (0, 1], got {ratio!r}")
        self.process_group = process_group
        self.ratio = ratio
        self.error_dict: dict[int, torch.Tensor] = {}


def topk_count(numel: int, ratio: float) -> int:
    """k: how many of a bucket's ``numel`` values each rank sends."""
    return max(1, int(ratio * numel))


def topk_hook(state: "TopKState", bucket) -> torch.futures.Future[torch.Tensor]:
    """Top-k sparsification with error feedback (Aji and Heafield 2017; Lin et al. 2018):
    leave in ``bucket.buffer()`` the average of what every rank sent; return the future of it,
    pending while the all-gathers are in flight.

    1. error feedback: add ``state.error_dict[i]`` (i = ``bucket.index()``), if any, to the buffer;
    2. keep the k = ``topk_count(numel, state.ratio)`` values of largest magnitude: their
       indices (int64) and values (the buffer's dtype);
    3. the new error is the buffer with those k entries set to zero (what was not sent);
    4. start the all-gather of the indices, then of the values (``dist.all_gather_single``
       of k each, ``async_op=True``, over ``state.process_group``): sparse vectors do not add
       up element by element like dense ones, so every rank gets everyone's k pairs;
    5. when both are done (``torch.futures.collect_all``, ``.then``): zero the buffer, add
       every pair into it (``index_add_``: two ranks may send the same index), divide by N;
       the value is the buffer.
    """
    # BEGIN SOLUTION compress.topk: add the error, k largest |values|, new error = the rest, all-gather indices then values, scatter-add into the zeroed buffer, / N
    group = state.process_group
    world = _group_size(group)
    buffer, index = bucket.buffer(), bucket.index()
    if index in state.error_dict:
        buffer.add_(state.error_dict[index])
    k = topk_count(buffer.numel(), state.ratio)
    indices = buffer.abs().topk(k).indices
    values = buffer[indices]
    error = buffer.clone()
    error[indices] = 0
    state.error_dict[index] = error

    all_indices = indices.new_empty(world * k)
    all_values = values.new_empty(world * k)
    gathered = [dist.all_gather_single(all_indices, indices, group=group, async_op=True).get_future(),
                dist.all_gather_single(all_values, values, group=group, async_op=True).get_future()]

    def scatter_add(_):
        buffer.zero_().index_add_(0, all_indices, all_values)
        buffer.div_(world)
        return buffer

    return torch.futures.collect_all(gathered).then(scatter_add)
    # END SOLUTION


# ----------------------------------------------------------------------------- hierarchical


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


# ============================================================================= collective matmul
# Overlap by decomposition (Wang et al. 2022, "Overlap Communication with Dependent Computation
# via Decomposition in Large Deep Learning Models", ASPLOS '23; torchtitan's async tensor
# parallelism). Chapter 07's sequence parallelism all-gathers the sequence before every
# column-parallel layer and reduce-scatters it after every row-parallel one, and the matmul
# waits for the whole collective. Split the collective into its N - 1 ring steps instead, and
# each step's transfer runs while the chunk already here is multiplied:
#
#   all-gather + matmul (column side): rank r holds sequence chunk r of x and its column
#   slice W_r. Step s: pass the chunk in hand to the next rank, multiply it, wait for the
#   chunk of rank r - s - 1 from the previous rank. After N - 1 steps every chunk was
#   multiplied: Y_r = all_gather(x) W_r^T, with no matmul waiting for more than one hop.
#   matmul + reduce-scatter (row side): rank r holds x's columns r (the whole sequence) and
#   W_r; the output chunk c is the sum over ranks of x[c] W_r^T. Step s: multiply chunk
#   c = r - s - 1 while the running sum of the previous chunk travels; add the sum that
#   arrived, pass it on. After N steps rank r holds the full sum of its own chunk r.
#
# The same bytes as the unsplit collective (N - 1 messages of one chunk each way), in N - 1
# steps instead of one call. It pays when multiplying a chunk takes at least as long as
# sending one (compute per chunk >= transfer per chunk); with tiny chunks the N - 1 message
# latencies cost more than the overlap hides.
#
# The backward of each is the other: the gradient of an all-gather-matmul's input is a
# matmul-reduce-scatter of grad_y W_r (every rank used every chunk), and that of a
# matmul-reduce-scatter's input an all-gather-matmul of grad_y.
# The weight gradient of the all-gather side needs the whole gathered x: keeping it costs N
# times the shard until backward. ``regather=True`` keeps the shard and runs the ring
# all-gather again in backward, each chunk's share of grad_W computed while the next travels
# (Megatron-LM's choice with sequence parallelism; chapter 07): 1/N of the memory, one more
# all-gather's bytes per step.
#
# Tasks (run ``labkit grade compress``):
#     compress.ag_matmul   ring_all_gather_matmul, AllGatherMatmul (forward, backward)
#     compress.matmul_rs   ring_matmul_reduce_scatter, MatmulReduceScatter (forward, backward)
# Each Function's backward runs the other task's ring, so each task's tests (forward and
# backward) need both rings: write ring_all_gather_matmul and ring_matmul_reduce_scatter first.
# ``AllGatherColumnLinear`` / ``MatmulReduceScatterLinear`` (given) put them in the chapter-05
# layers (same weight slices) and ``CollectiveMatmulMLP`` runs an MLP sequence-parallel on them.
# Shapes: [B, T, H], the sequence in dim 1 (as chapter 07). Bad shapes raise ValueError
# before any communication.

def ring_peers(group=None) -> tuple[int, int]:
    """Global ranks of the next and the previous rank on the group's ring."""
    me, n = dist.get_rank(group), dist.get_world_size(group)
    world = group or dist.group.WORLD
    return dist.get_global_rank(world, (me + 1) % n), dist.get_global_rank(world, (me - 1) % n)


def start_exchange(tensor: torch.Tensor, to_rank: int, from_rank: int, group=None):
    """Post the send of ``tensor`` to ``to_rank`` and the receive of a tensor of its shape from
    ``from_rank`` (global ranks); returns (the receive buffer, the works). Wait on every work
    before reading the buffer (or reusing ``tensor``)."""
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor.contiguous(), to_rank, group),
           dist.P2POp(dist.irecv, received, from_rank, group)]
    return received, dist.batch_isend_irecv(ops)


def ring_all_gather_matmul(x_local: torch.Tensor, matmul, group=None):
    """All-gather ``x_local`` (this rank's chunk) around the ring, applying ``matmul`` to each
    chunk as soon as it is here. Returns (outputs, chunks): lists indexed by the rank whose
    chunk it is, ``outputs[c] = matmul(chunk c)``.

    Step s = 0..N-1: this rank holds the chunk of rank (r - s) mod N. Unless it is the last
    step, post its exchange (send it to the next rank, receive from the previous one:
    ``start_exchange`` with ``ring_peers``); multiply it; then wait: the next chunk arrived
    while this one was multiplied. N - 1 exchanges of one chunk each. ``matmul`` is called once
    per step, in step order (``AllGatherMatmul``'s re-gather relies on it).
    """
    # BEGIN SOLUTION compress.ag_matmul: N steps: post the exchange of the chunk in hand (not on the last), record chunk and matmul(chunk) at its owner's index, wait, take the received chunk (owner r - s - 1)
    n, me = dist.get_world_size(group), dist.get_rank(group)
    to_rank, from_rank = ring_peers(group)
    outputs, chunks = [None] * n, [None] * n
    held, owner = x_local.contiguous(), me
    for step in range(n):
        pending = start_exchange(held, to_rank, from_rank, group) if step < n - 1 else None
        chunks[owner], outputs[owner] = held, matmul(held)  # while the next chunk travels
        if pending is not None:
            held, works = pending
            for work in works:
                work.wait()
            owner = (owner - 1) % n
    return outputs, chunks
    # END SOLUTION


def ring_matmul_reduce_scatter(partial, group=None) -> torch.Tensor:
    """The sum over the group's ranks of ``partial(r)``, r this rank: each rank's own partial
    product for sequence chunk r, reduce-scattered around the ring. ``partial(c)`` computes
    this rank's partial product for chunk c (called once per chunk).

    Step s = 0..N-1: compute ``partial(c)`` for c = (r - s - 1) mod N; while it was computed,
    the running sum of chunk c from the previous rank was on its way: wait for it (from step
    1 on) and add it; unless it is the last step, post the exchange that passes the sum on to
    the next rank (``start_exchange``; the received buffer is next step's incoming sum). At
    the last step c = r: the sum over every rank of chunk r.
    """
    # BEGIN SOLUTION compress.matmul_rs: N steps: chunk c = (r - s - 1) mod N; part = partial(c) (the previous sum in flight); wait and add the received sum; post the exchange of part unless last
    n, me = dist.get_world_size(group), dist.get_rank(group)
    to_rank, from_rank = ring_peers(group)
    pending, part = None, None
    for step in range(n):
        chunk = (me - step - 1) % n
        part = partial(chunk)  # computed while the previous running sum travels
        if pending is not None:
            received, works = pending
            for work in works:
                work.wait()
            part = part + received
        if step < n - 1:
            pending = start_exchange(part, to_rank, from_rank, group)
    return part
    # END SOLUTION


def _sequence_chunks(x: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    return x.split(x.shape[1] // n, dim=1)


class AllGatherMatmul(torch.autograd.Function):
    """Y_r = all_gather(x) W_r^T + b_r, the all-gather decomposed: x_local [B, T/N, in]
    (sequence chunk r), weight W_r [out/N, in], bias b_r [out/N] or None -> [B, T, out/N].

    Forward: ``ring_all_gather_matmul`` with ``F.linear`` per chunk; the output is the chunks'
    outputs in rank order along dim 1. Save the weight, and for the weight gradient (it needs
    every chunk): the gathered x (``regather=False``: N times the shard kept until backward),
    or only x_local (``regather=True``, Megatron-LM's choice with sequence parallelism: the
    shard kept, x gathered again in backward).
    Backward: grad_x = the reduce-scatter of grad_y W_r along the sequence, decomposed
    (``ring_matmul_reduce_scatter``, partial(c) = chunk c of grad_y times W_r); grad_W =
    grad_y^T x over all B·T rows: with ``regather``, x all-gathered again by
    ``ring_all_gather_matmul`` whose matmul adds the chunk's share of grad_W, (grad_y chunk
    c)^T (x chunk c), into one grad_W buffer (not N weight-sized partials kept for a sum),
    each while the next chunk travels (the ring calls it in step order: at step s it holds the
    chunk of rank (r - s) mod N); grad_b = grad_y summed over B and T.
    """

    @staticmethod
    def forward(ctx, x_local, weight, bias, group, regather=False):
        # BEGIN SOLUTION compress.ag_matmul: ring_all_gather_matmul(x_local, F.linear with weight and bias); save x_local if regather else the gathered x (cat of the chunks), and weight; cat the outputs along dim 1
        outputs, chunks = ring_all_gather_matmul(x_local, lambda chunk: F.linear(chunk, weight, bias), group)
        ctx.save_for_backward(x_local if regather else torch.cat(chunks, dim=1), weight)
        ctx.group, ctx.has_bias, ctx.regather = group, bias is not None, regather
        return torch.cat(outputs, dim=1)
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad_y):
        # BEGIN SOLUTION compress.ag_matmul: grad_x by ring_matmul_reduce_scatter of (grad_y chunk c) @ weight; grad_w = grad_y^T x (rows flattened), with regather a ring_all_gather_matmul of the saved shard whose matmul adds (grad_y chunk c)^T (x chunk c) into one grad_w, c = r - s at step s; grad_b = grad_y summed over B, T
        x_saved, weight = ctx.saved_tensors
        n = dist.get_world_size(ctx.group)
        grads = _sequence_chunks(grad_y, n)
        grad_x = ring_matmul_reduce_scatter(lambda c: grads[c] @ weight, ctx.group)  # every rank used every chunk
        if ctx.regather:  # x gathered again; each chunk's share of grad_W added while the next travels
            me, steps, grad_w = dist.get_rank(ctx.group), iter(range(n)), torch.zeros_like(weight)

            def add_weight_grad(chunk):
                c = (me - next(steps)) % n  # step s holds the chunk of rank r - s
                grad_w.add_(grads[c].flatten(0, 1).t() @ chunk.flatten(0, 1))

            ring_all_gather_matmul(x_saved, add_weight_grad, ctx.group)
        else:
            grad_w = grad_y.flatten(0, 1).t() @ x_saved.flatten(0, 1)
        grad_b = grad_y.sum(dim=(0, 1)) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None
        # END SOLUTION


class MatmulReduceScatter(torch.autograd.Function):
    """Y_r = chunk r of sum_ranks x W_rank^T, the reduce-scatter decomposed: x [B, T, in/N]
    (the whole sequence, this rank's input columns), weight W_r [out, in/N] -> [B, T/N, out].

    Forward: ``ring_matmul_reduce_scatter`` with partial(c) = F.linear(chunk c of x, weight);
    save x and the weight.
    Backward: grad_y [B, T/N, out] is all-gathered and multiplied, decomposed
    (``ring_all_gather_matmul``, matmul = g @ W_r): grad_x = the outputs in rank order along
    dim 1; grad_W = (the gathered grad_y)^T x over all B·T rows.
    """

    @staticmethod
    def forward(ctx, x, weight, group):
        # BEGIN SOLUTION compress.matmul_rs: ring_matmul_reduce_scatter(partial(c) = F.linear(x chunk c, weight)); save x and weight
        chunks = _sequence_chunks(x, dist.get_world_size(group))
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return ring_matmul_reduce_scatter(lambda c: F.linear(chunks[c], weight), group)
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad_y):
        # BEGIN SOLUTION compress.matmul_rs: ring_all_gather_matmul(grad_y, g @ weight): grad_x = cat of the outputs (dim 1); grad_w = gathered grad_y^T x (rows flattened)
        x, weight = ctx.saved_tensors
        outputs, grads = ring_all_gather_matmul(grad_y, lambda g: g @ weight, ctx.group)
        grad_w = torch.cat(grads, dim=1).flatten(0, 1).t() @ x.flatten(0, 1)
        return torch.cat(outputs, dim=1), grad_w, None
        # END SOLUTION


def _check_sequence_input(x: torch.Tensor, features: int, n: int, what: str, whole_sequence: bool) -> None:
    """ValueError, before any communication, unless x is [B, T, features] (T divisible by N
    when x holds the whole sequence)."""
    if x.dim() != 3:
        raise ValueError(f"{what}: input must be [B, T, H] (sequence in dim 1), got shape {tuple(x.shape)}")
    if x.shape[-1] != features:
        raise ValueError(f"{what}: input has {x.shape[-1]} features, the layer's slice takes {features}")
    if whole_sequence and x.shape[1] % n:
        raise ValueError(f"{what}: sequence length T={x.shape[1]} is not divisible by the tensor-parallel degree {n}")


class AllGatherColumnLinear(ColumnParallelLinear):
    """A chapter-05 ``ColumnParallelLinear`` (the same weight slice, from ``from_linear``)
    whose input is sequence-parallel: x [B, T/N, in] -> [B, T, out/N], the all-gather of the
    sequence overlapped with the matmul (``AllGatherMatmul``). ``regather=True`` keeps only the
    input shard for backward and all-gathers it again there (``AllGatherMatmul``'s option):
    activation memory 1/N of the gathered input's, for one more ring all-gather per step."""

    def __init__(self, *args, regather: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.regather = regather
        if self.gather_output:
            raise ValueError("AllGatherColumnLinear: gather_output is not supported (the row layer takes the slice)")

    def forward(self, x):
        _check_sequence_input(x, self.in_features, dist.get_world_size(self.group), "AllGatherColumnLinear", False)
        return AllGatherMatmul.apply(x, self.weight, self.bias, self.group, self.regather)


class MatmulReduceScatterLinear(RowParallelLinear):
    """A chapter-05 ``RowParallelLinear`` (the same weight slice) whose output is
    sequence-parallel: x [B, T, in/N] -> [B, T/N, out], the reduce-scatter overlapped with the
    matmul (``MatmulReduceScatter``). The bias is added to this rank's tokens after the sum: its
    gradient is this rank's share (sum it over the group, as chapter 07's
    ``reduce_layernorm_grads`` does)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not self.input_is_parallel:
            raise ValueError("MatmulReduceScatterLinear: the input must already be split (input_is_parallel=True)")

    def forward(self, x):
        n = dist.get_world_size(self.group)
        _check_sequence_input(x, self.weight.shape[1], n, "MatmulReduceScatterLinear", True)
        y = MatmulReduceScatter.apply(x, self.weight, self.group)
        return y + self.bias if self.bias is not None else y


class CollectiveMatmulMLP(nn.Module):
    """``labkit.models.MLP`` with tensor + sequence parallelism on collective matmuls: input and
    output are this rank's sequence chunk [B, T/N, n_embd]; c_fc all-gathers while it
    multiplies, c_proj reduce-scatters while it multiplies. ``regather``: c_fc keeps only its
    input shard and gathers it again in backward (Megatron-LM)."""

    def __init__(self, mlp, group=None, regather: bool = False):
        super().__init__()
        self.c_fc = AllGatherColumnLinear.from_linear(mlp.c_fc, group, regather=regather)
        self.c_proj = MatmulReduceScatterLinear.from_linear(mlp.c_proj, group)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


# ============================================================================= local SGD / DiLoCo
# Send less often. Local SGD (Stich 2019, arXiv:1805.09767; Lin et al. 2020, arXiv:1808.07217)
# lets each rank take H optimizer steps on its own data without communicating, then averages
# the models; DiLoCo (Douillard et al. 2023, arXiv:2311.08105) treats that average as an
# *outer gradient* and applies it with an outer optimizer: the inner one is AdamW (its state
# kept on each rank across rounds), the outer one SGD with Nesterov momentum (lr 0.7,
# momentum 0.9). Plain periodic averaging is the outer SGD with lr 1 and no momentum.
# One all-reduce per trainable tensor per round (not a flat buffer: no copy in and out, and
# the tensors keep their own dtypes), every H steps instead of every step: the bytes per
# token of DDP divided by H.

DILOCO_OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}


class LocalSGD:
    """Local SGD / DiLoCo around a model and its (inner) optimizer, over ``group`` (None: the
    world). Call ``step()`` after every ``inner_optimizer.step()``: it counts the steps and on
    every ``sync_every``-th one runs the outer step, returning True (False on the local steps,
    which communicate nothing). ``local_steps``: the inner steps counted so far.

    The outer step, for every trainable parameter (``requires_grad``; frozen ones are neither
    sent nor changed; one unused on this rank still takes part, with a zero delta, since
    another rank may have used it):
        delta = theta_start - theta_local          the outer gradient of this rank
        delta = all-reduce(delta) / N              its average over the group
        outer optimizer step on theta_start with gradient delta
        theta_local = theta_start                  every rank of the group ends equal
    ``theta_start`` (``self.start``) lives in the outer optimizer (copies made at construction,
    the same tensors updated in place round after round, its state kept across rounds); ``outer_optimizer_cls(params, **outer_kwargs)`` builds it, by default
    DiLoCo's SGD with Nesterov momentum (``DILOCO_OUTER``). The inner optimizer's state is
    left alone (DiLoCo keeps it across rounds). ``sync_every`` < 1 raises ValueError before
    any communication.
    """

    def __init__(self, model: nn.Module, inner_optimizer, outer_optimizer_cls=torch.optim.SGD,
                 outer_kwargs: dict | None = None, sync_every: int = 4, group=None):
        if int(sync_every) != sync_every or sync_every < 1:
            raise ValueError(f"LocalSGD: sync_every must be an integer >= 1, got {sync_every!r}")
        self.model, self.inner, self.group, self.sync_every = model, inner_optimizer, group, int(sync_every)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.start = [p.detach().clone() for p in self.params]
        self.outer = outer_optimizer_cls(self.start, **(DILOCO_OUTER if outer_kwargs is None else outer_kwargs))
        self.local_steps = 0

    @torch.no_grad()
    def step(self) -> bool:
        # BEGIN SOLUTION compress.local_sgd: count the step; unless it is a multiple of sync_every return False; delta = start - param, start every all-reduce (group), wait, / N into start.grad; outer step; copy start into the params; True
        self.local_steps += 1
        if self.local_steps % self.sync_every:
            return False
        n = _group_size(self.group)
        deltas = [start - param for start, param in zip(self.start, self.params)]
        works = [dist.all_reduce(delta, group=self.group, async_op=True) for delta in deltas]
        for start, delta, work in zip(self.start, deltas, works):
            work.wait()
            start.grad = delta.div_(n)
        self.outer.step()
        for start, param in zip(self.start, self.params):
            param.copy_(start)
        return True
        # END SOLUTION
