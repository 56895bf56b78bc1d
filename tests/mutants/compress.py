"""Wrong implementations of chapter 11 that the grader must fail (see labkit.course.mutants)."""

from labkit.course.mutants import Mutant

MUTANTS = [
    # compress.fp16
    Mutant("compress.fp16", "no_divide", "sums the ranks' gradients and never divides by N",
           find="compressed = buffer.to(dtype).div_(_group_size(process_group))", replace="compressed = buffer.to(dtype)"),
    Mutant("compress.fp16", "divide_after_sum", "divides after the fp16 sum: N gradients near 65504 overflow to inf",
           find="        buffer.copy_(done.value()[0])\n",
           replace="        buffer.copy_(done.value()[0] / _group_size(process_group))\n"),
    Mutant("compress.fp16", "divide_twice", "divides before the sum and again when copying back",
           find="        buffer.copy_(done.value()[0])\n",
           replace="        buffer.copy_(done.value()[0]).div_(_group_size(process_group))\n"),
    Mutant("compress.fp16", "no_cast", "all-reduces the full-precision buffer: correct average, no bytes saved",
           find="compressed = buffer.to(dtype).div_(", replace="compressed = buffer.clone().div_("),
    Mutant("compress.fp16", "ignores_the_group", "all-reduces over the world whatever process_group it is given",
           find="dist.all_reduce(compressed, group=process_group, async_op=True)",
           replace="dist.all_reduce(compressed, async_op=True)"),
    Mutant("compress.fp16", "torchs_hook", "calls torch's own hook (forbidden: it is the oracle)",
           find="    buffer = bucket.buffer()\n    compressed = buffer.to(dtype)",
           replace="    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks\n"
                   "    if dtype == torch.float16:\n"
                   "        return default_hooks.fp16_compress_hook(process_group, bucket)\n"
                   "    buffer = bucket.buffer()\n    compressed = buffer.to(dtype)"),
    # compress.powersgd
    Mutant("compress.powersgd", "no_error_feedback", "never adds last step's error back: what compression drops is lost",
           find="            buffer.add_(state.error_dict[index])\n", replace="            pass\n"),
    Mutant("compress.powersgd", "no_orthogonalisation", "skips orthogonalising P: P Q^T is no longer a projection of M",
           find="        orthogonalize(p, state.orthogonalization_epsilon)\n        torch.matmul(matrix.t(), p, out=q)\n",
           replace="        torch.matmul(matrix.t(), p, out=q)\n"),
    Mutant("compress.powersgd", "no_warm_start", "draws a fresh random Q every step instead of continuing from the last",
           find="fresh = not state.warm_start or index not in state.q_memory_dict", replace="fresh = True"),
    Mutant("compress.powersgd", "q_not_averaged", "forgets to divide the summed Q by N: the update is N times too big",
           find="    state.q_memory_dict[index] /= world\n", replace=""),
    Mutant("compress.powersgd", "rank_plus_one", "uses one rank more than asked: more bytes than r(n + m)",
           find="rank = min(*matrix.shape, state.matrix_approximation_rank)",
           replace="rank = min(*matrix.shape, state.matrix_approximation_rank + 1)"),
    Mutant("compress.powersgd", "compress_vectors", "compresses every tensor, biases and tiny matrices too",
           find="        if should_compress(*matrix.shape, rank, state.min_compression_rate):\n",
           replace="        if True:\n"),
    Mutant("compress.powersgd", "p_over_world", "all-reduces P over the world instead of the state's process group",
           find="dist.all_reduce(state.p_memory_dict[index], group=group)",
           replace="dist.all_reduce(state.p_memory_dict[index])"),
    Mutant("compress.powersgd", "gram_schmidt_no_projection", "normalises the columns but does not remove the earlier ones",
           find="        rest -= column * (column * rest).sum(dim=0, keepdim=True)\n", replace=""),
    # compress.topk
    Mutant("compress.topk", "no_error_feedback", "never adds last step's error back: what was not sent is lost",
           find="    if index in state.error_dict:\n        buffer.add_(state.error_dict[index])\n", replace=""),
    Mutant("compress.topk", "k_plus_one", "sends one value more than k = ratio x numel",
           find="k = topk_count(buffer.numel(), state.ratio)", replace="k = topk_count(buffer.numel(), state.ratio) + 1"),
    Mutant("compress.topk", "all_reduce_dense", "scatters its k values into a dense buffer and all-reduces that: right sum, full bytes",
           find="    dist.all_gather_single(all_indices, indices, group=group)\n"
                "    dist.all_gather_single(all_values, values, group=group)\n"
                "    buffer.zero_().index_add_(0, all_indices, all_values)\n",
           replace="    buffer.zero_()[indices] = values\n    dist.all_reduce(buffer, group=group)\n"),
    Mutant("compress.topk", "no_divide", "sums the sparse contributions and never divides by N",
           find="    buffer.div_(world)\n    return completed(buffer)\n    # END SOLUTION\n\n\n# ---", replace="    return completed(buffer)\n    # END SOLUTION\n\n\n# ---"),
    Mutant("compress.topk", "largest_signed", "keeps the k largest signed values, not the largest magnitudes",
           find="indices = buffer.abs().topk(k).indices", replace="indices = buffer.topk(k).indices"),
    Mutant("compress.topk", "error_not_zeroed", "keeps the sent values in the error too: they are sent again next step",
           find="    error[indices] = 0\n", replace=""),
    # compress.hierarchical
    Mutant("compress.hierarchical", "across_over_world", "all-reduces the shard over the whole world instead of across nodes",
           find="dist.all_reduce(part, group=groups.across)", replace="dist.all_reduce(part)"),
    Mutant("compress.hierarchical", "no_all_gather", "skips the all-gather: each rank holds only its own shard's sum",
           find="    dist.all_gather_single(padded, part, group=groups.inside)\n",
           replace="    padded.zero_()[dist.get_rank(groups.inside) * shard:][:shard] = part\n"),
    Mutant("compress.hierarchical", "flat_all_reduce", "one flat all-reduce of the whole tensor: right sum, slow links carry it all",
           find="    dist.reduce_scatter_single(part, padded, group=groups.inside)\n"
                "    dist.all_reduce(part, group=groups.across)\n"
                "    dist.all_gather_single(padded, part, group=groups.inside)\n",
           replace="    dist.all_reduce(padded)\n"),
    Mutant("compress.hierarchical", "whole_buffer_across", "all-reduces the whole node sum across nodes, not the shard",
           find="    dist.all_reduce(part, group=groups.across)\n    dist.all_gather_single(padded, part, group=groups.inside)\n",
           replace="    dist.all_gather_single(padded, part, group=groups.inside)\n    dist.all_reduce(padded, group=groups.across)\n"),
]
