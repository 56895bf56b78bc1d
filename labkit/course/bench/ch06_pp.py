"""``labkit bench`` rows of chapter 06 (pp): the course's implementation vs PyTorch's."""

from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.course.bench.runner import BenchRow, row
from labkit.launch import launch
from labkit.oracles import PP_BENCH_GPT, builtin_pipeline
from labkit.timing import interleaved_medians


def _1f1b_vs_schedule_1f1b(repeats: int, microbatches: int, micro_batch: int) -> dict:
    """One training step (1F1B forward/backward of every micro-batch, then AdamW) with
    labkit.pp's runner and with torch's PipelineStage + Schedule1F1B, interleaved."""
    from labkit import pp
    from labkit.comm import CommTracer
    from labkit.data import markov_tokens
    from labkit.models import GPT, GPTConfig
    p, rank = dist.get_world_size(), dist.get_rank()
    config = GPTConfig(n_layer=p, **PP_BENCH_GPT)
    ours = pp.split_gpt(GPT(config), p)[rank]
    theirs = pp.split_gpt(GPT(config), p)[rank]
    runner = pp.PipelineRunner({rank: ours}, p)
    actions = pp.one_f_one_b(p, microbatches)[rank]
    schedule = builtin_pipeline({rank: theirs}, p, "1f1b", microbatches, pp.gpt_loss)
    optims = {"ours": torch.optim.AdamW(ours.parameters(), lr=1e-3),
              "builtin": torch.optim.AdamW(theirs.parameters(), lr=1e-3)}
    x, y = markov_tokens(microbatches * micro_batch, config.block_size, config.vocab_size, seed=0)

    def ours_step(_):
        runner.step(actions, x, y, microbatches, pp.gpt_loss)
        optims["ours"].step()
        optims["ours"].zero_grad(set_to_none=True)

    def builtin_step(_):
        schedule.step(*([x] if rank == 0 else []), **(dict(target=y) if rank == p - 1 else {}))
        optims["builtin"].step()
        optims["builtin"].zero_grad(set_to_none=True)

    steps = {"ours": ours_step, "builtin": builtin_step}
    medians = interleaved_medians(steps, lambda: None, repeats, warmup=3)
    with CommTracer() as tracer:
        ours_step(None)
    sent = torch.tensor([tracer.sent_bytes()], dtype=torch.float64)
    dist.all_reduce(sent, op=dist.ReduceOp.MAX)
    activation = micro_batch * config.block_size * config.n_embd * 4
    messages = 0 if p == 1 else 1 if p == 2 else 2  # a middle stage sends both ways, an end one way
    return dict(medians, sent=sent.item(), formula=messages * microbatches * activation)


def _pp_row(world_size: int, repeats: int, microbatches: int | None, micro_batch: int) -> BenchRow:
    m = microbatches or 2 * world_size
    r = launch(_1f1b_vs_schedule_1f1b, world_size, repeats, m, micro_batch, timeout=600)[0]
    # formula (the busiest rank): a middle stage sends each micro-batch's activation forward
    # and its gradient back, B*T*H float32 each, 2 m B T H * 4 bytes per step; with 2 ranks
    # each end sends one way only.
    return BenchRow(f"GPT step, labkit.pp 1F1B vs Schedule1F1B, {world_size} ranks, m={m}",
                    r["ours"], r["builtin"], r["sent"], r["formula"])


@row("pp")
def pp_row(repeats: int = 10, world_size: int = 2, microbatches: int | None = None, micro_batch: int = 4) -> BenchRow:
    """the learner's 1F1B (chapter 06) vs Schedule1F1B, 2 ranks"""
    return _pp_row(world_size, repeats, microbatches, micro_batch)


@row("pp_4")
def pp4_row(repeats: int = 10, world_size: int = 4, microbatches: int | None = None, micro_batch: int = 4) -> BenchRow:
    """the learner's 1F1B (chapter 06) vs Schedule1F1B, 4 ranks"""
    return _pp_row(world_size, repeats, microbatches, micro_batch)
