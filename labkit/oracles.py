"""The oracles: PyTorch's own implementation of each technique, set up the way the course's
version is, and the model shapes they are compared on.

Tests, labs and ``labkit bench`` all check or time the learner's code against these, so
the built-in side is written once. An exercise module never imports this (see
``labkit.course.rules``); the comparison code does.

    chapter  built-in                                     here
    01, 02   DistributedDataParallel                      builtin_ddp
    03       ZeroRedundancyOptimizer                      builtin_zero
    04       fully_shard (FSDP2), MixedPrecisionPolicy    builtin_fully_shard, mixed_precision_policy
    05       parallelize_module (TP plan), loss_parallel  builtin_tensor_parallel, builtin_block_tensor_parallel,
                                                          loss_parallel
    06       PipelineStage + Schedule*                    builtin_pipeline
    07       parallelize_module (SP plan)                 builtin_sequence_parallel
    08       init_device_mesh, fully_shard x TP           device_mesh, builtin_2d
    09       torch.distributed.checkpoint (DCP)           dcp_save, dcp_load, full_state_dict
    11       DDP comm hooks (fp16, PowerSGD)              builtin_fp16_hook, builtin_powersgd
    12       torch.utils.checkpoint (non-reentrant)       builtin_checkpoint

torch.distributed's submodules are imported inside the functions, on the ranks that use
them: importing this module costs nothing more than torch (``labkit tasks`` stays fast, and
``torch.distributed.optim`` compiles TorchScript at import).
"""

from __future__ import annotations

import torch


def heads_in_rank_order(weight: torch.Tensor, world: int) -> torch.Tensor:
    """c_attn's rows [Q | K | V] reordered to [Q_0 K_0 V_0 | Q_1 K_1 V_1 | ...], so that a
    contiguous split over ``world`` ranks (what torch's plans do) gives each rank whole heads
    of Q, K and V, as the course's head-parallel attention holds them."""
    q, k, v = weight.chunk(3, 0)
    return torch.cat([torch.cat([t.chunk(world, 0)[r] for t in (q, k, v)]) for r in range(world)])

# A GPT with 0.83 M parameters (3.3 MB of fp32 gradients): big enough that a step is tens of
# milliseconds of compute and a few MB of all-reduce, small enough for a laptop.
DDP_BENCH_GPT = dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)


def device_mesh(shape: tuple[int, ...] | None = None, names: tuple[str, ...] | None = None,
                device_type: str = "cpu"):
    """torch's ``init_device_mesh`` over every rank: 1-D ``(world,)`` unless ``shape`` is
    given (rank r at ``torch.arange(world).view(shape)``'s position of r, the last axis
    fastest, as ``labkit.mesh.RankGrid`` lays ranks out), its axes named ``names``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    shape = shape or (dist.get_world_size(),)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def builtin_ddp(model, process_group=None, **options):
    """``model`` wrapped in torch's ``DistributedDataParallel`` over ``process_group`` (default:
    every rank), the built-in of ``labkit.dp.average_gradients`` (chapter 01) and of
    ``labkit.ddp.DDP`` (chapter 02). At its defaults it broadcasts rank 0's parameters and
    buffers at construction, averages gradients in buckets (25 MB by default) during backward and
    broadcasts buffers before each forward; ``options`` (``bucket_cap_mb``,
    ``find_unused_parameters``, ...) go to it unchanged."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, process_group=process_group, **options)



def builtin_fp16_hook():
    """torch's ``fp16_compress_hook`` (chapter 11's oracle for ``compress.fp16``): the bucket
    cast to float16, divided by the group size, all-reduced and cast back. Register it with
    ``ddp.register_comm_hook(None, hook)``."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    return fp16_compress_hook


def builtin_powersgd(process_group=None, **settings):
    """torch's PowerSGD (chapter 11's oracle for ``compress.powersgd``): ``(state, hook)`` for
    ``ddp.register_comm_hook(state, hook)``, the state made with ``settings``
    (``matrix_approximation_rank``, ``start_powerSGD_iter``, ``min_compression_rate``,
    ``random_seed``, ...), as ``labkit.compress.PowerSGDState`` takes them. On gloo torch's hook
    hangs when DDP has several buckets: compare it on models that fit one bucket."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    return powerSGD_hook.PowerSGDState(process_group, **settings), powerSGD_hook.powerSGD_hook

# A small GPT (~0.1 M parameters, 0.42 MB fp32): its AdamW state is twice that.
ZERO_BENCH_GPT = dict(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=64)


def builtin_zero(params, optimizer_class, process_group=None, **options):
    """torch's ``ZeroRedundancyOptimizer``, the built-in of ``labkit.zero.ShardedOptimizer``
    (ZeRO-1, chapter 03): ``optimizer_class(**options)`` over this rank's share of ``params``
    (whole parameters, assigned greedily, as the course assigns them), the updated ones
    broadcast by their owners after each step. It expects the gradients already averaged
    (DDP, or ``average_gradients``), as stage 1 does."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(params, optimizer_class, process_group=process_group, **options)


# The GPT of the FSDP lab: 4 blocks, 0.2 M parameters (0.8 MB fp32), short sequences, so
# that parameters, gradients and AdamW state, not activations, dominate a rank's memory.
FSDP_BENCH_GPT = dict(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=64)


def mixed_precision_policy(param_dtype=None, reduce_dtype=None):
    """torch's ``MixedPrecisionPolicy``; ``labkit.fsdp.fully_shard`` takes the same object."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def builtin_fully_shard(model, mesh=None, **options):
    """``model`` (a labkit GPT) sharded by torch's ``fully_shard`` (FSDP2) the way the course
    shards it with ``labkit.fsdp.fully_shard``: one unit per block of ``model.blocks``, then
    the root unit (what is left: wte/lm_head, wpe, ln_f), each over ``mesh`` (default: a 1-D
    mesh of every rank, on the device type of ``model``'s parameters). ``options``
    (``mp_policy``, ``reshard_after_forward``, ...) go to every call. Returns ``model``."""
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        mesh = device_mesh(device_type=next(model.parameters()).device.type)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return model



def cpu_offload_policy(pin_memory: bool | None = None):
    """FSDP2's ``CPUOffloadPolicy`` (chapter 12's oracle for ``recompute.optimizer_offload``):
    with ``builtin_fully_shard(model, offload_policy=...)`` the sharded parameters, gradients
    and optimizer state live on the host and the optimizer steps there. Pinned host memory
    only where CUDA is there (default)."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory)

# A GPT where the matmuls are worth splitting: 4 blocks of 256 channels, 8 heads, 1.6 M
# parameters (untied head: parallelize_module cannot split a tied one), sequences of 64.
TP_BENCH_GPT = dict(vocab_size=512, block_size=64, n_layer=4, n_head=8, n_embd=256, tie_weights=False)


def _reorder_heads(block, n: int) -> None:
    """c_attn's rows as [Q_0 K_0 V_0 | Q_1 K_1 V_1 | ...]: torch's contiguous split then gives
    each of the n ranks its own heads, as labkit.tp's split does."""
    with torch.no_grad():
        for p in (block.attn.c_attn.weight, block.attn.c_attn.bias):
            p.copy_(heads_in_rank_order(p, n))


def _block_plan(prefix: str = "") -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {f"{prefix}attn.c_attn": ColwiseParallel(), f"{prefix}attn.c_proj": RowwiseParallel(),
            f"{prefix}mlp.c_fc": ColwiseParallel(), f"{prefix}mlp.c_proj": RowwiseParallel()}


def builtin_tensor_parallel(model, mesh):
    """``model`` (a labkit GPT) split by torch's ``parallelize_module`` exactly as
    ``labkit.tp.tensor_parallel`` splits it (c_attn's rows first reordered so that each rank
    gets its own heads). Its loss is a DTensor: compute it and backward under ``loss_parallel()``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"wte": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i, block in enumerate(model.blocks):
        _reorder_heads(block, mesh.size())
        plan |= _block_plan(f"blocks.{i}.")
    return parallelize_module(model, mesh, plan)


def builtin_block_tensor_parallel(block, mesh):
    """One labkit ``Block`` split by ``parallelize_module`` as chapter 05 splits it: the
    all-reduce baseline that sequence parallelism (chapter 07) improves on."""
    from torch.distributed.tensor.parallel import parallelize_module

    _reorder_heads(block, mesh.size())
    return parallelize_module(block, mesh, _block_plan())


def loss_parallel():
    """torch's ``loss_parallel()`` context: the cross-entropy of a vocabulary-sharded DTensor
    (the lm_head of ``builtin_tensor_parallel``) without gathering the logits; run the loss's
    forward and backward inside it."""
    from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel

    return torch_loss_parallel()


# One block per rank, 256 channels, micro-batches of 4 sequences of 64 tokens: each action
# is a few milliseconds of compute, so scheduling and messages show. Untied head (the
# built-in does not sum a tied embedding split across ranks).
PP_BENCH_GPT = dict(vocab_size=256, block_size=64, n_head=4, n_embd=256, tie_weights=False)


# The course's schedule names (labkit.pp) and torch.distributed.pipelining's classes; the first
# two run one stage per rank, the others several (v chunks, stage s on rank s mod p).
PIPELINE_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                      "interleaved": "ScheduleInterleaved1F1B", "zero_bubble": "ScheduleInterleavedZeroBubble"}


def builtin_pipeline(stages: dict, n_stages: int, schedule: str, n_microbatches: int, loss_fn,
                     device=torch.device("cpu")):
    """torch.distributed.pipelining's schedule ``schedule`` (a key of ``PIPELINE_SCHEDULES``)
    over this rank's ``stages`` ({stage index: module}, e.g. from ``labkit.pp.split_gpt``, in
    increasing index), each a ``PipelineStage`` of ``n_stages``; ``loss_fn(output, target)``
    per micro-batch, as the course's runner calls it. Run a step with
    ``schedule.step(x on the first stage's rank, target=y, losses=[] on the last's)``."""
    from torch.distributed import pipelining

    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"builtin_pipeline: unknown schedule {schedule!r}; one of {sorted(PIPELINE_SCHEDULES)}")
    torch_stages = [pipelining.PipelineStage(module, index, n_stages, device) for index, module in stages.items()]
    schedule_class = getattr(pipelining, PIPELINE_SCHEDULES[schedule])
    one_stage = schedule in ("gpipe", "1f1b")  # single-stage schedules take the stage, not a list
    return schedule_class(torch_stages[0] if one_stage else torch_stages, n_microbatches, loss_fn=loss_fn)


SP_BENCH_GPT = dict(vocab_size=64, block_size=512, n_layer=1, n_head=8, n_embd=256)


def builtin_sequence_parallel(block, mesh):
    """A labkit ``Block`` with torch's Megatron-SP plan: LayerNorms on sequence shards
    (``SequenceParallel``), all-gather into attention and MLP (``PrepareModuleInput``),
    column/row layers, reduce-scatter out (``RowwiseParallel(output_layouts=Shard(1))``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    _reorder_heads(block, mesh.size())
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan = {"ln_1": SequenceParallel(), "ln_2": SequenceParallel(), "attn": gather, "mlp": gather,
            "attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
            "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel(output_layouts=Shard(1))}
    return parallelize_module(block, mesh, plan)


MESH_BENCH_GPT = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128, tie_weights=False)


def builtin_2d(model, dp: int, tp: int):
    """torch's 2-D composition of ``model`` (a labkit GPT, untied head) on a ``(dp, tp)``
    mesh named ("dp", "tp"), as ``labkit.mesh`` composes the course's parts:
    ``builtin_tensor_parallel`` on the tp sub-mesh, then ``builtin_fully_shard`` on the dp
    sub-mesh. Its loss is a DTensor: compute it and backward under torch's
    ``loss_parallel()``. Returns the model."""
    mesh = device_mesh((dp, tp), ("dp", "tp"))
    return builtin_fully_shard(builtin_tensor_parallel(model, mesh["tp"]), mesh["dp"])


# ----------------------------------------------------------------------------- chapter 09: DCP


def dcp_save(model, optimizer, path: str) -> None:
    """Save ``model`` and ``optimizer`` with torch.distributed.checkpoint (a collective: every
    rank calls it), the built-in of ``labkit.elastic.save_checkpoint``: each rank writes its
    shards, under {"model": ..., "optim": ...} from ``get_state_dict``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)


def dcp_load(model, optimizer, path: str) -> None:
    """Load what ``dcp_save`` wrote into ``model`` and ``optimizer``, at this world size and
    this sharding (DCP reshards; ``labkit.elastic.load_checkpoint`` is the course's)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def full_state_dict(model) -> dict:
    """The whole (unsharded) parameters of a ``fully_shard`` model, on the CPU, **on rank 0**
    (torch's ``cpu_offload`` option leaves the other ranks an empty dict): compare it with
    ``labkit.fsdp.full_state_dict`` (which fills every rank) on rank 0. Every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


class builtin_checkpoint(torch.nn.Module):
    """``block`` (a module or any function of tensors) run under ``torch.utils.checkpoint``,
    non-reentrant (the recommended mode): put it where the block was
    (``model.blocks[i] = builtin_checkpoint(model.blocks[i])``), or call it once.
    ``early_stop=False`` makes backward run the block's whole forward again; by default torch
    stops recomputing once every saved tensor is back, which skips the ops after the last one
    that saves anything (in the course's block, the MLP's output projection: chapter 14)."""

    def __init__(self, block, early_stop: bool = True):
        super().__init__()
        self.block, self.early_stop = block, early_stop

    def forward(self, *inputs):
        from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

        with set_checkpoint_early_stop(self.early_stop):
            return checkpoint(self.block, *inputs, use_reentrant=False)
