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

# ----------------------------------------------------------------------------- collective matmul
MUTANTS += [
    # compress.ag_matmul
    Mutant("compress.ag_matmul", "wait_before_matmul", "waits for the next chunk before multiplying the one in hand: no overlap",
           find="        chunks[owner], outputs[owner] = held, matmul(held)  # while the next chunk travels\n"
                "        if pending is not None:\n"
                "            held, works = pending\n"
                "            for work in works:\n"
                "                work.wait()\n",
           replace="        if pending is not None:\n"
                   "            for work in pending[1]:\n"
                   "                work.wait()\n"
                   "        chunks[owner], outputs[owner] = held, matmul(held)\n"
                   "        if pending is not None:\n"
                   "            held, works = pending\n"),
    Mutant("compress.ag_matmul", "wrong_direction", "sends to the previous rank and receives from the next, but files chunks as if from the previous",
           find="        pending = start_exchange(held, to_rank, from_rank, group) if step < n - 1 else None\n",
           replace="        pending = start_exchange(held, from_rank, to_rank, group) if step < n - 1 else None\n"),
    Mutant("compress.ag_matmul", "owner_off_by_one", "files each received chunk under the wrong rank (counts up the ring from its own index)",
           find="            owner = (owner - 1) % n\n", replace="            owner = (me + step + 1) % n\n"),
    Mutant("compress.ag_matmul", "builtin_all_gather", "one dist.all_gather_into_tensor, then the matmuls: right output, nothing overlapped",
           find="    held, owner = x_local.contiguous(), me\n    for step in range(n):\n        pending = start_exchange(",
           replace="    gathered = x_local.new_empty((n * x_local.shape[0], *x_local.shape[1:]))\n"
                   "    dist.all_gather_into_tensor(gathered, x_local.contiguous(), group=group)\n"
                   "    for c, chunk in enumerate(gathered.chunk(n)):\n"
                   "        chunks[c], outputs[c] = chunk, matmul(chunk)\n"
                   "    return outputs, chunks\n"
                   "    held, owner = x_local.contiguous(), me\n    for step in range(n):\n        pending = start_exchange("),
    Mutant("compress.ag_matmul", "extra_check_gather", "all-gathers x once more \"to check\" the ring's result: twice the bytes",
           find="        ctx.save_for_backward(torch.cat(chunks, dim=1), weight)\n",
           replace="        check = x_local.new_empty((dist.get_world_size(group) * x_local.shape[0], *x_local.shape[1:]))\n"
                   "        dist.all_gather_into_tensor(check, x_local.contiguous(), group=group)\n"
                   "        ctx.save_for_backward(torch.cat(chunks, dim=1), weight)\n"),
    Mutant("compress.ag_matmul", "no_reduce_in_backward", "backward keeps only its own chunk's grad_y W_r: the other ranks' contributions to grad_x are lost",
           find="        grad_x = ring_matmul_reduce_scatter(lambda c: grads[c] @ weight, ctx.group)  # every rank used every chunk\n",
           replace="        grad_x = grads[dist.get_rank(ctx.group)] @ weight\n"),
    Mutant("compress.ag_matmul", "world_ring", "takes its ring neighbours in the world, whatever group the layer is on",
           find="    to_rank, from_rank = ring_peers(group)\n    outputs, chunks = [None] * n, [None] * n\n",
           replace="    to_rank, from_rank = ring_peers(None)\n    outputs, chunks = [None] * n, [None] * n\n"),
    # compress.matmul_rs
    Mutant("compress.matmul_rs", "wait_before_matmul", "waits for the incoming sum before computing the next partial: no overlap",
           find="        part = partial(chunk)  # computed while the previous running sum travels\n"
                "        if pending is not None:\n"
                "            received, works = pending\n"
                "            for work in works:\n"
                "                work.wait()\n"
                "            part = part + received\n",
           replace="        if pending is not None:\n"
                   "            received, works = pending\n"
                   "            for work in works:\n"
                   "                work.wait()\n"
                   "        part = partial(chunk)\n"
                   "        if pending is not None:\n"
                   "            part = part + received\n"),
    Mutant("compress.matmul_rs", "chunk_off_by_one", "computes chunk r - s instead of r - s - 1: the sum that ends here is the next rank's chunk",
           find="        chunk = (me - step - 1) % n\n", replace="        chunk = (me - step) % n\n"),
    Mutant("compress.matmul_rs", "wrong_direction", "passes the running sums to the previous rank, receives from the next",
           find="            pending = start_exchange(part, to_rank, from_rank, group)\n",
           replace="            pending = start_exchange(part, from_rank, to_rank, group)\n"),
    Mutant("compress.matmul_rs", "builtin_reduce_scatter", "all partial products, then one dist.reduce_scatter_tensor: right sum, nothing overlapped",
           find="    pending, part = None, None\n    for step in range(n):\n        chunk = (me - step - 1) % n\n",
           replace="    parts = [partial(c) for c in range(n)]\n"
                   "    full, mine = torch.cat(parts), torch.empty_like(parts[0])\n"
                   "    dist.reduce_scatter_tensor(mine, full, group=group)\n"
                   "    return mine\n"
                   "    pending, part = None, None\n    for step in range(n):\n        chunk = (me - step - 1) % n\n"),
    Mutant("compress.matmul_rs", "no_gather_in_backward", "backward multiplies only its own grad_y chunk: grad_x is zero on the other ranks' rows",
           find="        outputs, grads = ring_all_gather_matmul(grad_y, lambda g: g @ weight, ctx.group)\n",
           replace="        me, n = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)\n"
                   "        grads = [grad_y if c == me else torch.zeros_like(grad_y) for c in range(n)]\n"
                   "        outputs = [g @ weight for g in grads]\n"),
]
