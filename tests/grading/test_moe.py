"""Graded tests for chapter 10: expert parallelism (a mixture-of-experts layer routed by all-to-all).

Every check runs on every rank at world sizes 1, 2 and 4 (1 is a diagnostic) and compares
with a single-process reference: routing and losses against loops written here, capacity
against exact fractions and a loop over choices, the layer against one process holding every
expert (labkit.moe.reference_moe's loop, float64) for outputs, the auxiliary loss, every
gradient and a 5-step AdamW loss curve, dropless, with capacity and with uneven routing.
The tracer then checks the technique: the whole trace of a forward and backward is one
all-to-all of the E int64 counts and four all-to-alls of routed rows (dispatch, combine and
their reverses in backward), each of max(rows sent, rows received) x H x element size bytes,
the row counts derived here from the reference routing of every rank's tokens.

EP x DP (moe.ep_dp): a 2-layer MoE GPT (labkit.models, GPTConfig(n_experts=4)) trained 5 AdamW
steps with the learner's EP layer on every grid of the world (4 = 2x2, 4x1, 1x4; 2 = 2x1,
1x2), dropless, with capacity, and with uneven routing (most tokens choose expert 0, which
then drops at its capacity), each rank on its slice of the global batch, against one
process holding every expert that runs the same global batch in the same slices (capacity
and the load-balancing loss are per routing call) and averages their losses: the global loss
of every step, every dense parameter and this rank's experts after each step, float64. The
trace of step 1 is exactly, per MoE layer, the E int64 counts and two all-to-alls in the EP
group forward, two backward (max(rows sent, received) x H x 8 B each, rows from the
reference's routing), then one all-reduce per dense gradient over the world and one per
expert gradient over the DP group (numel x 8 B): EP groups are consecutive ranks.
"""

import copy
import math
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from labkit.check import assert_close
from labkit.comm import CommTracer, Op, assert_ops
from labkit.course.grading import run_graded, task

WORLD_SIZES = [1, 2, 4]
HIDDEN, FFN, EXPERTS, TOP_K, BATCH, SEQ = 8, 12, 4, 2, 2, 6
UNEVEN_SHIFT = 1.0


def tokens_of(rank: int, salt: int, dtype=torch.float64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * salt + rank)
    return torch.randn(BATCH, SEQ, HIDDEN, generator=gen, dtype=torch.float64).to(dtype)


def skewed_gate(gate: torch.Tensor) -> torch.Tensor:
    """Uneven routing: expert 0's weights lifted along the all-ones direction, so that for tokens
    shifted by +1 (``UNEVEN_SHIFT``) it takes most of them."""
    gate = gate.clone()
    gate[0] += 3.0 * gate.new_ones(gate.shape[1]) / math.sqrt(gate.shape[1])
    return gate


# ----------------------------------------------------------------------------- router

def router_on_rank() -> None:
    from labkit.moe import load_balancing_loss, route, router_z_loss
    rank = dist.get_rank()
    for salt, k in enumerate([1, 2, 3]):
        x = (tokens_of(rank, salt) + (UNEVEN_SHIFT if salt == 2 else 0.0)).reshape(-1, HIDDEN)
        gen = torch.Generator().manual_seed(7 + salt)
        gate = torch.randn(EXPERTS, HIDDEN, generator=gen, dtype=torch.float64)
        if salt == 2:
            gate = skewed_gate(gate)
        gate.requires_grad_(True)
        experts, weights, probs, logits = route(x, gate, k)
        what = f"moe.router: rank {rank}, k={k}"
        ref_logits = torch.einsum("th,eh->te", x, gate)
        ref_probs = torch.exp(ref_logits - ref_logits.max(1, keepdim=True).values)
        ref_probs = ref_probs / ref_probs.sum(1, keepdim=True)
        assert_close(logits, ref_logits, what + ": logits = x W^T")
        assert_close(probs, ref_probs, what + ": softmax probabilities")
        order = torch.sort(ref_probs, dim=1, descending=True, stable=True)
        assert torch.equal(experts, order.indices[:, :k]), what + ": experts must be the k most probable"
        chosen = order.values[:, :k]
        assert_close(weights, chosen / chosen.sum(1, keepdim=True), what + ": weights renormalised over the k chosen")
        aux = load_balancing_loss(probs, experts, EXPERTS)
        ref_aux = sum(EXPERTS * (experts == e).sum().item() / experts.numel() * ref_probs[:, e].mean()
                      for e in range(EXPERTS))
        assert_close(aux, ref_aux, what + ": load-balancing loss E * sum f_e P_e")
        z = router_z_loss(logits)
        ref_z = (ref_logits.exp().sum(1).log() ** 2).mean()
        assert_close(z, ref_z, what + ": z-loss mean(logsumexp^2)")
        (aux + z).backward()
        ref_gate = gate.detach().clone().requires_grad_(True)
        ref_l = torch.einsum("th,eh->te", x, ref_gate)
        ref_p = ref_l.softmax(1)
        f = torch.bincount(experts.reshape(-1), minlength=EXPERTS).double() / experts.numel()
        (EXPERTS * (f * ref_p.mean(0)).sum() + (torch.logsumexp(ref_l, 1) ** 2).mean()).backward()
        assert_close(gate.grad, ref_gate.grad, what + ": gate gradient of aux + z (f_e carries no gradient)")


# ----------------------------------------------------------------------------- capacity

def capacity_on_rank() -> None:
    from labkit.moe import expert_capacity, keep_mask
    rank = dist.get_rank()
    for tokens, experts, k, factor in [(12, 4, 2, 1.0), (10, 4, 2, 1.25), (7, 3, 1, 0.5), (9, 8, 2, 2.0)]:
        want = math.ceil(Fraction(factor) * k * tokens / experts)
        got = expert_capacity(tokens, experts, k, factor)
        assert got == want, f"moe.capacity: T={tokens}, E={experts}, k={k}, C={factor}: {got}, want ceil(C k T / E) = {want}"
    assert expert_capacity(12, 4, 2, None) is None, "moe.capacity: capacity_factor=None is dropless (None)"
    for bad in (0, -1.0):
        with pytest.raises(ValueError):
            expert_capacity(12, 4, 2, bad)
    for salt, capacity in enumerate([1, 2, 3, 5, None]):
        gen = torch.Generator().manual_seed(50 + salt + 10 * rank)
        choices = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(11)])
        choices[::2, 0] = 0  # crowd expert 0
        mask = keep_mask(choices, EXPERTS, capacity)
        taken, want = [0] * EXPERTS, torch.zeros_like(choices, dtype=torch.bool)
        for t in range(choices.shape[0]):
            for j in range(TOP_K):
                e = choices[t, j].item()
                if capacity is None or taken[e] < capacity:
                    taken[e] += 1
                    want[t, j] = True
        assert mask.dtype == torch.bool and torch.equal(mask, want), (
            f"moe.capacity: rank {rank}, capacity {capacity}: keep_mask must keep each expert's first "
            f"choices in (token, slot) order\n got  {mask.int().tolist()}\n want {want.int().tolist()}")


# ----------------------------------------------------------------------------- dispatch

def dispatch_on_rank() -> None:
    from labkit.moe import AllToAll, exchange_counts
    rank, n = dist.get_rank(), dist.get_world_size()
    members = list(range(n))
    rows_to = lambda src, dst: (src + 2 * dst) % 3 + (1 if dst == 0 else 0)  # uneven, some zero
    for dtype in (torch.float64, torch.float32):
        send = [rows_to(rank, d) for d in members]
        recv = [rows_to(s, rank) for s in members]
        x = torch.cat([torch.full((send[d], HIDDEN), 100.0 * rank + d, dtype=dtype) for d in members])
        x += torch.arange(HIDDEN, dtype=dtype)
        x.requires_grad_(True)
        with CommTracer() as tracer:
            out = AllToAll.apply(x, recv, send, None)
            (out * (rank + 1)).sum().backward()
        what = f"moe.dispatch: AllToAll on rank {rank} of {n}, {dtype}, sends {send}, receives {recv}"
        want = torch.cat([torch.full((recv[s], HIDDEN), 100.0 * s + rank, dtype=dtype) for s in members])
        assert_close(out, want + torch.arange(HIDDEN, dtype=dtype), what + ": the blocks received, in rank order")
        grad = torch.cat([torch.full((send[d], HIDDEN), d + 1.0, dtype=dtype) for d in members])
        assert_close(x.grad, grad, what + ": backward sends each block's gradient back to its sender")
        size = HIDDEN * torch.tensor([], dtype=dtype).element_size()
        assert_ops(tracer, 2 * [Op("all_to_all", max(sum(send), sum(recv)) * size, members)],
                   what + " (one all-to-all forward, one back, max(rows sent, received) x H x bytes)")
        builtin = torch.empty_like(out)
        dist.all_to_all_single(builtin, x.detach(), recv, send)
        assert_close(out, builtin, what + " vs dist.all_to_all_single")
    counts = torch.tensor([10 * rank + e for e in range(EXPERTS * n)], dtype=torch.int64)
    with CommTracer() as tracer:
        got = exchange_counts(counts)
    want = torch.tensor([[10 * s + rank * EXPERTS + e for e in range(EXPERTS)] for s in members])
    what = f"moe.dispatch: exchange_counts on rank {rank} of {n}"
    assert torch.equal(got, want), f"{what}: row s = what rank s sends to my experts\n got {got.tolist()}\n want {want.tolist()}"
    assert_ops(tracer, [Op("all_to_all", counts.nbytes, members)], what + " (one all-to-all of the E counts)")


# ----------------------------------------------------------------------------- the layer

CASES = [("dropless", None, False), ("capacity 1.0", 1.0, False), ("uneven, dropless", None, True),
         ("uneven, capacity 1.25", 1.25, True)]


def routed_rows(xs, gate, k, factor, rank, n):
    """(rows rank sends, rows it receives) under the reference routing of every rank's tokens."""
    from labkit.moe import expert_capacity, keep_mask, route
    local = EXPERTS // n
    sent = received = 0
    for src, x in enumerate(xs):
        tokens = x.reshape(-1, HIDDEN)
        experts = route(tokens, gate, k)[0]
        kept = experts[keep_mask(experts, EXPERTS, expert_capacity(tokens.shape[0], EXPERTS, k, factor))]
        if src == rank:
            sent = kept.numel()
        received += ((kept // local) == rank).sum().item()
    return sent, received


def layer_on_rank() -> None:
    from labkit.moe import ExpertParallelMoE, init_experts, reference_moe, route
    rank, n = dist.get_rank(), dist.get_world_size()
    members, local = list(range(n)), EXPERTS // n
    with CommTracer() as tracer:  # bad input: a clear error before any communication
        for kwargs in [dict(num_experts=EXPERTS, k=EXPERTS + 1), dict(num_experts=EXPERTS, capacity_factor=0.0),
                       dict(num_experts=EXPERTS, capacity_factor=-1.0)] + (
                [dict(num_experts=EXPERTS * n + 1)] if n > 1 else []):
            with pytest.raises(ValueError):
                ExpertParallelMoE(HIDDEN, FFN, **kwargs)
    assert not tracer.events, f"moe.layer: bad input must fail before any communication, traced {tracer.ops()}"
    for salt, (name, factor, uneven) in enumerate(CASES):
        what = f"moe.layer: rank {rank} of {n}, {name}"
        layer = ExpertParallelMoE(HIDDEN, FFN, EXPERTS, TOP_K, factor, seed=salt, dtype=torch.float64)
        gate, w1, w2 = init_experts(EXPERTS, HIDDEN, FFN, salt, torch.float64)
        if uneven:
            gate = skewed_gate(gate)
            with torch.no_grad():
                layer.gate.copy_(gate)
        xs = [(tokens_of(r, salt) + (UNEVEN_SHIFT if uneven else 0.0)).requires_grad_(True) for r in members]
        ref = [p.clone().requires_grad_(True) for p in (gate, w1, w2)]
        ref_total = 0
        for r, x in enumerate(xs):
            y, aux, z = reference_moe(x, *ref, TOP_K, factor)
            ref_total = ref_total + (y.pow(2).sum() + aux + z)
            if r == rank:
                ref_y, ref_aux, ref_z = y, aux, z
        ref_total.backward()
        x = xs[rank].detach().clone().requires_grad_(True)
        with CommTracer() as tracer:
            y, aux = layer(x)
            (y.pow(2).sum() + aux + layer.z_loss).backward()
        assert_close(y, ref_y, what + ": output vs one process holding every expert")
        assert_close(aux, ref_aux, what + ": load-balancing loss")
        assert_close(x.grad, xs[rank].grad, what + ": input gradient (through combine, experts and dispatch)")
        assert_close(layer.z_loss, ref_z, what + ": z-loss")
        mine = slice(rank * local, (rank + 1) * local)
        assert_close(layer.w1.grad, ref[1].grad[mine], what + ": w1 gradient of my experts (tokens of every rank)")
        assert_close(layer.w2.grad, ref[2].grad[mine], what + ": w2 gradient of my experts (tokens of every rank)")
        gate_grad = layer.gate.grad.clone()
        dist.all_reduce(gate_grad)
        assert_close(gate_grad, ref[0].grad, what + ": gate gradient summed over ranks")
        if uneven:  # the case is what it says: expert 0 holds most choices
            share = (route(xs[rank].detach().reshape(-1, HIDDEN), gate, TOP_K)[0] == 0).float().mean().item()
            assert share > 0.4, f"test set-up: expert 0 should take most tokens, took {share:.0%}"
        sent, received = routed_rows([t.detach() for t in xs], gate, TOP_K, factor, rank, n)
        row = max(sent, received) * HIDDEN * 8
        assert_ops(tracer, [Op("all_to_all", EXPERTS * 8, members)] + 4 * [Op("all_to_all", row, members)],
                   what + f" (counts: E int64; dispatch, combine and their backward: max({sent} sent, "
                          f"{received} received) rows x H x 8 B)")
    # 5 AdamW steps on dropless uneven routing: the same loss curve on every rank
    layer = ExpertParallelMoE(HIDDEN, FFN, EXPERTS, TOP_K, 1.5, seed=9, dtype=torch.float64)
    ref = [p.clone().requires_grad_(True) for p in init_experts(EXPERTS, HIDDEN, FFN, 9, torch.float64)]
    opt, ref_opt = torch.optim.AdamW(layer.parameters(), lr=1e-2), torch.optim.AdamW(ref, lr=1e-2)
    for step in range(5):
        xs = [tokens_of(r, 40 + step) for r in members]
        y, aux = layer(xs[rank])
        loss = y.pow(2).mean() + 0.01 * aux
        opt.zero_grad()
        loss.backward()
        dist.all_reduce(layer.gate.grad)  # the gate is replicated: its gradient summed like the reference's
        opt.step()
        ref_losses = [reference_moe(x, *ref, TOP_K, 1.5) for x in xs]
        ref_losses = [y.pow(2).mean() + 0.01 * a for y, a, _ in ref_losses]
        ref_opt.zero_grad()
        sum(ref_losses).backward()
        ref_opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        assert_close(total, sum(ref_losses).detach(), f"moe.layer: rank {rank} of {n}, AdamW step {step}: summed loss")


# ----------------------------------------------------------------------------- EP x DP

GPT_MOE = dict(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=8, n_experts=4, moe_k=2)
GRIDS = {1: [(1, 1)], 2: [(2, 1), (1, 2)], 4: [(2, 2), (4, 1), (1, 4)]}  # (ep, dp)
PER_RANK, STEPS, LR = 2, 5, 1e-2
GPT_CASES = [("dropless", None, False), ("capacity 1.0", 1.0, False), ("uneven, capacity 1.0", 1.0, True)]


@torch.no_grad()
def skew_towards_expert_0(gpt) -> None:
    """Uneven routing in every MoE layer: LayerNorm outputs have zero mean over features, so a
    constant ln_2 bias is a direction every token shares; lifting expert 0's gate along it
    raises its logit for all tokens (by 0.5 * 2 * sqrt(H), about 2.8 at H = 8)."""
    for block in gpt.blocks:
        block.ln_2.bias.fill_(0.5)
        block.mlp.gate[0] += 2.0 / math.sqrt(block.mlp.gate.shape[1])


def ep_dp_on_rank() -> None:
    from labkit.models import GPT, GPTConfig
    from labkit.moe import (average_ep_dp_gradients, ep_dp_grid, expert_parallel_gpt, expert_parameters,
                            EP_AXIS)
    rank, n = dist.get_rank(), dist.get_world_size()
    with CommTracer() as tracer:  # bad input: a clear error before any communication
        for ep, dp in [(n, 2), (n + 1, 1), (0, n)]:
            with pytest.raises(ValueError):
                ep_dp_grid(n, ep, dp)
    assert not tracer.events, f"moe.ep_dp: bad grids must fail before any communication, traced {tracer.ops()}"
    for ep, dp in GRIDS[n]:
        grid = ep_dp_grid(n, ep, dp)
        with CommTracer() as tracer:  # a model whose experts do not split: refused before any communication
            for bad in ([dict(GPT_MOE, n_experts=2 * ep + 1)] if ep > 1 else []) + [dict(GPT_MOE, n_experts=0)]:
                with pytest.raises(ValueError):
                    expert_parallel_gpt(GPT(GPTConfig(**bad)), grid.group(EP_AXIS))
        assert not tracer.events, f"moe.ep_dp: bad models must fail before any communication, traced {tracer.ops()}"
        ep_members = list(range(rank // ep * ep, rank // ep * ep + ep))   # consecutive ranks
        dp_members = list(range(rank % ep, n, ep))
        for name, factor, uneven in GPT_CASES:
            what = f"moe.ep_dp: rank {rank} of {n}, ep={ep} x dp={dp}, {name}"
            config = GPTConfig(**GPT_MOE, moe_capacity_factor=factor)
            ref = GPT(config, seed=3).double()
            if uneven:
                skew_towards_expert_0(ref)
            model = expert_parallel_gpt(copy.deepcopy(ref), grid.group(EP_AXIS))
            opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=LR), torch.optim.AdamW(ref.parameters(), lr=LR)
            local = config.n_experts // ep
            mine = slice(rank % ep * local, (rank % ep + 1) * local)
            for step in range(STEPS):
                gen = torch.Generator().manual_seed(1000 * step + 17)
                data = torch.randint(0, config.vocab_size, (n * PER_RANK, config.block_size + 1), generator=gen)
                x, y = data[:, :-1], data[:, 1:]
                # the reference: every slice through one process holding every expert, losses averaged
                ref_opt.zero_grad()
                ref_loss, kept, chosen = 0, [], []
                for r in range(n):
                    part = slice(r * PER_RANK, (r + 1) * PER_RANK)
                    ref_loss = ref_loss + ref(x[part], y[part])[1] / n
                    kept.append([block.mlp.kept_experts for block in ref.blocks])
                    chosen.append([block.mlp.experts for block in ref.blocks])
                ref_loss.backward()
                ref_opt.step()
                mine_part = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
                with CommTracer() as tracer:
                    loss = model(x[mine_part], y[mine_part])[1]
                    opt.zero_grad()
                    loss.backward()
                    average_ep_dp_gradients(model, grid)
                opt.step()
                total = loss.detach().clone()
                dist.all_reduce(total)
                assert_close(total / n, ref_loss.detach(), f"{what}, step {step + 1}: global loss (mean over ranks)")
                if step == 0:
                    want = []
                    for layer in range(config.n_layer):
                        sent = kept[rank][layer].numel()
                        received = sum(((kept[r][layer] // local) == rank % ep).sum().item() for r in ep_members)
                        rows = max(sent, received) * config.n_embd * 8
                        want += [Op("all_to_all", config.n_experts * 8, ep_members)] + 4 * [Op("all_to_all", rows, ep_members)]
                    experts = {id(p) for p in expert_parameters(model)}
                    want += [Op("all_reduce", p.numel() * 8, dp_members if id(p) in experts else None)
                             for p in model.parameters()]
                    assert_ops(tracer, want, what + " (per MoE layer: counts + dispatch + combine in the EP group, "
                                                    "twice back; one all-reduce per dense grad over the world, "
                                                    "per expert grad over the DP group)")
                ref_params = dict(ref.named_parameters())
                for name, p in model.named_parameters():
                    ref_p = ref_params[name.replace("mlp.moe.", "mlp.")]
                    expert = name.endswith(("moe.w1", "moe.w2"))
                    assert_close(p, ref_p[mine] if expert else ref_p, f"{what}, after step {step + 1}: {name}"
                                 + (" (this rank's experts)" if expert else ""))
                if step == 0 and factor is not None:  # the case is what it says: some choices dropped
                    choices = sum(t.numel() for per_rank in kept for t in per_rank)
                    assert choices < n * config.n_layer * PER_RANK * config.block_size * config.moe_k, \
                        "test set-up: capacity 1.0 should drop some choices"
                if step == 0 and uneven:  # ... and most tokens choose expert 0, in every layer
                    share = [(t == 0).any(dim=1).float().mean().item() for per_rank in chosen for t in per_rank]
                    assert min(share) > 0.75, f"test set-up: most tokens should choose expert 0, {share}"

@task("moe.router", points=1)
@pytest.mark.parametrize("world_size", [1, 2])
def test_router(world_size):
    run_graded("moe.router", router_on_rank, world_size)


@task("moe.capacity", points=1)
@pytest.mark.parametrize("world_size", [1, 2])
def test_capacity(world_size):
    run_graded("moe.capacity", capacity_on_rank, world_size)


@task("moe.dispatch", points=2)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_dispatch(world_size):
    run_graded("moe.dispatch", dispatch_on_rank, world_size)


@task("moe.layer", points=3)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_layer(world_size):
    run_graded("moe.layer", layer_on_rank, world_size)


@task("moe.ep_dp", points=2)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ep_dp(world_size):
    run_graded("moe.ep_dp", ep_dp_on_rank, world_size, timeout=120)
