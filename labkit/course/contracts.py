"""What each exercise may change: the catalogue the contract layer enforces.

``labkit.runtime.contracts`` wraps every public function and method of the exercise modules
while grading (in the test process and in every rank) and fails a call that changes a
tensor argument or the global random generators without declaring it. This file is the
only place such a declaration lives: one line per callable, with the reason, so that a
wrong declaration is a visible review item and not a silent exemption. ``labkit tasks
--contracts`` prints it. Anything not listed writes none of its tensor arguments and
consumes no global random state.

One rule is general, as PyTorch's own modules behave: the ``__init__`` of an ``nn.Module``
may draw its initial weights from torch's global generator.

    "module.function" or "module.Class.method": Declares(writes=(argument names), consumes=("rng",), why=...)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from labkit.course.chapters import CHAPTERS


@dataclass(frozen=True)
class Declares:
    writes: tuple[str, ...] = ()     # arguments written in place (their tensors, or the tensors they hold)
    consumes: tuple[str, ...] = ()   # "rng": draws from or reseeds the global generators
    casts: bool = False              # returns another floating dtype than its arguments' (mixed precision)
    registers: bool = False          # keeps state in its module on purpose (a registry other calls read)
    why: str = ""


CATALOGUE: dict[str, Declares] = {
    # 00 collectives: in place, as torch.distributed's own collectives are
    "collectives.exchange": Declares(writes=("recv_buf",), why="receives into the caller's buffer"),
    "collectives.ring_reduce_scatter": Declares(writes=("output",), why="the result goes into output, like dist.reduce_scatter_tensor"),
    "collectives.ring_all_gather": Declares(writes=("output",), why="the result goes into output, like dist.all_gather_into_tensor"),
    "collectives.ring_all_reduce": Declares(writes=("tensor",), why="reduces in place, like dist.all_reduce"),
    "collectives.pipelined_ring_all_reduce": Declares(writes=("tensor",), why="reduces in place, like dist.all_reduce"),
    # 02 DDP
    "ddp.broadcast_tensors": Declares(writes=("tensors",), why="overwrites every tensor with group rank 0's, in place (its docstring)"),
    "ddp.HookResult.__init__": Declares(writes=("buffer",), why="holds the bucket while its all-reduce is in flight: the bucket changes under it"),
    # 03 ZeRO
    "zero.unflatten_into": Declares(writes=("tensors",), why="copies the slices of flat into the tensors, the inverse of flatten (its docstring)"),
    # 04 FSDP: mixed precision gathers fp32 shards as bf16/fp16 parameters and reduces their
    # gradients back onto the fp32 shards
    "fsdp.AllGatherParams.forward": Declares(casts=True, why="mixed precision: fp32 shards gathered as param_dtype parameters"),
    "fsdp.AllGatherParams.backward": Declares(casts=True, why="mixed precision: param_dtype gradients reduced onto the fp32 shards"),
    "fsdp.FSDPUnit.reduce_scatter_grads": Declares(casts=True, why="mixed precision: gradients land in the shards' (fp32) dtype"),
    "fsdp.pack_grads": Declares(casts=True, why="mixed precision: packs param_dtype gradients in the reduce dtype"),
    "fsdp.unpack_shard_grads": Declares(casts=True, why="mixed precision: each gradient in its shard's dtype (its docstring)"),
    # 09 fault tolerance: resuming exactly means restoring the generators a run was using
    "elastic.restore_state": Declares(consumes=("rng",), why="restores the captured torch and Python RNG states (exact resume)"),
    "elastic.load_checkpoint": Declares(consumes=("rng",), why="restores the checkpoint's RNG states (exact resume)"),
    "elastic.resume_training": Declares(consumes=("rng",), why="builds, trains (dropout, shuffles) and restores RNG states from checkpoints"),
    # 10/12: dropout draws from the global generator, as torch's dropout does (a checkpoint
    # restores the state it saw before the forward, so the recompute draws the same masks)
    "recompute.attention_core": Declares(consumes=("rng",), why="attention dropout"),
    "recompute.causal_attention": Declares(consumes=("rng",), why="attention dropout"),
    "recompute.MemoryBlock.forward": Declares(consumes=("rng",), why="dropout in the block"),
    "recompute.Checkpoint.forward": Declares(consumes=("rng",), why="runs the wrapped function, whose dropout draws"),
    "recompute.Checkpointed.forward": Declares(consumes=("rng",), why="runs the wrapped module, whose dropout draws"),
    "recompute.offloaded_forward": Declares(consumes=("rng",), why="the model's forward, whose dropout draws"),
    "recompute.chunked_cross_entropy": Declares(casts=True, why="the loss is an fp32 scalar whatever the inputs' dtype (its docstring)"),
    "recompute.ChunkedCrossEntropy.backward": Declares(casts=True, why="the fp32 loss's gradient comes back in each input's dtype (its docstring)"),
    "recompute.memory_gpt": Declares(consumes=("rng",), why="builds the model from its seed (torch.manual_seed(seed), as a script would)"),
    # 13 RPC: a name service: the owner registers an object under a name, connect() finds it
    "rpc.serve": Declares(registers=True, why="registers the RRef under its name for connect()"),
    "rpc.start_server": Declares(registers=True, why="serves the parameter server under its name (rpc.serve)"),
    "rpc.start_batching_server": Declares(registers=True, why="serves the batching server under its name (rpc.serve)"),
    # 11 communication efficiency: torch's comm hooks work on the bucket in place
    "compress.hierarchical_all_reduce": Declares(writes=("tensor",), why="reduces in place, like dist.all_reduce"),
    "compress.orthogonalize": Declares(writes=("matrix",), why="Gram-Schmidt in place, as torch's _orthogonalize does"),
    "compress.PowerSGDState.random_qs": Declares(writes=("qs",), why="fills the Q matrices in place (from its own generator, not the global one)"),
}


MODE_ENV = "LABKIT_CONTRACTS_MODE"   # "raise" (default), "record:<path>" (collect, for review), "off"


def spec(mode: str | None = None) -> dict | None:
    """What ``labkit.runtime.contracts.install`` takes; None when contracts are switched off."""
    mode = mode or os.environ.get(MODE_ENV, "raise")
    if mode == "off":
        return None
    declared = {name: dict(writes=list(d.writes), consumes=list(d.consumes) + ["dtype"] * d.casts
                                                          + ["globals"] * d.registers)
                for name, d in CATALOGUE.items()}
    return dict(modules=sorted(CHAPTERS.values()), declared=declared, init_may_consume=True, mode=mode)


def enable(mode: str | None = None) -> str | None:
    """Check every exercise call in this process from now on; return the value of
    ``LABKIT_CONTRACTS`` that makes the ranks of a launch do the same (the grading plugin
    sets it around each graded test only: a notebook or lab that the suite also runs is
    measured as a learner runs it, without the checks' copies), or None when switched off."""
    from labkit.runtime import contracts
    wanted = spec(mode)
    if wanted is None:
        return None
    contracts.install(wanted)
    return json.dumps(wanted)


def describe(task_prefix: str | None = None) -> list[str]:
    """One line per declaration (for ``labkit tasks --contracts``)."""
    lines = []
    for name, d in sorted(CATALOGUE.items()):
        if task_prefix and not name.startswith(task_prefix):
            continue
        what = ", ".join([f"writes {', '.join(d.writes)}"] * bool(d.writes) + ["consumes the global RNG"] * bool(d.consumes)
                         + ["casts"] * d.casts + ["registers in its module"] * d.registers)
        lines.append(f"{name:<44} {what}: {d.why}")
    return lines
