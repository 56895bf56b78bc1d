"""Chapter 14 exercises: performance at scale. Predict a step's FLOPs, time and MFU from arithmetic.

Chapters 00-13 derived, per technique, the bytes each rank stores and sends. This chapter turns
them into *time*, with three small models that every estimate of a large run is made of:

* **FLOPs per token** (Kaplan et al. 2020, arXiv:2001.08361; Chowdhery et al. 2022, PaLM,
  arXiv:2204.02311, appendix B). A matmul of a token's [1, n] row by an [n, m] weight is 2nm
  FLOPs forward and twice that backward (the gradient of the input and of the weight): 6 FLOPs
  per parameter the token touches. Attention adds the token's scores against the s keys and
  the weighted sum of the s values, 2 x 2 s d FLOPs per head forward: 12 L (a d) s per token for
  forward + backward. Causal masking does not halve it as counted here: the full s x s square is
  a COUNTING CONVENTION (``torch.utils.flop_counter`` and PaLM's formula count it so), not what
  causal kernels run: FlashAttention skips the masked tiles and executes about half of it. A mixture of experts multiplies by the k routed (and the shared) experts a token visits,
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
  achieves (cited in each row's ``source``; the GPUs, links and clusters are given data in
  ``labkit.hardware``, importable from here).

* **Communication time per collective and per link class** with chapter 00's alpha-beta
  model: a message of m bytes costs alpha + m / bandwidth. A ring all-reduce of S bytes on N
  ranks is 2(N-1) steps of S/N bytes; NCCL's pipelined double binary tree 2 ceil(log2 N)
  latencies and 2 S/B; an in-network reduction (NVLS, SHARP) 2 latencies and S/B. The ring's
  latency: the course charges every step the group's link alpha (NCCL's tuning model charges the
  network's only on the steps that cross nodes, which lowers it). A
  cluster has two link classes: NVLink inside a node (``gpus_per_node`` GPUs), the network
  between nodes. A group of ranks (the TP group, the DP group, ...) uses NVLink when it lies in
  one node and the network otherwise, where with *rails* every GPU has its own NIC (DGX: NIC i
  of every node on the same leaf switch) and NCCL runs a channel per NIC, so a group with k
  members in a node crosses on k NICs; without rails the GPUs of a node share one NIC. A
  72-GPU NVLink domain (GB200 NVL72) is a "node" of 72.

* **A software stack's efficiency, calibrated on one run.** The achieved fraction of the peak
  belongs to a software stack on a GPU generation, not to the GPU. ``Stack(name, gpu, matmul,
  memory=1.0, source)`` holds it; ``calibrate(model, layout, cluster, global_batch,
  tokens_per_second=... | step_seconds=...)`` fits ``matmul`` from ONE measured run (a published
  row, or your own timed step; tokens/s of the whole job) so that ``step_time`` reproduces it,
  and ``step_time(..., stack=stack)`` (or ``stack.on(cluster)``) predicts other runs of the
  same stack. Element-wise work is not in that fraction: ``elementwise_bytes`` prices it at
  HBM bandwidth (the roofline). ``Layout.flash``: fused attention (no scores in HBM, its
  backward recomputes them), independent of ``Layout.recompute``.

Units everywhere: seconds, bytes, FLOPs, FLOP/s, bytes/s.

Tasks (run ``labkit grade perf``; tests in ``tests/grading/test_perf.py``):
    perf.flops      Model.active_params, flops_per_token (dense, GQA, MoE, recomputation), mfu,
                    hfu (PaLM's convention, or Korthikanti's for selective recomputation)
    perf.roofline   op_time, matmul_time, arithmetic_intensity, ridge_point
    perf.comm       collective_time (ring, NCCL's pipelined tree, NVLS/SHARP in-network reduction;
                    per op), group_time (which link a group uses: NVLink, or the network over k rails)
    perf.step       step_time: a layout's step, term by term (below the marker line), with
                    elementwise_bytes (memory-bound work at HBM bandwidth), flash attention, fp32
                    gradients (Layout.grad_bytes), overlapped TP (Layout.tp_overlap) and TP's
                    re-gather in backward or the gathered input kept (Layout.tp_regather)
                    and when each strategy's traffic hides: dp_critical_tokens (tokens per GPU above
                    ~C/W), tp_max_degree (TP below ~F W / C), ep_min_expert_width (two regimes)
    perf.search     search_layouts: rank the layouts of a cluster by predicted step time

One file per model; import everything from ``labkit.perf`` as the chapter does:
    flops.py     perf.flops       Model, flops_per_token, mfu, hfu
    roofline.py  perf.roofline    op_time, matmul_time, arithmetic_intensity, ridge_point
    network.py   perf.comm        collective_time, group_link, group_time
    step.py      perf.step        Layout, step_time and its terms, when communication hides
    search.py    perf.search      candidate_layouts, search_layouts
    stacks.py    (given)          Stack, calibrate
"""

from labkit.hardware import CLUSTER_SOURCES, CLUSTERS, HARDWARE, Cluster, Hardware, Link  # noqa: F401 - given (re-exported)
from labkit.perf.flops import HFU_CONVENTIONS, RECOMPUTE, Model, flops_per_token, hfu, mfu, model_flops_per_token  # noqa: F401
from labkit.perf.roofline import arithmetic_intensity, matmul_time, op_time, ridge_point  # noqa: F401
from labkit.perf.network import ALGOS, OPS, collective_time, group_link, group_time  # noqa: F401
from labkit.perf.step import (  # noqa: F401
    ELEMENTWISE_PASSES, SCHEDULES, SEARCHED, Layout, StepTime, dp_critical_tokens, elementwise_bytes,
    ep_min_expert_width, in_flight, layers_on_rank, memory_per_gpu, parameters_per_gpu, step_time, tp_max_degree)
from labkit.perf.search import candidate_layouts, search_layouts  # noqa: F401
from labkit.perf.stacks import Stack, calibrate  # noqa: F401
