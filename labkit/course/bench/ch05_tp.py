"""``labkit bench`` rows of chapter 05 (tp): the course's implementation vs PyTorch's."""

from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.course.bench.runner import BenchRow, divides, race_training_steps, row
from labkit.launch import launch
from labkit.oracles import (
    TP_BENCH_GPT,
    builtin_tensor_parallel,
    device_mesh,
    loss_parallel,
)


def _tp_vs_parallelize_module(repeats: int, batch: int) -> dict:
    """One training step (forward, backward, AdamW) of the GPT split by labkit.tp and by
    parallelize_module (+ loss_parallel), interleaved; then one traced step each."""
    from labkit.data import markov_tokens
    from labkit.memory import param_bytes
    from labkit.models import GPT, GPTConfig
    from labkit.tp import tensor_parallel
    config = GPTConfig(**TP_BENCH_GPT)
    full_bytes = param_bytes(GPT(config))
    ours = tensor_parallel(GPT(config))
    builtin = builtin_tensor_parallel(GPT(config), device_mesh())
    optims = {"ours": torch.optim.AdamW(ours.parameters(), lr=1e-3),
              "builtin": torch.optim.AdamW(builtin.parameters(), lr=1e-3)}
    data = markov_tokens(batch, config.block_size, config.vocab_size, seed=0)  # the same on every rank

    medians, tracers = race_training_steps({"ours": ours, "builtin": builtin}, optims, data, repeats,
                                           loss_contexts={"builtin": loss_parallel})
    sent = {name: tracer.sent_bytes() for name, tracer in tracers.items()}
    n, L = dist.get_world_size(), config.n_layer
    activations = batch * config.block_size * config.n_embd * 4      # B*T*H float32 bytes
    reduced = 2 * (1 + 2 * L) * activations + 3 * batch * config.block_size * 4
    return dict(medians, sent=sent, formula=2 * (n - 1) / n * reduced, full_bytes=full_bytes,
                rank_bytes=param_bytes(ours))


@row("tp", divides(TP_BENCH_GPT["n_head"], TP_BENCH_GPT["n_embd"], TP_BENCH_GPT["vocab_size"]),
     "its 8 heads, 256 channels and 512 words split evenly over the ranks")
def tp_row(repeats: int = 15, world_size: int = 2, batch: int = 8) -> BenchRow:
    """the learner's tensor parallelism (chapter 05) vs parallelize_module"""
    r = launch(_tp_vs_parallelize_module, world_size, repeats, batch, timeout=600)[0]
    # formula: per step 2(1 + 2L) all-reduces of B*T*H (embedding, 2 per block, head; forward
    # and backward) and 3 of B*T (the loss), each 2(N-1)/N of its size on the wire.
    return BenchRow(f"GPT step, labkit.tp vs parallelize_module, {world_size} ranks",
                    r["ours"], r["builtin"], r["sent"]["ours"], r["formula"],
                    extra={"torch_sent": r["sent"]["builtin"], "param_bytes_full": r["full_bytes"],
                           "param_bytes_rank0": r["rank_bytes"]})
