"""The machines chapter 14's model runs on: GPUs, links and clusters, each figure with its source.

Given data, not an exercise: ``labkit.perf`` (chapter 14) prices FLOPs, bytes and messages on
these, and re-exports every name here (``perf.HARDWARE``, ``perf.Cluster``...).

* ``Hardware``: one accelerator's datasheet peaks (dense 16-bit and FP8 FLOP/s, HBM bandwidth
  and capacity) and, where a measurement is cited, what a matmul achieves on it.
* ``Link``: chapter 00's alpha-beta model of one link class, per GPU and one direction.
* ``Cluster``: nodes of GPUs joined by NVLink, nodes joined by the network (with rails: one
  NIC per GPU).
* ``HARDWARE`` and ``CLUSTERS``: the presets the chapter uses, each row citing its sources.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    """One accelerator: dense 16-bit peak FLOP/s, memory bandwidth (bytes/s) and capacity
    (bytes), and what a measured kernel achieves (None: no cited measurement; the peak is used).
    ``fp8_flops``: the dense FP8 peak where the tensor cores have one. A FLOP is a FLOP in either
    precision: MFU is quoted against the 16-bit peak (DeepSeek-V3 does so for its FP8 run), so a
    run in FP8 can exceed what the 16-bit peak allows."""
    name: str
    peak_flops: float
    memory_bandwidth: float
    memory_bytes: float
    achieved_flops: float | None = None
    achieved_bandwidth: float | None = None
    source: str = ""
    fp8_flops: float | None = None     # dense FP8 peak (None: no FP8 tensor cores); FLOPs are counted the same


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
        achieved_flops=794.5e12, fp8_flops=1979e12,
        source="NVIDIA H100 Tensor Core GPU datasheet: BF16 1,979 TFLOP/s with sparsity = 989 dense, "
               "FP8 3,958 with sparsity = 1,979 dense, "
               "HBM3 3.35 TB/s, 80 GB; " + _MAMF + ": 794.5 TFLOP/s (torch 2.7, CUDA 12.6)"),
    "H200": Hardware(
        "H200 SXM 141GB", peak_flops=989e12, memory_bandwidth=4.8e12, memory_bytes=141e9,
        achieved_flops=794.5e12, fp8_flops=1979e12,
        source="NVIDIA H200 Tensor Core GPU datasheet: BF16 1,979 TFLOP/s with sparsity = 989 dense, "
               "FP8 3,958 with sparsity = 1,979 dense, "
               "HBM3e 4.8 TB/s, 141 GB; " + _MAMF + ": 794.5 TFLOP/s, the H100 row ('H200 is the same')"),
    "H800": Hardware(
        "H800 SXM5 80GB", peak_flops=989e12, memory_bandwidth=3.35e12, memory_bytes=80e9,
        achieved_flops=794.5e12, fp8_flops=1979e12,
        source="NVIDIA H800 SXM5, the export variant of the H100 SXM5: its compute and HBM3 (989 TFLOP/s BF16 "
               "dense, 1,979 FP8 dense, 3.35 TB/s, 80 GB) with NVLink cut to 400 GB/s; the GPU of DeepSeek-V3 (technical report, "
               "arXiv:2412.19437, section 3.1); achieved: the H100 MAMF row, 794.5 TFLOP/s (same tensor cores)"),
    "GB200": Hardware(
        "B200 in a GB200 NVL72 (1,200 W)", peak_flops=2500e12, memory_bandwidth=8e12, memory_bytes=192e9,
        fp8_flops=5000e12,
        source="GB200 (the B200 of a GB200 superchip, configured at 1,200 W): BF16 2,500 TFLOP/s dense, FP8 "
               "5,000 dense, HBM3e 192 GB at 8 TB/s: glennklockwood.com/garden/processors/B200 quoting NVIDIA "
               "(a second source, verda.com's GB300 post, lists 2,250 BF16 dense for GB200: the figure is not "
               "settled; no achieved figure cited)"),
}


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
CLUSTERS["gb200-nvl72"] = Cluster(
    HARDWARE["GB200"], nvlink=Link(_NVLINK_ALPHA, 900e9), network=Link(_NET_ALPHA, 50e9), gpus_per_node=72,
    name="GB200 NVL72 (one 72-GPU NVLink domain)",
    source="GB200 NVL72: 72 Blackwell GPUs in one NVLink 5 domain through NVLink switches, 1.8 TB/s per GPU "
           "(900 GB/s each way): verda.com and aiwiki.ai quoting NVIDIA; network between racks: 400 Gb/s per GPU "
           "ASSUMED (not verified; IB 50 GB/s each way); " + _ALPHA_SOURCE)
CLUSTER_SOURCES = {key: cluster.source for key, cluster in CLUSTERS.items()}
