"""compress.topk: each rank sends its k largest entries as (index, value) pairs and keeps the
rest as error feedback (Aji and Heafield 2017; Lin et al. 2018; the overview:
``labkit/compress/__init__.py``).
"""

import torch
import torch.distributed as dist

from labkit.hooks import after, average_future, completed, future_of, in_turn  # noqa: F401 - the hooks' plumbing (given)


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
    world = dist.get_world_size(group)
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
