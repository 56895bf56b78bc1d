"""Graded tests for chapter 01: data parallelism.

Every training check runs STEPS optimizer steps and compares, after every step, each
parameter (and gradient) with a single process trained on the global batch: on every rank,
at world sizes 1-4 (3 ranks give unequal shards), with models that have a tied, a frozen and
an unused parameter (ToyModel) and a small GPT with tied embeddings and a frozen position
embedding. Where PyTorch ships the technique it is compared too (DistributedSampler, DDP).

* dp.sampler: index by index against DistributedSampler over lengths that divide and do
  not, drop_last both ways, shuffled or not, several seeds and epochs; with no
  communication at all (shared randomness, not messages: the trace must be empty). Then 200
  configurations drawn from the run's seed (lengths to 5000, 1-9 replicas, seeds to 2**62,
  epochs to 1e6; ``LABKIT_LONG=1``: 5000).
* dp.grad_average: equal shards (plain mean, also against DDP), unequal shards (weighted by
  samples), a model with float64 and float32 parameters (``MixedToy``: each gradient averaged
  in its own dtype; float32 tolerances), a parameter unused on some ranks only (world sizes 2-4: one rank has no "some"),
  and a world split into two groups that average separately (group=). At every step the
  tracer checks the whole signature: first ONE agreement all-reduce of P + 1 values (a flag
  per trainable parameter, plus the weight), then one all-reduce per gradient that some rank
  has, numel x element size of that parameter in its own dtype, all on the averaging group,
  after backward; nothing else.
  Subgroups (average_gradients(group=) is the chapter's one group-taking function; the
  others take replica counts, ranks or devices): inside the equal-shard and the weighted
  launches at 2-4 ranks, the world split in halves, then (at 4) the 2x2 grid's strided axis
  {0,2}|{1,3} and (at 3) {0,2} beside {1} alone, each group averaging over itself only,
  plain and weighted by num_samples (unequal shards of 10 samples).
  No task of this chapter claims overlap.
* dp.data_parallel: one process, K = 1-4 replicas on threads; outputs, gradients and
  parameters match the plain module; replicas are connected copies, run concurrently,
  keep grad mode and re-raise errors.
* dp.parameter_server: at world sizes 2-4 (rank 0 serves, so a single rank cannot run
  one): staleness 0 equals synchronous SGD step by step; with a bound s > 0 and a slow
  worker, no applied gradient is more than s versions old, some are, and training converges.
  The trace of each rank is the protocol's, message by message: per worker and iteration,
  two headers (5 float64 each) from the worker to rank 0, the version (1 float64) and the
  flat parameters (numel x element size) from rank 0 to it, and its flat gradient back; rank
  0 receives the headers from any source and each gradient from the worker named in its
  header; plus the final broadcast of the parameters. Staleness 0 also on drawn cases (a
  drawn float32 model, 2-4 global batches of drawn sizes, a scaled loss, a drawn lr).
"""

import contextlib
import dataclasses
import functools
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, DistributedSampler

from labkit.check import assert_close, tolerance
from labkit.comm import CommTracer, Op, assert_ops
from labkit.data import markov_tokens, regression
from labkit.course.grading import run_graded, task
from labkit.models import GPT, GPTConfig, ToyModel, toy_loss
from labkit.oracles import builtin_ddp
from tests.grading import configs
from tests.grading.configs import DrawnMLP, draw_model, draw_partition, mlp_data, mlp_loss

WORLD_SIZES = [1, 2, 3, 4]
STEPS = 5
GPT_CONFIG = GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16)


# ----------------------------------------------------------------------------- models and data


@contextlib.contextmanager
def one_thread():
    """Tiny models: a second intra-op thread per process only fights the other processes
    for the cores (on a busy 2-core machine it makes these tests several times slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make_toy():
    return ToyModel(seed=0).double()  # float64: the comparisons stay tight over many steps


class MixedToy(torch.nn.Module):
    """The ToyModel's weights in two dtypes: a float64 matrix (used twice) and float32 biases,
    plus a float32 vector no forward uses. Autograd gives each gradient its parameter's dtype,
    and so must the average."""

    def __init__(self):
        super().__init__()
        toy = make_toy()
        self.weight = torch.nn.Parameter(toy.shared.detach().clone())
        self.bias = torch.nn.Parameter(toy.bias_in.detach().float())
        self.out = torch.nn.Parameter(toy.bias_out.detach().float())
        self.unused = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        h = torch.tanh(x @ self.weight.t() + self.bias)   # float64 + float32 -> float64
        return h @ self.weight + self.out


def make_gpt():
    model = GPT(GPT_CONFIG, seed=0)  # lm_head.weight is wte.weight (tied)
    model.wpe.requires_grad_(False)  # and one frozen parameter
    return model


def gpt_loss(model, x, y):
    return model(x, y)[1]


def toy_batches(batch, steps=STEPS, seed=1):
    x, y = regression(batch * steps, 8, 8, seed=seed)
    return list(zip(x.double().split(batch), y.double().split(batch)))


def gpt_batches(batch, steps=STEPS, seed=2):
    x, y = markov_tokens(batch * steps, GPT_CONFIG.block_size, GPT_CONFIG.vocab_size, seed=seed)
    return list(zip(x.split(batch), y.split(batch)))


# (name, model factory, loss, global batches, learning rate)
def cases(batch):
    return [("ToyModel float64", make_toy, toy_loss, toy_batches(batch), 0.1),
            ("GPT float32", make_gpt, gpt_loss, gpt_batches(batch), 0.1)]


def sgd(model, lr):
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def compare_grads(model, ref, what, rtol=None, atol=None):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None or p.grad is None:
            assert p.grad is None and q.grad is None, (
                f"{what}, {name}.grad: {'None' if p.grad is None else 'a tensor'}, expected "
                f"{'None' if q.grad is None else 'a tensor'}")
            continue
        assert_close(p.grad, q.grad, f"{what}, {name}.grad", rtol, atol)


def compare_params(model, ref, what, rtol=None, atol=None):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.detach(), q.detach(), f"{what}, {name}", rtol, atol)


# ----------------------------------------------------------------------------- dp.sampler

LENGTHS = [0, 1, 2, 3, 5, 8, 12, 13, 17, 100]


def sampler_on_rank(seed: int) -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    with CommTracer() as tracer:
        check_sampler(rank, n, seed)
    # Every rank draws the same permutation from the same seed: nothing to send.
    assert_ops(tracer, [], f"dp.sampler: rank {rank} of {n}: shard_indices and ShardSampler must not "
                           "communicate (every rank draws the same seeded permutation itself)")


def check_sampler(rank: int, n: int, seed: int) -> None:
    from labkit.dp import ShardSampler, shard_indices, shard_size
    for length in LENGTHS:
        for shuffle in (True, False):
            for drop_last in (False, True):
                for seed in (0, 7):
                    # num_replicas and rank come from the process group on both sides.
                    builtin = DistributedSampler(range(length), shuffle=shuffle, seed=seed, drop_last=drop_last)
                    ours = ShardSampler(range(length), shuffle=shuffle, seed=seed, drop_last=drop_last)
                    what = (f"dp.sampler: rank {rank} of {n}, dataset of {length}, shuffle={shuffle}, "
                            f"seed {seed}, drop_last={drop_last}")
                    got = shard_size(length, n, drop_last)
                    assert got == len(builtin), f"{what}: shard_size {got}, DistributedSampler has {len(builtin)}"
                    for epoch in (0, 1, 2):
                        builtin.set_epoch(epoch)
                        ours.set_epoch(epoch)
                        expected = list(builtin)
                        got = shard_indices(length, n, rank, shuffle, seed, epoch, drop_last)
                        assert got == expected, f"{what}, epoch {epoch}: {_first_difference(got, expected)}"
                        assert list(ours) == expected and len(ours) == len(builtin), (
                            f"{what}, epoch {epoch}: ShardSampler yields {list(ours)}, expected {expected}")
    # More replicas than this group has, with explicit ranks: every rank checks them all.
    for replicas in (5, 7):
        for r in range(replicas):
            for length in (3, 11, 20):
                for drop_last in (False, True):
                    builtin = DistributedSampler(range(length), replicas, r, True, 3, drop_last)
                    builtin.set_epoch(4)
                    got = shard_indices(length, replicas, r, True, 3, 4, drop_last)
                    assert got == list(builtin), (
                        f"dp.sampler: rank {r} of {replicas} (explicit), dataset of {length}, seed 3, epoch 4, "
                        f"drop_last={drop_last}: {_first_difference(got, list(builtin))}")
    # Drawn (the run's seed, the same on every rank): any length, replica count, rank, seed
    # (up to 2**62), epoch, shuffle and drop_last, against DistributedSampler.
    rng = configs.stream(seed, "dp.sampler")
    for _ in range(configs.budget(ci=200, long=5000)):
        length, replicas = rng.choice((rng.randint(0, 40), rng.randint(0, 5000))), rng.randint(1, 9)
        r, shuffle, drop_last = rng.randrange(replicas), rng.random() < 0.7, rng.random() < 0.5
        sampler_seed, epoch = rng.choice((rng.randint(0, 99), rng.randint(0, 2 ** 62))), rng.randint(0, 10 ** 6)
        builtin = DistributedSampler(range(length), replicas, r, shuffle, sampler_seed, drop_last)
        builtin.set_epoch(epoch)
        got = shard_indices(length, replicas, r, shuffle, sampler_seed, epoch, drop_last)
        assert got == list(builtin), (
            f"dp.sampler: rank {r} of {replicas} (explicit), dataset of {length}, shuffle={shuffle}, seed "
            f"{sampler_seed}, epoch {epoch}, drop_last={drop_last}: {_first_difference(got, list(builtin))} "
            f"{configs.replay('dp.sampler')}")
        assert shard_size(length, replicas, drop_last) == len(builtin), (
            f"dp.sampler: shard_size({length}, {replicas}, drop_last={drop_last}) = "
            f"{shard_size(length, replicas, drop_last)}, DistributedSampler has {len(builtin)} {configs.replay()}")
    # In a DataLoader: the same batches as with DistributedSampler.
    data = torch.arange(23)
    ours = [b.tolist() for b in DataLoader(data, batch_size=2, sampler=_set(ShardSampler(data, seed=5)))]
    theirs = [b.tolist() for b in DataLoader(data, batch_size=2, sampler=_set(DistributedSampler(data, seed=5)))]
    assert ours == theirs, f"dp.sampler: rank {rank} of {n}, DataLoader batches {ours}, expected {theirs}"


def _set(sampler, epoch=1):
    sampler.set_epoch(epoch)
    return sampler


def _first_difference(got, expected) -> str:
    if len(got) != len(expected):
        return f"{len(got)} indices, expected {len(expected)} (got {got[:12]}, expected {expected[:12]})"
    i = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
    return f"position {i}: index {got[i]}, DistributedSampler gives {expected[i]} (got {got[:12]}, expected {expected[:12]})"


@task("dp.sampler", points=1)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_sampler_matches_distributed_sampler(world_size):
    run_graded("dp.sampler", sampler_on_rank, world_size, configs.announce("dp.sampler"))


# ----------------------------------------------------------------------------- dp.grad_average


FLAG_VALUES = "a flag per trainable parameter plus the weight"


def check_average_ops(tracer, model, has_grad, group_ranks, what) -> None:
    """The whole signature of one average_gradients call, derived from the model's shapes.

    ``has_grad[i]``: whether trainable parameter i has a gradient on SOME rank of the group.
    Expected, all on ``group_ranks``: first one all-reduce of P + 1 values (any one dtype:
    the flags and the weight), then one all-reduce per parameter in ``has_grad``, of
    numel x element size in the parameter's dtype; nothing else, nothing in backward."""
    params = [p for p in model.parameters() if p.requires_grad]
    events = tracer.events
    flag_size = events[0].dtype.itemsize if events and events[0].dtype is not None else 8
    flags = Op("all_reduce", (len(params) + 1) * flag_size, group_ranks)
    grads = [Op("all_reduce", p.numel() * p.element_size(), group_ranks) for p, g in zip(params, has_grad) if g]
    assert_ops(tracer, [flags, *grads],
               f"{what}: one all-reduce of the {len(params) + 1} agreement values ({FLAG_VALUES}), then one "
               f"all-reduce per gradient some rank has ({len(grads)}), over ranks {tuple(group_ranks)}")
    assert tracer.ops(events[:1]) == [flags], (
        f"{what}: the first all-reduce was {tracer.ops(events[:1])[0]!r}; the ranks must agree first, "
        f"in one all-reduce of {len(params) + 1} values ({FLAG_VALUES}), before reducing any gradient")
    dtypes = sorted(str(e.dtype) for e in events[1:])
    want = sorted(str(p.dtype) for p, g in zip(params, has_grad) if g)
    assert dtypes == want, (f"{what}: gradients all-reduced in dtypes {dtypes}, expected their own {want}: "
                            "reduce each .grad as it is, without a cast")
    assert not any(e.in_backward for e in events), f"{what}: communicated inside backward"


def some_rank_has_grad(ref) -> list[bool]:
    """Per trainable parameter: does the single process (all ranks' data) get a gradient?"""
    return [q.grad is not None for q in ref.parameters() if q.requires_grad]


def grad_average_on_rank(batch: int, weighted: bool) -> None:
    """Train with average_gradients on each rank's shard; compare with the global batch."""
    torch.set_num_threads(1)  # see one_thread()
    from labkit.dp import average_gradients
    rank, n = dist.get_rank(), dist.get_world_size()
    # Unequal shards test the weighting; the ToyModel alone is enough for that.
    mixed = ("float64 and float32 parameters in one model", MixedToy, toy_loss, toy_batches(batch), 0.1)
    for name, make_model, loss_fn, batches, lr in [*cases(batch)[:1 if weighted else 2], mixed]:
        # float32 parameters feed float64 ones: after a step every value carries float32 rounding.
        tol = tolerance(torch.float32) if make_model is MixedToy else (None, None)
        model, ref = make_model(), make_model()
        opt, ref_opt = sgd(model, lr), sgd(ref, lr)
        # DDP is the built-in for the plain mean (equal shards).
        ddp = None
        if not weighted:
            ddp_model = make_model()
            ddp = builtin_ddp(ddp_model, find_unused_parameters=True)
            ddp_opt = sgd(ddp_model, lr)
        frozen = {k: p.detach().clone() for k, p in model.named_parameters() if not p.requires_grad}
        for step, (x, y) in enumerate(batches):
            what = f"dp.grad_average: rank {rank} of {n}, {name}, global batch {batch}, step {step}"
            xs, ys = x.tensor_split(n)[rank], y.tensor_split(n)[rank]
            ref_opt.zero_grad(set_to_none=True)
            loss_fn(ref, x, y).backward()  # the single process on the global batch
            opt.zero_grad(set_to_none=True)
            loss_fn(model, xs, ys).backward()
            with CommTracer() as tracer:
                average_gradients(model, num_samples=len(xs) if weighted else None)
            check_average_ops(tracer, model, some_rank_has_grad(ref), range(n), what)
            compare_grads(model, ref, what, *tol)
            opt.step()
            ref_opt.step()
            compare_params(model, ref, what + " (after the step)", *tol)
            if ddp is not None:
                ddp_opt.zero_grad(set_to_none=True)
                loss_fn(ddp, xs, ys).backward()
                ddp_opt.step()
                for (k, p), q in zip(model.named_parameters(), ddp_model.parameters()):
                    assert_close(p.detach(), q.detach(), f"{what}, {k} vs DistributedDataParallel", *tol)
        for k, p in model.named_parameters():
            if k in frozen:
                assert torch.equal(p.detach(), frozen[k]), f"dp.grad_average: rank {rank}, {name}: frozen {k} changed"
    if n > 1:
        average_in_groups(rank, n, weighted)


# Partitions of the world whose groups average separately (group=), in the world's launch:
# halves; at 4 also the strided axis of a 2x2 grid, at 3 the pair {0, 2} beside {1} alone.
STRIDED = {4: [[0, 2], [1, 3]], 3: [[0, 2], [1]]}


def average_in_groups(rank: int, n: int, weighted: bool) -> None:
    """Each partition of the world in turn, every group averaging over itself only (group=);
    ``weighted``: unequal shards (10 samples split in the group) and num_samples."""
    for partition in [[list(range(n // 2)), list(range(n // 2, n))]] + ([STRIDED[n]] if n in STRIDED else []):
        average_in_partition(rank, n, partition, weighted)
    from labkit.dp import average_gradients
    frozen = torch.nn.Linear(3, 2).requires_grad_(False)  # nothing to average: no trainable parameter
    with CommTracer() as tracer:
        average_gradients(frozen, num_samples=5 if weighted else None)
    assert not tracer.events and all(p.grad is None for p in frozen.parameters()), (
        f"dp.grad_average: rank {rank} of {n}, a model without trainable parameters: communicated "
        f"{tracer.summary()} or set gradients; there is nothing to average")


def average_in_partition(rank: int, n: int, partition, weighted: bool) -> None:
    from labkit.dp import average_gradients
    groups = [dist.new_group(ranks) for ranks in partition]  # every rank creates every group
    members = next(ranks for ranks in partition if rank in ranks)
    group = groups[partition.index(members)]
    batch = 10 if weighted else 12
    x, y = toy_batches(batch, steps=1, seed=4 + partition.index(members))[0]  # each group its own batch
    model, ref = make_toy(), make_toy()
    xs, ys = x.tensor_split(len(members))[members.index(rank)], y.tensor_split(len(members))[members.index(rank)]
    toy_loss(model, xs, ys).backward()
    toy_loss(ref, x, y).backward()  # the group's global batch in one process
    what = (f"dp.grad_average: rank {rank} of {n}, averaging over its group {members} of {partition} only "
            f"(group=)" + (f", weighted by num_samples={len(xs)}" if weighted else ""))
    with CommTracer() as tracer:
        average_gradients(model, group=group, num_samples=len(xs) if weighted else None)
    check_average_ops(tracer, model, some_rank_has_grad(ref), members, what)
    compare_grads(model, ref, what + ", vs the group's global batch")


@task("dp.grad_average", points=1)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_grad_average_equal_shards(world_size):
    # 12 splits evenly over 1-4 ranks: the mean of the ranks' gradients is the global one.
    run_graded("dp.grad_average", grad_average_on_rank, world_size, 12, False)


@task("dp.grad_average", points=1)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_grad_average_unequal_shards_weighted(world_size):
    # 10 samples: 5+5, 4+3+3, 3+3+2+2. Only weighting by samples recovers the global mean.
    run_graded("dp.grad_average", grad_average_on_rank, world_size, 10, True)


def partially_unused_on_rank() -> None:
    """``unused`` gets a gradient on even ranks only (a penalty term there)."""
    torch.set_num_threads(1)  # see one_thread()
    from labkit.dp import average_gradients
    rank, n = dist.get_rank(), dist.get_world_size()

    def local_loss(model, x, y, r):
        loss = toy_loss(model, x, y)
        return loss + 0.1 * model.unused.square().sum() if r % 2 == 0 else loss

    model, ref = make_toy(), make_toy()
    opt, ref_opt = sgd(model, 0.1), sgd(ref, 0.1)
    for step, (x, y) in enumerate(toy_batches(12)):
        what = f"dp.grad_average: rank {rank} of {n}, `unused` used on even ranks only, step {step}"
        ref_opt.zero_grad(set_to_none=True)
        # The objective is the mean of the ranks' losses; one process computes all of them.
        ref_loss = sum(local_loss(ref, xs, ys, r) for r, (xs, ys) in enumerate(zip(x.tensor_split(n), y.tensor_split(n))))
        (ref_loss / n).backward()
        opt.zero_grad(set_to_none=True)
        local_loss(model, x.tensor_split(n)[rank], y.tensor_split(n)[rank], rank).backward()
        with CommTracer() as tracer:
            average_gradients(model)
        # `unused` has a gradient on the even ranks only: every rank must still reduce it.
        check_average_ops(tracer, model, some_rank_has_grad(ref), range(n), what)
        compare_grads(model, ref, what)
        opt.step()
        ref_opt.step()
        compare_params(model, ref, what + " (after the step)")


@task("dp.grad_average", points=1)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_grad_average_parameter_unused_on_some_ranks(world_size):
    # Ranks that skip their own None gradients issue fewer all-reduces than the others:
    # the collectives no longer line up, and the job fails or hangs. (One rank alone has
    # no "other ranks": world size 1 is covered by the tests above.)
    run_graded("dp.grad_average", partially_unused_on_rank, world_size, timeout=30)


# Drawn configurations (tests/grading/configs.py: a new seed each run, printed in every
# failure; LABKIT_SEED replays, LABKIT_LONG=1 draws more), in one launch of 4 ranks: a drawn
# model (float32/float64 layers in any order, biases or not, frozen and tied parameters), the
# world cut into a drawn partition of groups, each averaging over itself; equal shards and
# the plain mean, or shards of drawn unequal sizes and num_samples; a layer that a drawn set
# of ranks uses (none, some or all); a loss scaled by a drawn factor; SGD with momentum in two
# parameter groups (another lr, weight decay on one). Three steps, each checked against the
# group's global batch in one process: every gradient, every parameter after the step, and
# the whole trace. Tolerance: float32's, with an absolute 2e-5 for gradients near zero.

DRAWN_WORLD = 4


def draw_averages() -> list[dict]:
    rng = configs.rng("dp.grad_average")
    cases = []
    for i in range(configs.budget(ci=4, long=30)):
        groups = draw_partition(rng, DRAWN_WORLD)
        weighted = rng.random() < 0.5
        per_rank = rng.randint(1, 3)
        shards = [[rng.randint(1, 4) if weighted else per_rank for _ in g] for g in groups]
        cases.append(dict(spec=draw_model(rng, f"drawn case {i}"), groups=groups, weighted=weighted, shards=shards,
                          spare_users=sorted(rng.sample(range(DRAWN_WORLD), rng.randint(0, DRAWN_WORLD))),
                          label=f"drawn case {i} {configs.replay(f'dp.grad_average, case {i}')}"))
    return cases


def spare_penalty(model, rank: int, users) -> torch.Tensor | float:
    """A term on the unused layer from the ranks in ``users`` only (none of it if there is no such layer)."""
    if not hasattr(model, "spare") or rank not in users:
        return 0.0
    return 0.1 * sum(p.double().square().sum() for p in model.spare.parameters())


def two_groups(model) -> torch.optim.Optimizer:
    """SGD with momentum; weights in one parameter group, biases (with weight decay) in another."""
    params = [p for p in model.parameters() if p.requires_grad]
    weights = [p for p in params if p.dim() > 1]
    biases = [p for p in params if p.dim() <= 1]
    return torch.optim.SGD([dict(params=weights), dict(params=biases, lr=0.05, weight_decay=0.1)],
                           lr=0.1, momentum=0.9)


def drawn_average_on_rank(cases: list[dict]) -> None:
    torch.set_num_threads(1)  # see one_thread()
    from labkit.dp import average_gradients
    rank = dist.get_rank()
    for case in cases:
        groups, spec = case["groups"], case["spec"]
        made = [dist.new_group(g) for g in groups]  # every rank creates every group
        index = next(i for i, g in enumerate(groups) if rank in g)
        members, shards = groups[index], case["shards"][index]
        me, total = members.index(rank), sum(shards)
        model, ref = DrawnMLP(spec), DrawnMLP(spec)
        opt, ref_opt = two_groups(model), two_groups(ref)
        x, y = mlp_data(spec, 3 * total)
        for step in range(3):
            what = (f"dp.grad_average: rank {rank} in group {members} of {groups}, shards {shards}"
                    f"{', num_samples' if case['weighted'] else ', plain mean'}, {case['label']}, step {step}")
            gx, gy = x[step * total:(step + 1) * total], y[step * total:(step + 1) * total]
            xs, ys = gx.split(shards), gy.split(shards)
            ref_opt.zero_grad(set_to_none=True)
            # The objective: the ranks' losses weighted by their samples (or equally), in one process.
            share = [n / total for n in shards] if case["weighted"] else [1 / len(members)] * len(members)
            sum(w * (mlp_loss(spec, ref, a, b) + spare_penalty(ref, r, case["spare_users"]))
                for w, a, b, r in zip(share, xs, ys, members)).backward()
            opt.zero_grad(set_to_none=True)
            (mlp_loss(spec, model, xs[me], ys[me]) + spare_penalty(model, rank, case["spare_users"])).backward()
            with CommTracer() as tracer:
                average_gradients(model, group=made[index], num_samples=shards[me] if case["weighted"] else None)
            check_average_ops(tracer, model, some_rank_has_grad(ref), members, what)
            compare_grads(model, ref, what, 1e-5, 2e-5)
            opt.step()
            ref_opt.step()
            compare_params(model, ref, what + " (after the step)", 1e-5, 2e-5)


@task("dp.grad_average", points=1)
def test_grad_average_drawn_configurations():
    run_graded("dp.grad_average", drawn_average_on_rank, DRAWN_WORLD, draw_averages())


# ----------------------------------------------------------------------------- dp.data_parallel
# One process, K replicas on threads: these run in the test process, no launch needed.

CPU = torch.device("cpu")


def dp_cases():
    toy = ("ToyModel float64", make_toy, toy_batches(10),
           lambda out, y: F.mse_loss(out, y), lambda out: out)
    gpt = ("GPT float32", make_gpt, gpt_batches(10),
           lambda out, y: F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)),
           lambda out: out[0])  # GPT returns (logits, None): gather keeps the tuple
    return [toy, gpt]


@task("dp.data_parallel", points=1)
def test_replicas_are_connected_copies():
    from labkit.dp import replicate
    what = "dp.data_parallel: replicate"
    gpt = make_gpt()
    replicas = replicate(gpt, [CPU] * 3)
    assert len(replicas) == 3, f"{what}: {len(replicas)} replicas for 3 devices"
    assert len({id(r) for r in replicas} | {id(gpt)}) == 4, f"{what}: replicas must be new module objects"
    for i, r in enumerate(replicas):
        assert r.lm_head.weight is r.wte.weight, f"{what}: replica {i} lost the tie lm_head.weight = wte.weight"
        assert r.wte.weight is not gpt.wte.weight, f"{what}: replica {i} holds the master's Parameter itself, not a copy"
        assert r.wte.weight.grad_fn is not None, (
            f"{what}: replica {i}'s wte.weight has no autograd history: its gradient cannot reach the master")
        assert not r.wpe.weight.requires_grad, f"{what}: replica {i}'s frozen wpe.weight requires grad"
        assert torch.equal(r.wte.weight.detach(), gpt.wte.weight.detach()), f"{what}: replica {i}'s wte.weight differs"
    toy = make_toy()
    r = replicate(toy, [CPU])[0]
    assert torch.equal(r.scale, toy.scale) and r.scale is not toy.scale, f"{what}: the buffer `scale` must be copied"
    # A backward through one replica lands in the master's .grad, as on the master itself.
    x, y = toy_batches(4)[0]
    toy_loss(r, x, y).backward()
    ref = make_toy()
    toy_loss(ref, x, y).backward()
    compare_grads(toy, ref, f"{what}: backward through a replica")


@task("dp.data_parallel", points=1)
def test_scatter_and_gather():
    from labkit.dp import gather, scatter
    what = "dp.data_parallel"
    x = torch.arange(20.0).reshape(10, 2)
    chunks = scatter((x, "tag", x + 1), [CPU] * 4)
    assert [c[0].shape[0] for c in chunks] == [3, 3, 3, 1], (
        f"{what}: scatter of a batch of 10 on 4 devices gave sizes {[c[0].shape[0] for c in chunks]}, "
        "expected torch.chunk's [3, 3, 3, 1]")
    assert all(c[1] == "tag" for c in chunks), f"{what}: scatter must pass non-tensor arguments to every replica"
    assert torch.equal(torch.cat([c[2] for c in chunks]), x + 1), f"{what}: scatter split the second tensor wrongly"
    assert len(scatter((x[:2],), [CPU] * 4)) == 2, f"{what}: a batch of 2 on 4 devices gives 2 chunks, not 4"
    outs = [(c[0] * 2, c[0].sum(), None) for c in chunks]
    merged = gather(outs, CPU)
    assert isinstance(merged, tuple) and merged[2] is None, f"{what}: gather must keep tuples and Nones"
    assert_close(merged[0], x * 2, f"{what}: gather of tensors")
    assert_close(merged[1], torch.stack([c[0].sum() for c in chunks]), f"{what}: gather of 0-dim tensors (stacked)")
    merged = gather([[c[0], [c[0] + 1]] for c in chunks], CPU)  # lists, nested
    assert isinstance(merged, list) and isinstance(merged[1], list), f"{what}: gather must keep lists (nested too)"
    assert_close(merged[1][0], x + 1, f"{what}: gather of a list nested in a list")
    # What cannot be split or merged is refused, naming the problem.
    for bad, error, problem in [(lambda: scatter(("tag", 3), [CPU] * 2), ValueError, "scatter with no tensor argument"),
                                (lambda: scatter((x, x[:4]), [CPU] * 2), ValueError,
                                 "scatter of tensors with different batch sizes (10 and 4)"),
                                (lambda: gather([{"y": x}, {"y": x}], CPU), TypeError, "gather of dicts")]:
        with pytest.raises(error):
            bad()
            raise AssertionError(f"{what}: {problem} was accepted; raise {error.__name__}")


class Rendezvous(torch.nn.Module):
    """Every replica waits for all the others inside forward: succeeds only if they run at once."""

    def __init__(self, parties):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.barrier = threading.Barrier(parties, timeout=10)
        self.caller = threading.get_ident()  # the thread that calls parallel_apply

    def forward(self, x):
        assert threading.get_ident() != self.caller, (
            "dp.data_parallel: parallel_apply ran a replica on the caller's own thread, one after "
            "another: start one thread per replica, then join them all")
        self.barrier.wait()
        return x * self.weight


class Exploding(torch.nn.Module):
    def forward(self, x):
        if x.min() >= 6:  # only the last chunk
            raise ValueError("boom in a replica")
        return x


@task("dp.data_parallel", points=1)
def test_parallel_apply_threads_grad_mode_errors():
    from labkit.dp import parallel_apply
    what = "dp.data_parallel: parallel_apply"
    k = 4
    probe = Rendezvous(k)
    inputs = [(torch.full((2,), float(i)),) for i in range(k)]
    try:
        outs = parallel_apply([probe] * k, inputs)
    except threading.BrokenBarrierError:
        raise AssertionError(f"{what}: the {k} replicas did not run concurrently (one thread each)") from None
    assert all(torch.equal(o.detach(), i[0]) for o, i in zip(outs, inputs)), f"{what}: outputs out of order"
    assert all(o.requires_grad for o in outs), f"{what}: outputs lost their autograd graph"
    probe.barrier.reset()
    with torch.no_grad():
        outs = parallel_apply([probe] * k, inputs)
    assert not any(o.requires_grad for o in outs), (
        f"{what}: under torch.no_grad() the replicas still recorded a graph: grad mode is per "
        "thread, carry the caller's into each thread")
    with pytest.raises(ValueError, match="boom in a replica"):
        parallel_apply([Exploding()] * 4, [(torch.full((1,), 2.0 * i),) for i in range(4)])


# Last among this task's tests: the cheap structural checks above fail a wrong design
# before the training runs.


@task("dp.data_parallel", points=1)
@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
def test_data_parallel_trains_like_the_plain_module(replicas):
    # Batch 10 on K replicas: torch.chunk sizes 10 / 5+5 / 4+4+2 / 3+3+3+1.
    from labkit.dp import data_parallel
    with one_thread():
        check_data_parallel_training(data_parallel, replicas)
        drawn_data_parallel(data_parallel, replicas)


def drawn_data_parallel(data_parallel, replicas: int) -> None:
    """Drawn models (``configs.draw_model``: float32/float64 layers, tied and frozen weights, an
    unused layer, a buffer) on drawn batch sizes, 1 to 9 (fewer rows than replicas on each first
    step: fewer chunks, fewer replicas), 3 SGD steps with momentum, each step's batch size drawn anew: the output,
    each gradient (a loss, or a random incoming gradient) and the parameters against the plain
    module; an evaluation call under no_grad gives the output and records no graph."""
    rng = configs.rng(f"dp.data_parallel/{replicas}")
    for case in range(configs.budget(ci=2, long=20)):
        spec = draw_model(rng, f"drawn case {case}")
        model, ref = DrawnMLP(spec), DrawnMLP(spec)
        opt, ref_opt = sgd(model, 0.1), sgd(ref, 0.1)
        x, y = mlp_data(spec, 27)
        start = 0
        for step in range(3):
            rows = rng.randint(1, max(1, replicas - 1)) if step == 0 else rng.randint(1, 9)  # step 0: fewer rows
            xb, yb = x[start:start + rows], y[start:start + rows]
            start += rows
            what = (f"dp.data_parallel: {replicas} replicas, {spec}, batch of {rows}, step {step} "
                    f"{configs.replay(f'{replicas} replicas, case {case}')}")
            opt.zero_grad(set_to_none=True)
            ref_opt.zero_grad(set_to_none=True)
            out, ref_out = data_parallel(model, (xb,), replicas), ref(xb)
            assert_close(out, ref_out, what + ", gathered output")
            if rng.random() < 0.5:  # mlp_loss's scaled mean squared error, on the gathered output
                (spec.loss_scale * (out.double() - yb).pow(2).mean()).backward()
                (spec.loss_scale * (ref_out.double() - yb).pow(2).mean()).backward()
            else:
                incoming = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(rng.randrange(2 ** 31)),
                                       dtype=ref_out.dtype)
                out.backward(incoming)
                ref_out.backward(incoming)
                what += " (backward of a random incoming gradient)"
            compare_grads(model, ref, what, 1e-5, 2e-5)
            opt.step()
            ref_opt.step()
            compare_params(model, ref, what + " (after the step)", 1e-5, 2e-5)
        with torch.no_grad():
            out = data_parallel(model, (x[:rng.randint(1, 9)],), replicas)
        assert out.grad_fn is None and not out.requires_grad, \
            f"dp.data_parallel: {replicas} replicas, {spec}: under no_grad the output records a graph"


def check_data_parallel_training(data_parallel, replicas):
    for name, make_model, batches, criterion, logits in dp_cases():
        model, ref = make_model(), make_model()
        opt, ref_opt = sgd(model, 0.1), sgd(ref, 0.1)
        for step, (x, y) in enumerate(batches):
            what = f"dp.data_parallel: {replicas} replicas, {name}, step {step}"
            opt.zero_grad(set_to_none=True)
            ref_opt.zero_grad(set_to_none=True)
            out = data_parallel(model, (x,), replicas)
            ref_out = logits(ref(x))
            assert_close(logits(out), ref_out, what + ", gathered output")
            if step % 2 == 0:
                criterion(logits(out), y).backward()
                criterion(ref_out, y).backward()
            else:  # a random incoming gradient, not a loss's: every element of the output gets its
                # own weight, scaled like a mean loss's (1/numel) so float32's tolerance still fits
                incoming = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(step),
                                       dtype=ref_out.dtype) / ref_out.numel()
                logits(out).backward(incoming)
                ref_out.backward(incoming)
                what += " (backward of a random incoming gradient)"
            compare_grads(model, ref, what)  # the replicas' gradients summed into the master's
            opt.step()
            ref_opt.step()
            compare_params(model, ref, what + " (after the step)")


# ----------------------------------------------------------------------------- dp.parameter_server
# World sizes 2-4 only: rank 0 is the server, so a parameter server needs at least one more
# rank to do the work (run_parameter_server refuses a single rank; checked below).

HEADER_BYTES = 5 * 8   # a header: kind, iteration, version, samples, loss (float64)
VERSION_BYTES = 1 * 8  # the version that precedes the parameters (float64)


def check_ps_ops(tracer, model, steps: int, what: str) -> None:
    """This rank's whole trace against the protocol, message by message (see the docstring)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    flat = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    final = [Op("broadcast", flat)]  # run_parameter_server hands the result to every rank
    if rank == 0:
        per_step = [op for w in range(1, n) for op in (
            Op("recv", HEADER_BYTES), Op("recv", HEADER_BYTES),   # pull and push headers, from any source
            Op("recv", flat, peer=w),                              # the gradient, from the worker that pushed
            Op("send", VERSION_BYTES, peer=w), Op("send", flat, peer=w))]  # the answer to its pull
        how = (f"per iteration and worker: 2 headers of {HEADER_BYTES} B received from any source, the "
               f"{flat} B gradient received from that worker, {VERSION_BYTES} B of version and the {flat} B "
               "of parameters sent to it")
    else:
        per_step = [Op("send", HEADER_BYTES, peer=0), Op("send", HEADER_BYTES, peer=0), Op("send", flat, peer=0),
                    Op("recv", VERSION_BYTES, peer=0), Op("recv", flat, peer=0)]
        how = (f"per iteration: a pull header, then the {VERSION_BYTES} B version and {flat} B of parameters "
               f"from rank 0, then a push header and the {flat} B gradient to rank 0")
    assert_ops(tracer, per_step * steps + final,
               f"{what}: rank {rank}'s messages over {steps} iterations ({how}; then one broadcast)")


def ps_sync_on_rank(drawn: list[dict]) -> None:
    """Staleness 0 must be synchronous SGD on the global batch, step for step."""
    torch.set_num_threads(1)  # see one_thread()
    from labkit.dp import run_parameter_server
    rank, n = dist.get_rank(), dist.get_world_size()
    # Batch 10 splits unevenly over 3 workers (4+3+3): the server must weight by samples.
    fixed = cases(10)
    for case in drawn:   # a drawn float32 model (the server keeps one flat vector), batches, loss
        spec = case["spec"]
        x, y = mlp_data(spec, sum(case["batches"]))
        batches = list(zip(x.split(case["batches"]), y.split(case["batches"])))
        fixed.append((case["label"], lambda spec=spec: DrawnMLP(spec), functools.partial(loss_in_model_dtype, spec),
                      batches, case["lr"]))
    for name, make_model, loss_fn, batches, lr in fixed:
        what = f"dp.parameter_server: rank {rank} of {n} ({n - 1} workers), staleness 0, {name}"
        ref = make_model()
        ref_opt = sgd(ref, lr)
        ref_losses = []
        for x, y in batches:
            ref_opt.zero_grad(set_to_none=True)
            loss = loss_fn(ref, x, y)
            loss.backward()
            ref_opt.step()
            ref_losses.append(loss.detach())
        model = make_model()
        with CommTracer() as tracer:
            log = run_parameter_server(model, sgd(model, lr), loss_fn, batches, staleness=0)
        check_ps_ops(tracer, model, len(batches), what)
        shared = [log]
        dist.broadcast_object_list(shared, src=0)  # every rank checks the server's log, in the same order
        log = shared[0]
        assert log is not None, f"{what}: serve() returned None; it must return its ServerLog"
        applied = sorted((w, i) for w, i, _ in log.applied)
        expected = sorted((w, i) for w in range(1, n) for i in range(len(batches)))
        assert applied == expected, f"{what}: the server applied (worker, iteration) {applied}, expected {expected}"
        assert max(log.staleness) == 0 and min(log.staleness) == 0, (
            f"{what}: staleness {log.staleness}; with bound 0 every gradient must be computed on the latest version")
        assert len(log.losses) == len(batches), f"{what}: {len(log.losses)} losses logged for {len(batches)} updates"
        for step, (got, want) in enumerate(zip(log.losses, ref_losses)):
            assert_close(torch.tensor(got, dtype=want.dtype), want,
                         f"{what}, step {step}: sample-weighted loss of the workers vs the global batch's")
        compare_params(model, ref, what + f", parameters after {len(batches)} steps")


@task("dp.parameter_server", points=1)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_parameter_server_synchronous(world_size):
    if world_size == 2:  # one rank alone cannot be server and worker
        with pytest.raises(AssertionError, match="at least 2 ranks"):
            run_graded("dp.parameter_server", ps_sync_on_rank, 1, [], timeout=30)
    run_graded("dp.parameter_server", ps_sync_on_rank, world_size, draw_servers(world_size), timeout=30)


def loss_in_model_dtype(spec, model, x, y) -> torch.Tensor:
    """The drawn model's loss in its parameters' dtype (float32): the comparisons take its tolerance."""
    return mlp_loss(spec, model, x, y).to(spec.dtypes[0])


def draw_servers(n: int) -> list[dict]:
    """Drawn synchronous cases: a drawn float32 model (frozen, tied and unused parameters,
    a scaled loss), 2-4 iterations of global batches of drawn sizes (at least one sample per
    worker; uneven splits), a drawn learning rate."""
    rng = configs.rng(f"dp.parameter_server:{n}")
    out = []
    for i in range(configs.budget(ci=2, long=20)):
        spec = draw_model(rng, f"drawn case {i}")
        # float32 throughout (the drawn model's output is float32 anyway): one flat vector, one tolerance
        spec = dataclasses.replace(spec, dtypes=(torch.float32,) * len(spec.dtypes))
        out.append(dict(spec=spec, batches=[rng.randint(n - 1, 3 * n) for _ in range(rng.randint(2, 4))],
                        lr=round(rng.uniform(0.01, 0.2), 3),
                        label=f"drawn case {i} {configs.replay(f'dp.parameter_server, world size {n}')}"))
    return out


ASYNC_STEPS = 8
SLOW = 0.03  # seconds worker 1 sleeps per iteration: the others get ahead of it
# Worker 2 (where there is one) runs ahead, then pauses in iteration 3 long enough for worker 1
# to complete updates meanwhile: its gradient of iteration 3 is then pushed at a later version
# than it was computed on, and the log must say the one it was computed on.
PAUSE = [0.0, 0.0, 0.0, 0.5] + [0.0] * (ASYNC_STEPS - 4)


class VersionsSent(TorchDispatchMode):
    """The server's version messages (one float64 element, sent before the parameters that
    answer a pull), per worker in the order sent: worker w's i-th is the version of the
    parameters it computed iteration i on. Read off the wire, whatever code sent them."""

    def __init__(self):
        super().__init__()
        self.to: dict[int, list[int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d" and func._opname == "send":
            named = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
            tensor = named["tensors"][0]
            if tensor.numel() == 1 and tensor.dtype == torch.float64:
                self.to.setdefault(int(named["dst"]), []).append(int(tensor.item()))
        return func(*args, **kwargs)


def ps_async_on_rank(bounds) -> None:
    torch.set_num_threads(1)  # see one_thread()
    from labkit.dp import run_parameter_server
    rank, n = dist.get_rank(), dist.get_world_size()
    batches = toy_batches(12, steps=ASYNC_STEPS, seed=3)
    x_all, y_all = torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
    for bound in bounds:
        what = (f"dp.parameter_server: rank {rank} of {n} ({n - 1} workers), staleness bound {bound}, worker 1 slow"
                + (", worker 2 pausing in iteration 3" if n > 2 else ""))
        model = make_toy()
        with torch.no_grad():
            start = toy_loss(model, x_all, y_all).item()
        with CommTracer() as tracer, VersionsSent() as sent:
            log = run_parameter_server(model, sgd(model, 0.1), toy_loss, batches, staleness=bound,
                                       delays={1: SLOW, 2: PAUSE} if n > 2 else {1: SLOW})
        check_ps_ops(tracer, model, ASYNC_STEPS, what)
        with torch.no_grad():
            end = toy_loss(model, x_all, y_all).item()
        if rank != 0:
            continue
        applied = sorted((w, i) for w, i, _ in log.applied)
        expected = sorted((w, i) for w in range(1, n) for i in range(ASYNC_STEPS))
        assert applied == expected, f"{what}: the server applied (worker, iteration) {applied}, expected {expected}"
        for worker, iteration, version in log.applied:
            read = sent.to[worker][iteration]
            assert version == read, (
                f"{what}: the log says worker {worker}'s gradient of iteration {iteration} was computed on "
                f"version {version}, but the parameters sent for that pull were version {read}")
        for (worker, iteration, version), stale in zip(log.applied, log.staleness):
            assert 0 <= stale <= bound, (
                f"{what}: worker {worker}'s gradient of iteration {iteration} was computed on version "
                f"{version}, staleness {stale}, outside [0, {bound}]")
        if n > 2:  # with two or more workers the fast ones must have run ahead of the slow one
            assert max(log.staleness) > 0, (
                f"{what}: every gradient had staleness 0: fast workers must not wait for the slow one "
                "while their parameters are fewer than `bound` versions behind")
        assert end < 0.7 * start, f"{what}: loss on all the data went from {start:.4f} to {end:.4f}, not below 70%"


@task("dp.parameter_server", points=1)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_parameter_server_bounded_staleness(world_size):
    # Bounds 1 and 3 in one job. With a single worker (world size 2) nobody can run ahead:
    # staleness stays 0, which the bound allows.
    run_graded("dp.parameter_server", ps_async_on_rank, world_size, [1, 3], timeout=30)
