"""``labkit bench`` rows of chapter 03 (zero): the course's implementation vs PyTorch's."""

from __future__ import annotations

import torch

from labkit.course.bench.runner import BenchRow, race_training_steps, rank_batch, row
from labkit.launch import launch
from labkit.oracles import ZERO_BENCH_GPT, builtin_ddp, builtin_zero


def _zero_vs_builtin(repeats: int, batch: int, shard_gradients: bool) -> dict:
    """A full training step (forward, backward, gradient sync, AdamW step) with
    labkit.zero.ShardedOptimizer and with DDP + ZeroRedundancyOptimizer, interleaved.

    Stage 1 (``shard_gradients=False``) runs under DDP too, as ZeroRedundancyOptimizer does;
    stage 2 averages the gradients itself (reduce-scatter), so its model is not wrapped."""
    from labkit.models import GPT, GPTConfig
    from labkit.zero import ShardedOptimizer
    config = GPTConfig(**ZERO_BENCH_GPT)
    ours_model = GPT(config) if shard_gradients else builtin_ddp(GPT(config))
    models = {"ours": ours_model, "builtin": builtin_ddp(GPT(config))}
    optims = {"ours": ShardedOptimizer(models["ours"].parameters(), torch.optim.AdamW,
                                       shard_gradients=shard_gradients, lr=1e-3),
              "builtin": builtin_zero(models["builtin"].parameters(), torch.optim.AdamW, lr=1e-3)}
    medians, tracers = race_training_steps(models, optims, rank_batch(config, batch), repeats)
    sent = {name: tracer.sent_bytes() for name, tracer in tracers.items()}
    kinds = {name: sorted(tracer.kinds()) for name, tracer in tracers.items()}
    phi = sum(p.numel() * p.element_size() for p in models["builtin"].parameters() if p.requires_grad)
    ours = optims["ours"]
    largest_shard = max(ours.shard_numels) * ours.params[0].element_size()
    return dict(medians, sent=sent, kinds=kinds, phi=phi, largest_shard=largest_shard,
                state_bytes=sum(t.numel() * t.element_size() for s in optims["ours"].state.values()
                                for t in s.values() if isinstance(t, torch.Tensor)))


def _zero_row(stage: int, repeats: int, world_size: int, batch: int) -> BenchRow:
    r = launch(_zero_vs_builtin, world_size, repeats, batch, stage == 2, timeout=600)[0]
    share = (world_size - 1) / world_size * r["phi"]
    # Gradients: stage 1 under DDP all-reduces them (2 shares), stage 2 reduce-scatters them in
    # uneven pieces, each rank's shard exactly (1 share). Parameters: one all-gather of the
    # shards padded to the largest, (N-1) x the largest shard: whole parameters do not split
    # Φ evenly, and the padding is the difference (here 512 B at 2 ranks).
    formula = (2 if stage == 1 else 1) * share + (world_size - 1) * r["largest_shard"]
    torch_side = "ZeroRedundancyOptimizer" if stage == 1 else "DDP+ZeroRedundancyOptimizer"
    return BenchRow(f"GPT step, ZeRO-{stage} ours vs {torch_side}, {world_size} ranks",
                    r["ours"], r["builtin"], r["sent"]["ours"], formula,
                    extra={"phi_bytes": r["phi"], "largest_shard_bytes": r["largest_shard"], "torch_sent": r["sent"]["builtin"], "ops": r["kinds"],
                           "optimizer_state_bytes_rank0": r["state_bytes"]})


@row("zero1")
def zero1_row(repeats: int = 15, world_size: int = 2, batch: int = 8) -> BenchRow:
    """ZeRO-1 (chapter 03) vs ZeroRedundancyOptimizer"""
    return _zero_row(1, repeats, world_size, batch)


@row("zero2")
def zero2_row(repeats: int = 15, world_size: int = 2, batch: int = 8) -> BenchRow:
    """ZeRO-2 (chapter 03) vs DDP + ZeroRedundancyOptimizer"""
    return _zero_row(2, repeats, world_size, batch)
