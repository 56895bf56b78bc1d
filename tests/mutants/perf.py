"""Wrong implementations of chapter 14 that the grader must fail (see labkit.course.mutants)."""

from labkit.course.mutants import Mutant

MUTANTS = [
    # perf.flops
    Mutant("perf.flops", "no_attention", "6 x parameters only: the attention scores and weighted values are left out",
           find="    flops = 6 * model.active_params() + 3 * attention_forward\n",
           replace="    flops = 6 * model.active_params()\n"),
    Mutant("perf.flops", "causal_half", "halves the attention term because the mask hides half of the scores",
           find="    flops = 6 * model.active_params() + 3 * attention_forward\n",
           replace="    flops = 6 * model.active_params() + 3 * attention_forward / 2\n"),
    Mutant("perf.flops", "no_lm_head", "forgets the output layer (vocab x hidden) in the matmul parameters",
           find="        return self.layers * self.attention_params() + dense + moe + self.vocab * self.hidden\n",
           replace="        return self.layers * self.attention_params() + dense + moe\n"),
    Mutant("perf.flops", "all_experts", "counts every routed expert, not the top_k a token visits",
           find="                                 + (self.top_k + self.shared_experts) * self.ffn_params(self.expert_width))\n"
                "        return self.layers",
           replace="                                 + (self.experts + self.shared_experts) * self.ffn_params(self.expert_width))\n"
                   "        return self.layers"),
    Mutant("perf.flops", "no_shared_experts", "forgets the always-on shared experts",
           find="                                 + (self.top_k + self.shared_experts) * self.ffn_params(self.expert_width))\n"
                "        return self.layers",
           replace="                                 + self.top_k * self.ffn_params(self.expert_width))\n"
                   "        return self.layers"),
    Mutant("perf.flops", "no_router", "leaves the router [hidden, experts] out of an MoE layer",
           find="        moe = self.moe_layers * (self.hidden * self.experts\n"
                "                                 + (self.top_k + self.shared_experts)",
           replace="        moe = self.moe_layers * (0\n"
                   "                                 + (self.top_k + self.shared_experts)"),
    Mutant("perf.flops", "gqa_ignored", "k and v as wide as q: grouped-query attention ignored",
           find="        return 2 * self.hidden * self.heads * self.head_size + 2 * self.hidden * self.kv_heads_ * self.head_size\n",
           replace="        return 4 * self.hidden * self.heads * self.head_size\n"),
    Mutant("perf.flops", "attention_on_hidden", "q and o as hidden x hidden, whatever the heads' width",
           find="        return 2 * self.hidden * self.heads * self.head_size + 2 * self.hidden * self.kv_heads_ * self.head_size\n",
           replace="        return 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads_ * self.head_size\n"),
    Mutant("perf.flops", "swiglu_two_matrices", "a gated FFN counted with two matrices, not three",
           find="        return (3 if self.gated else 2) * self.hidden * (width or self.ffn_width)\n",
           replace="        return 2 * self.hidden * (width or self.ffn_width)\n"),
    Mutant("perf.flops", "full_recomputes_head", "full recomputation runs the output layer again too",
           find="        flops += 2 * (model.active_params() - model.vocab * model.hidden) + attention_forward\n",
           replace="        flops += 2 * model.active_params() + attention_forward\n"),
    Mutant("perf.flops", "full_without_attention", "full recomputation adds the matmuls but not attention's forward",
           find="        flops += 2 * (model.active_params() - model.vocab * model.hidden) + attention_forward\n",
           replace="        flops += 2 * (model.active_params() - model.vocab * model.hidden)\n"),
    Mutant("perf.flops", "selective_is_free", "selective recomputation counted as no extra FLOPs",
           find="    if recompute == \"selective\":\n        flops += attention_forward\n",
           replace="    if recompute == \"selective\":\n        flops += 0\n"),
    Mutant("perf.flops", "hfu_is_mfu", "HFU with the model FLOPs: recomputation not counted",
           find="    return tokens_per_second * flops_per_token(model, recompute) / (gpus * peak_flops)\n",
           replace="    return tokens_per_second * model_flops_per_token(model) / (gpus * peak_flops)\n"),
    Mutant("perf.flops", "mfu_per_chip", "MFU over one chip's peak: forgets to multiply by the number of GPUs",
           find="    return tokens_per_second * model_flops_per_token(model) / (gpus * peak_flops)\n",
           replace="    return tokens_per_second * model_flops_per_token(model) / peak_flops\n"),
    Mutant("perf.flops", "mfu_with_recompute", "MFU counts the hardware FLOPs of full recomputation",
           find="    return tokens_per_second * model_flops_per_token(model) / (gpus * peak_flops)\n",
           replace="    return tokens_per_second * flops_per_token(model, \"full\") / (gpus * peak_flops)\n"),
    # perf.roofline
    Mutant("perf.roofline", "sum_not_max", "adds compute and memory time: no overlap of loads and math",
           find="    return max(flops / rate, nbytes / bandwidth)\n",
           replace="    return flops / rate + nbytes / bandwidth\n"),
    Mutant("perf.roofline", "always_peak", "always the datasheet peaks, never the achieved figures",
           find="    rate = hw.achieved_flops if achieved and hw.achieved_flops else hw.peak_flops\n"
                "    bandwidth = hw.achieved_bandwidth if achieved and hw.achieved_bandwidth else hw.memory_bandwidth\n"
                "    return max(",
           replace="    rate = hw.peak_flops\n    bandwidth = hw.memory_bandwidth\n    return max("),
    Mutant("perf.roofline", "achieved_flag_ignored", "uses the achieved figures even when asked for the peaks",
           find="    rate = hw.achieved_flops if achieved and hw.achieved_flops else hw.peak_flops\n"
                "    bandwidth = hw.achieved_bandwidth if achieved and hw.achieved_bandwidth else hw.memory_bandwidth\n"
                "    return max(",
           replace="    rate = hw.achieved_flops or hw.peak_flops\n"
                   "    bandwidth = hw.achieved_bandwidth or hw.memory_bandwidth\n    return max("),
    Mutant("perf.roofline", "matmul_mnk", "a matmul of m n k multiply-adds counted as mnk FLOPs",
           find="    return op_time(2 * m * n * k, ",
           replace="    return op_time(m * n * k, "),
    Mutant("perf.roofline", "no_output_bytes", "reads the inputs but forgets writing the output",
           find="(m * k + k * n + m * n) * element_bytes, hw, achieved)",
           replace="(m * k + k * n) * element_bytes, hw, achieved)"),
    Mutant("perf.roofline", "bf16_always", "2 bytes per element whatever element_bytes says",
           find="(m * k + k * n + m * n) * element_bytes, hw, achieved)",
           replace="(m * k + k * n + m * n) * 2, hw, achieved)"),
    Mutant("perf.roofline", "ridge_inverted", "the ridge point as bandwidth / FLOP/s",
           find="    return rate / bandwidth\n",
           replace="    return bandwidth / rate\n"),
    # perf.comm
    Mutant("perf.comm", "bus_as_algorithm_bandwidth",
           "treats the link's bandwidth as the collective's algorithm bandwidth: S/B, not 2(N-1)/N S/B",
           find="        return steps * (alpha + nbytes / ranks / bandwidth)\n",
           replace="        return steps * alpha + nbytes / bandwidth\n"),
    Mutant("perf.comm", "whole_buffer_per_step", "each ring step sends the whole buffer, not one chunk of S/N",
           find="        return steps * (alpha + nbytes / ranks / bandwidth)\n",
           replace="        return steps * (alpha + nbytes / bandwidth)\n"),
    Mutant("perf.comm", "all_gather_like_all_reduce", "all-gather and reduce-scatter with 2(N-1) steps, like an all-reduce",
           find="        steps = 2 * (ranks - 1) if op == \"all_reduce\" else ranks - 1\n",
           replace="        steps = 2 * (ranks - 1)\n"),
    Mutant("perf.comm", "tree_floor_log", "floor(log2 N) rounds: a tree on 5 ranks in 2 rounds",
           find="    rounds = math.ceil(math.log2(ranks))\n",
           replace="    rounds = int(math.log2(ranks))\n"),
    Mutant("perf.comm", "tree_allgather_full_rounds", "recursive doubling charged S per round, like the all-reduce tree",
           find="    return rounds * alpha + (ranks - 1) / ranks * nbytes / bandwidth\n",
           replace="    return rounds * (alpha + nbytes / bandwidth)\n"),
    Mutant("perf.comm", "send_no_latency", "a send costs only its bytes",
           find="        return alpha + nbytes / bandwidth\n",
           replace="        return nbytes / bandwidth\n"),
    Mutant("perf.comm", "rails_ignored", "the network at full per-GPU bandwidth even when a node's GPUs share one NIC",
           find="    if cluster.rails:\n        return cluster.network\n",
           replace="    if True:\n        return cluster.network\n"),
    Mutant("perf.comm", "all_gpus_share", "without rails every GPU of the node is counted on the NIC, whatever the stride",
           find="    sharers = min(stride, cluster.gpus_per_node)\n",
           replace="    sharers = cluster.gpus_per_node\n"),
    Mutant("perf.comm", "size_decides", "a group is inside a node when it has at most gpus_per_node ranks, whatever its stride",
           find="    if cluster.gpus_per_node % (stride * group_size) == 0:\n",
           replace="    if group_size <= cluster.gpus_per_node:\n"),
    Mutant("perf.comm", "one_rank_sends", "no shortcut for one rank: a send to oneself still pays alpha + S/B",
           find="    if ranks == 1:\n        return 0.0\n    alpha, bandwidth",
           replace="    alpha, bandwidth"),
]

EQUIVALENT: dict[str, str] = {
    "perf.roofline/swap/d61f3305": "max(a, b) and max(b, a) are the same value",
    "perf.comm/swap/acc9d0bf": "min(stride, gpus_per_node) and min(gpus_per_node, stride) are the same value",
}


# ============================================================ perf.step, perf.search (appended below: MUTANTS += [...], EQUIVALENT.update({...}))
