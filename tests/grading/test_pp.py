"""Graded tests for chapter 06: pipeline parallelism (labkit/pp.py).

Numbers: for every schedule, at p = 2, 3 and 4 pipeline ranks, with m = p and 2p + 1
micro-batches (m = 1 too where the schedule allows it; the interleaved one, at v = 2 chunks
per rank, with m = p and 2p), the loss and every parameter's gradient on every rank equal
the single-process GPT on the global batch, in float64, over 5 AdamW steps. The GPT has a
tied embedding/head, so its two halves live on the first and last ranks.

Behaviour: the order each rank executed its actions in (traced by the runner) equals the
schedule's table, derived here from its definition; the micro-batches in flight per stage
peak at m (GPipe) and p - s (1F1B), counted by the runner and measured as live tensor bytes
with labkit.memory; the same stages under torch.distributed.pipelining with the matching
built-in schedule give the same losses; bad arguments raise ValueError before anything runs.
"""

import itertools

import pytest
import torch
import torch.distributed as dist

from labkit.check import assert_close
from labkit.course.grading import run_graded, task

STEPS = 5
BATCH_PER_MICRO = 2
PIPELINE_RANKS = [2, 3, 4]
SCHEDULES = {"gpipe": "pp.gpipe", "1f1b": "pp.1f1b", "interleaved": "pp.interleaved",
             "zero_bubble": "pp.zero_bubble"}


# ----------------------------------------------------------------------------- the tables


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
    total = m * v
    def fwd(k):
        return f"F{(k // (p * v)) * p + k % p}s{((k // p) % v) * p + rank}"
    def bwd(k):
        return f"B{(k // (p * v)) * p + k % p}s{(v - 1 - (k // p) % v) * p + rank}"
    warmup = min((v - 1) * p + 2 * (p - 1 - rank), total)
    order = [fwd(k) for k in range(warmup)]
    for j in range(total - warmup):
        order += [fwd(warmup + j), bwd(j)]
    return order + [bwd(k) for k in range(total - warmup, total)]


def micro_batch_counts(kind: str, p: int, m: int) -> list[int]:
    """The schedule's peak of micro-batches in flight per stage (GPipe: all; 1F1B: p - s)."""
    return [m if kind == "gpipe" else min(p - s, m) for s in range(p)]


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


def train_pipeline(kind: str, m: int, v: int, tie: bool, check_against_reference: bool):
    """Our pipeline on this rank; per step the loss (on the last stage's rank) and, when
    checking, every gradient against the single-process GPT. Returns (losses, traces)."""
    from labkit import pp
    from labkit.models import GPT
    task_id = SCHEDULES[kind]
    p, rank = dist.get_world_size(), dist.get_rank()
    stages_total = p * v
    model, reference = GPT(config(p, v, tie)).double(), GPT(config(p, v, tie)).double()
    stages = pp.split_gpt(model, stages_total)
    mine = {s: stages[s] for s in range(stages_total) if pp.rank_of_stage(s, p) == rank}
    runner = pp.PipelineRunner(mine, stages_total, deferred_weights=kind == "zero_bubble")
    names = {id(q): n for n, q in model.named_parameters()}
    ours = [q for stage in mine.values() for q in dict.fromkeys(stage.parameters())]
    opt, opt_ref = torch.optim.AdamW(ours, lr=1e-2), torch.optim.AdamW(reference.parameters(), lr=1e-2)
    reference_params = dict(reference.named_parameters())
    actions = schedule_of(kind, p, m, v)[rank]
    x, y = tokens(m)
    losses, traces = [], []
    for step in range(STEPS):
        size = m * BATCH_PER_MICRO
        xb, yb = x[step * size:(step + 1) * size], y[step * size:(step + 1) * size]
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
    if kind in ("gpipe", "1f1b"):
        peak = traces[-1].peak_in_flight[rank]
        assert peak == micro_batch_counts(kind, p, m)[rank], \
            f"{task_id}: p={p}, m={m}: stage {rank} held {peak} micro-batches at once; expected {micro_batch_counts(kind, p, m)[rank]}"


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


def run_schedule_on_rank(kind: str, ms: list[int], v: int, memory_m: int | None):
    torch.set_num_threads(1)
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
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble)
    from labkit import pp
    from labkit.models import GPT
    torch.set_num_threads(1)
    p, rank = dist.get_world_size(), dist.get_rank()
    stages_total = p * v
    stages = pp.split_gpt(GPT(config(p, v, tie=False)).double(), stages_total)
    mine = [s for s in range(stages_total) if pp.rank_of_stage(s, p) == rank]
    torch_stages = [PipelineStage(stages[s], s, stages_total, torch.device("cpu")) for s in mine]
    schedule = {"gpipe": lambda: ScheduleGPipe(torch_stages[0], m, loss_fn=pp.gpt_loss),
                "1f1b": lambda: Schedule1F1B(torch_stages[0], m, loss_fn=pp.gpt_loss),
                "interleaved": lambda: ScheduleInterleaved1F1B(torch_stages, m, loss_fn=pp.gpt_loss),
                "zero_bubble": lambda: ScheduleInterleavedZeroBubble(torch_stages, m, loss_fn=pp.gpt_loss)}[kind]()
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
    gen = torch.Generator().manual_seed(0)
    for trial in range(60):
        n = 1 + trial % 7
        costs = torch.randint(1, 20, (n,), generator=gen).tolist()
        for k in range(1, n + 1):
            got, want = partition(costs, k), brute_force_partition(costs, k)
            assert got == want, f"pp.split: partition({costs}, {k}) = {got}; expected {want}"
    with pytest.raises(ValueError, match="layers"):
        partition([1, 2, 3], 4)


@task("pp.split", points=2)
def test_split_gpt_composes_back_to_the_model():
    from labkit.models import GPT
    from labkit.pp import layer_costs, partition, split_gpt
    for p, balance in ((1, "params"), (2, "params"), (3, "layers"), (4, "params")):
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


def p2p_on_rank(members=None):
    """Stages on the ranks of ``members`` (a subgroup, as the pipeline axis of a mesh; None:
    every rank) pass activations forward and gradients back, micro-batches out of order."""
    from labkit import pp
    from labkit.comm import CommTracer
    group = dist.new_group(members) if members else None
    if members and dist.get_rank() not in members:
        return
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    shape = (2, 3)
    with CommTracer() as tracer:
        works = []
        if rank < p - 1:  # send micro-batches out of order: the tags must keep them apart
            for i in (2, 0, 1):
                works.append(pp.send_forward(torch.full(shape, 10.0 * rank + i), i, rank, p, group))
        if rank > 0:
            for i in (0, 1, 2):
                got = pp.recv_forward(shape, torch.float32, i, rank, p, group)
                assert torch.equal(got, torch.full(shape, 10.0 * (rank - 1) + i)), \
                    f"pp.p2p: stage {rank} received {got[0, 0].item()} for micro-batch {i} from the previous stage"
            for i in (1, 2, 0):
                works.append(pp.send_backward(torch.full(shape, -10.0 * rank - i), i, rank, p, group))
        if rank < p - 1:
            for i in (0, 1, 2):
                got = pp.recv_backward(shape, torch.float32, i, rank, p, group)
                assert torch.equal(got, torch.full(shape, -10.0 * (rank + 1) - i)), \
                    f"pp.p2p: stage {rank} received gradient {got[0, 0].item()} for micro-batch {i} from the next stage"
        for work in works:
            work.wait()
    assert tracer.kinds() <= {"send", "recv"}, f"pp.p2p: use point-to-point messages only; traced {tracer.summary()}"


@task("pp.p2p", points=3)
@pytest.mark.parametrize("world_size", PIPELINE_RANKS)
def test_activations_and_gradients_reach_their_stage(world_size):
    run_graded("pp.p2p", p2p_on_rank, world_size)


@task("pp.p2p", points=1)
def test_a_pipeline_on_a_subgroup_talks_to_global_ranks():
    # the pipeline axis of a mesh: stages 0, 1, 2 on global ranks 1, 2, 3
    run_graded("pp.p2p", p2p_on_rank, 4, [1, 2, 3])


# ----------------------------------------------------------------------------- schedules


def cases(kind: str, p: int) -> list[int]:
    if kind == "interleaved":
        return [p, 2 * p]
    return [1, p, 2 * p + 1] if kind in ("gpipe", "1f1b") else [p, 2 * p + 1]


@task("pp.gpipe", points=2)
@pytest.mark.parametrize("world_size", PIPELINE_RANKS)
def test_gpipe_trains_like_one_process(world_size):
    run_graded("pp.gpipe", run_schedule_on_rank, world_size, "gpipe", cases("gpipe", world_size), 1,
               world_size + 2)


@task("pp.1f1b", points=2)
@pytest.mark.parametrize("world_size", PIPELINE_RANKS)
def test_1f1b_trains_like_one_process(world_size):
    run_graded("pp.1f1b", run_schedule_on_rank, world_size, "1f1b", cases("1f1b", world_size), 1,
               2 * world_size + 1)


@task("pp.interleaved", points=2)
@pytest.mark.parametrize("world_size", PIPELINE_RANKS)
def test_interleaved_trains_like_one_process(world_size):
    run_graded("pp.interleaved", run_schedule_on_rank, world_size, "interleaved",
               cases("interleaved", world_size), 2, None)


@task("pp.zero_bubble", points=2)
@pytest.mark.parametrize("world_size", PIPELINE_RANKS)
def test_zero_bubble_trains_like_one_process(world_size):
    run_graded("pp.zero_bubble", run_schedule_on_rank, world_size, "zero_bubble",
               cases("zero_bubble", world_size), 1, None)


def table_and_bad_arguments(kind: str) -> None:
    """In this process: the schedule's whole table (every rank) for a few shapes, a clock
    run of it that finishes, and ValueError for arguments it cannot take."""
    from labkit import pp
    task_id = SCHEDULES[kind]
    shapes = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 5, 8, 9)
              if kind != "interleaved" or m % p == 0]
    for p, m in shapes:
        table = schedule_of(kind, p, m, 2)
        got = [[repr(a) for a in actions] for actions in table]
        want = [expected_order(kind, p, m, r, 2) for r in range(p)]
        assert got == want, f"{task_id}: p={p}, m={m}: your table {got}; expected {want}"
        pp.simulate(table)  # raises if the lists could never finish
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
