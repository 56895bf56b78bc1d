"""Chapter 08 exercises: hybrid parallelism on a rank mesh, and a layout planner.

Real runs combine the methods of chapters 02-07, each where it fits the hardware:
tensor parallelism inside a node (an all-reduce per layer needs the fastest links),
pipeline parallelism across nodes (only point-to-point activations), data parallelism
(DDP, ZeRO or FSDP) over whatever is left, context parallelism when sequences are long.
The world is laid out as a grid of shape (dp, pp, cp, tp), TP the fastest-moving axis so
that a TP group is consecutive ranks, i.e. one node:

    rank = ((d * pp + p) * cp + c) * tp + t          (PyTorch's init_device_mesh order)

Each rank belongs to one group per axis: the ranks that differ from it only along that
axis. A TP all-reduce runs on the TP group, a pipeline send goes to the next rank of the PP
group, the gradient average runs on the DP group.

The planner (``Layout``, ``ModelShape``, ``memory_per_gpu``, ``step_time``) is the
arithmetic behind the chapter's widget: per GPU, the parameters, gradients and optimizer
state a layout leaves on it (the tests compare it with the bytes measured on real ranks),
the activations, and a rough step time.

Tasks (run ``labkit grade mesh``; tests in ``tests/grading/test_mesh.py``):
    mesh.grid       RankGrid: coordinates, axis groups (the same as init_device_mesh's)
    mesh.train_2d   parallelize_2d: your tensor parallelism (05) on tp, your FSDP (04) on dp
    mesh.train_3d   build_stages_3d: your TP (05) inside your pipeline stages (06) on pp
    mesh.plan       parameters_on_rank, memory_per_gpu
``train_2d`` and ``train_3d`` (given) run the training loops around your functions.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit import budget
from labkit.models import GPT, GPTConfig

AXES = ("dp", "pp", "cp", "tp")  # slowest to fastest


# ----------------------------------------------------------------------------- the grid


class RankGrid:
    """The ranks laid out as a (dp, pp, cp, tp) grid, and one process group per axis.

    ``RankGrid(world_size, dp=2, tp=2)`` (degrees default to 1) raises ValueError unless the
    degrees multiply to ``world_size``. ``coords(rank)`` -> {"dp": d, "pp": p, ...};
    ``axis_ranks(axis, rank)`` -> the ranks of ``rank``'s group along ``axis``, in order;
    ``make_groups()`` (a collective: every rank calls it) creates every group of every axis and
    keeps this rank's; ``group(axis)`` returns it.
    """

    def __init__(self, world_size: int, *, dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1):
        self.degrees = dict(dp=dp, pp=pp, cp=cp, tp=tp)
        # BEGIN SOLUTION mesh.grid: every degree >= 1, their product == world_size, else ValueError naming the degrees
        for axis, size in self.degrees.items():
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"the {axis} degree must be a positive integer, got {size!r}")
        if math.prod(self.degrees.values()) != world_size:
            shape = " x ".join(f"{axis}={size}" for axis, size in self.degrees.items())
            raise ValueError(f"{shape} = {math.prod(self.degrees.values())} ranks, but the world has {world_size}")
        # END SOLUTION
        self.world_size = world_size
        self._groups: dict[str, dist.ProcessGroup] = {}

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along every axis (TP fastest)."""
        # BEGIN SOLUTION mesh.grid: peel the axes off from the fastest (tp) to the slowest (dp) with divmod
        coords = {}
        for axis in reversed(AXES):
            rank, coords[axis] = divmod(rank, self.degrees[axis])
        return {axis: coords[axis] for axis in AXES}
        # END SOLUTION

    def rank_of(self, coords: dict[str, int]) -> int:
        # BEGIN SOLUTION mesh.grid: rank = ((d * pp + p) * cp + c) * tp + t
        rank = 0
        for axis in AXES:
            rank = rank * self.degrees[axis] + coords[axis]
        return rank
        # END SOLUTION

    def axis_ranks(self, axis: str, rank: int) -> list[int]:
        """The ranks that differ from ``rank`` only along ``axis``, in order along it."""
        # BEGIN SOLUTION mesh.grid: vary coords(rank)[axis] over range(degree), map back with rank_of
        here = self.coords(rank)
        return [self.rank_of(here | {axis: i}) for i in range(self.degrees[axis])]
        # END SOLUTION

    def make_groups(self) -> "RankGrid":
        """Create every group of every axis, in the same order on every rank (new_group is a
        collective over the whole world); keep this rank's. Returns self."""
        me = dist.get_rank()
        for axis in AXES:
            seen = set()
            for rank in range(self.world_size):
                members = tuple(self.axis_ranks(axis, rank))
                if members in seen:
                    continue
                seen.add(members)
                group = dist.new_group(list(members))
                if me in members:
                    self._groups[axis] = group
        return self

    def group(self, axis: str):
        if axis not in self._groups:
            raise RuntimeError("call make_groups() on every rank first")
        return self._groups[axis]

    def __repr__(self) -> str:
        return "RankGrid(" + ", ".join(f"{a}={s}" for a, s in self.degrees.items()) + ")"


# ----------------------------------------------------------------------------- 2-D and 3-D


def parallelize_2d(gpt: GPT, grid: RankGrid) -> GPT:
    """FSDP x TP: split ``gpt`` with your ``labkit.tp.tensor_parallel`` over the TP group,
    then shard what each rank holds with your ``labkit.fsdp.fully_shard`` over the DP group
    (one unit per block, then the root). Returns the model."""
    from labkit.fsdp import fully_shard
    from labkit.tp import tensor_parallel
    # BEGIN SOLUTION mesh.train_2d: tensor_parallel(gpt, grid.group("tp")); fully_shard each block, then gpt, with process_group=grid.group("dp")
    tensor_parallel(gpt, grid.group("tp"))
    for block in gpt.blocks:
        fully_shard(block, grid.group("dp"))
    fully_shard(gpt, grid.group("dp"))
    return gpt
    # END SOLUTION


def build_stages_3d(gpt: GPT, grid: RankGrid) -> dict[int, nn.Module]:
    """DP x PP x TP: your ``tensor_parallel`` over the TP group, then your ``labkit.pp.split_gpt``
    into ``grid.degrees["pp"]`` stages balanced by layers; return {stage: module} of the
    stage this rank runs (its PP coordinate)."""
    from labkit.pp import split_gpt
    from labkit.tp import tensor_parallel
    # BEGIN SOLUTION mesh.train_3d: tensor_parallel(gpt, tp group); stages = split_gpt(gpt, pp, balance="layers"); keep {pp coord: stages[pp coord]}
    tensor_parallel(gpt, grid.group("tp"))
    stages = split_gpt(gpt, grid.degrees["pp"], balance="layers")
    stage = grid.coords(dist.get_rank())["pp"]
    return {stage: stages[stage]}
    # END SOLUTION


@dataclass
class Trained:
    losses: list[float]          # the global-batch loss of every step (the same on every rank)
    param_bytes: int             # what this rank holds at the end (labkit.memory)
    grad_bytes: int
    optimizer_bytes: int


def dp_slice(x: torch.Tensor, grid: RankGrid) -> torch.Tensor:
    """This rank's part of a global batch: split along dim 0 over the DP axis only (TP and PP
    ranks of one replica see the same samples)."""
    d, dp = grid.coords(dist.get_rank())["dp"], grid.degrees["dp"]
    if len(x) % dp:
        raise ValueError(f"a global batch of {len(x)} does not split over dp={dp} replicas")
    share = len(x) // dp
    return x[d * share:(d + 1) * share]


def _global_loss(local: torch.Tensor | None, grid: RankGrid, last_stage_rank: int) -> float:
    """The mean over DP replicas of the loss the last pipeline stage computed."""
    loss = torch.zeros((), dtype=torch.float64) if local is None else local.detach().double().clone()
    if grid.degrees["pp"] > 1:
        dist.broadcast(loss, src=last_stage_rank, group=grid.group("pp"))
    dist.all_reduce(loss, group=grid.group("dp"))
    return (loss / grid.degrees["dp"]).item()


def _memory(params, optimizer) -> tuple[int, int, int]:
    from labkit.memory import optimizer_state_bytes, tensor_bytes
    params = list(dict.fromkeys(params))
    return (tensor_bytes(params), tensor_bytes([p.grad for p in params if p.grad is not None]),
            optimizer_state_bytes(optimizer))


def train_2d(config: GPTConfig, grid: RankGrid, x, y, steps: int, lr: float = 1e-2,
             dtype=torch.float64) -> Trained:
    """Train ``GPT(config)`` with ``parallelize_2d`` for ``steps`` AdamW steps on the global
    batches ``x[step]``, ``y[step]`` (each rank takes its ``dp_slice``)."""
    model = parallelize_2d(GPT(config).to(dtype), grid)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, memory = [], None
    for step in range(steps):
        loss = model(dp_slice(x[step], grid), dp_slice(y[step], grid))[1]
        loss.backward()
        if step == steps - 1:
            memory = _memory(model.parameters(), opt)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(_global_loss(loss, grid, 0))
    return Trained(losses, *memory)


def train_3d(config: GPTConfig, grid: RankGrid, x, y, steps: int, microbatches: int, lr: float = 1e-2,
             dtype=torch.float64) -> Trained:
    """Train ``GPT(config)`` (untied) on a dp x pp x tp grid: ``build_stages_3d``, your 1F1B
    (``labkit.pp.one_f_one_b``) on the PP group, the vocabulary-parallel loss on the TP group,
    then your ``labkit.dp.average_gradients`` over the DP group, and AdamW."""
    from labkit import pp
    from labkit.dp import average_gradients
    from labkit.tp import vocab_parallel_cross_entropy
    if config.tie_weights and grid.degrees["pp"] > 1:
        raise ValueError("3-D training here needs an untied head: GPTConfig(tie_weights=False)")
    stages = build_stages_3d(GPT(config).to(dtype), grid)
    stage_index, p = next(iter(stages)), grid.degrees["pp"]
    runner = pp.PipelineRunner(stages, p, group=grid.group("pp") if p > 1 else None)
    actions = pp.one_f_one_b(p, microbatches)[stage_index]
    loss_fn = functools.partial(vocab_parallel_cross_entropy, group=grid.group("tp"))
    module = stages[stage_index]
    params = list(dict.fromkeys(module.parameters()))
    opt = torch.optim.AdamW(params, lr=lr)
    last = grid.axis_ranks("pp", dist.get_rank())[-1]
    losses, memory = [], None
    for step in range(steps):
        loss, _ = runner.step(actions, dp_slice(x[step], grid), dp_slice(y[step], grid), microbatches, loss_fn)
        average_gradients(module, grid.group("dp"))
        if step == steps - 1:
            memory = _memory(params, opt)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(_global_loss(loss, grid, last))
    return Trained(losses, *memory)


# ----------------------------------------------------------------------------- the planner


@dataclass(frozen=True)
class ModelShape:
    """A GPT as ``labkit.models.GPT`` builds it: pre-LN blocks, MLP 4h, biases, learned
    positions, an output layer tied to the token embedding or not."""
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    tied: bool = True

    @classmethod
    def of(cls, config: GPTConfig) -> "ModelShape":
        return cls(config.n_layer, config.n_embd, config.n_head, config.vocab_size, config.block_size,
                   config.tie_weights)


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero: int = 0            # 0 (DDP), 1, 2, 3 (= FSDP): what the DP axis shards
    microbatch: int = 1      # sequences per micro-batch
    microbatches: int = 1    # per pipeline step (gradient accumulation without a pipeline)
    recompute: bool = False  # full activation recomputation

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


def block_tensors(shape: ModelShape, tp: int) -> list[tuple[int, int]]:
    """(rows, columns) of one block's parameter tensors on one TP rank, in the model's order:
    ln_1 (w, b), c_attn (w, b: split by rows), c_proj (w split by columns, b whole), ln_2,
    c_fc (split by rows), c_proj (split by columns). A vector is (n, 1)."""
    h = shape.hidden
    return [(h, 1), (h, 1), (3 * h // tp, h), (3 * h // tp, 1), (h, h // tp), (h, 1),
            (h, 1), (h, 1), (4 * h // tp, h), (4 * h // tp, 1), (h, 4 * h // tp), (h, 1)]


def layers_on_stage(shape: ModelShape, layout: Layout, stage: int) -> int:
    """Blocks on pipeline ``stage``: as even as possible, the first stages taking one more when
    pp does not divide the layers (as ``labkit.pp.split_gpt(balance="layers")`` cuts)."""
    whole, extra = divmod(shape.layers, layout.pp)
    return whole + (stage < extra)


def stage_tensors(shape: ModelShape, layout: Layout, stage: int) -> list[tuple[int, int]]:
    """(rows, columns) of the parameter tensors one rank of pipeline ``stage`` holds after
    tensor parallelism."""
    h, tp = shape.hidden, layout.tp
    tensors = [t for _ in range(layers_on_stage(shape, layout, stage)) for t in block_tensors(shape, tp)]
    if stage == 0:
        tensors = [(shape.vocab // tp, h), (shape.seq, h)] + tensors       # wte (vocab-parallel), wpe
    if stage == layout.pp - 1:
        tensors = tensors + [(h, 1), (h, 1)]                                # ln_f
        if not shape.tied or layout.pp > 1:
            tensors.append((shape.vocab // tp, h))                          # lm_head (its own copy on another stage)
    return tensors


def parameters_on_rank(shape: ModelShape, layout: Layout, stage: int = 0) -> dict[str, int]:
    """Elements of parameters, gradients and optimizer state one rank of ``stage`` keeps, as
    this course's implementations keep them: TP splits as in chapter 05; ZeRO-3/FSDP shards
    every tensor along dim 0, padded to ceil(rows / dp) rows (chapter 04); AdamW keeps two
    moments per element and one step counter per tensor. Returns {"params", "grads",
    "optimizer", "tensors"} (elements; ``tensors``: how many, i.e. step counters)."""
    tensors = stage_tensors(shape, layout, stage)
    # BEGIN SOLUTION mesh.plan: with ZeRO-3 over dp > 1 each (rows, cols) keeps ceil(rows / dp) * cols elements, else rows * cols; params = grads = their sum; optimizer = 2 x that; tensors = how many
    dp = layout.dp if layout.zero >= 3 else 1
    elements = sum(-(-rows // dp) * cols for rows, cols in tensors)
    return dict(params=elements, grads=elements, optimizer=2 * elements, tensors=len(tensors))
    # END SOLUTION


def memory_per_gpu(shape: ModelShape, layout: Layout, stage: int = 0, bytes_per_element: int = 2,
                   master_bytes: int = 4) -> dict[str, float]:
    """Bytes per GPU of one rank of ``stage``: parameters and gradients in ``bytes_per_element``,
    AdamW's two moments (and an fp32 master copy when training in 16 bits) in ``master_bytes``,
    sharded by ZeRO stage over the data-parallel ranks (dp x cp: context-parallel ranks hold
    the same weights, as in Megatron); activations from Korthikanti et al. (2022):
    s b h (34 + 5 a s / h) bytes per layer in 16-bit training, with tensor + sequence
    parallelism divided by tp; with cp each rank keeps s/cp of the tokens (scores against all
    s keys); times the micro-batches a pipeline stage keeps in flight. With full recomputation
    a layer keeps only its input, 2 s b h / tp, plus one layer's worth while it recomputes."""
    # the byte formulas are labkit.budget's (shared with chapters 08 and 12)
    elements = parameters_on_rank(shape, replace_zero(layout, 0), stage)["params"]
    states = budget.model_state_bytes(elements, budget.adamw_bytes(bytes_per_element, master_bytes),
                                      layout.zero, shards=layout.dp * layout.cp)
    in_flight = min(layout.pp - stage, layout.microbatches) if layout.pp > 1 else 1
    activations = budget.korthikanti_activation_bytes(
        layers_on_stage(shape, layout, stage), shape.seq, shape.hidden, shape.heads, micro=layout.microbatch,
        tp=layout.tp, cp=layout.cp, held=in_flight, full=layout.recompute)
    return dict(**states, activations=activations,
                total=states["params"] + states["grads"] + states["optimizer"] + activations)


def replace_zero(layout: Layout, zero: int) -> Layout:
    from dataclasses import replace
    return replace(layout, zero=zero)


@dataclass(frozen=True)
class Cluster:
    gpus_per_node: int = 8
    gpu_memory: float = 80e9        # bytes
    flops: float = 989e12           # dense 16-bit FLOP/s of one GPU (H100 SXM)
    mfu: float = 0.45               # fraction of it a good run achieves
    intra_node: float = 450e9       # bytes/s per GPU, one direction (NVLink)
    inter_node: float = 50e9        # bytes/s per GPU (400 Gb/s InfiniBand)


def step_time(shape: ModelShape, layout: Layout, cluster: Cluster, global_batch: int,
              bytes_per_element: int = 2) -> dict[str, float]:
    """A rough step time: compute (6 N + 12 L h s) FLOPs per token (Narayanan et al. 2021; 8 N +
    16 L h s with recomputation) over GPUs x FLOP/s x MFU, stretched by the pipeline bubble
    (p - 1) / (m + p - 1); TP's 4 all-reduces of s b h per layer per micro-batch on the
    intra-node links (inter-node if a TP group spans nodes); the DP gradient all-reduce (or
    reduce-scatter + all-gather) of the rank's parameters, on the intra-node links if the
    whole grid fits in one node, else the inter-node ones, not overlapped. Pipeline and
    context-parallel messages are left out (small next to these). Seconds."""
    params = 12 * shape.layers * shape.hidden ** 2 + shape.vocab * shape.hidden * (1 if shape.tied else 2)
    tokens = global_batch * shape.seq
    attention = 12 * shape.layers * shape.hidden * shape.seq
    per_token = 8 * params + attention * 4 / 3 if layout.recompute else 6 * params + attention
    compute = per_token * tokens / (layout.gpus * cluster.flops * cluster.mfu)
    m = max(layout.microbatches, 1)
    bubble = (layout.pp - 1) / (m + layout.pp - 1)
    s, b, h = shape.seq // layout.cp, layout.microbatch, shape.hidden
    tp_link = cluster.intra_node if layout.tp <= cluster.gpus_per_node else cluster.inter_node
    per_step_microbatches = global_batch // (layout.dp * layout.microbatch)
    tp_bytes = 4 * (shape.layers // layout.pp) * per_step_microbatches * 2 * (layout.tp - 1) / layout.tp \
        * s * b * h * bytes_per_element if layout.tp > 1 else 0.0
    tp_comm = tp_bytes / tp_link
    rank_params = params / (layout.tp * layout.pp)
    dp_link = cluster.intra_node if layout.gpus <= cluster.gpus_per_node else cluster.inter_node
    dp_comm = 2 * (layout.dp - 1) / layout.dp * rank_params * bytes_per_element / dp_link \
        * (1.5 if layout.zero >= 3 else 1.0)
    busy = compute + tp_comm
    total = busy / (1 - bubble) + dp_comm
    return dict(compute=compute, tp_comm=tp_comm, bubble=busy / (1 - bubble) - busy, dp_comm=dp_comm, total=total)
