"""``labkit bench`` rows of chapter 10 (moe): the expert-parallel MoE layer vs one process."""

from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.course.bench.runner import BenchRow, row
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


@row("moe_ep")
def moe_ep_row(repeats: int = 5, world_size: int = 2) -> BenchRow:
    """expert-parallel MoE layer (chapter 10) vs the same layer in one process"""
    r = launch(_ep_vs_one_process, world_size, repeats, timeout=600)[0]
    m = MOE_BENCH
    return BenchRow(f"MoE layer E={m['experts']} top-{m['top_k']}, {m['tokens']} tokens/rank, EP on {world_size} "
                    f"ranks vs one process (all ranks' tokens)", r["ours"], r["builtin"], r["traced"], r["formula"],
                    extra=dict(balanced_formula=r["balanced"]))


@row("moe_ep4")
def moe_ep4_row(repeats: int = 5, world_size: int = 4) -> BenchRow:
    """expert-parallel MoE layer on 4 ranks (chapter 10) vs the same layer in one process"""
    return moe_ep_row(repeats, world_size)
