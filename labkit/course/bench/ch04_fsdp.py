"""``labkit bench`` rows of chapter 04 (fsdp): the course's implementation vs PyTorch's."""

from __future__ import annotations

import torch

from labkit.course.bench.runner import BenchRow, race_training_steps, rank_batch, row
from labkit.launch import launch
from labkit.oracles import FSDP_BENCH_GPT, builtin_fully_shard, mixed_precision_policy


def _fsdp_vs_fully_shard(repeats: int, batch: int) -> dict:
    """A full training step (forward, backward, AdamW step) of the GPT sharded per block
    and at the root, with labkit.fsdp.fully_shard and with torch's fully_shard, interleaved."""
    from labkit import fsdp
    from labkit.memory import param_bytes
    from labkit.models import GPT, GPTConfig
    config = GPTConfig(**FSDP_BENCH_GPT)
    models = {"ours": GPT(config), "builtin": GPT(config)}
    full_bytes = param_bytes(models["ours"])
    for block in models["ours"].blocks:
        fsdp.fully_shard(block)
    fsdp.fully_shard(models["ours"])
    builtin_fully_shard(models["builtin"])
    optims = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
    medians, tracers = race_training_steps(models, optims, rank_batch(config, batch), repeats)
    sent = {name: tracer.sent_bytes() for name, tracer in tracers.items()}
    return dict(medians, sent=sent, formula=fsdp.step_bytes(models["ours"])["total"],
                full_bytes=full_bytes, shard_bytes=param_bytes(models["ours"]),
                torch_shard_bytes=param_bytes(models["builtin"]))


@row("fsdp")
def fsdp_row(repeats: int = 15, world_size: int = 2, batch: int = 8) -> BenchRow:
    """the learner's fully_shard (chapter 04) vs torch's fully_shard"""
    r = launch(_fsdp_vs_fully_shard, world_size, repeats, batch, timeout=600)[0]
    # formula: 3 x (N-1)/N x Phi (two all-gathers, one reduce-scatter; Phi padded). torch's
    # fully_shard keeps the root unit gathered from forward to backward: it sends a little less.
    return BenchRow(f"GPT step, labkit fully_shard vs torch fully_shard, {world_size} ranks",
                    r["ours"], r["builtin"], r["sent"]["ours"], r["formula"],
                    extra={"torch_sent": r["sent"]["builtin"], "param_bytes_full": r["full_bytes"],
                           "param_bytes_rank0": r["shard_bytes"], "torch_param_bytes_rank0": r["torch_shard_bytes"]})



def _fsdp_mixed_vs_fully_shard(repeats: int, batch: int) -> dict:
    """A training step of the FSDP lab's GPT with bf16 parameters and fp32 reductions, with
    labkit.fsdp.fully_shard and torch's fully_shard under the same MixedPrecisionPolicy."""
    from labkit import fsdp
    from labkit.models import GPT, GPTConfig
    config = GPTConfig(**FSDP_BENCH_GPT)
    policy = mixed_precision_policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    models = {"ours": GPT(config), "builtin": GPT(config)}
    for block in models["ours"].blocks:
        fsdp.fully_shard(block, mp_policy=policy)
    fsdp.fully_shard(models["ours"], mp_policy=policy)
    builtin_fully_shard(models["builtin"], mp_policy=policy)
    optims = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
    medians, tracers = race_training_steps(models, optims, rank_batch(config, batch), repeats)
    sent = {name: tracer.sent_bytes() for name, tracer in tracers.items()}
    return dict(medians, sent=sent, formula=fsdp.step_bytes(models["ours"])["total"])


@row("fsdp_mixed_precision")
def fsdp_mixed_row(repeats: int = 15, world_size: int = 2, batch: int = 8) -> BenchRow:
    """mixed-precision FSDP (bf16 params, fp32 reduce) vs torch's fully_shard with the same policy"""
    r = launch(_fsdp_mixed_vs_fully_shard, world_size, repeats, batch, timeout=600)[0]
    # formula: 2 all-gathers in bf16 + 1 reduce-scatter in fp32 of the padded shards, (N-1)/N each
    return BenchRow(f"GPT step, bf16 params / fp32 reduce, labkit fully_shard vs torch fully_shard, {world_size} ranks",
                    r["ours"], r["builtin"], r["sent"]["ours"], r["formula"], extra={"torch_sent": r["sent"]["builtin"]})
