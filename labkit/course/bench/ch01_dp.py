"""``labkit bench`` rows of chapter 01 (dp): the course's implementation vs PyTorch's."""

from __future__ import annotations

import torch.distributed as dist

from labkit.course.bench.runner import BenchRow, row
from labkit.launch import launch
from labkit.oracles import builtin_ddp
from labkit.timing import interleaved_medians


def _dp_step_vs_ddp(repeats: int) -> dict:
    """One training step's forward + backward + gradient sync: average_gradients vs DDP."""
    from labkit.comm import CommTracer
    from labkit.data import markov_tokens
    from labkit.dp import average_gradients
    from labkit.models import GPT, GPTConfig
    config = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=64)
    ours = GPT(config)
    ddp = builtin_ddp(GPT(config))
    batch = markov_tokens(8, config.block_size, config.vocab_size, seed=dist.get_rank())

    def ours_step(b):
        ours.zero_grad(set_to_none=True)
        ours(*b)[1].backward()
        average_gradients(ours)  # after backward: nothing overlaps

    def ddp_step(b):
        ddp.zero_grad(set_to_none=True)
        ddp(*b)[1].backward()  # DDP all-reduces buckets while backward still runs

    medians = interleaved_medians({"ours": ours_step, "builtin": ddp_step}, lambda: batch, repeats)
    with CommTracer() as tracer:
        ours_step(batch)
    trained = [p for p in ours.parameters() if p.requires_grad]
    grad_bytes = sum(p.numel() * p.element_size() for p in trained)
    # average_gradients first all-reduces one float64 per parameter ("has a gradient here")
    # plus the weight, so that ranks agree on which gradients to reduce: 8 (P + 1) bytes.
    flag_bytes = 8 * (len(trained) + 1)
    return dict(medians, sent=tracer.sent_bytes(), grad_bytes=grad_bytes, flag_bytes=flag_bytes,
                all_reduces=tracer.count("all_reduce"))


@row("dp_average_gradients")
def dp_average_gradients_row(repeats: int = 15, world_size: int = 2) -> BenchRow:
    """average_gradients after backward (chapter 01) vs DDP"""
    r = launch(_dp_step_vs_ddp, world_size, repeats)[0]
    # The ring's 2 (N-1)/N of the gradients and of the small all-reduce of flags before them.
    formula = 2 * (world_size - 1) / world_size * (r["grad_bytes"] + r["flag_bytes"])
    return BenchRow(f"GPT step, average_gradients vs DDP, {r['grad_bytes'] / 2**20:.2f} MB grads, {world_size} ranks",
                    r["ours"], r["builtin"], r["sent"], formula,
                    extra=dict(all_reduces=r["all_reduces"], flag_bytes=r["flag_bytes"]))
