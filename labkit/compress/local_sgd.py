"""compress.local_sgd: local SGD and DiLoCo.

Send less often. Local SGD (Stich 2019, arXiv:1805.09767; Lin et al. 2020, arXiv:1808.07217)
lets each rank take H optimizer steps on its own data without communicating, then averages
the models; DiLoCo (Douillard et al. 2023, arXiv:2311.08105) treats that average as an
*outer gradient* and applies it with an outer optimizer: the inner one is AdamW (its state
kept on each rank across rounds), the outer one SGD with Nesterov momentum (lr 0.7,
momentum 0.9). Plain periodic averaging is the outer SGD with lr 1 and no momentum.
One all-reduce per trainable tensor per round (not a flat buffer: no copy in and out, and
the tensors keep their own dtypes), every H steps instead of every step: the bytes per
token of DDP divided by H.
"""

import torch
import torch.distributed as dist
import torch.nn as nn


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
        n = dist.get_world_size(self.group)
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
