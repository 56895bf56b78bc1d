"""Chapter 14's model held to emulated nodes: ``validate`` (needs root; ``labkit.netbed``'s bed).

It runs the learner's exercises (chapter 11's hierarchical all-reduce, chapter 05's tensor
parallelism, chapter 06's pipeline) on nodes emulated with throttled links, and predicts their
step times with chapter 14's model (``labkit.perf.collective_time``) on links fitted on the same
bed, so it sits in the course room, which may import the exercises.
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from labkit.comm import fit_alpha_beta
from labkit.netbed import NetbedError, NetbedUnavailable, run_on_nodes, unavailable  # noqa: F401 - the lab's names
from labkit.perf import Link, collective_time  # chapter 14's model: what the bed checks

# The alpha-beta model (chapter 00), calibrated per link class on the bed, predicts the step time
# of three pairs of layouts run on the same bed, in the same launch, right after the calibration
# (``validate``). What the model is:
#
# * a message of s bytes on a link: alpha + s / bandwidth, fitted from ping-pongs (``calibrate``);
#   across nodes alpha comes out NEGATIVE on this bed: tc's token bucket lets the first 64 KiB of
#   an idle link through at once (its burst), so a lone message of s bytes costs (s - 64 KiB) /
#   rate plus microseconds. The fit says so; a message across is never predicted faster than the
#   same message inside a node (``_message``'s floor).
# * a collective: the ring formulas (``collective_time``: 2(N-1) steps of S/N for an all-reduce,
#   N-1 for a reduce-scatter or all-gather), each step one message on the slowest link it uses;
# * a node has ONE link to the switch (no rails): k flows crossing it at once in one direction
#   share it; for k = 2 the per-flow link is fitted on the bed too ("across_shared": both pairs
#   of ranks all-reducing at once; TCP flows share the token bucket at ~0.93-0.99 of half), else
#   bandwidth / k;
# * compute: measured on the bed, in the measured steps themselves: the time outside their
#   all-reduces (TP, DP) or the F and B actions of the pipeline runner's trace (PP), added where it
#   sits on the critical path (TP, DP: between/after the collectives; PP: the flow shop of chapter
#   06's GPipe schedule, where the link is one more stage);
# * the bed: 100 Mbit/s between nodes, so network time dominates (compute is 1-5 % of a step);
#   the ranks run at nice -10 and TCP does not restart slow after idle inside the node namespaces.


MODEL = "labkit.perf.collective_time (ring), links fitted on the bed"
EXPERIMENTS = ("allreduce", "pp_vs_tp", "2d")


def links_of(calibration: dict) -> dict[str, Link]:
    """{"inside": Link, "across": Link} (and "across_shared" when fitted) from (alpha, beta) fits."""
    return {k: Link(v[0], 1.0 / v[1]) for k, v in calibration.items() if k in ("inside", "across", "across_shared")}


def shared(links: dict, flows: int) -> Link:
    """The link across nodes as each of ``flows`` flows crossing a node's link at once sees it:
    "across_shared" where it was fitted for 2 flows (the two pairs of nodes' ranks all-reducing at
    once: TCP flows share a token bucket less than perfectly), else the bandwidth / ``flows``."""
    if flows == 1:
        return links["across"]
    if flows == 2 and "across_shared" in links:
        return links["across_shared"]
    return Link(links["across"].alpha, links["across"].bandwidth / flows)


def _message(op: str, nbytes: float, ranks: int, links: dict, where: str, flows: int = 1) -> float:
    """A collective on ``where`` ("inside" or "across", ``flows`` at once on a node's link); a
    collective across never faster than the same one inside (the bucket's burst can't beat loopback)."""
    inside = collective_time(op, nbytes, ranks, links["inside"])
    if where == "inside":
        return inside
    return max(collective_time(op, nbytes, ranks, shared(links, flows)), inside)


def predict_all_reduce(nbytes: float, links: dict, nodes: int = 2, ranks_per_node: int = 2) -> dict[str, float]:
    """Seconds of an all-reduce of ``nbytes`` on ``nodes x ranks_per_node`` ranks:
    * "flat": the ring over the world in rank order (gloo's ``dist.all_reduce``): 2(N-1) steps of
      S/N; every step waits for its hop across nodes (one flow per direction on each link);
    * "hierarchical" (``labkit.compress.hierarchical_all_reduce``): a ring reduce-scatter inside
      the node, the all-reduce of the S/L shard across nodes (the L ranks of a node send at once:
      L flows share its link), the all-gather inside."""
    world, local = nodes * ranks_per_node, ranks_per_node
    shard = math.ceil(nbytes / 4 / local) * 4
    flat = _message("all_reduce", nbytes, world, links, "across" if nodes > 1 else "inside")
    hier = (_message("reduce_scatter", shard * local, local, links, "inside")
            + _message("all_reduce", shard, nodes, links, "across", flows=local)
            + _message("all_gather", shard * local, local, links, "inside"))
    return {"flat": flat, "hierarchical": hier}


def predict_tp(tokens: int, hidden: int, layers: int, degree: int, links: dict, where: str, flows: int = 1,
               compute: float = 0.0, element_bytes: int = 4) -> dict[str, float]:
    """A training step of ``labkit.tp.tensor_parallel``'s GPT (untied head) on ``degree`` ranks:
    4 layers + 2 all-reduces of the activation [tokens, hidden] (forward: the embedding's g and
    two g per block; backward: two f per block and the head's f) and 3 of one number per token
    (the vocabulary-parallel loss), on ``where`` with ``flows`` TP groups sharing a node's link;
    plus ``compute`` (measured)."""
    act = tokens * hidden * element_bytes
    comm = ((4 * layers + 2) * _message("all_reduce", act, degree, links, where, flows)
            + 3 * _message("all_reduce", tokens * element_bytes, degree, links, where, flows))
    return {"comm": comm, "compute": compute, "total": comm + compute}


def predict_pipeline(activation_bytes: float, microbatches: int, links: dict, forward: tuple, backward: tuple,
                     where: str = "across") -> dict[str, float]:
    """A GPipe step (chapter 06) of two stages, one per node: every micro-batch's activation
    (``activation_bytes`` each) goes forward over the link, its gradient back. The link is one
    more stage of a flow shop: with per-micro-batch times f0 (stage 0), c (the message), f1,
    the forward takes f0 + c + f1 + (m - 1) max(f0, c, f1), the backward b1 + c + b0 + (m - 1)
    max(b1, c, b0). ``forward`` = (f0, f1), ``backward`` = (b1, b0): measured compute."""
    c = _message("send", activation_bytes, 2, links, where)
    m = microbatches
    fwd = sum(forward) + c + (m - 1) * max(*forward, c)
    bwd = sum(backward) + c + (m - 1) * max(*backward, c)
    compute = sum(forward) + sum(backward) + (m - 1) * (max(forward) + max(backward))
    total = fwd + bwd
    return {"comm": total - compute, "compute": compute, "total": total}


def predict_dp(param_bytes: float, replicas: int, links: dict, where: str, flows: int = 1,
               compute: float = 0.0) -> dict[str, float]:
    """A data-parallel step: compute (measured), then one all-reduce of the gradients
    (``param_bytes``, one flat buffer) over ``replicas`` ranks, ``flows`` such groups sharing a
    node's link."""
    comm = _message("all_reduce", param_bytes, replicas, links, where, flows)
    return {"comm": comm, "compute": compute, "total": comm + compute}


# ----------------------------------------------------------------------------- the runs


@dataclass(frozen=True)
class Plan:
    """What ``validate`` runs (defaults: network time dominates at 100 Mbit/s, compute is tens of
    ms, one launch takes about 30-40 s on a loaded 2-core machine)."""
    bandwidth: str = "100mbit"
    repeats: int = 7                       # measured steps per layout (after one warm-up), interleaved: the median
    #                                        of 7 stands 3 hiccups (a 200 ms TCP stall now and then on a loaded box)
    # the fit (chapter 00, from whole all-reduces on 2 ranks: per step, S/2 bytes in t/2 seconds)
    inside_sizes: tuple = (1 << 10, 1 << 16, 1 << 20, 1 << 22)   # all-reduce bytes, ranks 0 and 1 (one node):
    #   from one number per token (TP's loss) to the hierarchical reduce-scatter; alpha from the smallest
    across_sizes: tuple = (1 << 19, 1 << 20, 1 << 21, 1 << 22)   # ranks 0 and 2 (one per node): steps of 256 KiB - 2 MiB
    calibration_repeats: int = 5                         # the median of these (after one warm-up) across;
    inside_repeats: int = 9                              # inside (cheap; a loopback is noisier under load)
    shared_sizes: tuple = (1 << 20, 1 << 21, 1 << 22)    # both pairs (0, 2) and (1, 3) at once: 2 flows per link
    shared_repeats: int = 3
    allreduce_bytes: int = 8 << 20         # (a): 8 MiB of fp32
    # (b) PP vs TP across two nodes (one rank each): activations [batch, seq, n_embd] = 2 MiB of fp32 (PP: ~0.4 s a step)
    seq_gpt: tuple = (("vocab_size", 64), ("block_size", 32), ("n_layer", 2), ("n_head", 2), ("n_embd", 32),
                      ("tie_weights", False))
    seq_batch: int = 512
    microbatches: int = 2
    # (c) TP inside x DP across vs DP over all four: gradients of ~1.6 M parameters, few tokens
    grid_gpt: tuple = (("vocab_size", 64), ("block_size", 16), ("n_layer", 2), ("n_head", 2), ("n_embd", 256),
                       ("tie_weights", False))
    grid_batch: int = 8
    experiments: tuple = EXPERIMENTS       # which of (a), (b), (c) to run
    nice: int = -10                        # the ranks' CPU priority (run_on_nodes): each emulated node is meant
    #                                        to be a machine of its own, not to queue behind the box's other load
    trace_hierarchical: bool = False       # (a): also trace the bytes the hierarchical all-reduce sends (the
    #                                        bench row's; CommTracer around its chained futures takes ~20 s here)


@dataclass
class Row:
    experiment: str            # "allreduce" | "pp_vs_tp" | "2d"
    layout: str
    predicted_s: float
    measured_s: float          # median over the repeats of the slowest rank's step
    error: float               # measured / predicted - 1
    comm_s: float              # the prediction's two terms
    compute_s: float
    samples: list = field(default_factory=list)


@dataclass
class Verdict:
    experiment: str
    faster: str                # by the measured medians
    slower: str
    measured_speedup: float    # slower / faster, measured
    predicted_speedup: float   # the same two layouts, predicted
    agree: bool                # the prediction picks the same winner


@dataclass
class Validation:
    links: dict                # {"inside": Link, "across": Link}, fitted on this bed in this launch
    rows: list
    verdicts: list
    bandwidth: str = ""
    model: str = MODEL
    calibration: dict = field(default_factory=dict)   # the ping-pong times {class: {bytes: s}}
    details: dict = field(default_factory=dict)       # measured compute pieces, traced collectives

    def ok(self, tolerance: float = 0.25) -> bool:
        return all(abs(r.error) <= tolerance for r in self.rows) and all(v.agree for v in self.verdicts)

    def table(self) -> str:
        lines = [f"emulated nodes 2 x 2, {self.bandwidth}/s between nodes; model: {self.model}",
                 "links: " + ", ".join(f"{k}: alpha {v.alpha * 1e6:.0f} us, {v.bandwidth / 1e6:.2f} MB/s"
                                       for k, v in self.links.items())
                 + (f" (per flow: {2 * self.links['across_shared'].bandwidth / self.links['across'].bandwidth:.2f}"
                    " of half the link)" if "across_shared" in self.links else ""),
                 f"{'experiment':10} {'layout':38} {'predicted':>10} {'measured':>10} {'error':>7}"]
        for r in self.rows:
            lines.append(f"{r.experiment:10} {r.layout:38} {r.predicted_s * 1e3:8.1f}ms {r.measured_s * 1e3:8.1f}ms "
                         f"{r.error:+7.1%}")
        for v in self.verdicts:
            lines.append(f"{v.experiment}: {v.faster} beats {v.slower} by {v.measured_speedup:.2f}x measured, "
                         f"{v.predicted_speedup:.2f}x predicted ({'agree' if v.agree else 'DISAGREE'})")
        return "\n".join(lines)


def _race(candidates: dict, repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Every rank: seconds of each ``candidates[name]()`` from a common barrier, interleaved
    (A B, then B A, ...) after ``warmup`` rounds: wall-clock under ``name``, this process's CPU
    seconds (``time.process_time``, every thread) under ``name + " cpu"``, and what the call
    returned (its seconds outside collectives) under ``name + " compute"``. The caller takes
    the slowest rank's."""
    names = list(candidates)
    times = {key: [] for name in names for key in (name, name + " cpu")}
    for i in range(warmup + repeats):
        for name in names if i % 2 == 0 else names[::-1]:
            dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            outside = candidates[name]()
            _stamp(f"  {name}, round {i}: {time.perf_counter() - start:.3f} s")
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
                times[name + " cpu"].append(time.process_time() - cpu)
                times.setdefault(name + " compute", []).append(outside or 0.0)
    return times


class _Outside:
    """Times a step's compute: its wall-clock seconds outside ``dist.all_reduce`` (every
    collective the TP and DP steps here make), and records the bytes of every all-reduce it
    made (``sizes``, the last step's). Compute measured inside the real step, between its
    waits, is what the step spends: the same code with the collectives removed would run as
    one long stretch, and a loaded machine's scheduler stretches that (many time slices behind
    the other runnable processes) where short pieces after a wait run at once."""

    def __init__(self, step):
        self.step, self.sizes = step, []

    def __call__(self) -> float:
        inside, saved, sizes = [0.0], dist.all_reduce, []

        def timed(tensor, *args, **kwargs):
            sizes.append(tensor.numel() * tensor.element_size())
            start = time.perf_counter()
            try:
                return saved(tensor, *args, **kwargs)
            finally:
                inside[0] += time.perf_counter() - start

        dist.all_reduce, start = timed, time.perf_counter()
        try:
            self.step()
        finally:
            dist.all_reduce = saved
        self.sizes = sorted(sizes)
        return time.perf_counter() - start - inside[0]


def _zero(params) -> None:
    for p in params:
        p.grad = None


def _tokens(config, batch: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(config.vocab_size, (batch, config.block_size + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _calibrate_all_reduce(groups, plan: Plan) -> dict:
    """On rank 0: {"inside": {message bytes: seconds}, "across": ..., "across_shared": ...} from
    all-reduces on two ranks of one node (0, 1), of two nodes (0, 2), and of both such pairs at
    once (0, 2 and 1, 3: the slowest of the two), the median of the repeats: a
    2-rank ring all-reduce of S bytes is 2 steps of one S/2 message each way (chapter 00)."""
    rank, times = dist.get_rank(), {}
    for name, members, group, sizes, repeats in (
            ("inside", (0, 1), groups.inside, plan.inside_sizes, plan.inside_repeats),
            ("across", (0, 2), groups.across, plan.across_sizes, plan.calibration_repeats),
            ("across_shared", (0, 1, 2, 3), groups.across, plan.shared_sizes, plan.shared_repeats)):
        times[name] = {}
        for size in sizes:
            buf, samples = torch.zeros(size // 4), []
            for i in range(repeats + 1):
                dist.barrier()
                if rank in members:
                    start = time.perf_counter()
                    dist.all_reduce(buf, group=group)
                    samples.append(time.perf_counter() - start)
            if members == (0, 1, 2, 3):  # the pair that finished last sets the time
                slowest = torch.tensor(samples, dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                samples = slowest.tolist()
            if rank == 0:
                times[name][size // 2] = statistics.median(samples[1:]) / 2
    return times


def _stamp(what: str, t0=time.monotonic()) -> None:
    """With LABKIT_NETBED_TRACE set, rank 0 says where the launch is (to stderr)."""
    if os.environ.get("LABKIT_NETBED_TRACE") and dist.get_rank() == 0:
        sys.stderr.write(f"netbed rank 0: {time.monotonic() - t0:.2f} s: {what}\n")


def _validate_rank(plan: Plan) -> dict:
    from labkit.compress import NodeGroups
    torch.set_num_threads(1)
    _stamp("rank started")
    groups = NodeGroups(2, 2)
    _stamp("groups made")
    out = {"calibration": _calibrate_all_reduce(groups, plan),  # and the namespaces, to check they go
           "namespaces": (os.readlink("/proc/self/ns/net"), os.readlink(f"/proc/{os.getppid()}/ns/net"))}
    _stamp("calibrated")
    for name, run in (("allreduce", _run_allreduce), ("pp_vs_tp", _run_pp_vs_tp), ("2d", _run_2d)):
        if name in plan.experiments:
            out.update(run(plan, groups))
            _stamp(f"{name} done")
    return out


def _run_allreduce(plan: Plan, groups) -> dict:
    """(a) hierarchical vs flat all-reduce, and the bytes the hierarchical one sends."""
    from labkit.comm import CommTracer
    from labkit.compress import hierarchical_all_reduce
    x = torch.randn(plan.allreduce_bytes // 4)
    out = {"allreduce": _race({"flat": lambda: dist.all_reduce(x.clone()),
                               "hierarchical": lambda: hierarchical_all_reduce(x.clone(), groups)}, plan.repeats)}
    if plan.trace_hierarchical:
        with CommTracer() as tracer:
            hierarchical_all_reduce(x.clone(), groups)
        out["hierarchical_traced_bytes"] = sum(e.bytes for e in tracer.events)
    return out


def _run_pp_vs_tp(plan: Plan, groups) -> dict:
    """(b) PP vs TP across nodes: ranks 0 (node 0) and 2 (node 1); 1 and 3 idle."""
    from labkit import pp
    from labkit.models import GPT, GPTConfig
    from labkit.tp import tensor_parallel
    rank, out = dist.get_rank(), {}
    config = GPTConfig(**dict(plan.seq_gpt))
    idx, tgt = _tokens(config, plan.seq_batch, 0)
    pair = groups.across  # [0, 2] on ranks 0 and 2
    active = rank in (0, 2)
    steps, traces = {}, []
    if active:
        tp_model = tensor_parallel(GPT(config), pair)
        stage = 0 if rank == 0 else 1
        stage_module = pp.split_gpt(GPT(config), 2, balance="layers")[stage]
        runner = pp.PipelineRunner({stage: stage_module}, 2, group=pair)
        actions = pp.gpipe(2, plan.microbatches)[stage]

        def tp_step():
            _zero(tp_model.parameters())
            tp_model(idx, tgt)[1].backward()

        def pp_step():
            _zero(stage_module.parameters())
            traces.append(runner.step(actions, idx, tgt, plan.microbatches, pp.gpt_loss)[1])

        steps = {"PP": pp_step, "TP": _Outside(tp_step)}
    out["pp_vs_tp"] = _race({k: steps.get(k, lambda: None) for k in ("PP", "TP")}, plan.repeats)
    if active:
        out["tp_traced"] = steps["TP"].sizes
    # the pipeline's compute per micro-batch: the F and B actions of the measured steps (their
    # waits for a message excluded, as the runner's trace keeps them)
    f = [end - start for t in traces[1:] for a, start, end in t.events if a.kind == "F"]
    b = [end - start for t in traces[1:] for a, start, end in t.events if a.kind == "B"]
    out["pp_pieces"] = {"forward": f, "backward": b}
    return out


def _run_2d(plan: Plan, groups) -> dict:
    """(c) TP inside x DP across vs DP over all four ranks."""
    from labkit.models import GPT, GPTConfig
    from labkit.tp import tensor_parallel
    rank, out = dist.get_rank(), {}
    config = GPTConfig(**dict(plan.grid_gpt))
    idx, tgt = _tokens(config, plan.grid_batch, 1)
    node, local = divmod(rank, 2)
    half, quarter = plan.grid_batch // 2, plan.grid_batch // 4
    grid_model = tensor_parallel(GPT(config), groups.inside)
    dp_model = GPT(config)
    grid_params, dp_params = list(grid_model.parameters()), list(dp_model.parameters())

    def grid_step():
        _zero(grid_params)
        grid_model(idx[node * half:(node + 1) * half], tgt[node * half:(node + 1) * half])[1].backward()
        dist.all_reduce(torch.cat([p.grad.reshape(-1) for p in grid_params]), group=groups.across)

    def dp_step():
        _zero(dp_params)
        dp_model(idx[rank * quarter:(rank + 1) * quarter], tgt[rank * quarter:(rank + 1) * quarter])[1].backward()
        dist.all_reduce(torch.cat([p.grad.reshape(-1) for p in dp_params]))

    grid, flat = _Outside(grid_step), _Outside(dp_step)
    out["2d"] = _race({"TPxDP": grid, "DP": flat}, plan.repeats)
    out["grid_traced"] = grid.sizes
    out["grid_param_bytes"] = sum(p.numel() * p.element_size() for p in grid_params)
    out["dp_param_bytes"] = sum(p.numel() * p.element_size() for p in dp_params)
    return out


def _slowest(results: list, key: str) -> dict[str, list[float]]:
    """Per layout, every repeat's time of the slowest rank."""
    names = results[0][key]
    return {name: [max(r[key][name][i] for r in results) for i in range(len(results[0][key][name]))]
            for name in names}


def _row(experiment, layout, prediction, samples) -> Row:
    measured = statistics.median(samples)
    return Row(experiment, layout, prediction["total"], measured, measured / prediction["total"] - 1,
               prediction["comm"], prediction["compute"], list(samples))


def _verdict(experiment, a: Row, b: Row) -> Verdict:
    fast, slow = (a, b) if a.measured_s <= b.measured_s else (b, a)
    return Verdict(experiment, fast.layout, slow.layout, slow.measured_s / fast.measured_s,
                   slow.predicted_s / fast.predicted_s, slow.predicted_s >= fast.predicted_s)


def validate(plan: Plan | None = None, timeout: float = 300, **changes) -> Validation:
    """Calibrate alpha-beta per link class on emulated nodes (2 x 2), then, in the same launch,
    run and predict (a) the hierarchical vs the flat all-reduce, (b) a 2-stage pipeline vs TP=2
    across the two nodes, (c) TP inside x DP across vs DP over all four ranks. ``changes``:
    fields of ``Plan`` (e.g. ``bandwidth="50mbit"``, ``repeats=7``, ``experiments=("allreduce",)``)."""
    plan = plan or Plan()
    if changes:
        plan = Plan(**{**plan.__dict__, **changes})
    unknown = set(plan.experiments) - set(EXPERIMENTS)
    if unknown:
        raise ValueError(f"validate: unknown experiments {sorted(unknown)}; choose from {EXPERIMENTS}")
    results = run_on_nodes(_validate_rank, 2, 2, plan, bandwidth=plan.bandwidth, timeout=timeout, nice=plan.nice)
    times = {k: v for k, v in results[0]["calibration"].items() if v}
    links = links_of({k: fit_alpha_beta(list(v), list(v.values())) for k, v in times.items()})
    out = Validation(links, [], [], plan.bandwidth, MODEL, times,
                     {"samples": {}, "namespaces": sorted({ns for r in results for ns in r["namespaces"]})})
    for name, analyse in (("allreduce", _analyse_allreduce), ("pp_vs_tp", _analyse_pp_vs_tp), ("2d", _analyse_2d)):
        if name in plan.experiments:
            out.details["samples"][name] = _slowest(results, name)
            a, b = analyse(plan, results, links, out.details)
            out.rows += [a, b]
            out.verdicts.append(_verdict(name, a, b))
    return out


def _check_traced(what: str, traced: list, expected: list) -> None:
    if traced != sorted(expected):
        raise RuntimeError(f"{what}: the all-reduces the step made (bytes {traced}) are not the "
                           f"model's (bytes {sorted(expected)}): the prediction would count the wrong messages")


def _analyse_allreduce(plan, results, links, details):
    samples = _slowest(results, "allreduce")
    predicted = predict_all_reduce(plan.allreduce_bytes, links)
    if "hierarchical_traced_bytes" in results[0]:
        details["hierarchical_traced_bytes"] = results[0]["hierarchical_traced_bytes"]
    mib = plan.allreduce_bytes / 2**20
    flat = _row("allreduce", f"flat ring {mib:g} MiB (dist.all_reduce)",
                {"total": predicted["flat"], "comm": predicted["flat"], "compute": 0.0}, samples["flat"])
    hier = _row("allreduce", f"hierarchical 2x2 {mib:g} MiB",
                {"total": predicted["hierarchical"], "comm": predicted["hierarchical"], "compute": 0.0},
                samples["hierarchical"])
    return flat, hier


def _analyse_pp_vs_tp(plan, results, links, details):
    from labkit.models import GPTConfig
    config = GPTConfig(**dict(plan.seq_gpt))
    tokens = plan.seq_batch * config.block_size
    samples = _slowest(results, "pp_vs_tp")
    _check_traced("TP=2 step", results[0]["tp_traced"],
                  [tokens * config.n_embd * 4] * (4 * config.n_layer + 2) + [tokens * 4] * 3)
    tp = predict_tp(tokens, config.n_embd, config.n_layer, 2, links, "across",
                    compute=statistics.median(samples["TP compute"]))
    med = {r: {k: statistics.median(v) for k, v in results[r]["pp_pieces"].items()} for r in (0, 2)}
    details["pp_compute_per_microbatch_s"] = {"stage 0": med[0], "stage 1": med[2]}
    mb_bytes = tokens // plan.microbatches * config.n_embd * 4
    pipe = predict_pipeline(mb_bytes, plan.microbatches, links, (med[0]["forward"], med[2]["forward"]),
                            (med[2]["backward"], med[0]["backward"]))
    return (_row("pp_vs_tp", f"PP=2 across (GPipe, {plan.microbatches} micro-batches)", pipe, samples["PP"]),
            _row("pp_vs_tp", "TP=2 across", tp, samples["TP"]))


def _analyse_2d(plan, results, links, details):
    from labkit.models import GPTConfig
    config = GPTConfig(**dict(plan.grid_gpt))
    samples = _slowest(results, "2d")
    tokens = plan.grid_batch // 2 * config.block_size  # one replica's (one node's)
    grid_bytes, dp_bytes = results[0]["grid_param_bytes"], results[0]["dp_param_bytes"]
    details["gradient_bytes"] = {"TPxDP": grid_bytes, "DP": dp_bytes}
    _check_traced("TP=2 x DP=2 step", results[0]["grid_traced"],
                  [tokens * config.n_embd * 4] * (4 * config.n_layer + 2) + [tokens * 4] * 3 + [grid_bytes])
    tp = predict_tp(tokens, config.n_embd, config.n_layer, 2, links, "inside")
    dp = predict_dp(grid_bytes, 2, links, "across", flows=2)  # the two DP groups cross at once
    grid = {"comm": tp["comm"] + dp["comm"], "compute": statistics.median(samples["TPxDP compute"])}
    grid["total"] = grid["comm"] + grid["compute"]
    flat = predict_dp(dp_bytes, 4, links, "across", compute=statistics.median(samples["DP compute"]))
    return (_row("2d", "TP=2 inside x DP=2 across", grid, samples["TPxDP"]),
            _row("2d", "DP=4 (flat ring over both nodes)", flat, samples["DP"]))
