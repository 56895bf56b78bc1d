"""perf.comm: a collective's time on a link (alpha-beta: ring, NCCL's tree, NVLS/SHARP) and the link
a group of ranks uses (NVLink inside a node, the network over k rails; the overview:
``labkit/perf/__init__.py``).
"""

from __future__ import annotations

import math

from labkit.hardware import Cluster, Link

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")
ALGOS = ("ring", "tree", "nvls")


def collective_time(op: str, nbytes: float, ranks: int, link: Link, algo: str = "ring") -> float:
    """Seconds for ``op`` among ``ranks`` ranks over ``link`` (chapter 00's alpha-beta model;
    full duplex: a rank sends one message and receives one at once). ``nbytes`` is the whole
    buffer: the all-reduce's input, the all-gather's output, the reduce-scatter's input, one
    rank's all-to-all input, the message of a send. One rank: 0 (nothing crosses a link).

        ring  all_reduce      2(N-1) (alpha + S/(N B))        reduce-scatter, then all-gather
              all_gather, reduce_scatter, all_to_all
                              (N-1) (alpha + S/(N B))          all_to_all: pairwise exchange
        tree  all_reduce      2 ceil(log2 N) alpha + 2 S/B     NCCL's pipelined double binary tree:
                                                               latency of a reduce up and a broadcast
                                                               down the tree, the buffer cut into small
                                                               chunks that stream (each rank sends and
                                                               receives S up and S down; Sanders et al.
                                                               2009, NCCL 2.4's trees)
              all_gather, reduce_scatter
                              ceil(log2 N) alpha + (N-1)/N S/B recursive doubling / halving
                                                               (Thakur et al. 2005)
        nvls  all_reduce      2 alpha + S/B                    in-network reduction (NCCL's NVLS on an
                                                               NVSwitch, CollNet/SHARP on an InfiniBand
                                                               switch): each rank pushes S to the switch,
                                                               which reduces, and receives the S reduced
                                                               (multicast): half a ring's bytes
              all_gather, reduce_scatter
                              alpha + (N-1)/N S/B              one multicast / one in-switch reduction
        send                  alpha + S/B                      (any algorithm)
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if algo not in ALGOS:
        raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
    if op == "all_to_all" and algo != "ring":
        raise ValueError("all_to_all: this model has only the pairwise exchange (algo='ring')")
    if ranks < 1 or nbytes < 0:
        raise ValueError(f"{op}: need ranks >= 1 and nbytes >= 0, got ranks={ranks}, nbytes={nbytes}")
    # BEGIN SOLUTION perf.comm: N = 1 -> 0; send: alpha + S/B; ring: (N-1) or 2(N-1) steps of S/N; nvls: 2 alpha + S/B (AG/RS: alpha + (N-1)/N S/B); tree: ceil(log2 N) rounds of alpha (all-reduce 2x, pipelined: 2 S/B in all; AG/RS: (N-1)/N S in all)
    if ranks == 1:
        return 0.0
    alpha, bandwidth = link.alpha, link.bandwidth
    if op == "send":
        return alpha + nbytes / bandwidth
    if algo == "ring":
        steps = 2 * (ranks - 1) if op == "all_reduce" else ranks - 1
        return steps * (alpha + nbytes / ranks / bandwidth)
    if algo == "nvls":
        if op == "all_reduce":
            return 2 * alpha + nbytes / bandwidth
        return alpha + (ranks - 1) / ranks * nbytes / bandwidth
    rounds = math.ceil(math.log2(ranks))
    if op == "all_reduce":
        return 2 * rounds * alpha + 2 * nbytes / bandwidth
    return rounds * alpha + (ranks - 1) / ranks * nbytes / bandwidth
    # END SOLUTION


def group_link(group_size: int, stride: int, cluster: Cluster) -> Link:
    """The link a group of ``group_size`` ranks, consecutive members ``stride`` ranks apart in
    the global order (TP stride 1, then CP, PP, DP: chapter 08's grid), runs at. Such groups
    tile blocks of stride x group_size consecutive ranks: when that block divides a node the
    group is inside one node (NVLink); otherwise some group spans nodes and its ring is as slow
    as its network hop. With rails every GPU drives its own NIC, and NCCL runs one ring channel
    per NIC: a group with k = min(group_size, gpus_per_node // stride) members in a node (at
    least 1) crosses between nodes on k NICs at once, so its hop runs at min(k x NIC, NVLink)
    (FSDP over consecutive ranks: all 8 NICs; a DP group 8 or more apart: one). Without rails
    the node's GPUs that cross the network at once share its one NIC: min(stride,
    gpus_per_node) of them (one boundary hop per group, stride groups interleaved in a node)."""
    if group_size < 1 or stride < 1:
        raise ValueError(f"group_size and stride must be >= 1, got {group_size}, {stride}")
    # BEGIN SOLUTION perf.comm: inside a node iff gpus_per_node % (stride x group_size) == 0 -> nvlink; rails: network x k NICs (k members in a node), at most NVLink; else bandwidth / min(stride, gpus_per_node)
    if cluster.gpus_per_node % (stride * group_size) == 0:
        return cluster.nvlink
    if cluster.rails:
        nics = max(1, min(group_size, cluster.gpus_per_node // stride))
        return Link(cluster.network.alpha, min(nics * cluster.network.bandwidth, cluster.nvlink.bandwidth))
    sharers = min(stride, cluster.gpus_per_node)
    return Link(cluster.network.alpha, cluster.network.bandwidth / sharers)
    # END SOLUTION


def group_time(op: str, nbytes: float, group_size: int, stride: int, cluster: Cluster, algo: str = "ring") -> float:
    """``collective_time`` of ``op`` on a group of ``group_size`` ranks ``stride`` apart, over
    the link ``group_link`` picks."""
    return collective_time(op, nbytes, group_size, group_link(group_size, stride, cluster), algo)
