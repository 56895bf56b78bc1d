"""Graded tests for chapter 06: pipeline parallelism (labkit/pp.py).

Schedules as data: each schedule's whole table (every rank's action list) for p = 1-4 and
several m (the interleaved one at v = 1, 2 and 3 chunks per rank) equals the table written
out here from the chapter's rules (1F1B: w = min(p - 1 - s, m) warm-up forwards, then one
forward and one backward while forwards remain, then the last backwards; ...), and the
table run on the unit-cost clock (``simulate``) has the chapter's bubble (p - 1) / (v m +
p - 1), its micro-batches in flight per rank, and (ZB-H1) a third of 1F1B's idle time.

Numbers: for every schedule, at p = 2, 3 and 4 pipeline ranks, with m = p and 2p + 1
micro-batches (m = 1 too where the schedule allows it; the interleaved one, at v = 2 chunks
per rank, with m = p and 2p), the loss and every parameter's gradient on every rank equal
the single-process GPT on the global batch, in float64, over 5 AdamW steps. The GPT has a
tied embedding/head, so its two halves live on the first and last ranks.

Technique, on every rank: the rank's list is checked against the table before anything
runs (a wrong table never gets to hang the pipeline); the order executed equals it; the
micro-batches in flight peak at m (GPipe), p - s (1F1B), p (ZB-H1), w + 1 (interleaved),
counted by the runner and (GPipe, 1F1B) measured as live tensor bytes with labkit.memory.
The first step's whole communication is traced: per micro-batch and stage boundary one send
and one receive each way (the activation forward, its gradient back), each of one
micro-batch's activation (B x T x hidden x 8 bytes), to or from the global rank of the
neighbouring stage, tagged ``message_tag(micro-batch, receiving stage, backward)``, in the
table's order; the tied embedding's one all-reduce between the first and last ranks;
nothing else. Each message is checked as it is posted, before the transport sees it: a
wrong peer or tag fails by name instead of hanging two ranks.

pp.p2p on its own: stages pass activations forward and gradients back, micro-batches out of
order, over the whole world and over two sub-groups (pipeline axes of a mesh; the second not
contiguous), with exactly those messages; sends are asynchronous (the stage computes between
posting and waiting, and a send waited on before any computation fails: no overlap); a
receive has completed when it returns; and a GPipe step of the runner on each sub-group
moves exactly the messages above, between global ranks, and trains like one process. The
same stages under torch.distributed.pipelining with the matching built-in schedule give the
same losses; bad arguments raise ValueError before anything runs.

Group-taking functions and where each is graded on a subgroup (p2p messages checked against
the plan, global peers and the group's ranks, as each is posted, by ``StageTracer``):
    send_forward/recv_forward/send_backward/recv_backward(..., group), peer(stage, n, group),
    PipelineRunner(group=): at 4 ranks on {1,2,3} and {0,1,3} (a rank outside each), then on
        the 2x2 grid's axis {0,2} and {1,3} (one pipeline after the other, the others idle); at
        3 ranks on {0,2} after the world, rank 1 standing by (it posts nothing)
Overlap (event order): pp.p2p's sends must be in flight while the stage computes (a send
waited on before any computation fails as it is waited on, world and every subgroup).
"""

import itertools
import random
import re

import pytest
import torch
import torch.distributed as dist

from labkit.check import assert_close
from labkit.comm import OP_KINDS, CommTracer, Op, assert_ops, assert_overlap
from labkit.course.grading import run_graded, task
from tests.grading import configs

STEPS = 5
BATCH_PER_MICRO = 2
PIPELINE_RANKS = [2, 3, 4]
SCHEDULES = {"gpipe": "pp.gpipe", "1f1b": "pp.1f1b", "interleaved": "pp.interleaved",
             "zero_bubble": "pp.zero_bubble"}
SUBGROUPS = [[1, 2, 3], [0, 1, 3], [0, 2], [1, 3]]  # pipeline axes of a 4-rank mesh, as in chapter 08
AFTER_THE_WORLD = {3: [[0, 2]]}  # in the world's own launch: a pipeline of 2 beside a bystander
FLOAT64 = torch.empty((), dtype=torch.float64).element_size()
LONG = configs.LONG
DRAWS = 8 if LONG else 1  # drawn pipelines per launch (drawn_pipeline); x40 drawn table shapes


# ----------------------------------------------------------------------------- the tables


def interleaved_warmup(p: int, m: int, v: int, rank: int) -> int:
    """The chapter's warm-up of the interleaved schedule: (v - 1) p + 2 (p - 1 - r) forwards."""
    return min((v - 1) * p + 2 * (p - 1 - rank), m * v)


def expected_order(kind: str, p: int, m: int, rank: int, v: int = 2) -> list[str]:
    """Each schedule's action order on ``rank``, written out from its definition."""
    if kind == "gpipe":
        return [f"F{i}s{rank}" for i in range(m)] + [f"B{i}s{rank}" for i in range(m)]
    if kind in ("1f1b", "zero_bubble"):
        warmup = min(p - 1 - rank, m)
        forwards = iter(range(m))
        backwards = iter(range(m))
        order = [f"F{next(forwards)}s{rank}" for _ in range(warmup)]
        for _ in range(m - warmup):
            order += [f"F{next(forwards)}s{rank}", f"B{next(backwards)}s{rank}"]
        order += [f"B{i}s{rank}" for i in backwards]
        if kind == "1f1b":
            return order
        with_w, done = [], 0  # W of micro-batch i right after B of micro-batch i + rank
        for action in order:
            with_w.append(action)
            if action.startswith("B") and int(action[1:].split("s")[0]) >= rank:
                with_w.append(f"W{done}s{rank}")
                done += 1
        return with_w + [f"W{i}s{rank}" for i in range(done, m)]
    # interleaved: rounds of p micro-batches; chunk c of rank r is stage c * p + r
    total, warmup = m * v, interleaved_warmup(p, m, v, rank)
    def fwd(k):
        return f"F{(k // (p * v)) * p + k % p}s{((k // p) % v) * p + rank}"
    def bwd(k):
        return f"B{(k // (p * v)) * p + k % p}s{(v - 1 - (k // p) % v) * p + rank}"
    order = [fwd(k) for k in range(warmup)]
    for j in range(total - warmup):
        order += [fwd(warmup + j), bwd(j)]
    return order + [bwd(k) for k in range(total - warmup, total)]


# Tables drawn in the papers, written out by hand (micro-batches counted from 0): they check
# the rules above as much as the learner's code. GPipe (Huang et al. 2019, fig. 2) and 1F1B
# (Narayanan et al. 2021, fig. 4 top: 4 devices, 8 micro-batches).
DRAWN = {
    ("gpipe", 4, 4): ["F0 F1 F2 F3 B0 B1 B2 B3"] * 4,
    ("1f1b", 4, 8): ["F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
                     "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
                     "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
                     "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"],
}


def micro_batch_counts(kind: str, p: int, m: int, v: int = 1) -> list[int]:
    """The schedule's peak of micro-batches in flight per rank (all chunks together): GPipe
    all m; 1F1B p - s; ZB-H1 p (W's hold their inputs longer); interleaved w + 1."""
    if kind == "gpipe":
        return [m] * p
    if kind == "1f1b":
        return [min(p - s, m) for s in range(p)]
    if kind == "zero_bubble":
        return [min(p, m)] * p
    return [min(interleaved_warmup(p, m, v, r) + 1, m * v) for r in range(p)]


def parse(action: str) -> tuple[str, int, int]:
    """'F3s1' -> ('F', 3, 1)."""
    kind, microbatch, stage = re.fullmatch(r"([FBW])(\d+)s(\d+)", action).groups()
    return kind, int(microbatch), int(stage)


def in_flight_peak(order: list[str]) -> int:
    """Most micro-batches holding activations at once along a rank's order: +1 at F, -1 at
    the action that frees them (W when the schedule has W's, else B)."""
    release = "W" if any(a.startswith("W") for a in order) else "B"
    held = peak = 0
    for action in order:
        held += {"F": 1, release: -1}.get(action[0], 0)
        peak = max(peak, held)
    return peak


# ----------------------------------------------------------------------------- messages


def message_plan(order: list[str], num_stages: int, stage_rank, nbytes: int, group_ranks) -> list:
    """The messages a rank running ``order`` posts, in order, as (Op, tag, what): F(i, s)
    receives its input from stage s - 1 (s > 0) and sends its output to s + 1 (s < last);
    B(i, s) receives its output's gradient from s + 1 (s < last) and sends its input's
    gradient to s - 1 (s > 0); W sends nothing. Each message is one micro-batch's activation
    (``nbytes``), to or from the global rank ``stage_rank(stage)``."""
    from labkit.pp import message_tag
    plan, last = [], num_stages - 1
    for action in order:
        kind, i, s = parse(action)
        if kind == "F":
            if s > 0:
                plan.append(p2p("recv", i, s - 1, s, False, stage_rank, nbytes, group_ranks, message_tag))
            if s < last:
                plan.append(p2p("send", i, s, s + 1, False, stage_rank, nbytes, group_ranks, message_tag))
        elif kind == "B":
            if s < last:
                plan.append(p2p("recv", i, s + 1, s, True, stage_rank, nbytes, group_ranks, message_tag))
            if s > 0:
                plan.append(p2p("send", i, s, s - 1, True, stage_rank, nbytes, group_ranks, message_tag))
    return plan


def p2p(kind, microbatch, source, destination, backward, stage_rank, nbytes, group_ranks, message_tag):
    """One message of micro-batch ``microbatch`` from stage ``source`` to ``destination``."""
    mine, other = (source, destination) if kind == "send" else (destination, source)
    what = (f"stage {mine} (global rank {stage_rank(mine)}) {'sending' if kind == 'send' else 'receiving'} "
            f"micro-batch {microbatch}'s {'gradient' if backward else 'activation'} "
            f"{'to' if kind == 'send' else 'from'} stage {other}")
    return Op(kind, nbytes, group_ranks, stage_rank(other)), message_tag(microbatch, destination, backward), what


class StageTracer(CommTracer):
    """A ``CommTracer`` that holds a stage to its message plan while it runs.

    Every send and receive is compared, before the transport sees it, with the next message
    of ``plan`` (kind, bytes, group, global peer, tag): a wrong peer, tag or size fails
    naming it, where it would otherwise hang two ranks or mix up two messages; a message
    beyond the plan fails as extra. A receive must have completed (been waited on) before
    anything else is posted (``recv_*`` are blocking). With ``async_sends``, a send waited
    on before any computation ran while it was in flight fails at that wait: the same rule
    as ``assert_overlap``, applied before a blocking wait could hang."""

    def __init__(self, what: str, plan: list, async_sends: bool = False):
        super().__init__()
        self.what, self.plan, self.async_sends = what, plan, async_sends
        self.posted = 0                    # messages of the plan posted so far
        self.labels: dict[int, str] = {}   # event index -> what the message is
        self.done: set[int] = set()        # event indices waited on

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = OP_KINDS.get(func._opname) if func.namespace == "c10d" else None
        if kind in ("send", "recv"):
            self._check_next(kind, func, args, kwargs or {})
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _check_next(self, kind, func, args, kwargs) -> None:
        self.assert_received()
        event = self._event(kind, func, args, kwargs, None, 0.0)
        named = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
        got, tag = Op(kind, event.bytes, event.group, event.peer), named.get("tag")
        if self.posted >= len(self.plan):
            raise AssertionError(f"{self.what}: an extra {got!r} (tag {tag}): this stage's "
                                 f"{len(self.plan)} messages were all posted already, and nothing else may be")
        want, want_tag, label = self.plan[self.posted]
        if (got, tag) != (want, want_tag):
            fields = (("a", got[0], want[0], ""), ("bytes:", got[1], want[1], ""),
                      ("peer: global rank", got[3], want[3], ""),
                      ("group: ranks", got[2], want[2], " (the pipeline's messages go over its group: group=group)"),
                      ("tag", tag, want_tag, " (message_tag(micro-batch, receiving stage, backward))"))
            wrong = [f"{name} {g} instead of {w}{hint}" for name, g, w, hint in fields if g != w]
            raise AssertionError(f"{self.what}: {label}: " + ", ".join(wrong) + f" (posted a {got!r} with "
                                 f"tag {tag}; expected a {want!r} with tag {want_tag})")
        self.labels[len(self.events)] = label  # the index its event will have
        self.posted += 1

    def _waited(self, entry) -> None:
        super()._waited(entry)
        if entry is None:
            return
        index = entry[1]
        self.done.add(index)
        if not self.async_sends or self.events[index].kind != "send":
            return
        posted = next(n for n, s in enumerate(self.timeline) if s.what == "post" and s.event == index)
        if not any(s.what == "compute" for s in self.timeline[posted:]):
            raise AssertionError(
                f"{self.what}: {self.labels.get(index, 'a send')}: the send was waited on before any "
                f"computation ran while it was in flight (no overlap): send_forward/send_backward post "
                f"it (dist.isend) and return its work; the stage computes, and waits later")

    def assert_received(self) -> None:
        """Every receive posted so far has completed."""
        for index, event in enumerate(self.events):
            if event.kind == "recv" and index not in self.done:
                raise AssertionError(f"{self.what}: {self.labels.get(index, 'a receive')}: it returned "
                                     f"before the message arrived (never waited on): recv_forward/recv_backward "
                                     f"block until the buffer holds the message")

    def assert_plan_done(self) -> None:
        """Every message of the plan was posted."""
        missing = self.plan[self.posted:]
        if missing:
            raise AssertionError(f"{self.what}: {len(missing)} message(s) of this stage never posted, "
                                 f"the first: {missing[0][2]} ({missing[0][0]!r})")


# ----------------------------------------------------------------------------- on every rank


def config(p: int, v: int, tie: bool = True):
    from labkit.models import GPTConfig
    return GPTConfig(vocab_size=32, block_size=8, n_layer=p * v, n_head=2, n_embd=16, tie_weights=tie)


def schedule_of(kind: str, p: int, m: int, v: int):
    from labkit import pp
    return {"gpipe": lambda: pp.gpipe(p, m), "1f1b": lambda: pp.one_f_one_b(p, m),
            "interleaved": lambda: pp.interleaved_1f1b(p, m, v),
            "zero_bubble": lambda: pp.zero_bubble_h1(p, m)}[kind]()


def tokens(m: int):
    from labkit.data import markov_tokens
    return markov_tokens(STEPS * m * BATCH_PER_MICRO, 8, 32, seed=6)


def step_ops(order: list[str], cfg, num_stages: int, tokens_per_sequence: int, members=None):
    """This rank's whole communication in one step of ``order``: the message plan (see
    ``message_plan``; one message = one micro-batch's activation, B x T x hidden float64)
    and the Ops of the trace: those messages, plus one all-reduce of the tied embedding's
    gradient (vocab x hidden float64) between the ranks of the first and last stages."""
    members = members or list(range(dist.get_world_size()))
    p = len(members)
    activation = BATCH_PER_MICRO * tokens_per_sequence * cfg.n_embd * FLOAT64
    plan = message_plan(order, num_stages, lambda s: members[s % p], activation, members)
    ops = [op for op, _, _ in plan]
    ends = sorted({members[0], members[(num_stages - 1) % p]})
    if cfg.tie_weights and len(ends) == 2 and dist.get_rank() in ends:
        ops.append(Op("all_reduce", cfg.vocab_size * cfg.n_embd * FLOAT64, ends))
    return plan, ops


def check_table_first(kind: str, p: int, m: int, v: int, rank: int) -> list:
    """This rank's list from the learner's schedule, compared with the table before it runs."""
    actions = schedule_of(kind, p, m, v)[rank]
    got, want = [repr(a) for a in actions], expected_order(kind, p, m, rank, v)
    assert got == want, (f"{SCHEDULES[kind]}: p={p}, m={m}" + (f", v={v}" if kind == "interleaved" else "")
                         + f": rank {rank}'s list is {got}; the schedule's rule gives {want}")
    return actions


def train_pipeline(kind: str, m: int, v: int, tie: bool, check_against_reference: bool):
    """Our pipeline on this rank; per step the loss (on the last stage's rank) and, when
    checking, every gradient against the single-process GPT. The first step's communication
    is traced and must be exactly the table's messages (and the tied all-reduce).
    Returns (losses, traces)."""
    from labkit import pp
    from labkit.models import GPT
    task_id = SCHEDULES[kind]
    p, rank = dist.get_world_size(), dist.get_rank()
    stages_total = p * v
    actions = check_table_first(kind, p, m, v, rank)
    cfg = config(p, v, tie)
    model, reference = GPT(cfg).double(), GPT(cfg).double()
    stages = pp.split_gpt(model, stages_total)
    mine = {s: stages[s] for s in range(stages_total) if pp.rank_of_stage(s, p) == rank}
    runner = pp.PipelineRunner(mine, stages_total, deferred_weights=kind == "zero_bubble")
    names = {id(q): n for n, q in model.named_parameters()}
    ours = [q for stage in mine.values() for q in dict.fromkeys(stage.parameters())]
    opt, opt_ref = torch.optim.AdamW(ours, lr=1e-2), torch.optim.AdamW(reference.parameters(), lr=1e-2)
    reference_params = dict(reference.named_parameters())
    x, y = tokens(m)
    losses, traces = [], []
    for step in range(STEPS):
        size = m * BATCH_PER_MICRO
        xb, yb = x[step * size:(step + 1) * size], y[step * size:(step + 1) * size]
        if step == 0:
            what = f"{task_id}: {kind}, p={p}, m={m}, rank {rank}, step 0"
            plan, ops = step_ops(expected_order(kind, p, m, rank, v), cfg, stages_total, xb.shape[1])
            with StageTracer(what, plan) as tracer:
                loss, trace = runner.step(actions, xb, yb, m, pp.gpt_loss)
            tracer.assert_plan_done()
            assert_ops(tracer, ops, what)
        else:
            loss, trace = runner.step(actions, xb, yb, m, pp.gpt_loss)
        traces.append(trace)
        if check_against_reference:
            expected = reference(xb, yb)[1]
            expected.backward()
            what = f"{task_id}: {kind}, p={p}, m={m}, rank {rank}, step {step}"
            if loss is not None:
                assert_close(loss, expected.detach(), f"{what}: loss")
            for q in ours:
                assert q.grad is not None, f"{what}: {names[id(q)]} got no gradient"
                assert_close(q.grad, reference_params[names[id(q)]].grad, f"{what}: gradient of {names[id(q)]}")
            opt_ref.step()
            opt_ref.zero_grad()
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else loss.item())
    return losses, traces


def check_order_and_flight(kind: str, m: int, v: int, traces) -> None:
    p, rank = dist.get_world_size(), dist.get_rank()
    task_id = SCHEDULES[kind]
    executed = [repr(a) for a in traces[-1].order()]
    expected = expected_order(kind, p, m, rank, v)
    assert executed == expected, (f"{task_id}: p={p}, m={m}: rank {rank} ran {executed}; the schedule's "
                                  f"table says {expected}")
    # GPipe, 1F1B, ZB-H1: the runner's count of micro-batches holding activations on the
    # stage; interleaved: over the rank's v chunks, along the order it ran.
    peak = in_flight_peak(executed) if kind == "interleaved" else traces[-1].peak_in_flight[rank]
    want = micro_batch_counts(kind, p, m, v)[rank]
    assert peak == want, (f"{task_id}: p={p}, m={m}: rank {rank} held {peak} micro-batches' activations "
                          f"at once; the schedule keeps {want}")


def measured_micro_batches(kind: str, m: int) -> float:
    """The micro-batches in flight on this stage, measured as live tensor bytes (labkit.memory)
    between actions: 1 + (peak - bytes after the first forward) / bytes one more micro-batch
    adds (from a GPipe step of 2). Gradients sent back (input-sized) are held until the step
    ends; they are subtracted."""
    from labkit import pp
    from labkit.memory import PeakMemory, tensor_bytes
    from labkit.models import GPT
    p, rank = dist.get_world_size(), dist.get_rank()
    stage = pp.split_gpt(GPT(config(p, 1, tie=False)).double(), p)[rank]
    runner = pp.PipelineRunner({rank: stage}, p)
    x, y = tokens(m)
    held = lambda: tensor_bytes([list(stage.parameters()), [q.grad for q in stage.parameters()]])  # noqa: E731
    input_grad = BATCH_PER_MICRO * 8 * 16 * 8 if rank > 0 else 0

    def live_after_each_action(actions, micro_batches):
        size, samples, backwards = micro_batches * BATCH_PER_MICRO, [], [0]

        def probe(action):
            backwards[0] += action.kind == "B"
            samples.append(mem.live_bytes() - held() - backwards[0] * input_grad)
        with PeakMemory(stage) as mem:
            runner.step(actions, x[:size], y[:size], micro_batches, pp.gpt_loss, after_action=probe)
        return samples

    two = schedule_of("gpipe", p, 2, 1)[rank]
    live_after_each_action(two, 2)  # a first step: the gradients exist from here on
    first, second = live_after_each_action(two, 2)[:2]  # after F0 and after F1
    samples = live_after_each_action(schedule_of(kind, p, m, 1)[rank], m)
    return 1 + (max(samples) - samples[0]) / (second - first)


def drawn_optimizer(params, kind: str):
    """Two param groups: matrices (lr, weight decay), biases/LayerNorms (another lr, no decay)."""
    matrices, vectors = [q for q in params if q.dim() > 1], [q for q in params if q.dim() <= 1]
    groups = [dict(params=matrices, lr=1e-2, weight_decay=0.1), dict(params=vectors, lr=3e-2, weight_decay=0.0)]
    if kind == "adamw":  # eps 1e-6: the key bias's true gradient is 0; eps 1e-8 would amplify its rounding
        return torch.optim.AdamW([g for g in groups if g["params"]], eps=1e-6)
    return torch.optim.SGD([dict(g, momentum=0.9) for g in groups if g["params"]], lr=0.1)


def drawn_pipeline(kind: str, seed: int, draws: int) -> None:
    """``draws`` pipelines drawn from ``seed`` (the same on every rank): m (not a multiple of p
    unless the schedule needs it), v (interleaved), more blocks than stages (uneven stages), a
    batch of m to 2m + 1 sequences (micro-batches of unequal size when m does not divide it),
    sequence length, heads, width, bias, tied or not, float64 or float32, AdamW or momentum SGD
    with two param groups; 3 steps, each rank's loss and gradients and (after each optimizer step)
    parameters against the single-process GPT on the whole batch."""
    from labkit import pp
    from labkit.check import tolerance
    from labkit.models import GPT, GPTConfig
    task_id = SCHEDULES[kind]
    p, rank = dist.get_world_size(), dist.get_rank()
    rng = random.Random(seed)
    for draw in range(draws):
        v = rng.randint(1, 3) if kind == "interleaved" else 1
        m = p * rng.randint(1, 3) if kind == "interleaved" else rng.randint(1, 2 * p + 2)
        heads = rng.randint(1, 2)
        cfg = GPTConfig(vocab_size=rng.randint(2, 12), block_size=8, n_layer=p * v + rng.randint(0, 2), n_head=heads,
                        n_embd=heads * rng.choice([4, 6, 8]), bias=rng.random() < 0.5, tie_weights=rng.random() < 0.5)
        # float32 with SGD only: AdamW's m / sqrt(v) turns float32 rounding of near-zero gradients
        # (the key bias's is 0 in exact arithmetic) into steps of the size of lr
        dtype, opt_kind = rng.choice([torch.float64, torch.float32]), rng.choice(["adamw", "sgd"])
        opt_kind = "sgd" if dtype == torch.float32 else opt_kind
        rows, length = m + rng.randint(0, m + 1), rng.randint(1, 8)
        gen = torch.Generator().manual_seed(rng.randrange(2**31))
        what = f"{task_id}: drawn pipeline {draw} of seed {seed}: p={p}, m={m}, v={v}, {rows} sequences of " \
               f"{length}, {cfg}, {dtype}, {opt_kind}, rank {rank}"
        rtol, atol = tolerance(dtype)
        tol = dict(rtol=10 * rtol, atol=10 * atol) if dtype == torch.float32 else dict(rtol=rtol, atol=atol)
        model, reference = GPT(cfg).to(dtype), GPT(cfg).to(dtype)
        stages = pp.split_gpt(model, p * v)
        mine = {s: stages[s] for s in range(p * v) if pp.rank_of_stage(s, p) == rank}
        runner = pp.PipelineRunner(mine, p * v, deferred_weights=kind == "zero_bubble")
        actions = schedule_of(kind, p, m, v)[rank]
        names = {id(q): n for n, q in model.named_parameters()}
        ours = [q for stage in mine.values() for q in dict.fromkeys(stage.parameters())]
        reference_params = dict(reference.named_parameters())
        opt, opt_ref = drawn_optimizer(ours, opt_kind), drawn_optimizer(list(reference.parameters()), opt_kind)
        for step in range(3):
            x, y = (torch.randint(0, cfg.vocab_size, (rows, length), generator=gen) for _ in range(2))
            loss, _ = runner.step(actions, x, y, m, pp.gpt_loss)
            expected = reference(x, y)[1]
            expected.backward()
            if loss is not None:
                assert_close(loss, expected.detach(), f"{what}, step {step}: loss (micro-batches weighted by size)", **tol)
            for q in ours:
                assert q.grad is not None, f"{what}, step {step}: {names[id(q)]} got no gradient"
                assert_close(q.grad, reference_params[names[id(q)]].grad,
                             f"{what}, step {step}: gradient of {names[id(q)]}", **tol)
            for o in (opt, opt_ref):
                o.step()
                o.zero_grad()
            for q in ours:
                assert_close(q.detach(), reference_params[names[id(q)]].detach(),
                             f"{what}: {names[id(q)]} after step {step}", **tol)


def run_schedule_on_rank(kind: str, ms: list[int], v: int, memory_m: int | None, seed: int = 0, draws: int = 0):
    torch.set_num_threads(1)
    drawn_pipeline(kind, seed, draws)
    for m in ms:
        _, traces = train_pipeline(kind, m, v, tie=True, check_against_reference=True)
        check_order_and_flight(kind, m, v, traces)
    if memory_m is not None:
        p, rank = dist.get_world_size(), dist.get_rank()
        measured = measured_micro_batches(kind, memory_m)
        expected = micro_batch_counts(kind, p, memory_m)[rank]
        assert abs(measured - expected) <= 0.3, \
            (f"{SCHEDULES[kind]}: p={p}, m={memory_m}: stage {rank}'s live activations peaked at "
             f"{measured:.2f} micro-batches' worth; the schedule keeps {expected} (tolerance 0.3)")


def builtin_on_rank(kind: str, m: int, v: int):
    """The same (untied) stages under torch.distributed.pipelining; losses per step."""
    from labkit import pp
    from labkit.models import GPT
    from labkit.oracles import builtin_pipeline
    torch.set_num_threads(1)
    p, rank = dist.get_world_size(), dist.get_rank()
    stages_total = p * v
    stages = pp.split_gpt(GPT(config(p, v, tie=False)).double(), stages_total)
    mine = [s for s in range(stages_total) if pp.rank_of_stage(s, p) == rank]
    schedule = builtin_pipeline({s: stages[s] for s in mine}, stages_total, kind, m, pp.gpt_loss)
    opt = torch.optim.AdamW([q for s in mine for q in stages[s].parameters()], lr=1e-2)
    x, y = tokens(m)
    losses = []
    for step in range(STEPS):
        size = m * BATCH_PER_MICRO
        xb, yb = x[step * size:(step + 1) * size], y[step * size:(step + 1) * size]
        out = []
        schedule.step(*([xb] if 0 in mine else []),
                      **(dict(target=yb, losses=out) if stages_total - 1 in mine else {}))
        opt.step()
        opt.zero_grad()
        losses.append(sum(loss.item() for loss in out) / m if out else None)
    ours, _ = train_pipeline(kind, m, v, tie=False, check_against_reference=False)
    return ours, losses


def compare_with_builtin(kind: str, p: int, m: int, v: int) -> None:
    results = run_graded(SCHEDULES[kind], builtin_on_rank, p, kind, m, v)
    last = p - 1  # the last stage's rank holds the losses (with v chunks too: stage p v - 1)
    ours, theirs = results[last]
    assert_close(torch.tensor(ours), torch.tensor(theirs),
                 f"{SCHEDULES[kind]}: p={p}, m={m}: your losses vs torch.distributed.pipelining's")


# ----------------------------------------------------------------------------- split and p2p


def brute_force_partition(costs, k):
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), k - 1):
        edges = [0, *cuts, len(costs)]
        sizes = [b - a for a, b in zip(edges, edges[1:])]
        worst = max(sum(costs[a:b]) for a, b in zip(edges, edges[1:]))
        key = (worst, [-s for s in sizes])  # smallest max; then earlier stages larger
        if best is None or key < best[0]:
            best = (key, [range(a, b) for a, b in zip(edges, edges[1:])])
    return best[1]


@task("pp.split", points=2)
def test_partition_is_contiguous_balanced_and_refuses_too_many_stages():
    from labkit.pp import partition
    # fixed: stages that reach the best limit exactly, ties, one layer dwarfing the rest
    fixed = [[1, 1, 1], [2, 2, 2, 2, 2], [3, 1, 2, 2, 1], [1, 2, 3, 4, 5, 6, 7, 8], [10 ** 6, 1, 10 ** 6, 1], [5]]
    rng = configs.rng("pp.split")  # the run's seed: other costs each run
    drawn = []
    for trial in range(configs.budget(ci=60, long=600)):
        top = rng.choice((3, 20, 10 ** 6))   # few distinct costs (many ties) to large ones
        drawn.append([rng.randint(1, top) for _ in range(1 + trial % 8)])
    for costs in fixed + drawn:
        for k in range(1, len(costs) + 1):
            got, want = partition(costs, k), brute_force_partition(costs, k)
            assert got == want, f"pp.split: partition({costs}, {k}) = {got}; expected {want} {configs.replay()}"
    with pytest.raises(ValueError, match="layers"):
        partition([1, 2, 3], 4)


@task("pp.split", points=2)
def test_split_gpt_composes_back_to_the_model():
    from labkit.models import GPT
    from labkit.pp import layer_costs, partition, split_gpt
    # 3 stages of 4 blocks: by parameters [0], [1, 2], [3] (the first holds the embeddings);
    # by layers [0, 1], [2], [3]
    for p, balance in ((1, "params"), (2, "params"), (3, "params"), (3, "layers"), (4, "params")):
        model = GPT(config(4, 1)).double()
        x, _ = tokens(1)
        stages = split_gpt(model, p, balance)
        assert len(stages) == p, f"pp.split: {p} stages asked, {len(stages)} made"
        h = x
        for stage in stages:
            h = stage(h)
        assert_close(h, model(x)[0], f"pp.split: p={p}: the stages in a row vs the model")
        blocks = [[id(b) for b in stage.blocks] for stage in stages]
        ranges = partition(layer_costs(model, balance), p)
        assert blocks == [[id(model.blocks[i]) for i in r] for r in ranges], \
            f"pp.split: p={p}, balance={balance}: stage blocks do not follow partition(layer_costs)"
    with pytest.raises(ValueError, match="layers"):
        split_gpt(GPT(config(2, 1)), 3)


def p2p_on_rank(subgroups=None, seed: int = 0):
    """Stages on the whole world, or on each of ``subgroups`` (pipeline axes of a mesh),
    pass activations forward and gradients back, then run a GPipe step through the runner."""
    torch.set_num_threads(1)
    # Every rank takes part in making every group, even those outside it.
    if not subgroups:
        subgroups = [None] + AFTER_THE_WORLD.get(dist.get_world_size(), [])
    groups = [(members, dist.new_group(members) if members else None) for members in subgroups]
    for members, group in groups:
        if members and dist.get_rank() not in members:
            continue
        exchange_on_rank(members, group)
        # a second exchange in the same process: another shape and dtype (nothing kept from the first)
        rng = random.Random(seed)
        shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 4)))
        exchange_on_rank(members, group, shape, rng.choice([torch.float64, torch.bfloat16, torch.int64]))
        runner_step_on_rank(members, group)


def exchange_on_rank(members, group, shape=(2, 3), dtype=torch.float32) -> None:
    """Each stage sends micro-batches 2, 0, 1 forward and 1, 2, 0 back (out of order: the
    tags keep them apart), computes while its sends are in flight, then waits for them. The
    messages posted must be exactly these, to and from global ranks, as they are posted."""
    from labkit import pp
    ranks = members or list(range(dist.get_world_size()))
    p, r = dist.get_world_size(group), dist.get_rank(group)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    where = f"pp.p2p: {p} stages on " + (f"sub-group {members}" if members else "the whole world")
    what = f"{where}, stage {r} (global rank {ranks[r]})"

    def message(kind, microbatch, source, destination, backward):
        return p2p(kind, microbatch, source, destination, backward, ranks.__getitem__, nbytes, ranks,
                   pp.message_tag)

    plan = []
    if r < p - 1:
        plan += [message("send", i, r, r + 1, False) for i in (2, 0, 1)]
    if r > 0:
        plan += [message("recv", i, r - 1, r, False) for i in (0, 1, 2)]
        plan += [message("send", i, r, r - 1, True) for i in (1, 2, 0)]
    if r < p - 1:
        plan += [message("recv", i, r + 1, r, True) for i in (0, 1, 2)]

    def sent(work, function):
        assert callable(getattr(work, "wait", None)), \
            f"{what}: {function} returned {work!r}, not the send's work (what dist.isend returns): the caller waits on it"
        return work

    works, kept = [], []  # the sent tensors stay referenced until their sends complete
    with StageTracer(where, plan, async_sends=True) as tracer:
        if r < p - 1:
            for i in (2, 0, 1):
                kept.append(torch.full(shape, 10.0 * r + i, dtype=dtype))
                works.append(sent(pp.send_forward(kept[-1], i, r, p, group), "send_forward"))
        if r > 0:
            for i in (0, 1, 2):
                got = pp.recv_forward(shape, dtype, i, r, p, group)
                tracer.assert_received()
                assert torch.equal(got, torch.full(shape, 10.0 * (r - 1) + i, dtype=dtype)), \
                    f"{what}: received {got.flatten()[0].item()} ({got.dtype} {tuple(got.shape)}) for micro-batch {i} " \
                    f"from the previous stage; sent {dtype} {shape}"
            for i in (1, 2, 0):
                kept.append(torch.full(shape, -10.0 * r - i, dtype=dtype))
                works.append(sent(pp.send_backward(kept[-1], i, r, p, group), "send_backward"))
        if r < p - 1:
            for i in (0, 1, 2):
                got = pp.recv_backward(shape, dtype, i, r, p, group)
                tracer.assert_received()
                assert torch.equal(got, torch.full(shape, -10.0 * (r + 1) - i, dtype=dtype)), \
                    f"{what}: received gradient {got.flatten()[0].item()} ({got.dtype} {tuple(got.shape)}) for " \
                    f"micro-batch {i} from the next stage; sent {dtype} {shape}"
        work_meanwhile = torch.ones(8, 8) @ torch.ones(8, 8)  # the stage computes while its sends travel
        for work in works:
            work.wait()
    del work_meanwhile
    tracer.assert_plan_done()
    assert_ops(tracer, [op for op, _, _ in plan], what)
    assert_overlap(tracer, what, kinds=("send",))


def runner_step_on_rank(members, group, m: int = 2) -> None:
    """One GPipe step (the table written here, not the learner's) of a GPT with one block per
    stage, through ``PipelineRunner`` on ``group``: the messages are exactly the table's,
    between global ranks, and the loss and gradients those of the single-process GPT."""
    from labkit import pp
    from labkit.models import GPT
    ranks = members or list(range(dist.get_world_size()))
    p, r = dist.get_world_size(group), dist.get_rank(group)
    where = (f"pp.p2p: a GPipe step through the runner, {p} stages on "
             + (f"sub-group {members}" if members else "the whole world") + f", m={m}")
    what = f"{where}, stage {r} (global rank {ranks[r]})"
    cfg = config(p, 1, tie=False)  # a tied pair of ranks inside a sub-group is not supported
    model, reference = GPT(cfg).double(), GPT(cfg).double()
    stage = pp.StageModule(model, range(r, r + 1), first=r == 0, last=r == p - 1)
    order = expected_order("gpipe", p, m, r)
    runner = pp.PipelineRunner({r: stage}, p, group=group)
    x, y = tokens(m)
    xb, yb = x[:m * BATCH_PER_MICRO], y[:m * BATCH_PER_MICRO]
    plan, ops = step_ops(order, cfg, p, xb.shape[1], ranks)
    with StageTracer(where, plan) as tracer:
        loss, _ = runner.step([pp.Action(*parse(a)) for a in order], xb, yb, m, pp.gpt_loss)
    tracer.assert_plan_done()
    assert_ops(tracer, ops, what)
    expected = reference(xb, yb)[1]
    expected.backward()
    if loss is not None:
        assert_close(loss, expected.detach(), f"{what}: loss")
    names, reference_params = {id(q): n for n, q in model.named_parameters()}, dict(reference.named_parameters())
    for q in stage.parameters():
        assert q.grad is not None, f"{what}: {names[id(q)]} got no gradient"
        assert_close(q.grad, reference_params[names[id(q)]].grad, f"{what}: gradient of {names[id(q)]}")


@task("pp.p2p", points=3)
@pytest.mark.parametrize("world_size", PIPELINE_RANKS)
def test_activations_and_gradients_reach_their_stage(world_size):
    run_graded("pp.p2p", p2p_on_rank, world_size, None, configs.announce())


@task("pp.p2p", points=1)
def test_a_pipeline_on_a_subgroup_talks_to_global_ranks():
    # the pipeline axis of a mesh: stages 0, 1, 2 on global ranks 1, 2, 3, then on 0, 1, 3;
    # then the strided axis of a 2x2 grid: 2 stages on 0, 2, then on 1, 3
    run_graded("pp.p2p", p2p_on_rank, 4, SUBGROUPS, configs.announce())


# ----------------------------------------------------------------------------- schedules


def cases(kind: str, p: int) -> list[int]:
    if kind == "interleaved":
        return [p, 2 * p]
    return [1, p, 2 * p + 1] if kind in ("gpipe", "1f1b") else [p, 2 * p + 1]


@task("pp.gpipe", points=2)
@pytest.mark.parametrize("world_size", PIPELINE_RANKS)
def test_gpipe_trains_like_one_process(world_size):
    run_graded("pp.gpipe", run_schedule_on_rank, world_size, "gpipe", cases("gpipe", world_size), 1,
               world_size + 2, configs.announce(), DRAWS)


@task("pp.1f1b", points=2)
@pytest.mark.parametrize("world_size", PIPELINE_RANKS)
def test_1f1b_trains_like_one_process(world_size):
    run_graded("pp.1f1b", run_schedule_on_rank, world_size, "1f1b", cases("1f1b", world_size), 1,
               2 * world_size + 1, configs.announce(), DRAWS)


@task("pp.interleaved", points=2)
@pytest.mark.parametrize("world_size", PIPELINE_RANKS)
def test_interleaved_trains_like_one_process(world_size):
    run_graded("pp.interleaved", run_schedule_on_rank, world_size, "interleaved",
               cases("interleaved", world_size), 2, None, configs.announce(), DRAWS)


@task("pp.zero_bubble", points=2)
@pytest.mark.parametrize("world_size", PIPELINE_RANKS)
def test_zero_bubble_trains_like_one_process(world_size):
    run_graded("pp.zero_bubble", run_schedule_on_rank, world_size, "zero_bubble",
               cases("zero_bubble", world_size), 1, None, configs.announce(), DRAWS)


def table_and_bad_arguments(kind: str) -> None:
    """In this process: the schedule's whole table (every rank) for a few shapes, its run on
    the unit-cost clock (it finishes, with the chapter's bubble and micro-batches in flight),
    and ValueError for arguments it cannot take."""
    from labkit import pp
    task_id = SCHEDULES[kind]
    shapes = [(p, m, v) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 5, 8, 9)
              for v in ((1, 2, 3) if kind == "interleaved" else (1,)) if kind != "interleaved" or m % p == 0]
    for p, m, v in shapes:
        shape = f"p={p}, m={m}" + (f", v={v}" if kind == "interleaved" else "")
        table = schedule_of(kind, p, m, v)
        got = [[repr(a) for a in actions] for actions in table]
        want = [expected_order(kind, p, m, r, v) for r in range(p)]
        if (kind, p, m) in DRAWN:
            drawn = [[f"{a}s{r}" for a in row.split()] for r, row in enumerate(DRAWN[kind, p, m])]
            assert want == drawn, f"{task_id}: the test's own table for {shape} is not the paper's figure"
        assert got == want, f"{task_id}: {shape}: your table {got}; expected {want}"
        clock = pp.simulate(table)  # raises if the lists could never finish
        peaks = micro_batch_counts(kind, p, m, v)
        assert clock.peak_in_flight == peaks, \
            f"{task_id}: {shape}: on the clock the ranks hold {clock.peak_in_flight} micro-batches at most; expected {peaks}"
        if kind == "zero_bubble":
            # F, B, W one unit each: each rank works 3m units; ZB-H1 idles p - 1 of them once
            # m >= p, a third of 1F1B's 3 (p - 1)
            if m >= p:
                assert clock.makespan == 3 * m + p - 1, \
                    (f"{task_id}: {shape}: the step takes {clock.makespan:g} units on the clock; ZB-H1 "
                     f"takes 3m + p - 1 = {3 * m + p - 1} (a bubble of p - 1, a third of 1F1B's)")
        else:
            bubble = (p - 1) / (v * m + p - 1)
            assert abs(clock.bubble() - bubble) < 1e-9, \
                (f"{task_id}: {shape}: the bubble on the clock is {clock.bubble():.4f}; the chapter's "
                 f"(p - 1) / (v m + p - 1) is {bubble:.4f}")
    rng = random.Random(configs.announce())  # shapes drawn beyond the list: p up to 8, m up to 24, v up to 4
    for _ in range(40 * DRAWS):
        p, v = rng.randint(1, 8), rng.randint(1, 4) if kind == "interleaved" else 1
        m = rng.randint(1, 24)
        shape = f"drawn p={p}, m={m}" + (f", v={v}" if kind == "interleaved" else "")
        if kind == "interleaved" and m % p:
            with pytest.raises(ValueError, match="multiple"):
                schedule_of(kind, p, m, v)
            continue
        table = schedule_of(kind, p, m, v)
        got = [[repr(a) for a in actions] for actions in table]
        want = [expected_order(kind, p, m, r, v) for r in range(p)]
        assert got == want, f"{task_id}: {shape}: your table {got}; expected {want}"
        assert pp.simulate(table).peak_in_flight == micro_batch_counts(kind, p, m, v), \
            f"{task_id}: {shape}: micro-batches in flight on the clock"
    bad = [(lambda: schedule_of(kind, 2, 0, 2), "micro-batch"), (lambda: schedule_of(kind, 0, 4, 2), "rank")]
    if kind == "interleaved":
        bad += [(lambda: pp.interleaved_1f1b(3, 4, 2), "multiple"), (lambda: pp.interleaved_1f1b(2, 4, 0), "num_chunks")]
    for make, words in bad:
        with pytest.raises(ValueError, match=words):
            make()


@task("pp.gpipe", points=1)
def test_gpipe_table_and_bad_arguments():
    table_and_bad_arguments("gpipe")


@task("pp.1f1b", points=1)
def test_1f1b_table_and_bad_arguments():
    table_and_bad_arguments("1f1b")


@task("pp.interleaved", points=1)
def test_interleaved_table_and_bad_arguments():
    table_and_bad_arguments("interleaved")


@task("pp.zero_bubble", points=1)
def test_zero_bubble_table_and_bad_arguments():
    table_and_bad_arguments("zero_bubble")


@task("pp.gpipe", points=1)
def test_gpipe_matches_torch_schedule_gpipe():
    compare_with_builtin("gpipe", 2, 4, 1)


@task("pp.1f1b", points=1)
def test_1f1b_matches_torch_schedule_1f1b():
    compare_with_builtin("1f1b", 2, 4, 1)


@task("pp.interleaved", points=1)
def test_interleaved_matches_torch_schedule_interleaved_1f1b():
    compare_with_builtin("interleaved", 2, 4, 2)


@task("pp.zero_bubble", points=1)
def test_zero_bubble_matches_torch_schedule_interleaved_zero_bubble():
    compare_with_builtin("zero_bubble", 2, 4, 1)
