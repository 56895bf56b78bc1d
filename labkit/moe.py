"""Chapter 10 exercises: expert parallelism, a mixture-of-experts layer routed by all-to-all.

A mixture-of-experts (MoE) layer replaces a transformer's MLP by E expert MLPs and a router
that sends each token to k of them (Shazeer et al., 2017, arXiv:1701.06538; GShard, Lepikhin
et al., 2020, arXiv:2006.16668; Switch, Fedus et al., 2021, arXiv:2101.03961). Parameters
grow with E, FLOPs per token only with k.

Expert parallelism (EP) splits the E experts over the N ranks of a group, E/N each. Every rank
routes its own tokens, then:

1. counts, per expert, the tokens it sends and exchanges these counts (an all-to-all of E
   int64s): without them no rank knows how many rows it will receive, and all_to_all_single
   with mismatched split sizes hangs;
2. sorts its (token, choice) pairs by expert (a permutation) and sends each block to the rank
   holding the expert: all_to_all_single with uneven input/output split sizes (dispatch);
3. computes each local expert on its rows, batched per expert;
4. sends the results back with the reverse all-to-all (combine), un-permutes them and adds
   them up, weighted by the gate.

Both all-to-alls move (routed rows) x hidden x element size bytes; backward runs them again in
reverse. Capacity: with factor C, an expert takes at most ceil(C * k * T / E) of a rank's T
tokens; the rule here keeps the earliest (token index, then choice slot) and drops the rest
(a dropped choice contributes nothing; the token still has its residual path). ``capacity_factor
= None`` is dropless.

Tasks (run ``labkit grade moe``; tests in ``tests/grading/test_moe.py``):
    moe.router    route, load_balancing_loss, router_z_loss
    moe.capacity  expert_capacity, keep_mask
    moe.dispatch  AllToAll, exchange_counts
    moe.layer     plan_dispatch, compute_experts, combine (steps 1-4), ExpertParallelMoE.forward
    moe.ep_dp     ep_dp_grid, average_ep_dp_gradients (EP x DP on the chapter-08 rank grid)
    moe.bias_balance  route(..., bias=...), BiasBalancer: count, update, route (auxiliary-loss-free balancing)
    moe.shared_overlap  AllToAllOverlap, SharedExpertMoE.forward (shared experts computed while
                  the dispatch and combine all-to-alls are in flight; moe.layer's steps reused)
Bad input (experts not divisible by the EP degree, k > E, capacity factor <= 0, ep x dp not
the world, no shared expert) raises ValueError before any communication.

EP x DP. With N = ep x dp ranks the experts are split over the ep ranks of an EP group and
each split is replicated over the dp ranks of a DP group; every rank reads its own slice of
the global batch (EP ranks too: they share experts, not data). The groups come from the
chapter-08 ``RankGrid`` (the learner's ``labkit.mesh``), EP on its fastest axis (consecutive
ranks, one node: the all-to-alls need the fastest links), DP on its slowest:
``RankGrid(N, dp=dp, tp=ep)``, so rank = d * ep + e. Gradients, for the loss the mean of the
N ranks' losses (one process on the global batch, routed in the same N slices):

* a dense parameter (attention, norms, embeddings, the gate) is used by this rank's tokens
  only: grad = (1/N) sum over all N ranks, an all-reduce over the world;
* an expert's weights already received, through the backward all-to-alls, the gradient of
  every token of the EP group routed to it (the ep ranks' losses). The dp copies of the
  expert saw the other EP groups' tokens: grad = (1/N) sum over its DP group, an all-reduce
  over the dp ranks holding that expert, divided by N (not by dp: each copy already holds ep
  ranks' worth). Megatron-LM does the same: its DDP sums expert gradients over the expert-data-
  parallel group and scales them, like the dense ones, by 1 / the full data-parallel size
  (megatron/core/distributed/distributed_data_parallel.py).

``labkit.models.GPT`` with ``GPTConfig(n_experts=E, ...)`` is the single-process MoE GPT;
``expert_parallel_gpt`` (given) swaps each block's MoE MLP for your ``ExpertParallelMoE``
holding this rank's experts.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


# ----------------------------------------------------------------------------- router

def route(x: torch.Tensor, gate_weight: torch.Tensor, k: int, bias: torch.Tensor | None = None):
    """Top-k routing of tokens ``x`` [T, H] with a linear gate [E, H] (both of one dtype).

    Returns (experts [T, k] int64, weights [T, k], probs [T, E], logits [T, E]), the floats
    in the dtype of ``x``. For k >= 2 the weights are the chosen softmax probabilities
    renormalised to sum to 1 per token (GShard, Mixtral). For k = 1 the weight is the chosen
    probability itself, not renormalised (Switch Transformer): renormalised, it would always
    be 1, and the router would get no gradient from the task loss (only from the auxiliary
    losses).

    ``bias`` [E] (float32, from ``BiasBalancer``): see ``biased_route``; None routes on the
    probabilities alone."""
    if bias is not None:
        return biased_route(x, gate_weight, k, bias)
    # BEGIN SOLUTION moe.router: logits = x @ W.T, softmax, topk; for k >= 2 divide the k weights by their sum, for k = 1 keep the probability (Switch: a weight of 1 gives the router no gradient)
    logits = x @ gate_weight.t()
    probs = logits.softmax(dim=-1)
    weights, experts = probs.topk(k, dim=-1)
    if k > 1:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return experts, weights, probs, logits
    # END SOLUTION


def biased_route(x: torch.Tensor, gate_weight: torch.Tensor, k: int, bias: torch.Tensor):
    """``route`` with a per-expert bias that only chooses (DeepSeek-V3, arXiv:2412.19437,
    section 2.1.2, auxiliary-loss-free load balancing): the experts are the top-k of
    probs + bias, computed in float32 (no gradient), highest biased score first; the weights
    are the *unbiased* probabilities of those experts, renormalised for k >= 2 and not for
    k = 1, as in ``route``. The bias never reaches a weight, so the gate's gradient does not
    depend on it. Returns what ``route`` returns."""
    # BEGIN SOLUTION moe.bias_balance: logits and softmax as in route; experts = topk of (probs.float() + bias.float()); weights = probs.gather(experts), renormalised for k > 1
    logits = x @ gate_weight.t()
    probs = logits.softmax(dim=-1)
    experts = (probs.float() + bias.float()).topk(k, dim=-1).indices  # indices: no gradient
    weights = probs.gather(-1, experts)
    if k > 1:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return experts, weights, probs, logits
    # END SOLUTION


class BiasBalancer:
    """The per-expert routing bias of auxiliary-loss-free balancing (Wang et al., 2024,
    arXiv:2408.15664; DeepSeek-V3, arXiv:2412.19437, section 2.1.2). ``bias`` [E] float32 starts
    at 0; ``counts`` [E] int64 holds this rank's choices (T x k per routing, before any capacity
    drop) since the last update. Routing and updating are separate, as in DeepSeek-V3 (the bias
    is adjusted at the end of each step) and Megatron-Core (tokens per expert accumulated over
    the global batch, one update in ``finalize_model_grads``):

    * ``route(x, gate_weight, k)`` routes with the current bias and, only while autograd records
      (``torch.is_grad_enabled()``, Megatron-Core's rule), adds its choices to ``counts`` with
      ``count``. It communicates nothing and never changes the bias: every micro-batch of a step
      routes with the same bias, and so does the recomputation of a checkpointed layer (an
      update between forward and recompute would choose other experts in backward than in
      forward: wrong gradients). An evaluation forward under ``no_grad`` counts nothing; under
      reentrant checkpointing (this course's ``recompute.Checkpoint``,
      ``torch.utils.checkpoint(use_reentrant=True)``) the forward runs without grad and the
      recompute with it, so each token is counted once. (torch's non-reentrant checkpoint
      records in both runs: there, route the forward and count its experts yourself.)
    * ``update()`` once per step, after the last micro-batch's backward: the counts summed
      (all-reduced) over ``group`` (None = the world; Megatron-Core: the whole data x tensor x
      context-parallel group), the global load, so the bias stays identical on every rank; then

          bias_e += gamma * sign(mean_e load - load_e)

      raised for an under-loaded expert, lowered for an over-loaded one, unchanged at the mean
      (sign 0); ``counts`` back to 0. The bias of step s comes from steps 1 ... s-1.

    ``gamma`` is the bias update speed, in units of the router's scores (here softmax
    probabilities, about 1/E each): DeepSeek-V3 uses 0.001 on sigmoid affinities."""

    def __init__(self, num_experts: int, gamma: float = 1e-3, group=None):
        self.num_experts, self.gamma, self.group = num_experts, gamma, group
        self.bias = torch.zeros(num_experts, dtype=torch.float32)
        self.counts = torch.zeros(num_experts, dtype=torch.int64)

    def count(self, experts: torch.Tensor) -> None:
        """Adds the choices in ``experts`` (int64, any shape, e.g. [T, k]) to ``self.counts`` (in
        place). No communication."""
        # BEGIN SOLUTION moe.bias_balance: counts += bincount of the flattened experts (minlength E)
        self.counts += torch.bincount(experts.reshape(-1), minlength=self.num_experts)
        # END SOLUTION

    def update(self) -> torch.Tensor:
        """The end of a step: ``counts`` summed over the group (one all-reduce of E int64s), the
        bias moved by gamma * sign(mean - load) (in place), ``counts`` zeroed. Returns ``bias``."""
        # BEGIN SOLUTION moe.bias_balance: copy of self.counts, all_reduce over self.group, bias += gamma * sign(load.mean() - load) (float32); zero self.counts
        load = self.counts.clone()  # a copy: all_reduce writes its argument
        dist.all_reduce(load, group=self.group)
        load = load.to(torch.float32)
        self.bias += self.gamma * torch.sign(load.mean() - load)
        self.counts.zero_()
        return self.bias
        # END SOLUTION

    def route(self, x: torch.Tensor, gate_weight: torch.Tensor, k: int):
        """``route(x, gate_weight, k, bias=self.bias)``; its experts counted (``count``) when grad
        is enabled. The bias is not changed. Returns route's four outputs."""
        # BEGIN SOLUTION moe.bias_balance: route with the current bias; if torch.is_grad_enabled(), count its experts; no update here
        out = route(x, gate_weight, k, bias=self.bias)
        if torch.is_grad_enabled():
            self.count(out[0])
        return out
        # END SOLUTION


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch/GShard auxiliary loss E * sum_e f_e * P_e: f_e the fraction of the T*k choices
    sent to expert e (no gradient), P_e the mean router probability of e. 1 when balanced.
    In the dtype of ``probs``."""
    # BEGIN SOLUTION moe.router: f = bincount(experts)/(T*k), P = probs.mean(0), E * (f * P).sum()
    counts = torch.bincount(experts.reshape(-1), minlength=num_experts).to(probs.dtype)
    fraction = counts / experts.numel()
    return num_experts * (fraction * probs.mean(dim=0)).sum()
    # END SOLUTION


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss (Zoph et al., 2022, arXiv:2202.08906): mean of logsumexp(logits)^2,
    in the dtype of ``logits``. Exact where exp(logits) overflows (logits of 1e3 in fp32)."""
    # BEGIN SOLUTION moe.router: torch.logsumexp over experts, squared, mean over tokens
    return torch.logsumexp(logits, dim=-1).pow(2).mean()
    # END SOLUTION


# ----------------------------------------------------------------------------- capacity

def expert_capacity(tokens: int, num_experts: int, k: int, capacity_factor: float | None) -> int | None:
    """ceil(C * k * T / E) rows per expert; None (dropless) when capacity_factor is None."""
    if capacity_factor is None:
        return None
    if capacity_factor <= 0:
        raise ValueError(f"moe: capacity factor must be > 0, got {capacity_factor}")
    # BEGIN SOLUTION moe.capacity: math.ceil of C * k * T / E
    return math.ceil(capacity_factor * k * tokens / num_experts)
    # END SOLUTION


def keep_mask(experts: torch.Tensor, num_experts: int, capacity: int | None) -> torch.Tensor:
    """Bool [T, k]: which choices an expert accepts. Each expert takes choices in order of
    token index, then slot (row-major over [T, k]), until it holds ``capacity``."""
    if capacity is None:
        return torch.ones_like(experts, dtype=torch.bool)
    # BEGIN SOLUTION moe.capacity: one-hot of the flat choices, cumsum down the rows = position in its expert; keep position < capacity
    flat = experts.reshape(-1)
    one_hot = F.one_hot(flat, num_experts)
    position = (one_hot.cumsum(dim=0) * one_hot).sum(dim=1) - 1
    return (position < capacity).reshape(experts.shape)
    # END SOLUTION


# ----------------------------------------------------------------------------- dispatch

class AllToAll(torch.autograd.Function):
    """Rows of ``x`` [M, H] go out in blocks of ``input_splits`` (one per rank of ``group``);
    the result holds the blocks received, ``output_splits`` rows from each rank, in rank
    order. Backward sends the gradient back the other way (splits swapped)."""

    @staticmethod
    def forward(ctx, x, output_splits: list[int], input_splits: list[int], group=None):
        # BEGIN SOLUTION moe.dispatch: new_empty(sum(output_splits), H), dist.all_to_all_single with both split lists
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        # BEGIN SOLUTION moe.dispatch: the same all-to-all with the split lists swapped
        output_splits, input_splits = ctx.splits
        return AllToAll.forward(ctx, grad, input_splits, output_splits, ctx.group), None, None, None
        # END SOLUTION


def exchange_counts(counts: torch.Tensor, group=None) -> torch.Tensor:
    """``counts`` [E] int64: rows this rank sends to each expert. Returns [N, E/N]: row s holds
    the rows rank s sends to each of this rank's experts (one even all-to-all of E int64s)."""
    n = dist.get_world_size(group)
    # BEGIN SOLUTION moe.dispatch: all_to_all_single of the E counts (even splits), reshaped to [N, E/N]
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received.view(n, -1)
    # END SOLUTION


# ----------------------------------------------------------------------------- the layer

def init_experts(num_experts: int, hidden: int, ffn: int, seed: int, dtype=torch.float32):
    """Every expert's weights (w1 [E, H, F], w2 [E, F, H]) and the gate [E, H], from a seed:
    the same on every rank and in the single-process reference."""
    gen = torch.Generator().manual_seed(seed)
    gate = torch.randn(num_experts, hidden, generator=gen, dtype=torch.float64) / math.sqrt(hidden)
    w1 = torch.randn(num_experts, hidden, ffn, generator=gen, dtype=torch.float64) / math.sqrt(hidden)
    w2 = torch.randn(num_experts, ffn, hidden, generator=gen, dtype=torch.float64) / math.sqrt(ffn)
    return gate.to(dtype), w1.to(dtype), w2.to(dtype)


def expert_mlp(rows: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return F.gelu(rows @ w1) @ w2


class ExpertParallelMoE(nn.Module):
    """A top-k MoE MLP with its E experts split over ``group`` (E/N per rank, rank r holds
    experts r*E/N ... (r+1)*E/N - 1). ``forward(x [B, T, H])`` -> (y, aux) with aux the
    load-balancing loss of this rank's tokens; ``self.z_loss`` holds the router z-loss."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, k: int = 2,
                 capacity_factor: float | None = None, group=None, seed: int = 0, dtype=torch.float32):
        super().__init__()
        n = dist.get_world_size(group)
        if num_experts % n:
            raise ValueError(f"moe: {num_experts} experts do not split over {n} EP ranks (E % N != 0)")
        if not 1 <= k <= num_experts:
            raise ValueError(f"moe: top-k {k} must be between 1 and the number of experts {num_experts}")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"moe: capacity factor must be > 0, got {capacity_factor}")
        self.num_experts, self.k, self.capacity_factor, self.group = num_experts, k, capacity_factor, group
        self.local = num_experts // n
        first = dist.get_rank(group) * self.local
        gate, w1, w2 = init_experts(num_experts, hidden, ffn, seed, dtype)
        self.gate = nn.Parameter(gate)
        self.w1 = nn.Parameter(w1[first:first + self.local].clone())
        self.w2 = nn.Parameter(w2[first:first + self.local].clone())
        self.routed_rows = (0, 0)  # (rows sent, rows received) by the last dispatch

    def route_tokens(self, tokens: torch.Tensor):
        """Routing and capacity of this rank's tokens [T, H]: (experts, weights, keep, aux); sets
        ``self.z_loss``."""
        experts, weights, probs, logits = route(tokens, self.gate, self.k)
        self.z_loss = router_z_loss(logits)
        capacity = expert_capacity(tokens.shape[0], self.num_experts, self.k, self.capacity_factor)
        keep = keep_mask(experts, self.num_experts, capacity)
        return experts, weights, keep, load_balancing_loss(probs, experts, self.num_experts)

    def forward(self, x: torch.Tensor):
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        experts, weights, keep, aux = self.route_tokens(tokens)
        # BEGIN SOLUTION moe.layer: plan_dispatch, AllToAll of the sorted rows, compute_experts, AllToAll back, combine into zeros
        plan = plan_dispatch(experts, weights, keep, self.num_experts, self.group)
        rows = AllToAll.apply(tokens[plan.token_of[plan.order]], plan.recv_splits, plan.send_splits, self.group)
        results = compute_experts(rows, plan.received, self.w1, self.w2)
        back = AllToAll.apply(results, plan.send_splits, plan.recv_splits, self.group)
        y = combine(back, plan, torch.zeros_like(tokens))
        self.routed_rows = (sum(plan.send_splits), sum(plan.recv_splits))
        # END SOLUTION
        return y.reshape(shape), aux


class DispatchPlan(NamedTuple):
    """Where this rank's kept choices go: ``token_of`` / ``weight_of`` [C] (the token and gate
    weight of each kept choice, row-major over [T, k]), ``order`` [C] (the permutation that
    sorts them by expert), ``received`` [N, E/N] (``exchange_counts``), ``send_splits`` and
    ``recv_splits`` (rows to and from each rank of the group)."""
    token_of: torch.Tensor
    weight_of: torch.Tensor
    order: torch.Tensor
    received: torch.Tensor
    send_splits: list
    recv_splits: list


def plan_dispatch(experts, weights, keep, num_experts: int, group=None) -> DispatchPlan:
    """The kept choices sorted by expert, the counts exchanged (one all-to-all of E int64s) and
    the split sizes of both row all-to-alls: steps 1-2 of the module docstring."""
    local = num_experts // dist.get_world_size(group)
    # BEGIN SOLUTION moe.layer: token and weight of each kept choice, stable argsort by expert, bincount (minlength E), exchange_counts, splits summed per rank
    token_of = torch.arange(experts.shape[0]).unsqueeze(1).expand_as(experts)[keep]
    expert_of, weight_of = experts[keep], weights[keep]
    order = torch.argsort(expert_of, stable=True)          # the permutation: sorted by expert
    counts = torch.bincount(expert_of, minlength=num_experts)
    received = exchange_counts(counts, group)              # [N, E/N]
    send_splits = counts.view(-1, local).sum(dim=1).tolist()
    recv_splits = received.sum(dim=1).tolist()
    return DispatchPlan(token_of, weight_of, order, received, send_splits, recv_splits)
    # END SOLUTION


def compute_experts(rows: torch.Tensor, received: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Step 3: the rows received (by source rank, then local expert; ``received`` [N, E/N] says
    how many of each) through this rank's experts, batched per expert; returned in the order
    they arrived, ready to go back."""
    # BEGIN SOLUTION moe.layer: regroup the rows by local expert (stable argsort of repeat_interleave'd expert ids), one expert_mlp per expert, index_copy back to arrival order
    local_expert = torch.repeat_interleave(
        torch.arange(w1.shape[0]).repeat(received.shape[0]), received.reshape(-1))
    by_expert = torch.argsort(local_expert, stable=True)
    per_expert = received.sum(dim=0).tolist()
    outputs = [expert_mlp(block, w1[e], w2[e]) for e, block in enumerate(rows[by_expert].split(per_expert))]
    computed = torch.cat(outputs)  # never empty: every rank holds E/N >= 1 experts
    return torch.empty_like(computed).index_copy(0, by_expert, computed)  # back to arrival order
    # END SOLUTION


def combine(back: torch.Tensor, plan: DispatchPlan, base: torch.Tensor) -> torch.Tensor:
    """Step 4: the rows back from the experts un-permuted (the inverse of ``plan.order``) and
    added, gate-weighted, to their tokens' rows of ``base`` [T, H] (not written: a new tensor)."""
    # BEGIN SOLUTION moe.layer: index_copy by plan.order (the inverse permutation), then base.index_add of rows x weight_of
    unsorted = torch.empty_like(back).index_copy(0, plan.order, back)
    return base.index_add(0, plan.token_of, unsorted * plan.weight_of.unsqueeze(1))
    # END SOLUTION


def reference_moe(x: torch.Tensor, gate, w1, w2, k: int, capacity_factor: float | None):
    """One process holding every expert: the same routing and capacity rule, a loop over
    experts. Returns (y, aux, z_loss)."""
    tokens = x.reshape(-1, x.shape[-1])
    experts, weights, probs, logits = route(tokens, gate, k)
    num_experts = gate.shape[0]
    keep = keep_mask(experts, num_experts, expert_capacity(tokens.shape[0], num_experts, k, capacity_factor))
    y = torch.zeros_like(tokens)
    for e in range(num_experts):
        token, slot = torch.nonzero((experts == e) & keep, as_tuple=True)
        y = y.index_add(0, token, expert_mlp(tokens[token], w1[e], w2[e]) * weights[token, slot].unsqueeze(1))
    return y.reshape(x.shape), load_balancing_loss(probs, experts, num_experts), router_z_loss(logits)


# ----------------------------------------------------------------------------- shared experts, overlapped

def init_shared_experts(num_shared: int, hidden: int, ffn: int, seed: int, dtype=torch.float32):
    """The S shared experts' weights (w1 [S, H, F], w2 [S, F, H]) from a seed, in the layout of
    ``init_experts`` (their own random stream: not the routed experts')."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    w1 = torch.randn(num_shared, hidden, ffn, generator=gen, dtype=torch.float64) / math.sqrt(hidden)
    w2 = torch.randn(num_shared, ffn, hidden, generator=gen, dtype=torch.float64) / math.sqrt(ffn)
    return w1.to(dtype), w2.to(dtype)


def shared_fc1(x: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
    """The shared experts' first layer and activation: gelu(x [T, H] @ w1 [H, S F])."""
    return F.gelu(x @ w1)


def shared_fc2(hidden: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The shared experts' second layer: hidden [T, S F] @ w2 [S F, H]."""
    return hidden @ w2


class AllToAllOverlap(torch.autograd.Function):
    """``AllToAll`` (moe.dispatch) with an independent side computation hidden behind it, both ways.

    ``AllToAllOverlap.apply(x, output_splits, input_splits, group, side_fn, *side_inputs)`` returns
    (the rows received, ``side_fn(*side_inputs)``). ``side_fn`` must not need the all-to-all's
    result (the shared experts need only the tokens). Forward: post the all-to-all
    (``async_op=True``), run ``side_fn`` while it is in flight, then ``wait()``. Backward, given
    (grad of the rows, grad of the side output): post the reverse all-to-all (split lists
    swapped) the same way, compute the side's backward (the gradients of its inputs, by
    ``torch.autograd.grad`` through the graph its forward recorded) while that is in flight,
    then wait. Side inputs that require grad get their gradient, the others None."""

    @staticmethod
    def forward(ctx, x, output_splits: list[int], input_splits: list[int], group, side_fn, *side_inputs):
        # BEGIN SOLUTION moe.shared_overlap: post all_to_all_single(async_op=True); under torch.enable_grad() run side_fn on detached copies of the inputs (requires_grad as the originals); work.wait(); return (rows, side output detached)
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        work = dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group, async_op=True)
        ctx.side_inputs = [t.detach().requires_grad_(t.requires_grad) for t in side_inputs]
        with torch.enable_grad():  # a Function's forward runs without grad: record the side's graph
            ctx.side_output = side_fn(*ctx.side_inputs)
        work.wait()
        return out, ctx.side_output.detach()
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad_out, grad_side):
        # BEGIN SOLUTION moe.shared_overlap: post the reverse all-to-all (splits swapped, async_op=True); torch.autograd.grad of the side output for its inputs that require grad; work.wait(); None for the rest
        output_splits, input_splits = ctx.splits
        grad_x = grad_out.new_empty((sum(input_splits),) + tuple(grad_out.shape[1:]))
        work = dist.all_to_all_single(grad_x, grad_out.contiguous(), input_splits, output_splits,
                                      group=ctx.group, async_op=True)
        wanted = [t for t in ctx.side_inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(ctx.side_output, wanted, grad_side) if wanted else ())
        work.wait()
        return (grad_x, None, None, None, None) + tuple(next(grads) if t.requires_grad else None
                                                        for t in ctx.side_inputs)
        # END SOLUTION


class SharedExpertMoE(ExpertParallelMoE):
    """``ExpertParallelMoE`` plus S shared experts that every token goes through (DeepSeekMoE, Dai
    et al., 2024, arXiv:2401.06066; DeepSeek-V3 has one): y = sum_s shared_s(x) + the routed
    experts' gate-weighted sum. The shared experts are dense, replicated on every rank of the
    group like the gate: each rank runs them on its own tokens, and their gradient on a rank is
    its tokens' share (summed over the group, one process's gradient).

    The S shared experts of width F_s are one MLP of width S F_s (gelu acts elementwise):
    ``shared_w1`` [H, S F_s] holds expert s in columns s F_s ... (s+1) F_s - 1, ``shared_w2``
    [S F_s, H] in the same rows, from ``init_shared_experts(num_shared, hidden, shared_ffn, seed)``.

    The overlap: the shared experts need no all-to-all, so their FLOPs can hide one. ``forward``
    runs ``ExpertParallelMoE.forward``'s pipeline with the dispatch through ``AllToAllOverlap``
    (side: ``shared_fc1`` of the tokens) and the combine through ``AllToAllOverlap`` (side:
    ``shared_fc2`` of that), so the first half of the shared experts runs while the dispatch is
    in flight and the second half while the combine is; in backward, fc2's backward while the
    combine's reverse all-to-all is in flight, fc1's while the dispatch's is. The traffic is
    ``ExpertParallelMoE``'s: nothing more is sent."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, k: int = 2,
                 capacity_factor: float | None = None, group=None, seed: int = 0, dtype=torch.float32,
                 num_shared: int = 1, shared_ffn: int | None = None):
        shared_ffn = ffn if shared_ffn is None else shared_ffn
        if num_shared < 1 or shared_ffn < 1:
            raise ValueError(f"moe: need at least one shared expert of width >= 1, got {num_shared} of width {shared_ffn}")
        super().__init__(hidden, ffn, num_experts, k, capacity_factor, group, seed, dtype)
        w1, w2 = init_shared_experts(num_shared, hidden, shared_ffn, seed, dtype)
        self.shared_w1 = nn.Parameter(w1.permute(1, 0, 2).reshape(hidden, num_shared * shared_ffn).clone())
        self.shared_w2 = nn.Parameter(w2.reshape(num_shared * shared_ffn, hidden).clone())

    def forward(self, x: torch.Tensor):
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        experts, weights, keep, aux = self.route_tokens(tokens)
        # BEGIN SOLUTION moe.shared_overlap: moe.layer's steps; dispatch = AllToAllOverlap(..., shared_fc1, tokens, shared_w1), combine's all-to-all = AllToAllOverlap(..., shared_fc2, its output, shared_w2); y = combine into the shared output
        plan = plan_dispatch(experts, weights, keep, self.num_experts, self.group)
        rows, hidden = AllToAllOverlap.apply(tokens[plan.token_of[plan.order]], plan.recv_splits, plan.send_splits,
                                             self.group, shared_fc1, tokens, self.shared_w1)
        results = compute_experts(rows, plan.received, self.w1, self.w2)
        back, shared = AllToAllOverlap.apply(results, plan.send_splits, plan.recv_splits, self.group,
                                             shared_fc2, hidden, self.shared_w2)
        y = combine(back, plan, shared)
        self.routed_rows = (sum(plan.send_splits), sum(plan.recv_splits))
        # END SOLUTION
        return y.reshape(shape), aux


# ----------------------------------------------------------------------------- EP x DP

class ExpertParallelMLP(nn.Module):
    """``Block.mlp`` of an expert-parallel GPT: your ``ExpertParallelMoE``, keeping its
    load-balancing loss in ``aux`` as ``labkit.models.MoEMLP`` does (``GPT.forward`` adds it)."""

    def __init__(self, moe: ExpertParallelMoE):
        super().__init__()
        self.moe = moe

    def forward(self, x):
        y, self.aux = self.moe(x)
        return y


def expert_parallel_gpt(gpt: nn.Module, group=None) -> nn.Module:
    """Swap each block's ``labkit.models.MoEMLP`` for an ``ExpertParallelMoE`` over ``group``
    holding this rank's E/N experts, weights copied from ``gpt`` (the gate whole, w1 and w2
    sliced). The rest of ``gpt`` stays replicated. Returns ``gpt``."""
    config = gpt.config
    if not config.n_experts:
        raise ValueError("expert_parallel_gpt: the model has no experts (GPTConfig(n_experts=0))")
    n = dist.get_world_size(group)
    if config.n_experts % n:
        raise ValueError(f"moe: {config.n_experts} experts do not split over {n} EP ranks (E % N != 0)")
    first = dist.get_rank(group) * (config.n_experts // n)
    for block in gpt.blocks:
        dense = block.mlp
        moe = ExpertParallelMoE(config.n_embd, 4 * config.n_embd, config.n_experts, config.moe_k,
                                config.moe_capacity_factor, group=group, dtype=dense.gate.dtype)
        with torch.no_grad():
            moe.gate.copy_(dense.gate)
            moe.w1.copy_(dense.w1[first:first + moe.local])
            moe.w2.copy_(dense.w2[first:first + moe.local])
        block.mlp = ExpertParallelMLP(moe)
    return gpt


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The expert weights (w1, w2 of every ``ExpertParallelMoE``) in ``model``: the parameters
    that differ between the ranks of an EP group. Everything else is dense (replicated)."""
    return [p for m in model.modules() if isinstance(m, ExpertParallelMoE) for p in (m.w1, m.w2)]


EP_AXIS, DP_AXIS = "tp", "dp"  # the RankGrid axes EP and DP take (see the module docstring)


def ep_dp_grid(world_size: int, ep: int, dp: int):
    """The chapter-08 ``RankGrid`` of ``world_size`` ranks as dp x ep, EP on the fastest axis
    (``EP_AXIS``), DP on the slowest, with its groups made (a collective: every rank calls it).
    ValueError, before any communication, unless ep * dp == world_size."""
    from labkit.mesh import RankGrid
    # BEGIN SOLUTION moe.ep_dp: RankGrid(world_size, dp=dp, tp=ep) checks ep * dp == world_size; then make_groups()
    return RankGrid(world_size, dp=dp, tp=ep).make_groups()
    # END SOLUTION


def average_ep_dp_gradients(model: nn.Module, grid) -> None:
    """After ``loss.backward()`` on every rank: each dense ``.grad`` all-reduced over the world,
    each expert ``.grad`` (``expert_parameters``) over ``grid.group(DP_AXIS)``, and every one
    divided by the world size N (see the module docstring for why experts too). One all-reduce
    per parameter with a gradient, in ``model.parameters()`` order."""
    # BEGIN SOLUTION moe.ep_dp: experts = ids of expert_parameters(model); all_reduce each grad over the DP group if an expert else the world; divide by world size
    experts = {id(p) for p in expert_parameters(model)}
    n = dist.get_world_size()
    for p in model.parameters():
        if p.grad is None:
            continue
        dist.all_reduce(p.grad, group=grid.group(DP_AXIS) if id(p) in experts else None)
        p.grad /= n
    # END SOLUTION


def train_ep_dp(config, grid, xs, ys, lr: float = 1e-2, dtype=torch.float64) -> list[float]:
    """Train ``labkit.models.GPT(config)`` with EP x DP on ``grid``: ``expert_parallel_gpt`` over
    the EP group, each rank on its slice (rank order) of the global batches ``xs[step]``,
    ``ys[step]``, your ``average_ep_dp_gradients``, AdamW. Returns the global loss (the mean of
    the ranks' losses) of every step, the same on every rank."""
    from labkit.models import GPT
    n, rank = dist.get_world_size(), dist.get_rank()
    if len(xs[0]) % n:
        raise ValueError(f"a global batch of {len(xs[0])} does not split over {n} ranks")
    model = expert_parallel_gpt(GPT(config).to(dtype), grid.group(EP_AXIS))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    share, losses = len(xs[0]) // n, []
    for x, y in zip(xs, ys):
        loss = model(x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share])[1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        average_ep_dp_gradients(model, grid)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / n)
    return losses
