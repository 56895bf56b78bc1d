"""``labkit bench`` rows of chapter 02 (ddp): the course's implementation vs PyTorch's."""

from __future__ import annotations

import torch

from labkit.course.bench.runner import BenchRow, race_training_steps, rank_batch, row
from labkit.launch import launch
from labkit.oracles import DDP_BENCH_GPT, builtin_ddp


def _ddp_vs_builtin(repeats: int, batch: int) -> dict:
    """A full training step (forward, backward, AdamW step) with labkit.ddp.DDP and with
    DistributedDataParallel, both at their default bucket sizes, interleaved."""
    from labkit.ddp import DDP
    from labkit.models import GPT, GPTConfig
    config = GPTConfig(**DDP_BENCH_GPT)
    models = {"ours": DDP(GPT(config)), "builtin": builtin_ddp(GPT(config))}
    optims = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
    medians, tracers = race_training_steps(models, optims, rank_batch(config, batch), repeats)
    calls = {name: tracer.count("all_reduce") for name, tracer in tracers.items()}
    sent = tracers["ours"].sent_bytes()
    grad_bytes = sum(p.numel() * p.element_size() for p in models["ours"].parameters() if p.requires_grad)
    return dict(medians, calls=calls, sent=sent, grad_bytes=grad_bytes)


@row("ddp")
def ddp_row(repeats: int = 15, world_size: int = 2, batch: int = 8) -> BenchRow:
    """the learner's DDP (chapter 02) vs DistributedDataParallel, a full GPT step"""
    r = launch(_ddp_vs_builtin, world_size, repeats, batch, timeout=600)[0]
    return BenchRow(f"GPT step, labkit DDP vs DistributedDataParallel, {world_size} ranks",
                    r["ours"], r["builtin"], r["sent"], 2 * (world_size - 1) / world_size * r["grad_bytes"],
                    extra={"all_reduces_per_step": {"ours": r["calls"]["ours"], "torch": r["calls"]["builtin"]},
                           "grad_mb": r["grad_bytes"] / 2 ** 20})
