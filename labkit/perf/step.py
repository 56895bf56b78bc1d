"""perf.step: the step-time model of a layout, term by term, its memory, and when each
strategy's traffic hides (the overview: ``labkit/perf/__init__.py``).

Chapter 08's planner extended from memory to time. The world is chapter 08's grid
(dp, pp, cp, tp), TP the fastest axis: rank = ((d * pp + p) * cp + c) * tp + t, so a TP group
is `tp` consecutive ranks (stride 1), a CP group has stride tp, a PP group stride tp * cp and
a DP group stride tp * cp * pp. Expert parallelism (ep) splits the routed experts of every MoE
layer over `ep` ranks of the DP axis (Megatron-core's and DeepSeek's choice: EP inside data
parallelism), so ep divides dp and does not change the number of GPUs; the expert weights are
then data-parallel over the remaining dp / ep replicas (times cp).

One step of a layout, per GPU (the critical rank), with m = global_batch / (dp * microbatch)
micro-batches of b sequences of s tokens:
  compute    m x flops_per_token(model) x b s / (tp cp pp) / achieved FLOP/s
  recompute  m x the extra FLOPs of the recomputation mode (flops_per_token(model, mode) - it)
  tp_comm    Megatron tensor + sequence parallelism (chapters 05, 07): per layer and micro-batch
             4 all-gathers and 4 reduce-scatters of the (s/cp) b h activation (2 + 2 in each of
             the attention and MLP halves, forward and backward: the bytes of chapter 05's 4
             all-reduces), 6 + 6 when full recomputation runs the forward again; on the TP group.
             Layout.tp_regather (Megatron-LM, the default): each column layer's input is kept as
             its 1/tp shard and all-gathered again in backward, 2 more all-gathers per layer
             (chapter 11, section 5), and activations are Korthikanti's 34 sbh / tp; False
             (torch's SP plan): no re-gather, and the two gathered LayerNorm outputs are kept
             whole, + 4 sbh (1 - 1/tp) bytes per layer (s = s/cp, b the micro-batch)
             Layout.tp_overlap (collective matmul / async TP, chapter 11): only what exceeds the
             micro-batch's compute + recompute is exposed
  cp_comm    ring attention (chapter 07): per layer, cp - 1 sends of the rank's K and V forward,
             2 (cp - 1) backward (K, V again and their gradients), + (cp - 1) with full recompute
  ep_comm    per MoE layer, dispatch + combine all-to-alls forward and backward (4; 6 with full
             recompute) of the rank's (s/cp) b / tp tokens x top_k x h
  pp_comm    per micro-batch, one activation forward and one gradient backward per model chunk
             ((s/cp) b h / tp elements: Megatron sends the sequence-parallel shard), v chunks
  bubble     (p - 1) / v micro-batch times of the stage (chapter 06: the idle fraction is
             (p - 1) / (v m + p - 1) of the pipeline's time, for GPipe, 1F1B and interleaved).
             Zero-bubble schedules split the backward into B (input gradients) and W (weight
             gradients, W = a third of the micro-batch's matmuls: compute / 3) and fill the
             bubble with W: ZB-H1 (Qi et al. 2024, arXiv:2401.10241; chapter 06 builds it)
             (p - 1)(F + B - W) = (p - 1)(stage - 2W) when m >= p (in general
             (p - 1)(stage - W) - (min(m, p) - 1) W), with the first rank's activations, p
             micro-batches, on every rank; DualPipe
             (DeepSeek-V3, arXiv:2412.19437, Table 2) (p/2 - 1)(F&B + B - 3W) with F&B = the
             stage (a forward and a backward chunk, their communication overlapped, no faster
             than the two together), B = the full backward, 2/3 of the stage: (p/2 - 1)
             (5/3 stage - 3W); p even and m even, activations of p + 1 micro-batches and two
             copies of the 16-bit weights
  dp_comm    the gradient reduction over the data-parallel group (dp x cp ranks share weights):
             ZeRO-0 an all-reduce; ZeRO-1/2 a reduce-scatter + an all-gather of the parameters;
             ZeRO-3 (FSDP) per micro-batch two all-gathers (forward, backward) + a reduce-scatter
             (2m all-gathers and m reduce-scatters a step). Gradients in Layout.grad_bytes (2, or 4
             for fp32 accumulation and reduction), weights in 16-bit.
             It overlaps with compute: ZeRO-0 with the backward of the last micro-batch, ZeRO-1/2
             with that backward and the forward of the first micro-batch (the parameter
             all-gather), ZeRO-3 with every micro-batch's forward and backward;
             dp_exposed = max(0, dp_comm - what it hides behind).
  total      every term above but dp_comm, plus dp_exposed.
Every communication term is labkit.perf.group_time with the group's size and stride, so a
group inside a node runs on NVLink and one that spans nodes on the network. Messages are
16-bit (2 bytes an element); parameters and gradients 16-bit with AdamW's fp32 moments and
master weights (labkit.budget.adamw_bytes(2, 4): 16 bytes a parameter, ZeRO's count).
Left out, on purpose: the optimizer step itself, kernel launch gaps, LayerNorm/bias
parameters, the imbalance of the embedding and output layers between pipeline stages.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit import budget  # the memory formulas of chapters 08 and 12
from labkit.hardware import Cluster
from labkit.perf.flops import RECOMPUTE, Model, flops_per_token, mfu
from labkit.perf.network import group_link, group_time

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "dualpipe")
SEARCHED = ("gpipe", "1f1b", "interleaved")  # search_layouts' default: the schedules the published runs ran
_ELEMENT = 2                                 # bytes of a 16-bit activation, gradient or parameter
ELEMENTWISE_PASSES = 3                       # forward write, backward read + gradient write (elementwise_bytes)


@dataclass(frozen=True)
class Layout:
    """A parallel layout: dp x tp x pp x cp GPUs (ep splits the experts inside dp), a ZeRO stage
    over the data-parallel ranks, the micro-batch size (sequences), the pipeline schedule with
    ``virtual`` model chunks per rank (interleaved only) and the recomputation mode. ``uneven``:
    the layers need not divide into pp x virtual equal chunks; the first chunks take one layer
    more (as ``labkit.pp.split_gpt(balance="layers")`` cuts; Llama 3 405B's 126 layers on 16
    stages, BLOOM's 70 on 12, DeepSeek-V3's 61 on 16), and the fullest rank sets the pipeline's pace."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 1                  # 0 DDP, 1, 2, 3 (= FSDP) over the dp axis
    microbatch: int = 1            # sequences per micro-batch
    schedule: str = "1f1b"         # "gpipe" | "1f1b" | "interleaved" | "zb-h1" | "dualpipe"
    virtual: int = 1               # interleaved: model chunks (virtual stages) per rank
    recompute: str = "none"        # "none" | "selective" | "full"
    uneven: bool = False           # allow layers not divisible by pp x virtual (the fuller stages set the pace)
    flash: bool = False            # fused (flash) attention: no s x s scores in HBM, its backward recomputes them
    grad_bytes: int = 2            # 4: gradients accumulated and reduced in fp32 (Megatron with bf16, Llama 3)
    tp_overlap: bool = False       # TP/SP collectives overlapped with the matmuls (collective matmul, async TP)
    tp_regather: bool = True       # TP + SP keeps the input shard and all-gathers it again in backward (Megatron-LM);
                                   # False: keeps the gathered input (torch's SP plan): less traffic, more memory

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def key(self) -> tuple:
        """A total order on layouts (the search breaks ties of time and memory with it)."""
        return (self.dp, self.tp, self.pp, self.cp, self.ep, self.zero, self.microbatch,
                SCHEDULES.index(self.schedule) if self.schedule in SCHEDULES else -1, self.virtual,
                RECOMPUTE.index(self.recompute) if self.recompute in RECOMPUTE else -1, self.uneven, self.flash,
                self.grad_bytes, self.tp_overlap, self.tp_regather)

    def __str__(self) -> str:
        text = f"dp{self.dp} tp{self.tp} pp{self.pp} cp{self.cp}"
        text += f" ep{self.ep}" if self.ep > 1 else ""
        text += f" zero{self.zero} mb{self.microbatch} {self.schedule}"
        text += f"(v={self.virtual})" if self.virtual > 1 else ""
        text += " uneven" if self.uneven else ""
        text += " flash" if self.flash else ""
        text += " fp32-grads" if self.grad_bytes == 4 else ""
        text += " tp-overlap" if self.tp_overlap else ""
        text += " tp-keeps-gathered" if not self.tp_regather else ""
        return text + (f" recompute={self.recompute}" if self.recompute != "none" else "")


_TERMS = ("compute", "recompute", "elementwise", "tp_comm", "cp_comm", "ep_comm", "pp_comm", "bubble", "dp_exposed")


@dataclass
class StepTime:
    """One training step of a layout, per GPU: every term in seconds (see the module's table);
    ``total`` is the sum of ``_TERMS`` (dp_comm counts only through dp_exposed). ``memory``:
    bytes on the fullest GPU (``memory_parts`` its split), ``fits``: memory <= the GPU's."""
    compute: float
    recompute: float
    bubble: float
    tp_comm: float
    cp_comm: float
    pp_comm: float
    ep_comm: float
    dp_comm: float
    dp_exposed: float
    total: float
    memory: float
    fits: bool
    tokens_per_second: float
    mfu: float
    layout: Layout | None = None
    microbatches: int = 0                          # m, per data-parallel replica and step
    memory_parts: dict | None = None
    elementwise: float = 0.0                       # memory-bound work at HBM bandwidth (the roofline)

    def explain(self) -> str:
        """The terms, one a line, with their share of the step, then memory, throughput, MFU."""
        lines = [f"layout {self.layout}, {self.microbatches} micro-batches per step"] if self.layout else []
        for name in _TERMS:
            value = getattr(self, name)
            lines.append(f"  {name:<11}{value * 1e3:12.3f} ms  {100 * value / self.total:5.1f}%")
            if name == "bubble":
                lines.append(f"  {'(dp_comm':<11}{self.dp_comm * 1e3:12.3f} ms  in all, "
                             f"{self.dp_comm - self.dp_exposed:.3g} s of it hidden behind compute)")
        lines.append(f"  {'total':<11}{self.total * 1e3:12.3f} ms")
        parts = ", ".join(f"{k} {v / 2**30:.1f}" for k, v in (self.memory_parts or {}).items())
        lines.append(f"memory {self.memory / 2**30:.1f} GiB per GPU ({parts}): "
                     + ("fits" if self.fits else "does NOT fit"))
        lines.append(f"{self.tokens_per_second:,.0f} tokens/s, MFU {100 * self.mfu:.1f}%")
        return "\n".join(lines)


def _check_layout(model: Model, layout: Layout, global_batch: int, gpus: int | None) -> int:
    """ValueError for a layout that cannot run this model and batch; else m, the micro-batches."""
    degrees = dict(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep,
                   microbatch=layout.microbatch, virtual=layout.virtual)
    for name, value in degrees.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"perf.step: Layout.{name} must be a positive integer, got {value!r}")
    if gpus is not None and layout.gpus != gpus:
        raise ValueError(f"perf.step: dp {layout.dp} x tp {layout.tp} x pp {layout.pp} x cp {layout.cp} "
                         f"= {layout.gpus} GPUs, not {gpus}")
    if not isinstance(layout.tp_regather, bool):
        raise ValueError(f"perf.step: tp_regather must be True or False, got {layout.tp_regather!r}")
    if layout.grad_bytes not in (2, 4):
        raise ValueError(f"perf.step: grad_bytes must be 2 (16-bit) or 4 (fp32), got {layout.grad_bytes!r}")
    if layout.zero not in (0, 1, 2, 3):
        raise ValueError(f"perf.step: ZeRO stage must be 0, 1, 2 or 3, got {layout.zero!r}")
    if layout.schedule not in SCHEDULES:
        raise ValueError(f"perf.step: schedule must be one of {SCHEDULES}, got {layout.schedule!r}")
    if layout.recompute not in RECOMPUTE:
        raise ValueError(f"perf.step: recompute must be one of {RECOMPUTE}, got {layout.recompute!r}")
    if layout.virtual > 1 and layout.schedule != "interleaved":
        raise ValueError(f"perf.step: virtual={layout.virtual} stages per rank need schedule='interleaved'")
    if layout.schedule == "interleaved" and layout.pp < 2:
        raise ValueError("perf.step: the interleaved schedule needs a pipeline (pp >= 2)")
    if layout.schedule == "dualpipe" and layout.pp % 2:
        raise ValueError(f"perf.step: DualPipe feeds the pipeline from both ends: pp must be even, got {layout.pp}")
    if model.heads % layout.tp:
        raise ValueError(f"perf.step: {model.heads} heads do not split over tp={layout.tp}")
    if model.layers % (layout.pp * layout.virtual) and not (layout.uneven and model.layers >= layout.pp * layout.virtual):
        raise ValueError(f"perf.step: {model.layers} layers do not split into pp x virtual = "
                         f"{layout.pp} x {layout.virtual} " + ("stages of a layer or more" if layout.uneven
                                                              else "equal stages (Layout(uneven=True) allows unequal ones)"))
    if model.seq % layout.cp:
        raise ValueError(f"perf.step: a sequence of {model.seq} tokens does not split over cp={layout.cp}")
    if layout.ep > 1 and (not model.experts or model.experts % layout.ep or layout.dp % layout.ep):
        raise ValueError(f"perf.step: ep={layout.ep} must divide the routed experts ({model.experts}) "
                         f"and the data-parallel degree (dp={layout.dp})")
    if global_batch < 1 or global_batch % (layout.dp * layout.microbatch):
        raise ValueError(f"perf.step: a global batch of {global_batch} sequences does not split into "
                         f"dp={layout.dp} replicas of micro-batches of {layout.microbatch}")
    m = global_batch // (layout.dp * layout.microbatch)
    if layout.schedule == "dualpipe" and m % 2:
        raise ValueError(f"perf.step: DualPipe splits the micro-batches between its two directions: m={m} must be even")
    if layout.schedule == "interleaved" and m % layout.pp:
        raise ValueError(f"perf.step: the interleaved schedule needs the micro-batches (m={m}) to be a "
                         f"multiple of pp={layout.pp}")
    return m


def in_flight(schedule: str, pp: int, m: int, virtual: int = 1, rank: int = 0) -> float:
    """Micro-batches whose activations pipeline ``rank`` holds at its peak, in units of one
    whole stage's (L / pp layers): GPipe m; 1F1B min(pp - rank, m); ZB-H1 min(pp, m) on every
    rank (rank r holds r micro-batches more than in 1F1B until their deferred W's ran: the
    first rank's peak everywhere); DualPipe min(pp + 1, m) on every rank (DeepSeek-V3's Table 2
    gives the peak device's, pp + 1); interleaved the warm-up's model chunks + 1 (chapter 06),
    capped at m v, over v."""
    # BEGIN SOLUTION perf.step: gpipe m; 1f1b min(pp - rank, m); zb-h1 min(pp, m); dualpipe min(pp + 1, m); interleaved min((v-1) pp + 2 (pp-1-rank) + 1, m v) / v
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(pp - rank, m)
    if schedule == "zb-h1":
        return min(pp, m)
    if schedule == "dualpipe":
        return min(pp + 1, m)
    chunks = min((virtual - 1) * pp + 2 * (pp - 1 - rank) + 1, m * virtual)
    return chunks / virtual
    # END SOLUTION


def layers_on_rank(model: Model, layout: Layout, rank: int = 0) -> tuple[int, int]:
    """(layers, MoE layers) on pipeline ``rank``: the L layers cut in order into pp x v chunks of
    L / (pp v) layers (uneven: the first L mod (pp v) chunks one more), chunk c on rank c % pp;
    the leading ``dense_layers`` of an MoE model have a dense FFN."""
    chunks = layout.pp * layout.virtual
    whole, extra = divmod(model.layers, chunks)
    layers = moe = 0
    for c in range(rank, chunks, layout.pp):
        start = c * whole + min(c, extra)
        end = start + whole + (c < extra)
        layers += end - start
        moe += max(0, end - max(start, model.dense_layers)) if model.experts else 0
    return layers, moe


def parameters_per_gpu(model: Model, layout: Layout, rank: int = 0) -> tuple[float, float]:
    """(dense, expert) parameters one GPU of pipeline ``rank`` holds before ZeRO sharding:
    attention and dense FFNs split over tp; routed experts over ep and tp; shared experts over
    tp; the router whole; the embedding (vocab / tp rows) on the first rank, the output layer
    on the last (one copy when tied and pp = 1); layers as ``layers_on_rank`` places them."""
    # BEGIN SOLUTION perf.step: count the layers on this rank (dense FFN or MoE); attention + FFN / tp, experts / (ep tp); embedding on rank 0, head on rank pp-1
    attention, dense_ffn, expert = model.attention_params(), model.ffn_params(), model.ffn_params(model.expert_width)
    mine, moe = layers_on_rank(model, layout, rank)
    dense = mine * attention / layout.tp + (mine - moe) * dense_ffn / layout.tp
    dense += moe * (model.shared_experts * expert / layout.tp + model.hidden * model.experts)
    experts = moe * model.experts * expert / (layout.ep * layout.tp)
    table = model.vocab * model.hidden / layout.tp
    if rank == 0:
        dense += table
    if rank == layout.pp - 1 and (layout.pp > 1 or not model.tied):
        dense += table
    return dense, experts
    # END SOLUTION


def memory_per_gpu(model: Model, layout: Layout, global_batch: int, rank: int = 0) -> dict[str, float]:
    """Bytes on one GPU of pipeline ``rank``: parameters, gradients and AdamW state
    (labkit.budget.model_state_bytes, 16-bit weights, ``layout.grad_bytes`` gradients, fp32
    moments and master copy: 16 bytes a parameter, 18 with fp32 gradients) sharded by
    the ZeRO stage over the dp x cp ranks (the experts' over dp x cp / ep); activations from
    labkit.budget.korthikanti_activation_bytes (tensor + sequence parallel, s / cp tokens) for
    L / pp layers x ``in_flight`` micro-batches (``flash`` or "selective" drop the scores; "full" keeps the layers' inputs); the last rank also keeps its micro-batch's
    fp32 logits, 4 (s / cp) b V / tp. Korthikanti's count assumes Megatron's re-gather
    (``layout.tp_regather``); without it each layer also keeps its two gathered LayerNorm outputs
    whole, + 4 (s / cp) b h (1 - 1/tp) bytes per layer kept (with "full", for the one layer recomputed).
    DualPipe keeps two copies of the 16-bit weights (DeepSeek-V3's Table 2: parameters 2x): its
    "params" are doubled. Returns {"params", "grads", "optimizer", "activations", "total"}."""
    # BEGIN SOLUTION perf.step: model_state_bytes for dense (shards dp*cp) and expert (dp*cp/ep) parameters; korthikanti activations x in_flight; + fp32 logits on the last rank; dualpipe: params x 2
    m = _check_layout(model, layout, global_batch, None)
    dense, experts = parameters_per_gpu(model, layout, rank)
    element = (_ELEMENT, layout.grad_bytes, budget.adamw_bytes(_ELEMENT, 4)[2])   # fp32 grads: 18 B a parameter
    shards = layout.dp * layout.cp
    states = budget.model_state_bytes(dense, element, layout.zero, shards)
    expert_states = budget.model_state_bytes(experts, element, layout.zero, shards // layout.ep)
    held = in_flight(layout.schedule, layout.pp, m, layout.virtual, rank)
    activations = budget.korthikanti_activation_bytes(
        layers_on_rank(model, layout, rank)[0], model.seq, model.hidden, model.heads, micro=layout.microbatch,
        tp=layout.tp, cp=layout.cp, held=held, flash=layout.flash or layout.recompute == "selective",
        full=layout.recompute == "full")
    if not layout.tp_regather:    # the two LayerNorm outputs kept whole, 2 x 2 (s/cp) b h, not their 1/tp shards
        gathered = 4 * model.seq / layout.cp * layout.microbatch * model.hidden * (1 - 1 / layout.tp)
        activations += gathered * (1 if layout.recompute == "full" else held * layers_on_rank(model, layout, rank)[0])
    if rank == layout.pp - 1:
        activations += 4 * model.seq / layout.cp * layout.microbatch * model.vocab / layout.tp
    parts = {k: states[k] + expert_states[k] for k in ("params", "grads", "optimizer")}
    if layout.schedule == "dualpipe":     # a second copy of the 16-bit weights, one per direction
        parts["params"] *= 2
    return dict(**parts, activations=activations, total=sum(parts.values()) + activations)
    # END SOLUTION


def elementwise_bytes(model: Model, layout: Layout, layers: int) -> float:
    """HBM bytes of one micro-batch's memory-bound work (LayerNorm, GeLU/SwiGLU, dropout,
    residual adds, and without ``flash`` the softmax and dropout over the s x s scores) on
    ``layers`` layers of one GPU, priced by the roofline at HBM bandwidth, not in the FLOP
    efficiency. The course's estimate: ELEMENTWISE_PASSES passes over the bytes a layer keeps
    for backward (Korthikanti et al. 2022: labkit.budget.korthikanti_layer_bytes with the
    rank's s / cp queries, its micro-batch, split over tp by sequence parallelism, scores
    unless flash): forward writes them, backward reads them and writes their gradients (3);
    full recomputation writes them once more (4)."""
    # BEGIN SOLUTION perf.step: passes (3; 4 with full recompute) x layers x korthikanti_layer_bytes(s, h, a, b, tp, cp, flash)
    passes = ELEMENTWISE_PASSES + (layout.recompute == "full")
    return passes * layers * budget.korthikanti_layer_bytes(model.seq, model.hidden, model.heads, layout.microbatch,
                                                            layout.tp, layout.cp, flash=layout.flash)
    # END SOLUTION


def step_time(model: Model, layout: Layout, cluster: Cluster, global_batch: int,
              gpus: int | None = None, stack: "Stack | None" = None) -> StepTime:  # noqa: F821 - labkit.perf.stacks.Stack (it imports this file)
    """One training step of ``global_batch`` sequences of ``model`` in ``layout`` on ``cluster``
    (the terms of the table above). ``gpus``: also check that the layout uses exactly that many.
    ``stack``: a calibrated software stack (``calibrate``); its achieved FLOP/s and bandwidth
    replace the cluster GPU's (``stack.on(cluster)``). Raises ValueError for a layout that
    cannot run the model or the batch."""
    if stack is not None:
        cluster = stack.on(cluster)
    # BEGIN SOLUTION perf.step: per micro-batch compute + recompute + TP/CP/EP/PP comm; bubble (p-1)/v of it (zb-h1: (p-1)(stage - W) - (min(m, p) - 1) W, dualpipe: (p/2-1)(5/3 stage - 3W), W = compute/3); DP comm exposed beyond the compute it hides behind; memory = the fullest pipeline rank
    m = _check_layout(model, layout, global_batch, gpus)
    dp, tp, pp, cp, ep, v = layout.dp, layout.tp, layout.pp, layout.cp, layout.ep, layout.virtual
    gpu = cluster.gpu
    achieved = gpu.achieved_flops or gpu.peak_flops
    layers = max(layers_on_rank(model, layout, r)[0] for r in range(pp))    # on the fullest rank
    tokens = layout.microbatch * model.seq                       # per micro-batch and replica
    share = tokens / (tp * cp) * layers / model.layers           # of them, per GPU of the fullest rank (1/pp)
    compute_mb = flops_per_token(model, "none") * share / achieved
    extra = flops_per_token(model, layout.recompute) - flops_per_token(model, "none")
    if layout.flash and layout.recompute != "selective":     # the fused kernel's backward recomputes the scores
        extra += flops_per_token(model, "selective") - flops_per_token(model, "none")
    recompute_mb = extra * share / achieved
    elementwise_mb = elementwise_bytes(model, layout, layers) / (gpu.achieved_bandwidth or gpu.memory_bandwidth)
    full = layout.recompute == "full"
    activation = model.seq / cp * layout.microbatch * model.hidden * _ELEMENT   # bytes, one layer's input
    # a group of one rank costs nothing (group_time is 0): no guards needed for tp, cp, pp, ep = 1
    gathers = (6 if full else 4) + (2 if layout.tp_regather else 0)     # Megatron re-gathers both column inputs
    tp_mb = layers * (gathers * group_time("all_gather", activation, tp, 1, cluster)
                      + (6 if full else 4) * group_time("reduce_scatter", activation, tp, 1, cluster))
    if layout.tp_overlap:     # hidden behind the micro-batch's matmuls: only the excess is on the critical path
        tp_mb = max(0.0, tp_mb - (compute_mb + recompute_mb))
    kv_bytes = 2 * model.seq / cp * layout.microbatch * -(-model.kv_heads_ // tp) * model.head_size * _ELEMENT
    cp_mb = layers * (cp - 1) * (4 if full else 3) * group_time("send", kv_bytes, cp, tp, cluster)
    moe_layers = max(layers_on_rank(model, layout, r)[1] for r in range(pp))
    routed = model.seq / cp * layout.microbatch / tp * model.top_k * model.hidden * _ELEMENT
    ep_mb = moe_layers * (6 if full else 4) * group_time("all_to_all", routed, ep, tp * cp * pp, cluster)
    pp_mb = 2 * v * group_time("send", activation / tp, pp, tp * cp, cluster)
    stage_mb = compute_mb + recompute_mb + elementwise_mb + tp_mb + cp_mb + ep_mb + pp_mb
    weight_grads_mb = compute_mb / 3       # W: the weight-gradient matmuls, what zero-bubble schedules move
    if layout.schedule == "zb-h1":
        bubble = (pp - 1) * (stage_mb - weight_grads_mb) - (min(m, pp) - 1) * weight_grads_mb
    elif layout.schedule == "dualpipe":
        bubble = (pp / 2 - 1) * (5 / 3 * stage_mb - 3 * weight_grads_mb)
    else:
        bubble = (pp - 1) / v * stage_mb

    # data parallelism: the rank with the most parameters, dense over dp x cp, experts over dp x cp / ep
    dense, experts = max(parameters_per_gpu(model, layout, r) for r in range(pp))
    dp_comm = 0.0
    for params, size, stride in ((dense, dp * cp, tp * cp * pp if dp > 1 else tp),
                                 (experts, dp * cp // ep, tp * cp * pp * ep if dp > ep else tp)):
        if size < 2 or not params:
            continue
        weights, grads = params * _ELEMENT, params * layout.grad_bytes
        if layout.zero == 0:      # all-reduce of the gradients
            dp_comm += group_time("all_reduce", grads, size, stride, cluster)
        elif layout.zero < 3:     # reduce-scatter the gradients, all-gather the updated 16-bit weights
            dp_comm += (group_time("reduce_scatter", grads, size, stride, cluster)
                        + group_time("all_gather", weights, size, stride, cluster))
        else:
            dp_comm += m * (2 * group_time("all_gather", weights, size, stride, cluster)
                            + group_time("reduce_scatter", grads, size, stride, cluster))
    backward_mb = compute_mb * 2 / 3 + recompute_mb
    hides = {0: backward_mb, 1: compute_mb + recompute_mb, 2: compute_mb + recompute_mb,
             3: m * (compute_mb + recompute_mb)}[layout.zero]
    dp_exposed = max(0.0, dp_comm - hides)

    total = m * stage_mb + bubble + dp_exposed
    memory = max((memory_per_gpu(model, layout, global_batch, r) for r in range(pp)), key=lambda d: d["total"])
    per_second = global_batch * model.seq / total
    return StepTime(compute=m * compute_mb, recompute=m * recompute_mb, bubble=bubble, tp_comm=m * tp_mb,
                    cp_comm=m * cp_mb, pp_comm=m * pp_mb, ep_comm=m * ep_mb, dp_comm=dp_comm,
                    dp_exposed=dp_exposed, total=total, memory=memory["total"],
                    fits=memory["total"] <= gpu.memory_bytes, tokens_per_second=per_second,
                    mfu=mfu(per_second, model, layout.gpus, gpu.peak_flops), layout=layout, microbatches=m,
                    memory_parts={k: memory[k] for k in ("params", "grads", "optimizer", "activations")},
                    elementwise=m * elementwise_mb)
    # END SOLUTION


# ============================================================ when communication hides (perf.step)
#
# Each strategy's traffic hides behind compute only above a size (Austin et al., "How to Scale
# Your Model", the GPU chapter): the ratio of a GPU's FLOP/s C to the bandwidth W its group gets.
# Derived here from the step-time table above (bandwidth terms; latencies, the attention's and
# the output layer's extra FLOPs and element-wise work left out: they only add compute or time).


def dp_critical_tokens(cluster: Cluster, group_size: int, stride: int = 1, zero: int = 0,
                       grad_bytes: int = 2, experts_per_token: float = 1.0) -> float:
    """Tokens per GPU and micro-batch (b s / cp, the tokens each GPU's parameter shard
    multiplies) above which the data-parallel traffic of ``zero`` over ``group_size`` ranks of
    ``stride`` hides behind the compute it overlaps with, in ``step_time``'s model. A parameter
    costs 6 FLOPs per token (2 forward, 4 backward) and moves, per ring step of the group's
    link (W = group_link(...).bandwidth, C = the achieved FLOP/s), (N-1)/N of its bytes:

        ZeRO-0  all-reduce g x 2 (N-1)/N bytes vs the last micro-batch's backward, 4 T / C:
                T* = (N-1)/N x (g/2) x C/W
        ZeRO-1/2 reduce-scatter g + all-gather 2 bytes vs a micro-batch's 6 T / C:
                T* = (N-1)/N x (g+2)/6 x C/W
        ZeRO-3  per micro-batch 2 all-gathers (2 B) + a reduce-scatter (g) vs its 6 T / C:
                T* = (N-1)/N x (4+g)/6 x C/W

    with g = ``grad_bytes``. For 16-bit gradients ZeRO-0 and ZeRO-3 both need T > (N-1)/N C/W:
    on H100s (C ~ 989 TFLOP/s) over rails (FSDP over whole nodes: 8 NICs of 50 GB/s) about
    2,500 tokens; over one NIC per GPU 8 times more. ``experts_per_token``: an expert's weights
    see only k / E of the tokens, so routed experts need E / k times more (pass E / k)."""
    # BEGIN SOLUTION perf.step: (N-1)/N x bytes moved per parameter / FLOPs it hides behind per token x C / W (x E/k)
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"perf.step: ZeRO stage must be 0, 1, 2 or 3, got {zero!r}")
    if group_size < 2:
        return 0.0
    gpu = cluster.gpu
    flops = gpu.achieved_flops or gpu.peak_flops
    bandwidth = group_link(group_size, stride, cluster).bandwidth
    ratio = {0: grad_bytes / 2, 1: (grad_bytes + _ELEMENT) / 6, 2: (grad_bytes + _ELEMENT) / 6,
             3: (2 * _ELEMENT + grad_bytes) / 6}[zero]
    return (group_size - 1) / group_size * ratio * experts_per_token * flops / bandwidth
    # END SOLUTION


def tp_max_degree(model: Model, cluster: Cluster, recompute: str = "none", regather: bool = True) -> float:
    """The largest TP degree t (a real number) whose TP/SP collectives hide behind the
    matmuls when overlapped (``Layout(tp_overlap=True)``), in ``step_time``'s model. Per layer
    and token a GPU computes F / (L t) FLOPs (F = flops_per_token(model, recompute), its
    recomputation included) and sends n all-gathers / reduce-scatters of (t-1)/t x 2 h bytes
    over NVLink (n = 8; 12 with full recomputation; + 2 with Megatron's re-gather):

        F / (L t C) = n (t-1)/t 2h / W   =>   t* = 1 + F W / (2 n h L C)

    For a dense layer F / L ~ 72 h^2 = 18 h x (4h): t* - 1 ~ (18 / 2n) F_ffn W / C, about
    F_ffn W / C (the book's "TP degree below F W / C"), with F_ffn the FFN width."""
    # BEGIN SOLUTION perf.step: 1 + F W / (2 n h L C), n = (4 or 6) all-gathers (+2 re-gather) + (4 or 6) reduce-scatters
    gpu = cluster.gpu
    flops = gpu.achieved_flops or gpu.peak_flops
    full = recompute == "full"
    collectives = 2 * (6 if full else 4) + (2 if regather else 0)
    per_token = flops_per_token(model, recompute)
    return 1 + per_token * cluster.nvlink.bandwidth / (2 * collectives * model.hidden * model.layers * flops)
    # END SOLUTION


def ep_min_expert_width(cluster: Cluster, ep: int, stride: int = 1, gated: bool = True,
                        recompute: str = "none") -> float:
    """The expert FFN width above which an expert's FLOPs outweigh the all-to-alls that bring
    it its tokens, in ``step_time``'s model (where the all-to-alls are never hidden). A routed
    token copy costs 6 x (2 or 3 matrices) x h x F_e FLOPs and 4 all-to-alls (dispatch and
    combine, forward and backward; 6 with full recomputation, which also runs the expert's
    forward again: 8 per parameter) of (ep-1)/ep x 2h bytes on the EP group's link:

        F_e* = a2a x (ep-1)/ep x 2 / (flops per parameter x matrices) x C / W

    TWO REGIMES: an EP group inside an NVLink domain (W = NVLink) needs a few hundred of width
    on H100s; one that spans nodes gets the network (one NIC per GPU with stride >= the node: W
    8 to 9 times smaller), and needs a width several thousand wide — wider than DeepSeek-V3's
    2,048, which is why it limits each token to 4 nodes and overlaps the all-to-alls."""
    # BEGIN SOLUTION perf.step: all-to-alls x (ep-1)/ep x 2 bytes / (FLOPs per parameter x matrices) x C / W
    if ep < 2:
        return 0.0
    gpu = cluster.gpu
    flops = gpu.achieved_flops or gpu.peak_flops
    full = recompute == "full"
    bandwidth = group_link(ep, stride, cluster).bandwidth
    all_to_alls, per_parameter = (6, 8) if full else (4, 6)
    return all_to_alls * (ep - 1) / ep * _ELEMENT / (per_parameter * (3 if gated else 2)) * flops / bandwidth
    # END SOLUTION
