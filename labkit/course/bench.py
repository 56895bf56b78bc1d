"""``labkit bench``: each course implementation against the PyTorch built-in, in one run.

Every row times both sides in the same launch, interleaved (A B, then B A, ...), after a
warm-up, and reports medians; the time of one repetition is the slowest rank's. The
ratio is ours / built-in, so below 1 means faster than PyTorch. Next to it, the bytes one
rank sent (traced) and what the formula says it should send.

Chapters add rows by decorating a function with ``@row("name")``; it returns a ``BenchRow``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from labkit.launch import WorkerError, launch
from labkit.timing import interleaved_medians


@dataclass
class BenchRow:
    name: str
    ours_s: float
    builtin_s: float
    traced_bytes: float | None = None    # bytes one rank sent in one call/step (traced)
    formula_bytes: float | None = None   # what the cost formula predicts
    extra: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.ours_s / self.builtin_s


ROWS: dict[str, callable] = {}


def row(name: str):
    """Register a benchmark row under ``name``."""
    def register(fn):
        ROWS[name] = fn
        return fn
    return register


def rank_batch(config, batch: int):
    """This rank's ``batch`` sequences of one global batch of Markov tokens (seeded)."""
    from labkit.data import markov_tokens
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = markov_tokens(batch * world, config.block_size, config.vocab_size, seed=0)
    return x[rank * batch:(rank + 1) * batch], y[rank * batch:(rank + 1) * batch]


def race_training_steps(models: dict, optimizers: dict, batch, repeats: int, warmup: int = 3):
    """On every rank: a full step (forward, backward, optimizer step) of each model, timed
    interleaved; then one traced step each. Returns (medians, {name: CommTracer})."""
    from labkit.comm import CommTracer

    def stepper(name):
        def step(b):
            models[name](*b)[1].backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
        return step

    steps = {name: stepper(name) for name in models}
    medians = interleaved_medians(steps, lambda: batch, repeats, warmup)
    tracers = {}
    for name, step in steps.items():
        with CommTracer() as tracers[name]:  # after the timing: never time under the tracer
            step(batch)
    return medians, tracers


# ----------------------------------------------------------------------------- rows


def _ring_vs_builtin(numel: int, repeats: int) -> dict:
    from labkit.collectives import ring_all_reduce
    from labkit.comm import CommTracer
    make_input = lambda: torch.ones(numel)  # noqa: E731
    medians = interleaved_medians({"ours": ring_all_reduce, "builtin": dist.all_reduce},
                                  make_input, repeats)
    with CommTracer() as tracer:
        ring_all_reduce(make_input())
    sent = sum(e.bytes for e in tracer.events if e.kind == "send")
    return dict(medians, sent=sent)


def pipelined_ring_all_reduce(tensor: torch.Tensor, group=None, segments: int = 4) -> None:
    """A ring all-reduce that overlaps its additions with its transfers (lab 00, "closing the
    gap"): every chunk is cut into ``segments``, and each segment moves on to the next step as
    soon as it has been added, instead of the whole chunk waiting for the whole step. The
    reduce-scatter and all-gather steps run as one pipeline; the bytes on the wire are the
    ring's 2 (N-1)/N S, in 2 (N-1) x segments messages."""
    from labkit.collectives import ring_neighbours
    n, me = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:
        return
    flat = tensor.reshape(-1)
    chunk = -(-flat.numel() // n)
    seg = -(-chunk // segments)
    buf = torch.zeros(n * chunk, dtype=tensor.dtype, device=tensor.device)
    buf[:flat.numel()] = flat
    chunks = buf.view(n, chunk)
    bounds = [(a, min(a + seg, chunk)) for a in range(0, chunk, seg)]
    to, frm = ring_neighbours(group)
    steps = 2 * (n - 1)
    incoming = torch.empty(chunk, dtype=tensor.dtype, device=tensor.device)

    def sent_chunk(k):  # reduce-scatter step k sends the partial sum of chunk me - k; all-gather forwards
        return (me - k) % n if k < n - 1 else (me + 1 - (k - (n - 1))) % n

    def received_chunk(k):
        return (me - k - 1) % n if k < n - 1 else (me - (k - (n - 1))) % n

    def post(k, j):  # step k's segment j: send it, and receive the neighbour's
        a, b = bounds[j]
        tag = k * len(bounds) + j
        into = incoming[a:b] if k < n - 1 else chunks[received_chunk(k), a:b]
        return (dist.isend(chunks[sent_chunk(k), a:b], dst=to, group=group, tag=tag),
                dist.irecv(into, src=frm, group=group, tag=tag))

    pending = {(0, j): post(0, j) for j in range(len(bounds))}
    sends = []
    for k in range(steps):
        for j, (a, b) in enumerate(bounds):
            send, received = pending.pop((k, j))
            received.wait()
            sends.append(send)
            if k < n - 1:
                chunks[received_chunk(k), a:b] += incoming[a:b]
            if k + 1 < steps:
                pending[(k + 1, j)] = post(k + 1, j)
    for send in sends:
        send.wait()
    tensor.copy_(buf[:flat.numel()].view_as(tensor))


def _pipelined_vs_builtin(numel: int, repeats: int) -> dict:
    from labkit.comm import CommTracer
    make_input = lambda: torch.ones(numel)  # noqa: E731
    medians = interleaved_medians({"ours": pipelined_ring_all_reduce, "builtin": dist.all_reduce},
                                  make_input, repeats)
    with CommTracer() as tracer:
        pipelined_ring_all_reduce(make_input())
    return dict(medians, sent=sum(e.bytes for e in tracer.events if e.kind == "send"))


@row("ring_all_reduce_pipelined")
def pipelined_ring_row(repeats: int = 15, world_size: int = 2, megabytes: float = 16) -> BenchRow:
    """a ring all-reduce with segments in flight (lab 00, closing the gap) vs dist.all_reduce"""
    numel = int(megabytes * 2 ** 20) // 4
    result = launch(_pipelined_vs_builtin, world_size, numel, repeats)[0]
    return BenchRow(f"pipelined ring all-reduce vs dist.all_reduce, {megabytes:g} MB fp32, {world_size} ranks",
                    result["ours"], result["builtin"], result["sent"],
                    2 * (world_size - 1) / world_size * numel * 4)


@row("ring_all_reduce")
def ring_all_reduce_row(repeats: int = 15, world_size: int = 2, megabytes: float = 16) -> BenchRow:
    """the learner's ring all-reduce (chapter 00) vs dist.all_reduce, 16 MB"""
    numel = int(megabytes * 2 ** 20) // 4
    result = launch(_ring_vs_builtin, world_size, numel, repeats)[0]
    size = numel * 4
    return BenchRow(f"ring all-reduce vs dist.all_reduce, {megabytes:g} MB fp32, gloo, {world_size} ranks",
                    result["ours"], result["builtin"], result["sent"],
                    2 * (world_size - 1) / world_size * size)


# ----------------------------------------------------------------------------- dp (chapter 01)


def _dp_step_vs_ddp(repeats: int) -> dict:
    """One training step's forward + backward + gradient sync: average_gradients vs DDP."""
    from labkit.comm import CommTracer
    from labkit.data import markov_tokens
    from labkit.dp import average_gradients
    from labkit.models import GPT, GPTConfig
    config = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=64)
    ours = GPT(config)
    ddp = torch.nn.parallel.DistributedDataParallel(GPT(config))
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
    grad_bytes = sum(p.numel() * p.element_size() for p in ours.parameters() if p.requires_grad)
    return dict(medians, sent=tracer.sent_bytes(), grad_bytes=grad_bytes,
                all_reduces=tracer.count("all_reduce"))


@row("dp_average_gradients")
def dp_average_gradients_row(repeats: int = 15, world_size: int = 2) -> BenchRow:
    """average_gradients after backward (chapter 01) vs DDP"""
    r = launch(_dp_step_vs_ddp, world_size, repeats)[0]
    formula = 2 * (world_size - 1) / world_size * r["grad_bytes"]
    return BenchRow(f"GPT step, average_gradients vs DDP, {r['grad_bytes'] / 2**20:.2f} MB grads, {world_size} ranks",
                    r["ours"], r["builtin"], r["sent"], formula, extra=dict(all_reduces=r["all_reduces"]))


# ----------------------------------------------------------------------------- ddp (chapter 02)

# A GPT with 0.83 M parameters (3.3 MB of fp32 gradients): big enough that a step is tens of
# milliseconds of compute and a few MB of all-reduce, small enough for a laptop.
DDP_BENCH_GPT = dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)


def _ddp_vs_builtin(repeats: int, batch: int) -> dict:
    """A full training step (forward, backward, AdamW step) with labkit.ddp.DDP and with
    DistributedDataParallel, both at their default bucket sizes, interleaved."""
    from labkit.ddp import DDP
    from labkit.models import GPT, GPTConfig
    config = GPTConfig(**DDP_BENCH_GPT)
    models = {"ours": DDP(GPT(config)), "builtin": torch.nn.parallel.DistributedDataParallel(GPT(config))}
    optims = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
    medians, tracers = race_training_steps(models, optims, rank_batch(config, batch), repeats)
    calls = {name: tracer.count("all_reduce") for name, tracer in tracers.items()}
    sent = tracers["ours"].sent_bytes()
    grad_bytes = sum(p.numel() * p.element_size() for p in models["ours"].parameters() if p.requires_grad)
    return dict(medians, calls=calls, sent=sent, grad_bytes=grad_bytes)


@row("ddp")
def ddp_row(repeats: int = 15, world_size: int = 2, batch: int = 8) -> BenchRow:
    """the learner's DDP (chapter 02) vs DistributedDataParallel, a full GPT step"""
    r = launch(_ddp_vs_builtin, world_size, repeats, batch, timeout=600)[0]
    return BenchRow(f"GPT step, labkit DDP vs DistributedDataParallel, {world_size} ranks",
                    r["ours"], r["builtin"], r["sent"], 2 * (world_size - 1) / world_size * r["grad_bytes"],
                    extra={"all_reduces_per_step": {"ours": r["calls"]["ours"], "torch": r["calls"]["builtin"]},
                           "grad_mb": r["grad_bytes"] / 2 ** 20})


# ----------------------------------------------------------------------------- zero (chapter 03)

# A small GPT (~0.1 M parameters, 0.42 MB fp32): its AdamW state is twice that.
ZERO_BENCH_GPT = dict(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=64)


def _zero_vs_builtin(repeats: int, batch: int, shard_gradients: bool) -> dict:
    """A full training step (forward, backward, gradient sync, AdamW step) with
    labkit.zero.ShardedOptimizer and with DDP + ZeroRedundancyOptimizer, interleaved.

    Stage 1 (``shard_gradients=False``) runs under DDP too, as ZeroRedundancyOptimizer does;
    stage 2 averages the gradients itself (reduce-scatter), so its model is not wrapped."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from labkit.models import GPT, GPTConfig
    from labkit.zero import ShardedOptimizer
    config = GPTConfig(**ZERO_BENCH_GPT)
    ours_model = GPT(config) if shard_gradients else DistributedDataParallel(GPT(config))
    models = {"ours": ours_model, "builtin": DistributedDataParallel(GPT(config))}
    optims = {"ours": ShardedOptimizer(models["ours"].parameters(), torch.optim.AdamW,
                                       shard_gradients=shard_gradients, lr=1e-3),
              "builtin": ZeroRedundancyOptimizer(models["builtin"].parameters(), torch.optim.AdamW, lr=1e-3)}
    medians, tracers = race_training_steps(models, optims, rank_batch(config, batch), repeats)
    sent = {name: tracer.sent_bytes() for name, tracer in tracers.items()}
    kinds = {name: sorted(tracer.kinds()) for name, tracer in tracers.items()}
    phi = sum(p.numel() * p.element_size() for p in models["builtin"].parameters() if p.requires_grad)
    return dict(medians, sent=sent, kinds=kinds, phi=phi,
                state_bytes=sum(t.numel() * t.element_size() for s in optims["ours"].state.values()
                                for t in s.values() if isinstance(t, torch.Tensor)))


def _zero_row(stage: int, repeats: int, world_size: int, batch: int) -> BenchRow:
    r = launch(_zero_vs_builtin, world_size, repeats, batch, stage == 2, timeout=600)[0]
    share = (world_size - 1) / world_size * r["phi"]
    # Stage 1 under DDP: all-reduce the gradients (2 shares), all-gather the parameters (1).
    # Stage 2: reduce-scatter the gradients (1 share), all-gather the parameters (1).
    formula = (3 if stage == 1 else 2) * share
    torch_side = "ZeroRedundancyOptimizer" if stage == 1 else "DDP+ZeroRedundancyOptimizer"
    return BenchRow(f"GPT step, ZeRO-{stage} ours vs {torch_side}, {world_size} ranks",
                    r["ours"], r["builtin"], r["sent"]["ours"], formula,
                    extra={"phi_bytes": r["phi"], "torch_sent": r["sent"]["builtin"], "ops": r["kinds"],
                           "optimizer_state_bytes_rank0": r["state_bytes"]})


@row("zero1")
def zero1_row(repeats: int = 15, world_size: int = 2, batch: int = 8) -> BenchRow:
    """ZeRO-1 (chapter 03) vs ZeroRedundancyOptimizer"""
    return _zero_row(1, repeats, world_size, batch)


@row("zero2")
def zero2_row(repeats: int = 15, world_size: int = 2, batch: int = 8) -> BenchRow:
    """ZeRO-2 (chapter 03) vs DDP + ZeroRedundancyOptimizer"""
    return _zero_row(2, repeats, world_size, batch)


# ----------------------------------------------------------------------------- fsdp (chapter 04)

# The GPT of the FSDP lab: 4 blocks, 0.2 M parameters (0.8 MB fp32), short sequences, so
# that parameters, gradients and AdamW state, not activations, dominate a rank's memory.
FSDP_BENCH_GPT = dict(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=64)


def _fsdp_vs_fully_shard(repeats: int, batch: int) -> dict:
    """A full training step (forward, backward, AdamW step) of the GPT sharded per block
    and at the root, with labkit.fsdp.fully_shard and with torch's fully_shard, interleaved."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from labkit import fsdp
    from labkit.memory import param_bytes
    from labkit.models import GPT, GPTConfig
    config = GPTConfig(**FSDP_BENCH_GPT)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    models = {"ours": GPT(config), "builtin": GPT(config)}
    full_bytes = param_bytes(models["ours"])
    for shard, model in ((fsdp.fully_shard, models["ours"]),
                         (lambda m: torch_fully_shard(m, mesh=mesh), models["builtin"])):
        for block in model.blocks:
            shard(block)
        shard(model)
    optims = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
    medians, tracers = race_training_steps(models, optims, rank_batch(config, batch), repeats)
    sent = {name: tracer.sent_bytes() for name, tracer in tracers.items()}
    return dict(medians, sent=sent, formula=fsdp.step_bytes(models["ours"])["total"],
                full_bytes=full_bytes, shard_bytes=param_bytes(models["ours"]),
                torch_shard_bytes=param_bytes(models["builtin"]))


@row("fsdp")
def fsdp_row(repeats: int = 15, world_size: int = 2, batch: int = 8) -> BenchRow:
    """the learner's fully_shard (chapter 04) vs torch's fully_shard"""
    r = launch(_fsdp_vs_fully_shard, world_size, repeats, batch, timeout=600)[0]
    # formula: 3 x (N-1)/N x Phi (two all-gathers, one reduce-scatter; Phi padded). torch's
    # fully_shard keeps the root unit gathered from forward to backward: it sends a little less.
    return BenchRow(f"GPT step, labkit fully_shard vs torch fully_shard, {world_size} ranks",
                    r["ours"], r["builtin"], r["sent"]["ours"], r["formula"],
                    extra={"torch_sent": r["sent"]["builtin"], "param_bytes_full": r["full_bytes"],
                           "param_bytes_rank0": r["shard_bytes"], "torch_param_bytes_rank0": r["torch_shard_bytes"]})


# ----------------------------------------------------------------------------- fsdp, mixed precision

def _fsdp_mixed_vs_fully_shard(repeats: int, batch: int) -> dict:
    """A training step of the FSDP lab's GPT with bf16 parameters and fp32 reductions, with
    labkit.fsdp.fully_shard and torch's fully_shard under the same MixedPrecisionPolicy."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from labkit import fsdp
    from labkit.models import GPT, GPTConfig
    config = GPTConfig(**FSDP_BENCH_GPT)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    models = {"ours": GPT(config), "builtin": GPT(config)}
    for shard, model in ((lambda m: fsdp.fully_shard(m, mp_policy=policy), models["ours"]),
                         (lambda m: torch_fully_shard(m, mesh=mesh, mp_policy=policy), models["builtin"])):
        for block in model.blocks:
            shard(block)
        shard(model)
    optims = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
    medians, tracers = race_training_steps(models, optims, rank_batch(config, batch), repeats)
    sent = {name: tracer.sent_bytes() for name, tracer in tracers.items()}
    return dict(medians, sent=sent, formula=fsdp.step_bytes(models["ours"])["total"])


@row("fsdp_mixed_precision")
def fsdp_mixed_row(repeats: int = 15, world_size: int = 2, batch: int = 8) -> BenchRow:
    """mixed-precision FSDP (bf16 params, fp32 reduce) vs torch's fully_shard with the same policy"""
    r = launch(_fsdp_mixed_vs_fully_shard, world_size, repeats, batch, timeout=600)[0]
    # formula: 2 all-gathers in bf16 + 1 reduce-scatter in fp32 of the padded shards, (N-1)/N each
    return BenchRow(f"GPT step, bf16 params / fp32 reduce, labkit fully_shard vs torch fully_shard, {world_size} ranks",
                    r["ours"], r["builtin"], r["sent"]["ours"], r["formula"], extra={"torch_sent": r["sent"]["builtin"]})


# ----------------------------------------------------------------------------- tp (chapter 05)

# A GPT where the matmuls are worth splitting: 4 blocks of 256 channels, 8 heads, 1.6 M
# parameters (untied head: parallelize_module cannot split a tied one), sequences of 64.
TP_BENCH_GPT = dict(vocab_size=512, block_size=64, n_layer=4, n_head=8, n_embd=256, tie_weights=False)


def builtin_tensor_parallel(model, mesh):
    """``model`` (a labkit GPT) split by torch's ``parallelize_module`` exactly as
    ``labkit.tp.tensor_parallel`` splits it. c_attn stacks Q, K and V; its rows are first
    reordered to [Q_0 K_0 V_0 | Q_1 K_1 V_1 | ...] so that torch's contiguous split gives each
    rank its own heads."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from labkit.tp import shard
    n = mesh.size()
    with torch.no_grad():
        for block in model.blocks:
            for p in (block.attn.c_attn.weight, block.attn.c_attn.bias):
                p.copy_(torch.cat([shard(p, 0, r, n, parts=3) for r in range(n)]))
    plan = {"wte": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(model.blocks)):
        plan |= {f"blocks.{i}.attn.c_attn": ColwiseParallel(), f"blocks.{i}.attn.c_proj": RowwiseParallel(),
                 f"blocks.{i}.mlp.c_fc": ColwiseParallel(), f"blocks.{i}.mlp.c_proj": RowwiseParallel()}
    return parallelize_module(model, mesh, plan)


def _tp_vs_parallelize_module(repeats: int, batch: int) -> dict:
    """One training step (forward, backward, AdamW) of the GPT split by labkit.tp and by
    parallelize_module (+ loss_parallel), interleaved; then one traced step each."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from labkit.comm import CommTracer
    from labkit.data import markov_tokens
    from labkit.memory import param_bytes
    from labkit.models import GPT, GPTConfig
    from labkit.tp import tensor_parallel
    config = GPTConfig(**TP_BENCH_GPT)
    full_bytes = param_bytes(GPT(config))
    ours = tensor_parallel(GPT(config))
    builtin = builtin_tensor_parallel(GPT(config), init_device_mesh("cpu", (dist.get_world_size(),)))
    optims = {"ours": torch.optim.AdamW(ours.parameters(), lr=1e-3),
              "builtin": torch.optim.AdamW(builtin.parameters(), lr=1e-3)}
    data = markov_tokens(batch, config.block_size, config.vocab_size, seed=0)  # the same on every rank

    def ours_step(b):
        ours(*b)[1].backward()
        optims["ours"].step()
        optims["ours"].zero_grad(set_to_none=True)

    def builtin_step(b):
        with loss_parallel():
            builtin(*b)[1].backward()
        optims["builtin"].step()
        optims["builtin"].zero_grad(set_to_none=True)

    steps = {"ours": ours_step, "builtin": builtin_step}
    medians = interleaved_medians(steps, lambda: data, repeats, warmup=3)
    sent = {}
    for name, step in steps.items():
        with CommTracer() as tracer:
            step(data)
        sent[name] = tracer.sent_bytes()
    n, L = dist.get_world_size(), config.n_layer
    activations = batch * config.block_size * config.n_embd * 4      # B*T*H float32 bytes
    reduced = 2 * (1 + 2 * L) * activations + 3 * batch * config.block_size * 4
    return dict(medians, sent=sent, formula=2 * (n - 1) / n * reduced, full_bytes=full_bytes,
                rank_bytes=param_bytes(ours))


@row("tp")
def tp_row(repeats: int = 15, world_size: int = 2, batch: int = 8) -> BenchRow:
    """the learner's tensor parallelism (chapter 05) vs parallelize_module"""
    r = launch(_tp_vs_parallelize_module, world_size, repeats, batch, timeout=600)[0]
    # formula: per step 2(1 + 2L) all-reduces of B*T*H (embedding, 2 per block, head; forward
    # and backward) and 3 of B*T (the loss), each 2(N-1)/N of its size on the wire.
    return BenchRow(f"GPT step, labkit.tp vs parallelize_module, {world_size} ranks",
                    r["ours"], r["builtin"], r["sent"]["ours"], r["formula"],
                    extra={"torch_sent": r["sent"]["builtin"], "param_bytes_full": r["full_bytes"],
                           "param_bytes_rank0": r["rank_bytes"]})


# ----------------------------------------------------------------------------- pp (chapter 06)

# One block per rank, 256 channels, micro-batches of 4 sequences of 64 tokens: each action
# is a few milliseconds of compute, so scheduling and messages show. Untied head (the
# built-in does not sum a tied embedding split across ranks).
PP_BENCH_GPT = dict(vocab_size=256, block_size=64, n_head=4, n_embd=256, tie_weights=False)


def _1f1b_vs_schedule_1f1b(repeats: int, microbatches: int, micro_batch: int) -> dict:
    """One training step (1F1B forward/backward of every micro-batch, then AdamW) with
    labkit.pp's runner and with torch's PipelineStage + Schedule1F1B, interleaved."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

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
    schedule = Schedule1F1B(PipelineStage(theirs, rank, p, torch.device("cpu")), microbatches, loss_fn=pp.gpt_loss)
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


# ----------------------------------------------------------------------------- sp (chapter 07)

SP_ATTENTION = dict(batch=1, heads=8, head_dim=32, tokens=2048)  # the whole sequence, over all ranks


def _attention_vs_sdpa(kind: str, repeats: int, causal: bool) -> dict:
    """Forward + backward of causal attention over the whole sequence: this rank's rows with
    ring attention (or Ulysses) vs unsharded SDPA of the whole sequence on every rank."""
    from labkit import sp
    from labkit.comm import CommTracer
    n, rank = dist.get_world_size(), dist.get_rank()
    b, h, d, t = (SP_ATTENTION[key] for key in ("batch", "heads", "head_dim", "tokens"))
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(b, h, t, d, generator=gen) for _ in range(3)]
    rows = sp.contiguous_positions(t, rank, n)
    mine = [x.index_select(2, rows) for x in full]

    def ours(_):
        q, k, v = (x.detach().requires_grad_() for x in mine)
        out = sp.ring_attention(q, k, v, rows, causal) if kind == "ring" else sp.ulysses_attention(q, k, v, causal)
        out.sum().backward()

    def builtin(_):
        q, k, v = (x.detach().requires_grad_() for x in full)
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward()

    medians = interleaved_medians({"ours": ours, "builtin": builtin}, lambda: None, repeats, warmup=2)
    with CommTracer() as tracer:
        ours(None)
    shard = mine[0].numel() * mine[0].element_size()
    if kind == "ring":  # forward: (N-1)(K + V + positions); backward: (N-1)(K, V, dK, dV, positions) + dK, dV
        pos = rows.numel() * rows.element_size()
        formula = (n - 1) * (2 * shard + pos) + (n - 1) * (4 * shard + pos) + (2 * shard if n > 1 else 0)
    else:  # 4 all-to-alls of one shard each way, (N-1)/N of each leaves the rank
        formula = 8 * (n - 1) / n * shard
    return dict(medians, sent=tracer.sent_bytes(), formula=formula)


def _attention_row(kind: str, repeats: int, world_size: int) -> BenchRow:
    r = launch(_attention_vs_sdpa, world_size, kind, repeats, True, timeout=600)[0]
    name = "ring attention" if kind == "ring" else "Ulysses"
    return BenchRow(f"causal attention, {SP_ATTENTION['tokens']} tokens, {name} on {world_size} ranks vs SDPA unsharded",
                    r["ours"], r["builtin"], r["sent"], r["formula"])


@row("sp_ring")
def sp_ring_row(repeats: int = 7, world_size: int = 2) -> BenchRow:
    """ring attention (chapter 07) vs unsharded SDPA"""
    return _attention_row("ring", repeats, world_size)


@row("sp_ulysses")
def sp_ulysses_row(repeats: int = 7, world_size: int = 2) -> BenchRow:
    """Ulysses (chapter 07) vs unsharded SDPA"""
    return _attention_row("ulysses", repeats, world_size)


SP_BENCH_GPT = dict(vocab_size=64, block_size=512, n_layer=1, n_head=8, n_embd=256)


def builtin_sequence_parallel(block, mesh):
    """A labkit ``Block`` with torch's Megatron-SP plan: LayerNorms on sequence shards
    (``SequenceParallel``), all-gather into attention and MLP (``PrepareModuleInput``),
    column/row layers, reduce-scatter out (``RowwiseParallel(output_layouts=Shard(1))``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    from labkit.tp import shard
    n = mesh.size()
    with torch.no_grad():  # rank r's contiguous slice of c_attn must hold its own heads' Q, K, V
        for p in (block.attn.c_attn.weight, block.attn.c_attn.bias):
            p.copy_(torch.cat([shard(p, 0, r, n, parts=3) for r in range(n)]))
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan = {"ln_1": SequenceParallel(), "ln_2": SequenceParallel(), "attn": gather, "mlp": gather,
            "attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
            "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel(output_layouts=Shard(1))}
    return parallelize_module(block, mesh, plan)


def _megatron_sp_vs_builtin(repeats: int, batch: int) -> dict:
    """Forward + backward of one transformer block on this rank's tokens: labkit.sp's block
    vs torch's SequenceParallel plan."""
    from torch.distributed.device_mesh import init_device_mesh

    from labkit import sp
    from labkit.comm import CommTracer
    from labkit.models import GPT, GPTConfig
    config = GPTConfig(**SP_BENCH_GPT)
    n = dist.get_world_size()
    ours = sp.sequence_parallel_block(GPT(config).blocks[0])
    builtin = builtin_sequence_parallel(GPT(config).blocks[0], init_device_mesh("cpu", (n,)))
    x = sp.split_sequence(torch.randn(batch, config.block_size, config.n_embd, generator=torch.Generator().manual_seed(0)))

    def ours_step(_):
        ours(x.detach().requires_grad_()).sum().backward()
        sp.reduce_layernorm_grads([ours])
        ours.zero_grad(set_to_none=True)

    def builtin_step(_):
        out = builtin(x.detach().requires_grad_())
        (out.to_local() if hasattr(out, "to_local") else out).sum().backward()
        builtin.zero_grad(set_to_none=True)

    medians = interleaved_medians({"ours": ours_step, "builtin": builtin_step}, lambda: None, repeats, warmup=2)
    sent = {}
    for name, step in (("ours", ours_step), ("builtin", builtin_step)):
        with CommTracer() as tracer:
            step(None)
        sent[name] = tracer.sent_bytes()
    activation = batch * config.block_size * config.n_embd * 4
    replicated = sum(p.numel() * p.element_size() for p in ours.layernorm_parameters())
    # 2 all-gathers + 2 reduce-scatters forward, the same backward, (N-1)/N of B*T*H each;
    # then the all-reduce of the LayerNorm (and row bias) gradients, 2(N-1)/N of them.
    return dict(medians, sent=sent, formula=(8 * activation + 2 * replicated) * (n - 1) / n)


@row("sp_megatron")
def sp_megatron_row(repeats: int = 10, world_size: int = 2, batch: int = 4) -> BenchRow:
    """the Megatron-SP block (chapter 07) vs torch's SequenceParallel plan"""
    r = launch(_megatron_sp_vs_builtin, world_size, repeats, batch, timeout=600)[0]
    return BenchRow(f"transformer block fwd+bwd, labkit.sp Megatron-SP vs SequenceParallel plan, {world_size} ranks",
                    r["ours"], r["builtin"], r["sent"]["ours"], r["formula"],
                    extra={"torch_sent": r["sent"]["builtin"]})


# ----------------------------------------------------------------------------- mesh (chapter 08)

MESH_BENCH_GPT = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128, tie_weights=False)


def _2d_vs_builtin(repeats: int, dp: int, tp: int, batch: int) -> dict:
    """One training step of the GPT on a dp x tp mesh: labkit.mesh.parallelize_2d (the
    course's TP + FSDP) vs fully_shard on the dp sub-mesh + parallelize_module on tp."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import loss_parallel

    from labkit.comm import CommTracer
    from labkit.data import markov_tokens
    from labkit.mesh import RankGrid, dp_slice, parallelize_2d
    from labkit.models import GPT, GPTConfig
    config = GPTConfig(**MESH_BENCH_GPT)
    grid = RankGrid(dp * tp, dp=dp, tp=tp).make_groups()
    ours = parallelize_2d(GPT(config), grid)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    builtin = builtin_tensor_parallel(GPT(config), mesh["tp"])
    for block in builtin.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(builtin, mesh=mesh["dp"])
    optims = {"ours": torch.optim.AdamW(ours.parameters(), lr=1e-3),
              "builtin": torch.optim.AdamW(builtin.parameters(), lr=1e-3)}
    x, y = markov_tokens(batch * dp, config.block_size, config.vocab_size, seed=0)
    data = dp_slice(x, grid), dp_slice(y, grid)

    def ours_step(b):
        ours(*b)[1].backward()
        optims["ours"].step()
        optims["ours"].zero_grad(set_to_none=True)

    def builtin_step(b):
        with loss_parallel():
            builtin(*b)[1].backward()
        optims["builtin"].step()
        optims["builtin"].zero_grad(set_to_none=True)

    steps = {"ours": ours_step, "builtin": builtin_step}
    medians = interleaved_medians(steps, lambda: data, repeats, warmup=3)
    sent = {}
    for name, step in steps.items():
        with CommTracer() as tracer:
            step(data)
        sent[name] = tracer.sent_bytes()
    from labkit.fsdp import step_bytes
    tokens = batch * config.block_size
    tp_reduced = 2 * (1 + 2 * config.n_layer) * tokens * config.n_embd * 4 + 3 * tokens * 4
    formula = 2 * (tp - 1) / tp * tp_reduced + step_bytes(ours)["total"]
    return dict(medians, sent=sent, formula=formula)


@row("mesh")  # formula: TP's all-reduces (chapter 05) + FSDP's 3 (N-1)/N of the padded shards (chapter 04)
def mesh_row(repeats: int = 10, world_size: int = 4, batch: int = 4) -> BenchRow:
    """2-D FSDP x TP from the learner's parts (chapter 08) vs fully_shard + parallelize_module"""
    dp, tp = 2, world_size // 2
    r = launch(_2d_vs_builtin, world_size, repeats, dp, tp, batch, timeout=600)[0]
    return BenchRow(f"GPT step on a {dp}x{tp} dp x tp mesh, labkit 2-D vs fully_shard + parallelize_module",
                    r["ours"], r["builtin"], r["sent"]["ours"], r["formula"], extra={"torch_sent": r["sent"]["builtin"]})


# ----------------------------------------------------------------------------- table


def run(names: list[str] | None = None, **options) -> list[BenchRow | str]:
    """Run the named rows (all by default); a row whose exercise is a stub says so."""
    results = []
    for name in names or list(ROWS):
        if name not in ROWS:
            raise ValueError(f"no benchmark row {name!r}; available: {', '.join(ROWS)}")
        try:
            results.append(ROWS[name](**options))
        except WorkerError as error:
            if error.exc_type != "NotImplementedError":
                raise
            results.append(f"{name}: not implemented yet ({error.message})")
    return results


def format_table(results: list[BenchRow | str]) -> str:
    header = f"{'benchmark':<62}{'ours ms':>10}{'torch ms':>10}{'ratio':>8}{'sent/rank':>14}{'formula':>14}"
    lines = [header, "-" * len(header)]
    for r in results:
        if isinstance(r, str):
            lines.append(r)
            continue
        sent = f"{r.traced_bytes:,.0f}" if r.traced_bytes is not None else "-"
        formula = f"{r.formula_bytes:,.0f}" if r.formula_bytes is not None else "-"
        lines.append(f"{r.name:<62}{r.ours_s * 1e3:>10.2f}{r.builtin_s * 1e3:>10.2f}"
                     f"{r.ratio:>8.2f}{sent:>14}{formula:>14}")
        if r.extra:  # row-specific figures, e.g. all-reduce calls per step for both sides
            lines.append("    " + ", ".join(f"{k}={_show(v)}" for k, v in r.extra.items()))
    lines.append("ratio = ours / torch (median of interleaved repetitions; < 1 is faster); "
                 "sent/rank = bytes one rank sent, traced")
    return "\n".join(lines)


def _show(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return f"{value:,}" if isinstance(value, int) else str(value)
