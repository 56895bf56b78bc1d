"""``labkit bench`` rows of chapter 14 (perf): the model's arithmetic vs what PyTorch measures.

Chapter 14's other row, the alpha-beta model against emulated nodes, is ``hierarchical_emulated``
(chapter 11's file: it times chapter 11's hierarchy)."""

from __future__ import annotations

from labkit.course.bench.runner import BenchRow, row
from labkit.launch import launch
from labkit.models import GPTConfig
from labkit.timing import interleaved_medians

# Small enough to count in a few milliseconds, with attention a visible part of the FLOPs.
FLOPS_GPT = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=96, block_size=64)


def _formula_vs_counter(repeats: int, batch: int) -> dict:
    """One rank: perf.flops_per_token x tokens (yours) vs FlopCounterMode counting a forward and
    backward of the course GPT with the math attention kernel (the fused CPU kernel counts 0)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from labkit import perf
    from labkit.data import markov_tokens
    from labkit.models import GPT
    config = GPTConfig(**FLOPS_GPT)
    model = GPT(config)
    x, y = markov_tokens(batch, config.block_size, config.vocab_size, seed=0)

    def formula(_):
        return perf.flops_per_token(perf.Model.of_gpt(config)) * x.numel()

    def counted(_):
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            model(x, y)[1].backward()
        model.zero_grad(set_to_none=True)
        return counter.get_total_flops()

    torch.manual_seed(0)
    medians = interleaved_medians({"ours": formula, "builtin": counted}, lambda: None, repeats)
    return dict(medians, formula_flops=formula(None), counted_flops=counted(None))


@row("perf_flops")
def perf_flops_row(repeats: int = 11, world_size: int = 1, batch: int = 2) -> BenchRow:
    """FLOPs of one training step: perf.flops_per_token (a formula) vs FlopCounterMode (a run)"""
    r = launch(_formula_vs_counter, 1, repeats, batch, timeout=300)[0]   # one rank: arithmetic, not a job
    return BenchRow("perf_flops", r["ours"], r["builtin"],
                    extra=dict(formula_flops=r["formula_flops"], counted_flops=r["counted_flops"]))
