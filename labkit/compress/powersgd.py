"""compress.powersgd: a rank-r approximation of each gradient matrix, one power-iteration step
per training step, with a warm start and error feedback (Vogels et al. 2019, arXiv:1905.13727;
the overview: ``labkit/compress/__init__.py``).
"""

import numpy as np
import torch
import torch.distributed as dist

from labkit.hooks import after, average_future, completed, future_of, in_turn  # noqa: F401 - the hooks' plumbing (given)


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
    world = dist.get_world_size(group)
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
