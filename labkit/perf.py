"""Chapter 14 exercises: performance at scale. Predict a step's FLOPs, time and MFU from arithmetic.

Chapters 00-13 derived, per technique, the bytes each rank stores and sends. This chapter turns
them into *time*, with three small models that every estimate of a large run is made of:

* **FLOPs per token** (Kaplan et al. 2020, arXiv:2001.08361; Chowdhery et al. 2022, PaLM,
  arXiv:2204.02311, appendix B). A matmul of a token's [1, n] row by an [n, m] weight is 2nm
  FLOPs forward and twice that backward (the gradient of the input and of the weight): 6 FLOPs
  per parameter the token touches. Attention adds the token's scores against the s keys and
  the weighted sum of the s values, 2 x 2 s d FLOPs per head forward: 12 L (a d) s per token for
  forward + backward. Causal masking does not halve it as counted here: the kernels compute
  the full s x s square (``torch.utils.flop_counter`` counts it so too, PaLM's formula counts it
  so). A mixture of experts multiplies by the k routed (and the shared) experts a token visits,
  not by all of them (the *active* parameters); grouped-query attention shrinks the k and v
  projections, not the attention term. Recomputation (chapter 12) runs a forward again:

      model FLOPs per token     6 N_active + 12 L a d s                 (PaLM, appendix B)
      hardware FLOPs per token  + one forward of every layer (full: 2 N_layers + 4 L a d s)
                                + attention's forward (selective: 4 L a d s)
      MFU = tokens/s x model FLOPs per token / (GPUs x peak FLOP/s)
      HFU = the same with the hardware FLOPs (what the chips actually ran)

* **A roofline per operation** (Williams, Waterman & Patterson 2009, CACM 52(4)): an operation
  that does F FLOPs and moves B bytes to and from memory takes max(F / FLOP/s, B / bandwidth).
  Its arithmetic intensity F / B against the hardware's ridge point (FLOP/s / bandwidth) tells
  which term wins: a large matmul is compute-bound, an element-wise op or a skinny matmul is
  memory-bound. ``HARDWARE`` holds each GPU's datasheet peaks and what a measured matmul
  achieves (cited in each row's ``source``).

* **Communication time per collective and per link class** with chapter 00's alpha-beta
  model: a message of m bytes costs alpha + m / bandwidth. A ring all-reduce of S bytes on N
  ranks is 2(N-1) steps of S/N bytes, a binomial tree 2 ceil(log2 N) steps of S bytes. A
  cluster has two link classes: NVLink inside a node (``gpus_per_node`` GPUs), the network
  between nodes. A group of ranks (the TP group, the DP group, ...) uses NVLink when it lies in
  one node and the network otherwise, where with *rails* every GPU has its own NIC (DGX: NIC i
  of every node on the same leaf switch) and without them the GPUs of a node share one NIC.

Units everywhere: seconds, bytes, FLOPs, FLOP/s, bytes/s.

Tasks (run ``labkit grade perf``; tests in ``tests/grading/test_perf.py``):
    perf.flops      Model.active_params, flops_per_token (dense, GQA, MoE, recomputation), mfu, hfu
    perf.roofline   op_time, matmul_time, arithmetic_intensity, ridge_point
    perf.comm       collective_time (ring, tree; per op), group_time (which link a group uses)
    perf.step       step_time: a layout's step, term by term (below the marker line)
    perf.search     search_layouts: rank the layouts of a cluster by predicted step time
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RECOMPUTE = ("none", "selective", "full")
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")
ALGOS = ("ring", "tree")


# ----------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class Model:
    """A decoder-only transformer as papers state it.

    ``heads`` query heads of ``head_dim`` (default hidden // heads; PaLM 540B has 48 x 256 on a
    width of 18432), ``kv_heads`` key/value heads (grouped-query attention; None = heads),
    an FFN of inner width ``ffn`` (None = 4 hidden), with three matrices when ``gated``
    (SwiGLU) instead of two. A mixture of experts: ``experts`` routed experts per MoE layer of
    inner width ``expert_ffn`` (None = ffn), ``top_k`` of them per token, ``shared_experts``
    always on, a router [hidden, experts]; the first ``dense_layers`` layers keep a dense FFN.
    ``tied``: the output layer is the token embedding. Biases, norms and learned position
    embeddings are left out of every count: none of them is a matmul, and in a large model they
    are a few parts in ten thousand of the parameters (the course's tiny GPT is the exception)."""
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    kv_heads: int | None = None
    ffn: int | None = None
    gated: bool = False
    experts: int = 0
    top_k: int = 1
    shared_experts: int = 0
    expert_ffn: int | None = None
    dense_layers: int = 0
    tied: bool = False
    name: str = ""
    head_dim: int | None = None

    def __post_init__(self):
        for field in ("layers", "hidden", "heads", "vocab", "seq"):
            if not isinstance(getattr(self, field), int) or getattr(self, field) < 1:
                raise ValueError(f"Model {self.name!r}: {field} must be a positive integer, got {getattr(self, field)!r}")
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"Model {self.name!r}: hidden {self.hidden} is not a multiple of heads {self.heads}; "
                             f"give head_dim")
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise ValueError(f"Model {self.name!r}: {self.heads} query heads do not split into {self.kv_heads} groups")
        if self.experts < 0 or self.shared_experts < 0:
            raise ValueError(f"Model {self.name!r}: experts and shared_experts must be >= 0")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"Model {self.name!r}: top_k {self.top_k} must be between 1 and experts {self.experts}")
        if not 0 <= self.dense_layers <= self.layers:
            raise ValueError(f"Model {self.name!r}: dense_layers {self.dense_layers} not in [0, {self.layers}]")

    # shapes
    @property
    def kv_heads_(self) -> int:
        """Key/value heads (``kv_heads``, else one per query head)."""
        return self.kv_heads or self.heads

    @property
    def head_size(self) -> int:
        """Width of one attention head (``head_dim``, else hidden // heads)."""
        return self.head_dim or self.hidden // self.heads

    @property
    def ffn_width(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def expert_width(self) -> int:
        return self.expert_ffn or self.ffn_width

    @property
    def moe_layers(self) -> int:
        """Layers whose FFN is a mixture of experts (0 for a dense model)."""
        return self.layers - self.dense_layers if self.experts else 0

    def attention_params(self) -> int:
        """One layer's attention projections: q and o are hidden x (heads x head_size) each;
        k and v hidden x (kv_heads x head_size) each (grouped-query attention shares them)."""
        # BEGIN SOLUTION perf.flops: q, o: hidden x heads x head_size; k, v: hidden x kv_heads_ x head_size
        return 2 * self.hidden * self.heads * self.head_size + 2 * self.hidden * self.kv_heads_ * self.head_size
        # END SOLUTION

    def ffn_params(self, width: int | None = None) -> int:
        """One FFN (or one expert) of inner ``width`` (None: ``ffn_width``): up and down
        projections hidden x width, and a gate of the same shape when ``gated`` (SwiGLU)."""
        # BEGIN SOLUTION perf.flops: 2 matrices hidden x width, 3 when gated
        return (3 if self.gated else 2) * self.hidden * (width or self.ffn_width)
        # END SOLUTION

    def params(self) -> int:
        """All parameters: token embedding, output layer (unless tied), every layer's attention,
        FFN, router and all experts (biases, norms, position embeddings left out)."""
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        dense = (self.layers - self.moe_layers) * self.ffn_params()
        moe = self.moe_layers * (self.hidden * self.experts
                                 + (self.experts + self.shared_experts) * self.ffn_params(self.expert_width))
        return embeddings + self.layers * self.attention_params() + dense + moe

    def active_params(self) -> int:
        """The matmul parameters one token's forward multiplies by: every layer's attention
        projections, the dense FFNs, in an MoE layer the router and the top_k routed + the
        shared experts, and the output layer (vocab x hidden, tied or not). The embedding lookup
        is not a matmul and is not counted."""
        # BEGIN SOLUTION perf.flops: layers x attention + dense FFNs + MoE layers x (router + (top_k + shared) experts) + the output layer
        dense = (self.layers - self.moe_layers) * self.ffn_params()
        moe = self.moe_layers * (self.hidden * self.experts
                                 + (self.top_k + self.shared_experts) * self.ffn_params(self.expert_width))
        return self.layers * self.attention_params() + dense + moe + self.vocab * self.hidden
        # END SOLUTION

    @classmethod
    def of_gpt(cls, config, seq: int | None = None) -> "Model":
        """The course GPT (``labkit.models.GPTConfig``): 4H MLP (or n_experts experts of 4H with
        a top-moe_k router, counted dropless), sequences of ``seq`` tokens (default block_size)."""
        return cls(layers=config.n_layer, hidden=config.n_embd, heads=config.n_head, vocab=config.vocab_size,
                   seq=seq or config.block_size, experts=config.n_experts,
                   top_k=config.moe_k if config.n_experts else 1, tied=config.tie_weights, name="labkit GPT")


# ----------------------------------------------------------------------------- perf.flops


def flops_per_token(model: Model, recompute: str = "none") -> float:
    """FLOPs of one token's forward + backward in a training step (PaLM, appendix B):
    6 x ``model.active_params()`` + 12 L (heads x head_size) s for attention's scores and
    weighted values (causal counted as the full square). ``recompute``: "none" (the model
    FLOPs), "selective" adds attention's forward again (4 L a d s; Korthikanti et al. 2022),
    "full" adds every layer's forward again (2 x the layers' matmul parameters + 4 L a d s; the
    output layer is not recomputed). Equals what ``torch.utils.flop_counter.FlopCounterMode``
    counts on ``labkit.models.GPT`` (math attention), per token."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    # BEGIN SOLUTION perf.flops: 6 x active params + 12 L (a d) s; selective: + attention's forward 4 L a d s; full: + 2 x (active params - output layer) + 4 L a d s
    attention_forward = 4 * model.layers * model.heads * model.head_size * model.seq
    flops = 6 * model.active_params() + 3 * attention_forward
    if recompute == "selective":
        flops += attention_forward
    elif recompute == "full":
        flops += 2 * (model.active_params() - model.vocab * model.hidden) + attention_forward
    return float(flops)
    # END SOLUTION


def model_flops_per_token(model: Model) -> float:
    """The model FLOPs of MFU: ``flops_per_token(model, "none")``, whatever the run recomputes."""
    return flops_per_token(model, "none")


def mfu(tokens_per_second: float, model: Model, gpus: int, peak_flops: float) -> float:
    """Model FLOPs utilization (PaLM, appendix B): the model FLOPs per second a run achieves
    (tokens/s x model FLOPs per token) over the peak FLOP/s of all its chips."""
    # BEGIN SOLUTION perf.flops: tokens/s x model FLOPs per token / (gpus x peak)
    return tokens_per_second * model_flops_per_token(model) / (gpus * peak_flops)
    # END SOLUTION


def hfu(tokens_per_second: float, model: Model, gpus: int, peak_flops: float, recompute: str) -> float:
    """Hardware FLOPs utilization (PaLM, appendix B): as MFU, with the FLOPs the chips ran,
    recomputation's included (``flops_per_token(model, recompute)``)."""
    # BEGIN SOLUTION perf.flops: tokens/s x flops_per_token(model, recompute) / (gpus x peak)
    return tokens_per_second * flops_per_token(model, recompute) / (gpus * peak_flops)
    # END SOLUTION


# ----------------------------------------------------------------------------- perf.roofline


@dataclass(frozen=True)
class Hardware:
    """One accelerator: dense 16-bit peak FLOP/s, memory bandwidth (bytes/s) and capacity
    (bytes), and what a measured kernel achieves (None: no cited measurement; the peak is used)."""
    name: str
    peak_flops: float
    memory_bandwidth: float
    memory_bytes: float
    achieved_flops: float | None = None
    achieved_bandwidth: float | None = None
    source: str = ""


_MAMF = ("achieved: Bekman, 'Machine Learning Engineering', Maximum Achievable Matmul FLOPS (MAMF) table, "
         "BF16 (github.com/stas00/ml-engineering, compute/accelerator/README.md)")
HARDWARE: dict[str, Hardware] = {
    "A100": Hardware(
        "A100 SXM4 80GB", peak_flops=312e12, memory_bandwidth=2.039e12, memory_bytes=80e9,
        achieved_flops=271.2e12,
        source="NVIDIA A100 Tensor Core GPU datasheet: BF16 312 TFLOP/s dense, HBM2e 2,039 GB/s, 80 GB; "
               + _MAMF + ": 271.2 TFLOP/s (torch 2.6, CUDA 12.6)"),
    "H100": Hardware(
        "H100 SXM5 80GB", peak_flops=989e12, memory_bandwidth=3.35e12, memory_bytes=80e9,
        achieved_flops=794.5e12,
        source="NVIDIA H100 Tensor Core GPU datasheet: BF16 1,979 TFLOP/s with sparsity = 989 dense, "
               "HBM3 3.35 TB/s, 80 GB; " + _MAMF + ": 794.5 TFLOP/s (torch 2.7, CUDA 12.6)"),
    "H200": Hardware(
        "H200 SXM 141GB", peak_flops=989e12, memory_bandwidth=4.8e12, memory_bytes=141e9,
        achieved_flops=794.5e12,
        source="NVIDIA H200 Tensor Core GPU datasheet: BF16 1,979 TFLOP/s with sparsity = 989 dense, "
               "HBM3e 4.8 TB/s, 141 GB; " + _MAMF + ": 794.5 TFLOP/s, the H100 row ('H200 is the same')"),
    "H800": Hardware(
        "H800 SXM5 80GB", peak_flops=989e12, memory_bandwidth=3.35e12, memory_bytes=80e9,
        achieved_flops=794.5e12,
        source="NVIDIA H800 SXM5, the export variant of the H100 SXM5: its compute and HBM3 (989 TFLOP/s BF16 "
               "dense, 3.35 TB/s, 80 GB) with NVLink cut to 400 GB/s; the GPU of DeepSeek-V3 (technical report, "
               "arXiv:2412.19437, section 3.1); achieved: the H100 MAMF row, 794.5 TFLOP/s (same tensor cores)"),
}


def op_time(flops: float, nbytes: float, hw: Hardware, achieved: bool = True) -> float:
    """The roofline: max(flops / FLOP/s, nbytes / bandwidth) seconds, with the hardware's
    achieved figures (each one that is None falls back to its peak), or its peaks when
    ``achieved`` is False."""
    # BEGIN SOLUTION perf.roofline: pick achieved or peak FLOP/s and bandwidth (None -> peak); the larger of the two times
    rate = hw.achieved_flops if achieved and hw.achieved_flops else hw.peak_flops
    bandwidth = hw.achieved_bandwidth if achieved and hw.achieved_bandwidth else hw.memory_bandwidth
    return max(flops / rate, nbytes / bandwidth)
    # END SOLUTION


def matmul_time(m: int, n: int, k: int, hw: Hardware, element_bytes: int = 2, achieved: bool = True) -> float:
    """[m, k] @ [k, n]: 2mnk FLOPs; reads both inputs and writes the output once,
    (mk + kn + mn) x element_bytes bytes; timed by ``op_time``."""
    # BEGIN SOLUTION perf.roofline: 2mnk FLOPs, (mk + kn + mn) x element_bytes bytes, op_time
    return op_time(2 * m * n * k, (m * k + k * n + m * n) * element_bytes, hw, achieved)
    # END SOLUTION


def arithmetic_intensity(flops: float, nbytes: float) -> float:
    """FLOPs per byte moved."""
    # BEGIN SOLUTION perf.roofline: flops / bytes
    return flops / nbytes
    # END SOLUTION


def ridge_point(hw: Hardware, achieved: bool = True) -> float:
    """The intensity (FLOPs/byte) above which an op is compute-bound: FLOP/s / bandwidth."""
    # BEGIN SOLUTION perf.roofline: FLOP/s / bandwidth, achieved or peak as in op_time
    rate = hw.achieved_flops if achieved and hw.achieved_flops else hw.peak_flops
    bandwidth = hw.achieved_bandwidth if achieved and hw.achieved_bandwidth else hw.memory_bandwidth
    return rate / bandwidth
    # END SOLUTION


# ----------------------------------------------------------------------------- perf.comm


@dataclass(frozen=True)
class Link:
    """alpha: seconds per message; bandwidth: bytes/s one GPU sends (and receives) at once,
    one direction (1/beta of chapter 00)."""
    alpha: float
    bandwidth: float


@dataclass(frozen=True)
class Cluster:
    """Nodes of ``gpus_per_node`` GPUs joined by NVLink (``nvlink``, per GPU); nodes joined
    by the network (``network``: one NIC). ``rails``: every GPU has its own NIC, NIC i of every
    node on rail i (DGX SuperPOD); without rails the GPUs of a node share one NIC (a commodity
    cluster, or this course's emulated nodes: one veth per namespace)."""
    gpu: Hardware
    nvlink: Link
    network: Link
    gpus_per_node: int = 8
    rails: bool = True
    name: str = ""
    source: str = ""      # citation for every figure


# alpha: NCCL's own cost model charges a few microseconds per step inside a node (src/graph/tuning.cc,
# hwLat NVLink ring Simple 3.4 us) and chapter 00's orders of magnitude: a few us within a node, tens
# of us across nodes (here 10 us). Bandwidths: one direction, per GPU.
_NVLINK_ALPHA, _NET_ALPHA = 3.4e-6, 10e-6
_ALPHA_SOURCE = ("alpha: orders of magnitude, not measured (NCCL's cost model, src/graph/tuning.cc, charges 3.4 us "
                 "per NVLink ring step; chapter 00: a few us inside a node, tens across)")
CLUSTERS: dict[str, Cluster] = {
    "dgx-a100": Cluster(
        HARDWARE["A100"], nvlink=Link(_NVLINK_ALPHA, 300e9), network=Link(_NET_ALPHA, 25e9), name="DGX A100",
        source="NVIDIA DGX A100 datasheet: NVLink 3 600 GB/s per GPU (300 each way), 8 x ConnectX-6 200 Gb/s "
               "HDR InfiniBand, one per GPU (25 GB/s each way); " + _ALPHA_SOURCE),
    "dgx-h100": Cluster(
        HARDWARE["H100"], nvlink=Link(_NVLINK_ALPHA, 450e9), network=Link(_NET_ALPHA, 50e9), name="DGX H100",
        source="NVIDIA DGX H100 datasheet: NVLink 4 900 GB/s per GPU (450 each way), 8 x ConnectX-7 400 Gb/s "
               "NDR InfiniBand, one per GPU (50 GB/s each way); " + _ALPHA_SOURCE),
    "dgx-h200": Cluster(
        HARDWARE["H200"], nvlink=Link(_NVLINK_ALPHA, 450e9), network=Link(_NET_ALPHA, 50e9), name="DGX H200",
        source="NVIDIA DGX H200 datasheet: NVLink 4 900 GB/s per GPU, 8 x ConnectX-7 400 Gb/s (as DGX H100); "
               + _ALPHA_SOURCE),
    "h800": Cluster(
        HARDWARE["H800"], nvlink=Link(_NVLINK_ALPHA, 160e9), network=Link(_NET_ALPHA, 50e9), name="DeepSeek H800",
        source="DeepSeek-V3 technical report (arXiv:2412.19437), sections 3.1 and 3.2.2: 8 H800 per node on "
               "NVLink/NVSwitch, InfiniBand between nodes; NVLink 160 GB/s, IB 50 GB/s per GPU; " + _ALPHA_SOURCE),
}
CLUSTER_SOURCES = {key: cluster.source for key, cluster in CLUSTERS.items()}


def collective_time(op: str, nbytes: float, ranks: int, link: Link, algo: str = "ring") -> float:
    """Seconds for ``op`` among ``ranks`` ranks over ``link`` (chapter 00's alpha-beta model;
    full duplex: a rank sends one message and receives one at once). ``nbytes`` is the whole
    buffer: the all-reduce's input, the all-gather's output, the reduce-scatter's input, one
    rank's all-to-all input, the message of a send. One rank: 0 (nothing crosses a link).

        ring  all_reduce      2(N-1) (alpha + S/(N B))        reduce-scatter, then all-gather
              all_gather, reduce_scatter, all_to_all
                              (N-1) (alpha + S/(N B))          all_to_all: pairwise exchange
        tree  all_reduce      2 ceil(log2 N) (alpha + S/B)     binomial reduce, then broadcast
              all_gather, reduce_scatter
                              ceil(log2 N) alpha + (N-1)/N S/B recursive doubling / halving
                                                               (Thakur et al. 2005)
        send                  alpha + S/B                      (either algorithm)
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if algo not in ALGOS:
        raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
    if op == "all_to_all" and algo == "tree":
        raise ValueError("all_to_all: this model has only the pairwise exchange (algo='ring')")
    if ranks < 1 or nbytes < 0:
        raise ValueError(f"{op}: need ranks >= 1 and nbytes >= 0, got ranks={ranks}, nbytes={nbytes}")
    # BEGIN SOLUTION perf.comm: N = 1 -> 0; send: alpha + S/B; ring: (N-1) or 2(N-1) steps of S/N; tree: ceil(log2 N) rounds (all-reduce 2x, S per round; AG/RS: (N-1)/N S in all)
    if ranks == 1:
        return 0.0
    alpha, bandwidth = link.alpha, link.bandwidth
    if op == "send":
        return alpha + nbytes / bandwidth
    if algo == "ring":
        steps = 2 * (ranks - 1) if op == "all_reduce" else ranks - 1
        return steps * (alpha + nbytes / ranks / bandwidth)
    rounds = math.ceil(math.log2(ranks))
    if op == "all_reduce":
        return 2 * rounds * (alpha + nbytes / bandwidth)
    return rounds * alpha + (ranks - 1) / ranks * nbytes / bandwidth
    # END SOLUTION


def group_link(group_size: int, stride: int, cluster: Cluster) -> Link:
    """The link a group of ``group_size`` ranks, consecutive members ``stride`` ranks apart in
    the global order (TP stride 1, then CP, PP, DP: chapter 08's grid), runs at. Such groups
    tile blocks of stride x group_size consecutive ranks: when that block divides a node the
    group is inside one node (NVLink); otherwise some group spans nodes and its ring is as slow
    as its network hop. With rails every GPU drives its own NIC; without, the node's GPUs that
    cross the network at once share its one NIC: min(stride, gpus_per_node) of them (one
    boundary hop per group, stride groups interleaved in a node)."""
    if group_size < 1 or stride < 1:
        raise ValueError(f"group_size and stride must be >= 1, got {group_size}, {stride}")
    # BEGIN SOLUTION perf.comm: inside a node iff gpus_per_node % (stride x group_size) == 0 -> nvlink; else network, bandwidth / min(stride, gpus_per_node) without rails
    if cluster.gpus_per_node % (stride * group_size) == 0:
        return cluster.nvlink
    if cluster.rails:
        return cluster.network
    sharers = min(stride, cluster.gpus_per_node)
    return Link(cluster.network.alpha, cluster.network.bandwidth / sharers)
    # END SOLUTION


def group_time(op: str, nbytes: float, group_size: int, stride: int, cluster: Cluster, algo: str = "ring") -> float:
    """``collective_time`` of ``op`` on a group of ``group_size`` ranks ``stride`` apart, over
    the link ``group_link`` picks."""
    return collective_time(op, nbytes, group_size, group_link(group_size, stride, cluster), algo)


# ============================================================ the step-time model (perf.step, perf.search)
