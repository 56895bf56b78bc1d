"""``labkit bench`` rows of chapter 08 (mesh): the course's implementation vs PyTorch's."""

from __future__ import annotations

import torch

from labkit.course.bench.runner import BenchRow, divides, race_training_steps, row
from labkit.launch import launch
from labkit.oracles import MESH_BENCH_GPT, builtin_2d, loss_parallel


def _2d_vs_builtin(repeats: int, dp: int, tp: int, batch: int) -> dict:
    """One training step of the GPT on a dp x tp mesh: labkit.mesh.parallelize_2d (the
    course's TP + FSDP) vs fully_shard on the dp sub-mesh + parallelize_module on tp."""
    from labkit.data import markov_tokens
    from labkit.mesh import RankGrid, dp_slice, parallelize_2d
    from labkit.models import GPT, GPTConfig
    config = GPTConfig(**MESH_BENCH_GPT)
    grid = RankGrid(dp * tp, dp=dp, tp=tp).make_groups()
    ours = parallelize_2d(GPT(config), grid)
    builtin = builtin_2d(GPT(config), dp, tp)
    optims = {"ours": torch.optim.AdamW(ours.parameters(), lr=1e-3),
              "builtin": torch.optim.AdamW(builtin.parameters(), lr=1e-3)}
    x, y = markov_tokens(batch * dp, config.block_size, config.vocab_size, seed=0)
    data = dp_slice(x, grid), dp_slice(y, grid)

    medians, tracers = race_training_steps({"ours": ours, "builtin": builtin}, optims, data, repeats,
                                           loss_contexts={"builtin": loss_parallel})
    sent = {name: tracer.sent_bytes() for name, tracer in tracers.items()}
    from labkit.fsdp import step_bytes
    tokens = batch * config.block_size
    tp_reduced = 2 * (1 + 2 * config.n_layer) * tokens * config.n_embd * 4 + 3 * tokens * 4
    formula = 2 * (tp - 1) / tp * tp_reduced + step_bytes(ours)["total"]
    return dict(medians, sent=sent, formula=formula)


@row("mesh", lambda n: n % 2 == 0 and divides(MESH_BENCH_GPT["n_head"])(n // 2),
     "dp = 2 times a tp that divides its 4 heads")  # formula: TP's all-reduces (chapter 05) + FSDP's 3 (N-1)/N of the padded shards (chapter 04)
def mesh_row(repeats: int = 10, world_size: int = 4, batch: int = 4) -> BenchRow:
    """2-D FSDP x TP from the learner's parts (chapter 08) vs fully_shard + parallelize_module"""
    dp, tp = 2, world_size // 2
    r = launch(_2d_vs_builtin, world_size, repeats, dp, tp, batch, timeout=600)[0]
    return BenchRow(f"GPT step on a {dp}x{tp} dp x tp mesh, labkit 2-D vs fully_shard + parallelize_module",
                    r["ours"], r["builtin"], r["sent"]["ours"], r["formula"], extra={"torch_sent": r["sent"]["builtin"]})
