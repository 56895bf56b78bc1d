"""The oracles: PyTorch's own implementation of each technique, set up the way the course's
version is, and the model shapes they are compared on.

Tests, labs and ``labkit bench`` all check or time the learner's code against these, so
the built-in side is written once. An exercise module never imports this (see
``labkit.course.rules``); the comparison code does.
"""

from __future__ import annotations

import torch


def heads_in_rank_order(weight: torch.Tensor, world: int) -> torch.Tensor:
    """c_attn's rows [Q | K | V] reordered to [Q_0 K_0 V_0 | Q_1 K_1 V_1 | ...], so that a
    contiguous split over ``world`` ranks (what torch's plans do) gives each rank whole heads
    of Q, K and V, as the course's head-parallel attention holds them."""
    q, k, v = weight.chunk(3, 0)
    return torch.cat([torch.cat([t.chunk(world, 0)[r] for t in (q, k, v)]) for r in range(world)])

# A GPT with 0.83 M parameters (3.3 MB of fp32 gradients): big enough that a step is tens of
# milliseconds of compute and a few MB of all-reduce, small enough for a laptop.
DDP_BENCH_GPT = dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)


# A small GPT (~0.1 M parameters, 0.42 MB fp32): its AdamW state is twice that.
ZERO_BENCH_GPT = dict(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=64)


# The GPT of the FSDP lab: 4 blocks, 0.2 M parameters (0.8 MB fp32), short sequences, so
# that parameters, gradients and AdamW state, not activations, dominate a rank's memory.
FSDP_BENCH_GPT = dict(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=64)


# A GPT where the matmuls are worth splitting: 4 blocks of 256 channels, 8 heads, 1.6 M
# parameters (untied head: parallelize_module cannot split a tied one), sequences of 64.
TP_BENCH_GPT = dict(vocab_size=512, block_size=64, n_layer=4, n_head=8, n_embd=256, tie_weights=False)


def builtin_tensor_parallel(model, mesh):
    """``model`` (a labkit GPT) split by torch's ``parallelize_module`` exactly as
    ``labkit.tp.tensor_parallel`` splits it. c_attn stacks Q, K and V; its rows are first
    reordered to [Q_0 K_0 V_0 | Q_1 K_1 V_1 | ...] so that torch's contiguous split gives each
    rank its own heads."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    n = mesh.size()
    with torch.no_grad():
        for block in model.blocks:
            for p in (block.attn.c_attn.weight, block.attn.c_attn.bias):
                p.copy_(heads_in_rank_order(p, n))
    plan = {"wte": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(model.blocks)):
        plan |= {f"blocks.{i}.attn.c_attn": ColwiseParallel(), f"blocks.{i}.attn.c_proj": RowwiseParallel(),
                 f"blocks.{i}.mlp.c_fc": ColwiseParallel(), f"blocks.{i}.mlp.c_proj": RowwiseParallel()}
    return parallelize_module(model, mesh, plan)


# One block per rank, 256 channels, micro-batches of 4 sequences of 64 tokens: each action
# is a few milliseconds of compute, so scheduling and messages show. Untied head (the
# built-in does not sum a tied embedding split across ranks).
PP_BENCH_GPT = dict(vocab_size=256, block_size=64, n_head=4, n_embd=256, tie_weights=False)


SP_BENCH_GPT = dict(vocab_size=64, block_size=512, n_layer=1, n_head=8, n_embd=256)


def builtin_sequence_parallel(block, mesh):
    """A labkit ``Block`` with torch's Megatron-SP plan: LayerNorms on sequence shards
    (``SequenceParallel``), all-gather into attention and MLP (``PrepareModuleInput``),
    column/row layers, reduce-scatter out (``RowwiseParallel(output_layouts=Shard(1))``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    n = mesh.size()
    with torch.no_grad():  # rank r's contiguous slice of c_attn must hold its own heads' Q, K, V
        for p in (block.attn.c_attn.weight, block.attn.c_attn.bias):
            p.copy_(heads_in_rank_order(p, n))
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan = {"ln_1": SequenceParallel(), "ln_2": SequenceParallel(), "attn": gather, "mlp": gather,
            "attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
            "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel(output_layouts=Shard(1))}
    return parallelize_module(block, mesh, plan)


MESH_BENCH_GPT = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128, tie_weights=False)
