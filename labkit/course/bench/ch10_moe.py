"""``labkit bench`` rows of chapter 10 (moe): the expert-parallel MoE layer vs one process."""

from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.course.bench.runner import BenchRow, divides, row
from labkit.launch import launch
from labkit.timing import interleaved_medians

MOE_BENCH = dict(hidden=256, ffn=512, experts=8, top_k=2, tokens=1024)  # tokens per rank


def _ep_vs_one_process(repeats: int) -> dict:
    """Forward + backward, dropless top-k: this rank's tokens through labkit.moe's EP layer
    (E/N experts here) vs one process running every rank's tokens through every expert."""
    from labkit.comm import CommTracer
    from labkit.moe import ExpertParallelMoE, init_experts, reference_moe
    n, rank = dist.get_world_size(), dist.get_rank()
    h, f, e, k, t = (MOE_BENCH[key] for key in ("hidden", "ffn", "experts", "top_k", "tokens"))
    layer = ExpertParallelMoE(h, f, e, k, None, seed=0)
    params = [p.requires_grad_(True) for p in init_experts(e, h, f, 0)]
    xs = [torch.randn(t, h, generator=torch.Generator().manual_seed(r)) for r in range(n)]

    def ours(_):
        y, aux = layer(xs[rank].clone().requires_grad_(True))
        (y.sum() + aux).backward()

    def one_process(_):
        for x in xs:
            y, aux, _ = reference_moe(x.clone().requires_grad_(True), *params, k, None)
            (y.sum() + aux).backward()

    medians = interleaved_medians({"ours": ours, "builtin": one_process}, lambda: None, repeats, warmup=1)
    with CommTracer() as tracer:
        ours(None)
    sent, received = layer.routed_rows
    rows = max(sent, received) * h * 4
    traced = sum(event.bytes for event in tracer.events)
    balanced = e * 8 + 4 * k * t * h * 4  # counts + dispatch, combine and both backward, k T rows each
    return dict(medians, traced=traced, formula=e * 8 + 4 * rows, balanced=balanced)


@row("moe_ep", divides(MOE_BENCH["experts"]),
     "its 8 experts split evenly over the ranks")
def moe_ep_row(repeats: int = 5, world_size: int = 2) -> BenchRow:
    """expert-parallel MoE layer (chapter 10) vs the same layer in one process"""
    r = launch(_ep_vs_one_process, world_size, repeats, timeout=600)[0]
    m = MOE_BENCH
    return BenchRow(f"MoE layer E={m['experts']} top-{m['top_k']}, {m['tokens']} tokens/rank, EP on {world_size} "
                    f"ranks vs one process (all ranks' tokens)", r["ours"], r["builtin"], r["traced"], r["formula"],
                    extra=dict(balanced_formula=r["balanced"]))


@row("moe_ep4", divides(MOE_BENCH["experts"]),
     "its 8 experts split evenly over the ranks")
def moe_ep4_row(repeats: int = 5, world_size: int = 4) -> BenchRow:
    """expert-parallel MoE layer on 4 ranks (chapter 10) vs the same layer in one process"""
    return moe_ep_row(repeats, world_size)


def _shared_overlap_vs_after(repeats: int) -> dict:
    """Forward + backward of labkit.moe's SharedExpertMoE (the shared expert computed while the
    all-to-alls are in flight) vs the same layer with the shared expert run after the routed
    path (ExpertParallelMoE, then the shared MLP): the same FLOPs and bytes, another order."""
    from labkit.comm import CommTracer
    from labkit.moe import ExpertParallelMoE, SharedExpertMoE, shared_fc1, shared_fc2
    rank = dist.get_rank()
    h, f, e, k, t = (MOE_BENCH[key] for key in ("hidden", "ffn", "experts", "top_k", "tokens"))
    layer = SharedExpertMoE(h, f, e, k, None, seed=0, num_shared=1, shared_ffn=4 * f)
    plain = ExpertParallelMoE(h, f, e, k, None, seed=0)
    w1, w2 = (p.detach().clone().requires_grad_(True) for p in (layer.shared_w1, layer.shared_w2))
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(rank))

    def ours(_):
        y, aux = layer(x.clone().requires_grad_(True))
        (y.sum() + aux).backward()

    def after(_):
        tokens = x.clone().requires_grad_(True)
        y, aux = plain(tokens)
        (y.sum() + shared_fc2(shared_fc1(tokens, w1), w2).sum() + aux).backward()

    medians = interleaved_medians({"ours": ours, "builtin": after}, lambda: None, repeats, warmup=1)
    with CommTracer() as tracer:
        ours(None)
    rows = max(layer.routed_rows) * h * 4
    return dict(medians, traced=sum(event.bytes for event in tracer.events), formula=e * 8 + 4 * rows)


@row("moe_shared", divides(MOE_BENCH["experts"]),
     "its 8 experts split evenly over the ranks")
def moe_shared_row(repeats: int = 5, world_size: int = 2) -> BenchRow:
    """MoE layer with a shared expert overlapping the all-to-alls (chapter 10) vs the shared expert after them"""
    r = launch(_shared_overlap_vs_after, world_size, repeats, timeout=600)[0]
    m = MOE_BENCH
    return BenchRow(f"MoE layer E={m['experts']} top-{m['top_k']} + a shared expert of width {4 * m['ffn']}, "
                    f"{m['tokens']} tokens/rank, EP on {world_size} ranks: shared expert behind the all-to-alls "
                    f"vs after them", r["ours"], r["builtin"], r["traced"], r["formula"])


MOE_GPT_BENCH = dict(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=64, n_experts=4, moe_k=2)
GPT_BATCH = 8  # sequences per rank


def _ep_dp_vs_one_process(repeats: int, ep: int, dp: int) -> dict:
    """One training step (forward, backward, gradient averaging) of the MoE GPT on an ep x dp
    grid with labkit.moe vs one process running the global batch in the same slices."""
    from labkit.comm import CommTracer
    from labkit.models import GPT, GPTConfig
    from labkit.moe import average_ep_dp_gradients, ep_dp_grid, expert_parallel_gpt, expert_parameters, EP_AXIS
    from labkit.data import markov_tokens
    n, rank = dist.get_world_size(), dist.get_rank()
    config = GPTConfig(**MOE_GPT_BENCH)
    grid = ep_dp_grid(n, ep, dp)
    model = expert_parallel_gpt(GPT(config), grid.group(EP_AXIS))
    reference = GPT(config)
    x, y = markov_tokens(n * GPT_BATCH, config.block_size, config.vocab_size, seed=0)
    mine = slice(rank * GPT_BATCH, (rank + 1) * GPT_BATCH)

    def ours(_):
        model(x[mine], y[mine])[1].backward()
        average_ep_dp_gradients(model, grid)

    def one_process(_):
        (sum(reference(xp, yp)[1] for xp, yp in zip(x.chunk(n), y.chunk(n))) / n).backward()

    medians = interleaved_medians({"ours": ours, "builtin": one_process}, lambda: None, repeats, warmup=1)
    with CommTracer() as tracer:
        ours(None)
    experts = {id(p) for p in expert_parameters(model)}
    rows = sum(max(block.mlp.moe.routed_rows) for block in model.blocks)
    formula = (config.n_layer * 8 * config.n_experts + 4 * rows * config.n_embd * 4   # counts; 4 all-to-alls a layer
               + sum(p.numel() * 4 for p in model.parameters()))                      # one all-reduce per gradient
    traced = sum(event.bytes for event in tracer.events)
    return dict(medians, traced=traced, formula=formula,
                expert_bytes=sum(p.numel() * 4 for p in model.parameters() if id(p) in experts))


@row("moe_ep_dp")
def moe_ep_dp_row(repeats: int = 5, world_size: int = 4) -> BenchRow:
    """a MoE GPT step with EP x DP (2 x 2, chapter 10) vs one process on the global batch"""
    ep = 2 if world_size % 2 == 0 else 1
    r = launch(_ep_dp_vs_one_process, world_size, repeats, ep, world_size // ep, timeout=600)[0]
    return BenchRow(f"MoE GPT step, ep={ep} x dp={world_size // ep} ({GPT_BATCH} seqs/rank) vs one process "
                    f"(global batch)", r["ours"], r["builtin"], r["traced"], r["formula"],
                    extra=dict(expert_grad_bytes=r["expert_bytes"]))
