"""``labkit bench`` rows of chapter 07 (sp): the course's implementation vs PyTorch's."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from labkit.course.bench.runner import BenchRow, divides, row
from labkit.launch import launch
from labkit.oracles import SP_BENCH_GPT, builtin_sequence_parallel
from labkit.timing import interleaved_medians

SP_ATTENTION = dict(batch=1, heads=8, head_dim=32, tokens=2048)  # the whole sequence, over all ranks


def _attention_vs_sdpa(kind: str, repeats: int, causal: bool) -> dict:
    """Forward + backward of causal attention over the whole sequence: this rank's rows with
    ring attention (contiguous and zig-zag rows, timed side by side) or Ulysses vs unsharded
    SDPA of the whole sequence on every rank."""
    from torch.utils.flop_counter import FlopCounterMode

    from labkit import sp
    from labkit.comm import CommTracer
    n, rank = dist.get_world_size(), dist.get_rank()
    b, h, d, t = (SP_ATTENTION[key] for key in ("batch", "heads", "head_dim", "tokens"))
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(b, h, t, d, generator=gen) for _ in range(3)]
    layouts = {"contiguous": sp.contiguous_positions(t, rank, n), "zig-zag": sp.zigzag_positions(t, rank, n)}

    def ring(layout):
        rows = layouts[layout]
        mine = [x.index_select(2, rows) for x in full]

        def step(_):
            q, k, v = (x.detach().requires_grad_() for x in mine)
            sp.ring_attention(q, k, v, rows, causal).sum().backward()
        return step

    def ulysses(_):
        q, k, v = (x.detach().requires_grad_() for x in mine)
        sp.ulysses_attention(q, k, v, causal).sum().backward()

    def builtin(_):
        q, k, v = (x.detach().requires_grad_() for x in full)
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward()

    rows = layouts["zig-zag" if kind == "ring_zigzag" else "contiguous"]
    mine = [x.index_select(2, rows) for x in full]
    candidates = {"builtin": builtin}
    candidates |= {"contiguous": ring("contiguous"), "zig-zag": ring("zig-zag")} if kind != "ulysses" else {"ours": ulysses}
    medians = interleaved_medians(candidates, lambda: None, repeats, warmup=2)
    ours = {"ring": "contiguous", "ring_zigzag": "zig-zag", "ulysses": "ours"}[kind]
    medians["ours"] = medians[ours]
    with CommTracer() as tracer:
        candidates[ours](None)
    result = dict(medians, sent=tracer.sent_bytes())
    shard = mine[0].numel() * mine[0].element_size()
    if kind != "ulysses":  # forward: (N-1)(K + V + positions); backward: (N-1)(K, V, dK, dV, positions) + dK, dV
        pos = rows.numel() * rows.element_size()
        result["formula"] = (n - 1) * (2 * shard + pos) + (n - 1) * (4 * shard + pos) + (2 * shard if n > 1 else 0)
        flops = {}
        for layout in layouts:  # this rank's attention FLOPs (the fused kernels' visible pairs)
            with FlopCounterMode(display=False, custom_mapping=sp.FUSED_ATTENTION_FLOPS) as counter:
                candidates[layout](None)
            flops[layout] = counter.get_total_flops()
        result["flops"] = flops
        # CPU seconds of each layout on this rank: what the busiest rank's pace is made of
        # when the cores are shared (a rank waiting for a message uses none).
        result["cpu"] = {layout: _cpu_seconds(candidates[layout], repeats) for layout in layouts}
    else:  # 4 all-to-alls of one shard each way, (N-1)/N of each leaves the rank
        result["formula"] = 8 * (n - 1) / n * shard
    return result


def _cpu_seconds(step, repeats: int) -> float:
    """Median process CPU seconds of ``step`` on this rank, after a barrier each time."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.process_time()
        step(None)
        times.append(time.process_time() - start)
    return statistics.median(times)


def _attention_row(kind: str, repeats: int, world_size: int) -> BenchRow:
    results = launch(_attention_vs_sdpa, world_size, kind, repeats, True, timeout=600)
    r = results[0]
    name = {"ring": "ring attention, contiguous rows", "ring_zigzag": "ring attention, zig-zag rows",
            "ulysses": "Ulysses"}[kind]
    extra = {}
    if kind != "ulysses":
        busiest = {layout: max(x["flops"][layout] for x in results) for layout in ("contiguous", "zig-zag")}
        extra = {"zigzag_s": r["zig-zag"], "contiguous_s": r["contiguous"],
                 "zigzag_over_contiguous": r["zig-zag"] / r["contiguous"],
                 "busiest_rank_gflop": {k: v / 1e9 for k, v in busiest.items()},
                 "flop_ratio_predicted": busiest["zig-zag"] / busiest["contiguous"]}
        cpu = {layout: max(x["cpu"][layout] for x in results) for layout in ("contiguous", "zig-zag")}
        extra |= {"busiest_rank_cpu_s": cpu, "cpu_zigzag_over_contiguous": cpu["zig-zag"] / cpu["contiguous"]}
    return BenchRow(f"causal attention, {SP_ATTENTION['tokens']} tokens, {name} on {world_size} ranks vs SDPA unsharded",
                    r["ours"], r["builtin"], r["sent"], r["formula"], extra=extra)


@row("sp_ring", divides(SP_ATTENTION["tokens"]),
     "its 2048 tokens split evenly over the ranks")
def sp_ring_row(repeats: int = 7, world_size: int = 2) -> BenchRow:
    """ring attention with contiguous rows (chapter 07) vs unsharded SDPA; zig-zag beside it"""
    return _attention_row("ring", repeats, world_size)


@row("sp_ring_zigzag", divides(SP_ATTENTION["tokens"] // 2),
     "its 2048 tokens split into 2N equal zig-zag chunks")
def sp_ring_zigzag_row(repeats: int = 7, world_size: int = 2) -> BenchRow:
    """ring attention with zig-zag rows (chapter 07) vs unsharded SDPA; contiguous beside it"""
    return _attention_row("ring_zigzag", repeats, world_size)


@row("sp_ulysses", divides(SP_ATTENTION["tokens"], SP_ATTENTION["heads"]),
     "its 8 heads and 2048 tokens split evenly over the ranks")
def sp_ulysses_row(repeats: int = 7, world_size: int = 2) -> BenchRow:
    """Ulysses (chapter 07) vs unsharded SDPA"""
    return _attention_row("ulysses", repeats, world_size)


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


@row("sp_megatron", divides(SP_BENCH_GPT["n_head"], SP_BENCH_GPT["block_size"]),
     "its 8 heads and 512 tokens split evenly over the ranks")
def sp_megatron_row(repeats: int = 10, world_size: int = 2, batch: int = 4) -> BenchRow:
    """the Megatron-SP block (chapter 07) vs torch's SequenceParallel plan"""
    r = launch(_megatron_sp_vs_builtin, world_size, repeats, batch, timeout=600)[0]
    return BenchRow(f"transformer block fwd+bwd, labkit.sp Megatron-SP vs SequenceParallel plan, {world_size} ranks",
                    r["ours"], r["builtin"], r["sent"]["ours"], r["formula"],
                    extra={"torch_sent": r["sent"]["builtin"]})
