"""``labkit bench`` rows of chapter 11 (compress): the hooks vs torch's (top-k vs its plain all-reduce), hierarchical vs flat all-reduce."""

from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.course.bench.runner import BenchRow, divides, race_training_steps, rank_batch, row
from labkit.launch import launch
from labkit.timing import interleaved_medians

HIER_NUMEL = 2 ** 22  # 16 MiB of fp32
TOPK_RATIO = 0.01


def _hooked_gpt(config, state, hook):
    from labkit.models import GPT
    from labkit.oracles import builtin_ddp as DDP
    torch.manual_seed(0)
    model = DDP(GPT(config))
    if hook is not None:  # None: DDP's own all-reduce
        model.register_comm_hook(state, hook)
    return model


def _hook_vs_torch(repeats: int, which: str) -> dict:
    """A DDP training step of a GPT with labkit.compress's hook vs torch's (same settings)."""
    from labkit import compress
    from labkit.models import GPTConfig
    from labkit.oracles import DDP_BENCH_GPT, ZERO_BENCH_GPT, builtin_fp16_hook, builtin_powersgd
    if which == "fp16":
        config = GPTConfig(**DDP_BENCH_GPT)
        pairs = {"ours": (None, compress.fp16_compress_hook), "builtin": (None, builtin_fp16_hook())}
    elif which == "topk":  # torch has no top-k hook: against DDP's own all-reduce; one bucket (error by index)
        config = GPTConfig(**ZERO_BENCH_GPT)
        pairs = {"ours": (compress.TopKState(None, ratio=TOPK_RATIO), compress.topk_hook), "builtin": (None, None)}
    else:  # one bucket (the GPT is under DDP's 1 MiB first bucket): torch's hook hangs on gloo with several
        config = GPTConfig(**ZERO_BENCH_GPT)
        settings = dict(matrix_approximation_rank=4, start_powerSGD_iter=2, random_seed=0)
        pairs = {"ours": (compress.PowerSGDState(None, **settings), compress.powersgd_hook),
                 "builtin": builtin_powersgd(**settings)}
    models = {name: _hooked_gpt(config, *pair) for name, pair in pairs.items()}
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
    medians, tracers = race_training_steps(models, optimizers, rank_batch(config, 8), repeats)
    shapes = [tuple(p.shape) for p in models["ours"].module.parameters()]
    numel = sum(torch.Size(s).numel() for s in shapes)
    if which == "fp16":
        formula = 2 * numel
    elif which == "topk":  # all-gathers of k int64 indices and k fp32 values from each of N ranks
        formula = dist.get_world_size() * compress.topk_count(numel, TOPK_RATIO) * (8 + 4)
    else:
        counts = compress.powersgd_elements(shapes, 4)
        formula = 4 * (counts["uncompressed"] + counts["p"] + counts["q"])
    ours_bytes = sum(e.bytes for e in tracers["ours"].events)
    return dict(medians, traced=ours_bytes, formula=formula,
                builtin_bytes=sum(e.bytes for e in tracers["builtin"].events))


@row("compress_fp16")
def compress_fp16_row(repeats: int = 5, world_size: int = 2) -> BenchRow:
    """a DDP GPT step with your fp16 hook (chapter 11) vs torch's fp16_compress_hook"""
    r = launch(_hook_vs_torch, world_size, repeats, "fp16", timeout=600)[0]
    return BenchRow(f"DDP GPT step, fp16 hook, {world_size} ranks vs torch's fp16_compress_hook", r["ours"], r["builtin"],
                    r["traced"], r["formula"], extra=dict(builtin_bytes=r["builtin_bytes"]))


@row("compress_powersgd")
def compress_powersgd_row(repeats: int = 5, world_size: int = 2) -> BenchRow:
    """a DDP GPT step with your PowerSGD hook, rank 4 (chapter 11) vs torch's powerSGD_hook"""
    r = launch(_hook_vs_torch, world_size, repeats, "powersgd", timeout=600)[0]
    # torch's hook issues its P and Q all-reduces from future callbacks, on the backend's thread,
    # where the tracer does not see them: its traced bytes would be the uncompressed part only.
    return BenchRow(f"DDP GPT step, PowerSGD r=4, {world_size} ranks vs torch's powerSGD_hook", r["ours"], r["builtin"],
                    r["traced"], r["formula"])


@row("compress_topk")
def compress_topk_row(repeats: int = 5, world_size: int = 2) -> BenchRow:
    """a DDP GPT step with your top-k hook, 1% (chapter 11) vs torch's DDP without a hook"""
    r = launch(_hook_vs_torch, world_size, repeats, "topk", timeout=600)[0]
    return BenchRow(f"DDP GPT step, top-k 1%, {world_size} ranks vs torch's DDP all-reduce (no top-k hook in torch)",
                    r["ours"], r["builtin"], r["traced"], r["formula"], extra=dict(builtin_bytes=r["builtin_bytes"]))


def _hierarchical_vs_flat(repeats: int, nodes: int) -> dict:
    from labkit.comm import CommTracer
    from labkit.compress import NodeGroups, hierarchical_all_reduce
    world = dist.get_world_size()
    groups = NodeGroups(nodes, world // nodes)
    x = torch.randn(HIER_NUMEL)
    medians = interleaved_medians({"ours": lambda t: hierarchical_all_reduce(t, groups), "builtin": dist.all_reduce},
                                  lambda: x.clone(), repeats, warmup=1)
    with CommTracer() as tracer:
        hierarchical_all_reduce(x.clone(), groups)
    shard = -(-HIER_NUMEL // (world // nodes)) * 4
    return dict(medians, traced=sum(e.bytes for e in tracer.events), formula=2 * shard * (world // nodes) + shard)


@row("hierarchical")
def hierarchical_row(repeats: int = 5, world_size: int = 4) -> BenchRow:
    """your hierarchical all-reduce, 2 nodes x N/2 (chapter 11) vs a flat dist.all_reduce"""
    nodes = 2 if world_size % 2 == 0 else 1
    r = launch(_hierarchical_vs_flat, world_size, repeats, nodes, timeout=600)[0]
    return BenchRow(f"all-reduce of {HIER_NUMEL * 4 / 2**20:.0f} MiB fp32, hierarchical {nodes} x {world_size // nodes} "
                    f"vs flat dist.all_reduce (one machine: no slow links to save)", r["ours"], r["builtin"],
                    r["traced"], r["formula"])


@row("hierarchical_emulated")
def hierarchical_emulated_row(repeats: int = 5, world_size: int = 4):
    """your hierarchical all-reduce vs the flat ring on 2 emulated nodes x 2 ranks (always 4), 100 Mbit/s between nodes, against the alpha-beta model calibrated on the same bed"""
    from labkit.course import emulated as netbed  # validate() and the bed's names
    why = netbed.unavailable()
    if why:
        return f"hierarchical_emulated: skipped: {why}"
    plan = netbed.Plan(repeats=repeats, experiments=("allreduce",), trace_hierarchical=True)
    v = netbed.validate(plan)  # one launch: alpha-beta per link class fitted, then both all-reduces timed
    flat, hier = v.rows
    shard = -(-plan.allreduce_bytes // 4 // 2) * 4  # the traced buffers: reduce-scatter in, all-reduce, all-gather out
    formula = 2 * shard * 2 + shard
    return BenchRow(f"all-reduce of {plan.allreduce_bytes / 2**20:g} MiB fp32, hierarchical 2 x 2 vs flat ring, "
                    f"emulated nodes, {plan.bandwidth}/s between nodes", hier.measured_s, flat.measured_s,
                    v.details["hierarchical_traced_bytes"], formula,
                    extra=dict(predicted_ms={"hierarchical": hier.predicted_s * 1e3, "flat": flat.predicted_s * 1e3},
                               measured_over_predicted={"hierarchical": hier.measured_s / hier.predicted_s,
                                                        "flat": flat.measured_s / flat.predicted_s},
                               alpha_us={k: link.alpha * 1e6 for k, link in v.links.items()},
                               beta_ns_per_B={k: 1e9 / link.bandwidth for k, link in v.links.items()}))


# ----------------------------------------------------------------------------- collective matmul

CM_BATCH, CM_SEQ, CM_EMBD = 4, 256, 256  # per rank [4, 256/N, 256]; hidden 1024


def _collective_matmul_vs_unsplit(repeats: int) -> dict:
    """Forward + backward of an MLP block, sequence-parallel: collective matmuls (labkit.compress)
    vs the chapter-05 layers behind one all-gather / reduce-scatter of the sequence (chapter 07)."""
    from types import SimpleNamespace

    from labkit.comm import CommTracer, wire_bytes
    from labkit.compress import CollectiveMatmulMLP
    from labkit.timing import WaitClock
    from labkit.models import MLP
    from labkit.sp import gather_sequence, reduce_scatter_sequence
    from labkit.tp import ParallelMLP
    torch.set_num_threads(1)
    n, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    block = MLP(SimpleNamespace(n_embd=CM_EMBD, bias=True))
    unsplit = ParallelMLP(block)
    unsplit.c_fc.input_op, unsplit.c_proj.output_op = gather_sequence, reduce_scatter_sequence
    models = {"ours": CollectiveMatmulMLP(block), "builtin": unsplit}
    x = torch.randn(CM_BATCH, CM_SEQ // n, CM_EMBD, generator=torch.Generator().manual_seed(rank))

    def step(name):
        def run(inp):
            models[name](inp).sum().backward()
        return run

    medians = interleaved_medians({name: step(name) for name in models}, lambda: x.clone().requires_grad_(),
                                  repeats, warmup=2)
    with WaitClock() as clock:
        step("ours")(x.clone().requires_grad_())
    sent = {}
    for name in models:
        with CommTracer() as tracer:
            step(name)(x.clone().requires_grad_())
        sent[name] = sum(e.wire_bytes for e in tracer.events)
    # four sequence collectives per step (all-gather and reduce-scatter, forward and backward), each
    # (N-1)/N of the gathered [B, T, H] activation, in fp32
    formula = 4 * wire_bytes("all_gather", CM_BATCH * CM_SEQ * CM_EMBD * 4, n)
    return dict(medians, traced=sent["ours"], formula=formula, builtin_bytes=sent["builtin"], exposed_wait_s=clock.seconds)


@row("collective_matmul", divides(CM_SEQ, 4 * CM_EMBD),
     "its 256 tokens and 1024 hidden channels split evenly over the ranks")
def collective_matmul_row(repeats: int = 5, world_size: int = 2) -> BenchRow:
    """an MLP block's forward + backward on your collective matmuls (chapter 11) vs the chapter-05 layers + unsplit all-gather / reduce-scatter"""
    r = launch(_collective_matmul_vs_unsplit, world_size, repeats, timeout=600)[0]
    return BenchRow(f"MLP fwd+bwd [{CM_BATCH}, {CM_SEQ}, {CM_EMBD}], sequence-parallel, {world_size} ranks: collective "
                    f"matmul vs chapter-05 layers + unsplit all-gather/reduce-scatter", r["ours"], r["builtin"],
                    r["traced"], r["formula"], extra=dict(builtin_bytes=r["builtin_bytes"], exposed_wait_s=r["exposed_wait_s"]))
