"""Lab 06 as a script: your pipeline schedules on N real ranks, against one process, with the bubble measured.

    torchrun --standalone --nproc-per-node 4 labs/06_pp.py
    python labs/06_pp.py --world-size 4        # labkit.launch starts the ranks

Every rank holds its stages of a float64 GPT (tied wte/lm_head, one block per stage; two stages per
rank for the interleaved schedule), cut by your ``split_gpt``, and trains it for 3 AdamW steps with
each schedule of ``labkit/pp.py`` (GPipe, 1F1B, interleaved 1F1B with v = 2, ZB-H1), executed by the
given ``PipelineRunner``, next to the whole GPT on the whole batch: the loss (on the last stage's rank)
and every gradient must agree to float64 rounding. Then the same schedules run on synthetic stages
that sleep 20 ms forward and 40 ms backward (ZB-H1: B and W 20 ms each), so that the wall clock shows
the schedule and not the CPU; the measured bubble, 1 - (time spent sleeping) / (p x makespan), is
printed next to what the unit-cost clock (``pp.simulate``) gives for your lists and the formula
(p-1)/(vm+p-1). Rank 0 prints; the exit status is 1 if a check fails or a task is not implemented yet.

The pipeline's tensors stay on the CPU (the runner receives into CPU buffers), so the backend is gloo
unless ``--backend`` says otherwise.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit import pp
from labkit.check import mismatch, not_implemented
from labkit.course.labscript import lab_arguments, run_lab
from labkit.data import markov_tokens
from labkit.models import GPT, GPTConfig

KINDS = ("GPipe", "1F1B", "interleaved", "ZB-H1")
V = 2                         # chunks per rank in the interleaved schedule
MICRO, STEPS = 2, 3           # sequences per micro-batch; AdamW steps checked
FORWARD_S, BACKWARD_S = 0.020, 0.040


def gpt_config(p: int, v: int) -> GPTConfig:
    return GPTConfig(vocab_size=32, block_size=8, n_layer=p * v, n_head=2, n_embd=16, tie_weights=True)


def chunks(kind: str) -> int:
    return V if kind == "interleaved" else 1


def schedule_of(kind: str, p: int, m: int):
    return {"GPipe": lambda: pp.gpipe(p, m), "1F1B": lambda: pp.one_f_one_b(p, m),
            "interleaved": lambda: pp.interleaved_1f1b(p, m, V), "ZB-H1": lambda: pp.zero_bubble_h1(p, m)}[kind]()


# ----------------------------------------------------------------------------- on every rank


def check_against_single(kind: str, m: int) -> dict:
    """STEPS AdamW steps of the pipeline and of the whole GPT; the worst loss and gradient mismatch."""
    p, rank, v = dist.get_world_size(), dist.get_rank(), chunks(kind)
    model, reference = GPT(gpt_config(p, v)).double(), GPT(gpt_config(p, v)).double()
    stages = pp.split_gpt(model, p * v)
    mine = {s: stages[s] for s in range(p * v) if pp.rank_of_stage(s, p) == rank}
    runner = pp.PipelineRunner(mine, p * v, deferred_weights=kind == "ZB-H1")
    actions = schedule_of(kind, p, m)[rank]
    ours = [q for stage in mine.values() for q in dict.fromkeys(stage.parameters())]
    names = {id(q): name for name, q in model.named_parameters()}
    theirs = dict(reference.named_parameters())
    opt, opt_ref = torch.optim.AdamW(ours, lr=1e-2), torch.optim.AdamW(reference.parameters(), lr=1e-2)
    x, y = markov_tokens(STEPS * m * MICRO, 8, 32, seed=6)
    problems, loss_gap, grad_gap = [], 0.0, 0.0
    for step in range(STEPS):
        rows = slice(step * m * MICRO, (step + 1) * m * MICRO)
        loss, _ = runner.step(actions, x[rows], y[rows], m, pp.gpt_loss)
        expected = reference(x[rows], y[rows])[1]
        expected.backward()
        if loss is not None:
            loss_gap = max(loss_gap, abs(loss.item() - expected.item()))
            if why := mismatch(loss, expected.detach()):
                problems.append(f"step {step}: loss: {why}")
        for q in ours:
            want = theirs[names[id(q)]].grad
            if q.grad is None:
                problems.append(f"step {step}: {names[id(q)]} got no gradient")
                continue
            grad_gap = max(grad_gap, (q.grad - want).abs().max().item())
            if why := mismatch(q.grad, want):
                problems.append(f"step {step}: gradient of {names[id(q)]}: {why}")
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    return dict(loss_gap=loss_gap, grad_gap=grad_gap, problems=problems)


class Sleep(torch.autograd.Function):
    """The identity; its forward sleeps the stage's forward time, its backward the backward time."""

    @staticmethod
    def forward(ctx, x, stage):
        ctx.stage = stage
        stage.work(stage.forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.stage.work(ctx.stage.backward_s)
        return grad, None


class SleepStage(nn.Module):
    """A stage of fixed cost for PipelineRunner (forward, hidden_size, one parameter); every sleep is
    logged as (start, end) in ``log``, shared by a rank's stages: one entry per action, in order."""

    def __init__(self, first: bool, forward_s: float, backward_s: float, log: list, hidden_size: int = 4):
        super().__init__()
        self.first, self.hidden_size = first, hidden_size
        self.forward_s, self.backward_s, self.log = forward_s, backward_s, log
        self.scale = nn.Parameter(torch.ones((), dtype=torch.float64))

    def work(self, seconds: float) -> None:
        start = time.perf_counter()
        time.sleep(seconds)
        self.log.append((start, time.perf_counter()))

    def forward(self, x):
        if self.first:  # token ids [b, T] -> [b, T, hidden_size]
            x = x.unsqueeze(-1).expand(*x.shape, self.hidden_size).to(self.scale.dtype)
        return Sleep.apply(x * self.scale, self)


def sleep_loss(out, targets):
    return out.mean()


def sleep_costs(kind: str) -> dict:
    v = chunks(kind)
    if kind == "ZB-H1":
        return {"F": FORWARD_S, "B": BACKWARD_S / 2, "W": BACKWARD_S / 2}
    return {"F": FORWARD_S / v, "B": BACKWARD_S / v, "W": 0.0}


def measure_bubble(kind: str, m: int) -> dict:
    """One step on sleeping stages: this rank's first action start, last sleep end and time asleep,
    from the barrier that started the step (so ranks on different hosts line up)."""
    p, rank, v = dist.get_world_size(), dist.get_rank(), chunks(kind)
    cost, log = sleep_costs(kind), []
    stages = {s: SleepStage(s == 0, cost["F"], cost["B"], log)
              for s in range(p * v) if pp.rank_of_stage(s, p) == rank}
    runner = pp.PipelineRunner(stages, p * v, deferred_weights=kind == "ZB-H1")
    actions = schedule_of(kind, p, m)[rank]

    def after(action):  # W, the other half of a split backward, sleeps in the runner's hook
        if action.kind == "W":
            stages[action.stage].work(cost["W"])

    tokens = torch.zeros(m, 2, dtype=torch.long)
    dist.barrier()
    t0 = time.perf_counter()
    _, trace = runner.step(actions, tokens, tokens, m, sleep_loss, after_action=after)
    return dict(first=trace.events[0][1] - t0, last=log[-1][1] - t0, busy=sum(e - s for s, e in log))


def main(m: int) -> dict:
    torch.set_num_threads(1)
    result = dict(backend=dist.get_backend(), m=m, checks={}, bubbles={})
    for kind in KINDS:
        try:
            result["checks"][kind] = check_against_single(kind, m)
        except NotImplementedError as exc:  # a stub raises on every rank alike, before any message
            result["checks"][kind] = not_implemented(exc)
    for kind in KINDS:
        if isinstance(result["checks"][kind], dict):
            result["bubbles"][kind] = measure_bubble(kind, m)
    return result


# ----------------------------------------------------------------------------- report


def report(results: list[dict]) -> bool:
    p, m = len(results), results[0]["m"]
    print(f"Lab 06: pipeline parallelism on {p} rank(s), backend {results[0]['backend']}, "
          f"m = {m} micro-batches of {MICRO} sequences\n")
    print(f"correctness: {STEPS} AdamW steps in float64 vs the whole GPT in one process (tied wte/lm_head)")
    print(f"  {'schedule':<12} {'max |loss diff|':>16} {'max |grad diff|':>16}  verdict")
    ok, correct = True, []
    for kind in KINDS:
        checks = [r["checks"][kind] for r in results]
        if isinstance(checks[0], str):
            print(f"  {kind:<12} {checks[0]}")
            ok = False
            continue
        problems = [f"rank {rank}, {why}" for rank, c in enumerate(checks) for why in c["problems"]]
        ok &= not problems
        if not problems:
            correct.append(kind)
        print(f"  {kind:<12} {max(c['loss_gap'] for c in checks):>16.1e} {max(c['grad_gap'] for c in checks):>16.1e}"
              f"  {'ok' if not problems else 'WRONG: ' + problems[0]}")

    if results[0]["bubbles"]:
        print(f"\nbubble on sleeping stages ({FORWARD_S * 1e3:.0f} ms forward, {BACKWARD_S * 1e3:.0f} ms backward "
              f"per stage and micro-batch; ZB-H1: B and W {BACKWARD_S / 2 * 1e3:.0f} ms each)")
        print(f"  {'schedule':<12} {'step ms':>8} {'measured':>9} {'clock':>7} {'formula':>8}")
    for kind in results[0]["bubbles"]:
        runs = [r["bubbles"][kind] for r in results]
        makespan = max(r["last"] for r in runs) - min(r["first"] for r in runs)
        measured = 1 - sum(r["busy"] for r in runs) / (p * makespan)
        clock = pp.simulate(schedule_of(kind, p, m), num_stages=p * chunks(kind), cost=sleep_costs(kind)).bubble()
        formula = (p - 1) / (3 * m + p - 1) if kind == "ZB-H1" else pp.bubble_formula(p, m, chunks(kind))
        note = "" if kind in correct else "   (its correctness check failed)"
        shown = "-" if kind == "ZB-H1" and m < p else f"{formula:.3f}"
        print(f"  {kind:<12} {makespan * 1e3:>8.0f} {measured:>9.3f} {clock:>7.3f} {shown:>8}{note}")
    if results[0]["bubbles"]:
        print("  clock = pp.simulate of your lists with the sleeps as costs; formula = (p-1)/(vm+p-1), "
              "ZB-H1: (p-1)/(3m+p-1) for m >= p.\n  Where measured exceeds the clock, the excess is what "
              "messages and Python cost per action.")
    return ok


if __name__ == "__main__":
    parser = lab_arguments(__doc__)
    parser.set_defaults(backend="gloo")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="micro-batches per step (default 2 x ranks; a multiple of the ranks)")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", args.world_size))
    m = args.microbatches or 2 * world
    if m % world:
        parser.error(f"--microbatches {m} must be a multiple of the ranks ({world}) for the interleaved schedule")
    run_lab(main, report, args, m)
