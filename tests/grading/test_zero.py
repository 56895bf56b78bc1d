"""Graded tests for chapter 03: ZeRO stages 1 and 2 (``labkit/zero.py``).

Every check runs on every rank at world sizes 1-4 (3 gives uneven shards) on two models:
``ToyModel`` (a tied, a frozen and an unused parameter) and a small ``GPT`` (tied
embedding/head; its position embedding frozen here), both in float64 (see ``make_toy``).
Each rank trains on its slice of a global batch of 12 for 5 AdamW steps and, after every
step, compares every parameter with

* a single-process AdamW trained on the whole global batch (each rank computes it);
* for stage 1, ``torch.distributed.optim.ZeroRedundancyOptimizer`` fed the same averaged
  gradients (PyTorch ships no ZeRO-2 optimizer; FSDP's version is chapter 04).

Then behaviour and memory: optimizer state per rank <= 1/N of the single-process state plus
the largest parameter's; for stage 2, after backward each used parameter's gradient lives on
exactly one rank, equals the averaged global gradient, and a rank holds at most Φ/N + the
largest parameter of gradient bytes.

Communication: the whole traced signature of a step, every op with its count, group and
bytes, and nothing else (``labkit.comm.assert_ops``), from the partition and the shapes:

* ``partition_parameters``: nothing (every rank computes the same partition on its own), on
  the two models, three fixed lists and 20 drawn from the run's seed (1-12 tensors of 1-3
  dims, empty ones and ties included, float32/float64/bfloat16), against the greedy;
* stage 1 ``step()``: one all-gather over the group of the shards padded to the largest,
  N x max_r(numel of rank r's shard) x element size bytes (a broadcast of each rank's shard,
  or of each parameter, from its owner is accepted too); gradients arrive averaged, so no
  reduction at all;
* stage 2: during backward (autograd running), one reduce-scatter of the flat gradients of
  every trainable parameter, Φ bytes (uneven pieces: rank r's is its shard), nothing else;
  ``step()``: the all-gather of stage 1. Never an all-reduce: 2Φ per step, as DDP.

At world size 1 the collectives of one rank may be skipped. Φ = bytes of the trainable
parameters, a tied one counted once.

Subgroups: ``ShardedOptimizer(group=...)`` is the one group-taking API (``partition_parameters``
takes a world size, graded at 1-4). Inside each launch at 3 and 4 ranks, after the world, the
ToyModel trains over the subgroups of ``PARTITIONS`` (at 4 both axes of a 2x2 grid, {0,1}|{2,3}
and {0,2}|{1,3}; at 3 the pair {0,2}, rank 1 standing by), where the shard is the group rank's,
the traffic the group's, and the averages over the group's size:
    zero.stage1  ShardedOptimizer(group=) step(): world, those subgroups, and {1,2,3} of 4 (own test)
    zero.stage2  ShardedOptimizer(group=, shard_gradients=True): world and those subgroups
Param groups (zero.stage1 and zero.stage2, inside the world's launch): the ToyModel with two
groups, matrices with weight decay 0.05 and vectors with none and another lr, under an
optimizer with state (SGD with momentum, always; then K drawn from the run's seed:
AdamW, Adam with amsgrad, momentum or Nesterov SGD, a loss scaled by 0.25-3 before backward,
2-4 steps; ``tests/grading/configs.py``), then ``state_dict()`` into a new ShardedOptimizer
that takes one more step; parameters against the torch optimizer in one process after every
step.

Overlap: none claimed (ZeRO-2 here reduce-scatters once, at the end of backward, inside
autograd: checked by the event's in_backward flag).
"""

from contextlib import nullcontext
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from labkit.check import assert_close
from labkit.comm import CommTracer, Op, assert_ops
from labkit.data import markov_tokens, regression
from labkit.course.grading import run_graded, task
from labkit.memory import grad_bytes, optimizer_state_bytes, tensor_bytes
from labkit.models import GPT, GPTConfig, ToyModel, toy_loss
from tests.grading import configs

WORLD_SIZES = [1, 2, 3, 4]
STEPS = 5
GLOBAL_BATCH = 12          # divisible by 1, 2, 3 and 4: every rank gets an equal slice
OPTIMIZER = torch.optim.AdamW
OPTIONS = dict(lr=1e-2, weight_decay=0.1)  # weight decay: a wrongly stepped frozen/unused param shows
TRACED_STEP = 2            # the step whose communication is traced (never time under the tracer)


# ----------------------------------------------------------------------------- models and data


# float64: the GPT's key bias gets a gradient that is zero in exact arithmetic (softmax
# ignores a shift), so what arrives is rounding noise. Adam divides by the gradient's own
# RMS, which turns float32 noise (~1e-10, above eps) into lr-sized steps that differ between
# any two summation orders; float64 noise stays far below eps and the check stays tight.
def make_toy():
    return ToyModel(seed=0).double()


GPT_CONFIG = GPTConfig(block_size=8, n_embd=16)   # 2 layers, 2 heads, vocab 32: small and quick


def make_gpt():
    model = GPT(GPT_CONFIG, seed=0).double()   # lm_head.weight is wte.weight: tied
    model.wpe.weight.requires_grad_(False)   # and one frozen parameter
    return model


def toy_data():
    x, y = regression(STEPS * GLOBAL_BATCH, 8, 8, seed=1)
    return x.double(), y.double()


def gpt_data():
    return markov_tokens(STEPS * GLOBAL_BATCH, GPT_CONFIG.block_size, GPT_CONFIG.vocab_size, seed=1)


def gpt_loss(model, x, y):
    return model(x, y)[1]


MODELS = {"ToyModel": (make_toy, toy_data, toy_loss), "GPT": (make_gpt, gpt_data, gpt_loss)}


def one_thread() -> None:
    # Models this small gain nothing from intra-op threads, and ranks sharing a few cores
    # with threads of their own mostly wait for each other.
    torch.set_num_threads(1)


def trainable(model) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def batch(x, y, step, rank=0, world=1):
    """Rank ``rank``'s slice of the global batch of ``step``."""
    rows = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
    return x[rows].chunk(world)[rank], y[rows].chunk(world)[rank]


@dataclass
class Reference:
    grads: list[dict]      # per step, after backward: parameter name -> gradient (or None)
    params: list[dict]     # per step, after the optimizer step: parameter name -> value
    state_bytes: int       # optimizer state after the last step
    largest_state_bytes: int   # of one parameter


def single_process(model_name) -> Reference:
    """Plain AdamW on the whole global batch, in this process. Every rank computes it: a
    fraction of a second, less than the pytest process would spend importing what the
    rank server has preloaded."""
    make, data, loss_fn = MODELS[model_name]
    model, (x, y) = make(), data()
    opt = OPTIMIZER(trainable(model), **OPTIONS)
    grads, params = [], []
    for step in range(STEPS):
        loss_fn(model, *batch(x, y, step)).backward()
        grads.append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    per_param = [tensor_bytes(list(s.values())) for s in opt.state.values()]
    return Reference(grads, params, optimizer_state_bytes(opt), max(per_param))


def average_gradients(model, group=None) -> None:
    """What DDP does for stage 1: every rank ends with the mean gradient."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(dist.get_world_size(group))


def compare_params(model, expected: dict, what: str) -> None:
    for name, p in model.named_parameters():
        assert_close(p.detach(), expected[name], f"{what}, parameter {name}")


def itemsize(model) -> int:
    return trainable(model)[0].element_size()


def sizes(model):
    """(Φ, largest trainable parameter), in bytes."""
    nbytes = [p.numel() * p.element_size() for p in trainable(model)]
    return sum(nbytes), max(nbytes)


def assert_signature(traced, options, what: str) -> None:
    """``assert_ops`` against the technique's ops, ``options[0]`` = (label, ops); any later
    option is an accepted alternative. Fails with the first option's extra/missing ops."""
    errors = []
    for label, ops in options:
        try:
            assert_ops(traced, ops, f"{what} ({label})")
            return
        except AssertionError as error:
            errors.append(str(error))
    others = "; ".join(label for label, _ in options[1:])
    raise AssertionError(errors[0] + (f"\n  (nor is it any accepted alternative: {others})" if others else ""))


def shard_bytes_per_rank(partition, itemsize: int) -> list[int]:
    """Bytes of each rank's shard: the numels of the parameters the partition gives it."""
    return [sum(p.numel() for p in part) * itemsize for part in partition]


def gather_signatures(partition, itemsize: int, ranks) -> list:
    """The accepted ways for stage 1's step() to give every rank every updated parameter:
    the chapter's all-gather of the shards padded to the largest (N x max shard bytes); or
    a broadcast of each rank's shard, or of each parameter, from its owner. One rank alone
    may skip it."""
    n = len(ranks)
    shards = shard_bytes_per_rank(partition, itemsize)
    options = [(f"one all-gather of the shards padded to the largest: N x {max(shards)} B",
                [Op("all_gather", n * max(shards), ranks)]),
               ("a broadcast of each rank's shard from its owner",
                [Op("broadcast", b, ranks) for b in shards if b]),
               ("a broadcast of each parameter from its owner",
                [Op("broadcast", p.numel() * itemsize, ranks) for part in partition for p in part])]
    return options + [("nothing: one rank alone", [])] if n == 1 else options


def expected_partition(params, n: int) -> list[list[int]]:
    """The chapter's greedy, as indices into ``params``: largest first (equal sizes in the
    given order), each to the least loaded rank (the lowest on a tie), each rank's list in
    the given order."""
    loads, owner = [0] * n, {}
    for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):
        rank = min(range(n), key=lambda r: (loads[r], r))
        owner[i] = rank
        loads[rank] += params[i].numel()
    return [[i for i in range(len(params)) if owner[i] == rank] for rank in range(n)]


# ----------------------------------------------------------------------------- zero.partition


def partition_on_rank(seed: int) -> None:
    from labkit.zero import partition_parameters
    one_thread()
    rank, n = dist.get_rank(), dist.get_world_size()
    cases = {
        "ToyModel": trainable(make_toy()),
        "GPT": trainable(make_gpt()),
        "sizes 5,1,9,3,3,7,2": [torch.empty(s) for s in (5, 1, 9, 3, 3, 7, 2)],
        "six equal sizes": [torch.empty(3) for _ in range(6)],
        "fewer parameters than ranks": [torch.empty(4, 2), torch.empty(3)],
        "4 float64, 5 bfloat16, 3 float32, 2 float64, 5 bfloat16, 1 float64 (elements, not bytes)": [
            torch.empty(numel, dtype=dtype) for numel, dtype in ((4, torch.float64), (5, torch.bfloat16),
                                                                 (3, torch.float32), (2, torch.float64),
                                                                 (5, torch.bfloat16), (1, torch.float64))],
    }
    # Drawn from the run's seed (the same stream on every rank): 1-12 tensors of 1-3 dims and
    # dtypes of other sizes (the greedy counts elements), many of equal size (ties), some empty.
    rng = configs.stream(seed, "zero.partition")
    for i in range(configs.budget(ci=20, long=300)):
        shapes = [tuple(rng.choice((0, 1, 2, 3, 4, 6)) if rng.random() < 0.1 else rng.choice((1, 2, 3, 4, 6))
                        for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 12))]
        dtypes = [rng.choice((torch.float32, torch.float64, torch.bfloat16)) for _ in shapes]
        cases[f"drawn case {i}, shapes {shapes} {configs.replay('zero.partition')}"] = [
            torch.empty(shape, dtype=dtype) for shape, dtype in zip(shapes, dtypes)]
    for label, params in cases.items():
        what = f"zero.partition: rank {rank} of {n}, {label}"
        with CommTracer() as tracer:
            parts = partition_parameters(params, n)
        assert_ops(tracer, [], f"{what}: partition_parameters must not communicate (every rank computes "
                               "the same partition on its own)")
        assert isinstance(parts, (list, tuple)) and len(parts) == n, \
            f"{what}: expected one list of parameters per rank ({n}), got {type(parts).__name__} of {len(parts)}"
        index = {id(p): i for i, p in enumerate(params)}
        assigned = [[index.get(id(p), -1) for p in part] for part in parts]
        flat = sorted(i for part in assigned for i in part)
        assert flat == list(range(len(params))), (
            f"{what}: every parameter must go to exactly one rank; got parameter indices per rank "
            f"{assigned} (-1: not one of the given parameters)")
        loads = [sum(params[i].numel() for i in part) for part in assigned]
        largest = max(p.numel() for p in params)
        assert max(loads) - min(loads) <= largest, (
            f"{what}: elements per rank {loads} differ by {max(loads) - min(loads)}; greedy largest-first "
            f"keeps them within the largest parameter ({largest})")
        greedy = expected_partition(params, n)
        for r, (got, want) in enumerate(zip(assigned, greedy)):
            assert got == want, (
                f"{what}: rank {r} got parameters {got} (elements {[params[i].numel() for i in got]}); the "
                f"greedy gives it {want}: visit the parameters largest first (equal sizes in the given "
                f"order), each to the rank with the fewest elements so far (the lowest on a tie), and "
                f"list each rank's in the given order; all ranks: {assigned}, expected {greedy}")
        again = [[index[id(p)] for p in part] for part in partition_parameters(params, n)]
        assert again == assigned, f"{what}: not deterministic: {assigned}, then {again}"
        everyone = [None] * n
        dist.all_gather_object(everyone, assigned)
        for other, theirs in enumerate(everyone):
            assert theirs == assigned, (f"{what}: rank {other} computed {theirs}, this rank {assigned}; "
                                        "every rank must compute the same partition")


@task("zero.partition", points=1)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_partition(world_size):
    run_graded("zero.partition", partition_on_rank, world_size, configs.announce("zero.partition"))


# ----------------------------------------------------------------------------- param groups


# Optimizers with state, by name (sent to the ranks as names): each with options the groups
# below override, so that a group's options lost on the way show.
GROUP_OPTIMIZERS = {
    "AdamW": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "SGD momentum": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.1)),
    "Adam amsgrad": (torch.optim.Adam, dict(lr=1e-2, amsgrad=True, weight_decay=0.1)),
    "SGD nesterov": (torch.optim.SGD, dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.1)),
}
# Always run (the mutants that ignore groups die whatever the seed), then the drawn ones.
GROUP_CASES = [dict(optimizer="SGD momentum", loss_scale=2.0, lr_ratio=3.0, steps=3, replay="")]


def draw_group_cases(task_id: str, n: int) -> list[dict]:
    rng = configs.rng(f"{task_id}:{n}")
    return [dict(optimizer=rng.choice(sorted(GROUP_OPTIMIZERS)), loss_scale=rng.choice([1.0, 0.25, 3.0]),
                 lr_ratio=rng.choice([0.5, 2.0, 5.0]), steps=rng.randint(2, 4),
                 replay=configs.replay(f"{task_id}, world size {n}, drawn case {i}"))
            for i in range(configs.budget(ci=1, long=8))]


def two_groups(model, lr: float, lr_ratio: float) -> list[dict]:
    """The usual recipe: decay on matrices, none on biases and vectors, which also get another lr."""
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for _, p in trained if p.dim() >= 2], "weight_decay": 0.05},
            {"params": [p for _, p in trained if p.dim() < 2], "weight_decay": 0.0, "lr": lr * lr_ratio}]


def param_groups_case(task_id: str, case: dict) -> None:
    """ShardedOptimizer over two param groups with their own lr and weight decay (a frozen,
    a tied and an unused parameter in the model), an optimizer with state, a loss scaled
    before backward, several steps, then a state_dict() round trip into a new optimizer that
    takes one more step; against the torch optimizer on the global batch in one process."""
    from labkit.zero import ShardedOptimizer
    rank, n = dist.get_rank(), dist.get_world_size()
    stage2 = task_id == "zero.stage2"
    cls, options = GROUP_OPTIMIZERS[case["optimizer"]]
    (x, y), ours_model, ref_model = toy_data(), make_toy(), make_toy()
    ours = ShardedOptimizer(two_groups(ours_model, options["lr"], case["lr_ratio"]), cls,
                            shard_gradients=stage2, **options)
    ref = cls(two_groups(ref_model, options["lr"], case["lr_ratio"]), **options)
    where = (f"{task_id}: rank {rank} of {n}, ToyModel, {case['optimizer']} {options} over two param groups "
             f"(matrices weight_decay 0.05; vectors weight_decay 0 and lr x {case['lr_ratio']}), loss x "
             f"{case['loss_scale']} {case['replay']}")

    def train(step, model, opt, replica=None):
        (toy_loss(model, *batch(x, y, step, rank, n)) * case["loss_scale"]).backward()
        if not stage2:
            average_gradients(model)
        opt.step()
        opt.zero_grad()
        (toy_loss(ref_model, *batch(x, y, step)) * case["loss_scale"]).backward()
        ref.step()
        ref.zero_grad()
        compare_params(model, dict(ref_model.named_parameters()), f"{where}, after step {step}")

    for step in range(case["steps"]):
        train(step, ours_model, ours)
    saved = ours.state_dict()   # a collective: the whole state on every rank
    resumed_model = make_toy()
    resumed_model.load_state_dict(ours_model.state_dict())
    resumed = ShardedOptimizer(two_groups(resumed_model, options["lr"], case["lr_ratio"]), cls,
                               shard_gradients=stage2, **options)
    resumed.load_state_dict(saved)
    train(case["steps"], resumed_model, resumed)


# ----------------------------------------------------------------------------- zero.stage1


# Subgroups each launch also runs, after the world: partitions of the world (a rank in no part
# stands by). At 4 both axes of a 2x2 grid, at 3 the pair {0, 2} with rank 1 standing by.
PARTITIONS = {4: [[[0, 1], [2, 3]], [[0, 2], [1, 3]]], 3: [[[0, 2]]]}


def own_groups(partitions):
    """(group, its global ranks) of this rank in each partition (None, None where it is in no
    part). Every rank creates every group: new_group is collective."""
    for partition in partitions:
        made = [dist.new_group(ranks) for ranks in partition]
        index = next((i for i, ranks in enumerate(partition) if dist.get_rank() in ranks), None)
        yield (None, None) if index is None else (made[index], partition[index])


def stage1_on_rank(partitions=None, models=tuple(MODELS), drawn=()) -> None:
    """The world with ``models``, then the ToyModel on each subgroup of ``PARTITIONS``, then
    the param-group cases (``GROUP_CASES`` and ``drawn``); or, given ``partitions``, the
    ToyModel on those only."""
    one_thread()
    if not partitions:
        for case in [*GROUP_CASES, *drawn]:
            param_groups_case("zero.stage1", case)
    runs = [] if partitions else [(None, None, models)]
    for group, ranks in own_groups(partitions or PARTITIONS.get(dist.get_world_size(), [])):
        runs.append((group, ranks, ("ToyModel",)) if ranks else None)
    for run in runs:
        if run is not None:  # None: this rank stands by while a subgroup trains
            stage1_over(*run)
    if not partitions:
        one_parameter_many_ranks()


def one_parameter_many_ranks() -> None:
    """One parameter over N ranks: every rank but its owner owns nothing (no local optimizer,
    nothing to step), and all still receive the updated parameter."""
    from labkit.zero import ShardedOptimizer
    rank, n = dist.get_rank(), dist.get_world_size()
    model = torch.nn.Linear(4, 1, bias=False).double()
    torch.nn.init.constant_(model.weight, 1.0)
    opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.5)
    for step in range(2):
        model.weight.grad = torch.full_like(model.weight, 1.0)  # as if averaged: the same on every rank
        opt.step()
        opt.zero_grad()
        assert_close(model.weight.detach(), torch.full_like(model.weight, 1.0 - 0.5 * (step + 1)),
                     f"zero.stage1: rank {rank} of {n}, a model of one parameter (ranks other than its owner "
                     f"own nothing), after step {step}: the weight vs SGD in one process")


def stage1_over(group, group_ranks, models) -> None:
    # builtin_zero imports torch.distributed.optim on the ranks (whose server has it loaded),
    # not in the pytest process: it compiles TorchScript at import, seconds of work.
    from labkit.oracles import builtin_zero
    from labkit.zero import ShardedOptimizer
    rank = dist.get_rank()
    me, n = dist.get_rank(group), dist.get_world_size(group)
    for model_name in models:
        make, data, loss_fn = MODELS[model_name]
        ref = single_process(model_name)
        (x, y), ours_model, zro_model = data(), make(), make()
        ours = ShardedOptimizer(ours_model.parameters(), OPTIMIZER, group=group, **OPTIONS)
        zro = builtin_zero(zro_model.parameters(), OPTIMIZER, process_group=group, **OPTIONS)
        for step in range(STEPS):
            for model in (ours_model, zro_model):
                loss_fn(model, *batch(x, y, step, me, n)).backward()
                average_gradients(model, group)
            if step == TRACED_STEP:
                with CommTracer() as tracer:
                    ours.step()
            else:
                ours.step()
            zro.step()
            ours.zero_grad()
            zro.zero_grad()
            what = (f"zero.stage1: rank {rank} (rank {me} of {n} in the group {group_ranks or 'of all ranks'}), "
                    f"{model_name}, after step {step}")
            compare_params(ours_model, ref.params[step], what + " vs single-process AdamW")
            compare_params(ours_model, dict(zro_model.named_parameters()), what + " vs ZeroRedundancyOptimizer")

        what = f"zero.stage1: rank {rank} (rank {me} of {n}), {model_name}"
        assert "all_reduce" not in tracer.kinds(), (
            f"{what}: step() issued an all-reduce; stage 1 gets averaged gradients (from DDP) and only "
            "has to send the updated parameters")
        ranks = group_ranks or range(dist.get_world_size())
        assert_signature(tracer, gather_signatures(ours.partition, itemsize(ours_model), ranks),
                         f"{what}, step {TRACED_STEP}: step()")

        # Memory: this rank's optimizer state covers its shard only.
        mine = optimizer_state_bytes(ours)
        total = torch.tensor([mine], dtype=torch.float64)
        dist.all_reduce(total, group=group)
        assert total.item() == ref.state_bytes, (
            f"{what}: the ranks hold {total.item():,.0f} bytes of optimizer state together; the "
            f"single-process AdamW holds {ref.state_bytes:,} (each trained parameter's state exactly once)")
        bound = ref.state_bytes / n + ref.largest_state_bytes
        assert mine <= bound, (f"{what}: {mine:,} bytes of optimizer state on this rank; expected at most "
                               f"1/N of {ref.state_bytes:,} plus the largest parameter's "
                               f"{ref.largest_state_bytes:,} = {bound:,.0f}")


@task("zero.stage1", points=2)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_stage1(world_size):
    run_graded("zero.stage1", stage1_on_rank, world_size, None, tuple(MODELS), draw_group_cases("zero.stage1", world_size))


@task("zero.stage1", points=1)
def test_stage1_on_a_subgroup():
    # Ranks 1-3 of 4 shard among themselves; rank 0 stays out. Chapter 08 shards the
    # optimizer over the data-parallel group of a mesh, so group= must be honoured.
    run_graded("zero.stage1", stage1_on_rank, 4, [[[1, 2, 3]]])


# ----------------------------------------------------------------------------- zero.stage2


def check_sharded_grads(model, expected: dict, phi: int, largest: int, what: str, owned=None, group=None) -> None:
    """After backward: this rank's gradients are the averaged global ones of its shard (the
    shards of the ranks of ``group``)."""
    n = dist.get_world_size(group)
    names = [name for name, _ in model.named_parameters()]
    if owned is not None:
        mine = {id(p) for p in owned}
        kept = [name for name, p in model.named_parameters() if p.grad is not None and id(p) not in mine]
        assert not kept, (f"{what}: this rank holds gradients of {kept}, which other ranks own; ZeRO-2 keeps "
                          "only its own shard's gradients (drop each full gradient once it is in the flat buffer)")
    holders = torch.zeros(len(names))
    for i, (name, p) in enumerate(model.named_parameters()):
        if p.grad is not None:
            holders[i] = 1
            if expected[name] is None:
                raise AssertionError(f"{what}: parameter {name} has a gradient, but no backward reaches it")
            assert_close(p.grad, expected[name], f"{what}, gradient of {name} vs the single-process one")
    held = grad_bytes(model)
    assert held <= phi / n + largest, (
        f"{what}: this rank holds {held:,} bytes of gradients after backward; ZeRO-2 keeps its shard "
        f"only: at most Φ/N + the largest parameter = {phi / n + largest:,.0f} (Φ = {phi:,})")
    dist.all_reduce(holders, group=group)
    for name, count in zip(names, holders.tolist()):
        wanted = 0 if expected[name] is None else 1
        assert count == wanted, (f"{what}: parameter {name} has a gradient on {count:.0f} ranks after "
                                 f"backward; expected {wanted} (its owner{'' if wanted else ': none reaches it'})")


def stage2_on_rank(drawn=()) -> None:
    """The param-group cases (``GROUP_CASES`` and ``drawn``), the world with every model, then
    the ToyModel on each subgroup of ``PARTITIONS``."""
    one_thread()
    for case in [*GROUP_CASES, *drawn]:
        param_groups_case("zero.stage2", case)
    runs = [(None, list(range(dist.get_world_size())), MODELS)]
    for group, ranks in own_groups(PARTITIONS.get(dist.get_world_size(), [])):
        runs.append((group, ranks, {"ToyModel": MODELS["ToyModel"]}) if ranks else None)
    for run in runs:
        if run is not None:  # None: this rank stands by while a subgroup trains
            stage2_over(*run)


def stage2_over(group, ranks, models) -> None:
    from labkit.zero import ShardedOptimizer
    rank, me, n = dist.get_rank(), dist.get_rank(group), dist.get_world_size(group)
    where = f"rank {rank} of {n}" if group is None else f"rank {rank} (rank {me} of {n} in the group {ranks})"
    for model_name, (make, data, loss_fn) in models.items():
        ref = single_process(model_name)
        (x, y), ours_model = data(), make()
        ours = ShardedOptimizer(ours_model.parameters(), OPTIMIZER, shard_gradients=True, group=group, **OPTIONS)
        phi, largest = sizes(ours_model)
        for step in range(STEPS):
            what = f"zero.stage2: {where}, {model_name}, step {step}"
            traced = step == TRACED_STEP
            with CommTracer() if traced else nullcontext() as in_backward:
                loss_fn(ours_model, *batch(x, y, step, me, n)).backward()
            check_sharded_grads(ours_model, ref.grads[step], phi, largest, what + ", after backward", ours.owned,
                                group)
            with CommTracer() if traced else nullcontext() as in_step:
                ours.step()
            if traced:
                check_stage2_traffic(in_backward, in_step, ours, ours_model, what, ranks)
            ours.zero_grad()
            compare_params(ours_model, ref.params[step], what + ", after the step, vs single-process AdamW")


def check_stage2_traffic(in_backward: CommTracer, in_step: CommTracer, ours, model, what: str, ranks) -> None:
    """The whole signature of a ZeRO-2 step over ``ranks`` (global): one reduce-scatter of Φ
    during backward, then stage 1's all-gather in step(); nothing else anywhere."""
    n = len(ranks)
    report = f"\nduring backward:\n{in_backward.format()}\nduring step():\n{in_step.format()}"
    assert "all_reduce" not in in_backward.kinds() | in_step.kinds(), (
        f"{what}: an all-reduce was issued; ZeRO-2 reduce-scatters the gradients (each rank receives "
        f"its shard's sum only){report}")
    reducing = {"reduce_scatter", "reduce"}
    late = [e.op for e in in_step.events if e.kind in reducing]
    late += [e.op for e in in_backward.events if e.kind in reducing and not e.in_backward]
    assert not late, (f"{what}: gradient reductions {late} were issued after backward; issue them from "
                      f"the gradient hooks (or the end-of-backward callback){report}")
    phi = sum(shard_bytes_per_rank(ours.partition, itemsize(model)))
    reduce = [Op("reduce_scatter", phi, ranks)]
    during = [e for e in in_backward.events if e.in_backward]
    assert_signature(during, [(f"one reduce-scatter of the flat gradients, Φ = {phi} B", reduce)]
                     + [("nothing: one rank alone", [])] * (n == 1),
                     f"{what}: during backward")
    after = [e for e in in_backward.events if not e.in_backward] + in_step.events
    assert_signature(after, gather_signatures(ours.partition, itemsize(model), ranks),
                     f"{what}: after backward (outside autograd, and step())")


@task("zero.stage2", points=2)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_stage2(world_size):
    run_graded("zero.stage2", stage2_on_rank, world_size, draw_group_cases("zero.stage2", world_size))


# ----------------------------------------------------------------------------- a torch optimizer


def real_optimizer_on_rank():
    """ShardedOptimizer used as training code uses a torch optimizer: an LR scheduler, a
    state_dict round trip into a new model and optimizer that resumes exactly, and
    add_param_group before training."""
    from labkit.models import GPT, GPTConfig
    from labkit.zero import ShardedOptimizer
    torch.set_num_threads(1)
    rank, n = dist.get_rank(), dist.get_world_size()
    config = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
    reference = GPT(config).double()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    x, y = markov_tokens(4 * 8, config.block_size, config.vocab_size, seed=3)

    def make(model):
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, shard_gradients=True, lr=1e-2)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    def step(k, model, opt, sched):
        xb, yb = x[4 * k:4 * (k + 1)], y[4 * k:4 * (k + 1)]
        if 4 % n == 0:  # this rank's share of the batch
            share = 4 // n
            local = xb[rank * share:(rank + 1) * share], yb[rank * share:(rank + 1) * share]
        else:  # 3 ranks: each runs the whole batch; the average of equal gradients is the same
            local = xb, yb
        model(*local)[1].backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        reference(xb, yb)[1].backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()

    model = GPT(config).double()
    opt, sched = make(model)
    assert isinstance(opt, torch.optim.Optimizer), "zero.stage1: ShardedOptimizer must be a torch.optim.Optimizer"
    for k in range(3):
        step(k, model, opt, sched)
    expected_lr = 1e-2 * 0.5 ** (3 // 2)  # StepLR(step_size=2, gamma=0.5) after 3 steps
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == expected_lr, \
        f"zero.stage1: after 3 StepLR steps lr is {opt.param_groups[0]['lr']}; expected {expected_lr}"
    saved = opt.state_dict()  # a collective: the whole state, on every rank
    expected = ref_opt.state_dict()
    assert sorted(saved["state"]) == sorted(expected["state"]), "zero.stage1: state_dict() lacks some parameters' state"
    for index, state in expected["state"].items():
        for key, value in state.items():
            assert_close(torch.as_tensor(saved["state"][index][key]).double(), torch.as_tensor(value).double(),
                         f"zero.stage1: rank {rank}: state_dict()['state'][{index}][{key!r}] vs one AdamW")
    # Resume as a restarted job would: a new model and optimizer, loaded from the saved dicts.
    resumed = GPT(config).double()
    resumed.load_state_dict(model.state_dict())
    opt2, sched2 = make(resumed)
    opt2.load_state_dict(saved)
    sched2.load_state_dict(sched.state_dict())
    for k in range(3, 5):
        step(k, resumed, opt2, sched2)
    for (name, p), q in zip(resumed.named_parameters(), reference.parameters()):
        assert_close(p, q, f"zero.stage1: rank {rank}: {name} after a state_dict round trip and 2 more steps")
    extra = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    grown = ShardedOptimizer([torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))], torch.optim.SGD, lr=0.1)
    grown.add_param_group({"params": [extra], "lr": 0.5})
    assert [g["lr"] for g in grown.param_groups] == [0.1, 0.5] and sum(len(ps) for ps in grown.partition) == 2, \
        "zero.stage1: add_param_group must add the group (with its options) and repartition"


@task("zero.stage1", points=2)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_real_torch_optimizer_schedulers_and_state_dicts(world_size):
    run_graded("zero.stage1", real_optimizer_on_rank, world_size)
