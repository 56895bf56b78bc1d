"""Wrong implementations of chapter 11 that the grader must fail (see labkit.course.mutants)."""

from labkit.course.mutants import Mutant

MUTANTS = [
    # compress.fp16
    Mutant("compress.fp16", "no_divide", "sums the ranks' gradients and never divides by N",
           find="compressed = buffer.to(dtype).div_(dist.get_world_size(process_group))", replace="compressed = buffer.to(dtype)"),
    Mutant("compress.fp16", "divide_after_sum", "divides after the fp16 sum: N gradients near 65504 overflow to inf",
           find="        buffer.copy_(done.value()[0])\n",
           replace="        buffer.copy_(done.value()[0] / dist.get_world_size(process_group))\n"),
    Mutant("compress.fp16", "divide_twice", "divides before the sum and again when copying back",
           find="        buffer.copy_(done.value()[0])\n",
           replace="        buffer.copy_(done.value()[0]).div_(dist.get_world_size(process_group))\n"),
    Mutant("compress.fp16", "no_cast", "all-reduces the full-precision buffer: correct average, no bytes saved",
           find="compressed = buffer.to(dtype).div_(", replace="compressed = buffer.clone().div_("),
    Mutant("compress.fp16", "ignores_the_group", "all-reduces over the world whatever process_group it is given",
           find="dist.all_reduce(compressed, group=process_group, async_op=True)",
           replace="dist.all_reduce(compressed, async_op=True)"),
    Mutant("compress.fp16", "divides_by_the_world", "all-reduces over the group but divides by the world's size",
           find="compressed = buffer.to(dtype).div_(dist.get_world_size(process_group))",
           replace="compressed = buffer.to(dtype).div_(dist.get_world_size(None))"),
    Mutant("compress.fp16", "always_fp16", "casts to fp16 whatever dtype it is asked for (bf16 never used)",
           find="compressed = buffer.to(dtype).div_(", replace="compressed = buffer.to(torch.float16).div_("),
    Mutant("compress.fp16", "blocks", "waits for its all-reduce and returns a completed future: DDP's backward stalls",
           find="    return future.then(decompress)\n    # END SOLUTION",
           replace="    future.wait()\n    return completed(decompress(future))\n    # END SOLUTION"),
    Mutant("compress.fp16", "torchs_hook", "calls torch's own hook (forbidden: it is the oracle)",
           find="    buffer = bucket.buffer()\n    compressed = buffer.to(dtype)",
           replace="    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks\n"
                   "    if dtype == torch.float16:\n"
                   "        return default_hooks.fp16_compress_hook(process_group, bucket)\n"
                   "    buffer = bucket.buffer()\n    compressed = buffer.to(dtype)"),
    # compress.powersgd
    Mutant("compress.powersgd", "no_error_feedback", "never adds last step's error back: what compression drops is lost",
           find="            buffer.add_(state.error_dict[index])\n", replace="            pass\n"),
    Mutant("compress.powersgd", "error_feedback_always", "keeps and adds the error even when use_error_feedback is off",
           find="    world = dist.get_world_size(group)\n    buffer, index = bucket.buffer(), bucket.index()\n    if state.use_error_feedback:",
           replace="    world = dist.get_world_size(group)\n    buffer, index = bucket.buffer(), bucket.index()\n"
                   "    state.use_error_feedback = True  # the option ignored\n    if state.use_error_feedback:"),
    Mutant("compress.powersgd", "error_not_carried", "computes the error but from the gradient before the old error was added",
           find="        intended = buffer.clone()\n",
           replace="        intended = buffer.clone() - state.error_dict.get(index, 0)\n"),
    Mutant("compress.powersgd", "no_orthogonalisation", "skips orthogonalising P: P Q^T is no longer a projection of M",
           find="            orthogonalize(p, state.orthogonalization_epsilon)\n            torch.matmul(matrix.t(), p, out=q)\n",
           replace="            torch.matmul(matrix.t(), p, out=q)\n"),
    Mutant("compress.powersgd", "no_warm_start", "draws a fresh random Q every step instead of continuing from the last",
           find="fresh = not state.warm_start or index not in state.q_memory_dict", replace="fresh = True"),
    Mutant("compress.powersgd", "warm_start_ignored", "always continues from last step's Q, even with warm_start=False",
           find="    fresh = not state.warm_start or index not in state.q_memory_dict\n",
           replace="    state.warm_start = True  # the option ignored\n"
                   "    fresh = not state.warm_start or index not in state.q_memory_dict\n"),
    Mutant("compress.powersgd", "warm_start_keeps_memory", "with warm_start=False draws fresh Qs but never frees P and Q "
           "(torch's state holds none between steps)",
           find="        if not state.warm_start:\n            state.p_memory_dict.clear()\n",
           replace="        if False:\n            state.p_memory_dict.clear()\n"),
    Mutant("compress.powersgd", "epsilon_ignored", "orthogonalises P and Q without orthogonalization_epsilon",
           find="            orthogonalize(p, state.orthogonalization_epsilon)\n",
           replace="            orthogonalize(p)\n"),
    Mutant("compress.powersgd", "gram_schmidt_no_epsilon", "orthogonalize divides by the norm alone: a zero column becomes NaN",
           find="        column /= torch.linalg.vector_norm(column) + epsilon\n",
           replace="        column /= torch.linalg.vector_norm(column)\n"),
    Mutant("compress.powersgd", "bucket_order_layout", "lays out P and Q, and draws the Qs, in bucket order instead of "
           "grouped by shape: differs from torch on every transformer",
           find="            by_shape.setdefault(tuple(matrix.shape), []).append(matrix)\n",
           replace="            by_shape.setdefault(len(by_shape), []).append(matrix)\n"),
    Mutant("compress.powersgd", "q_not_averaged", "forgets to divide the summed Q by N: the update is N times too big",
           find="        q_all.div_(world)\n", replace=""),
    Mutant("compress.powersgd", "rank_plus_one", "uses one rank more than asked: more bytes than r(n + m)",
           find="        rank = min(*matrix.shape, state.matrix_approximation_rank)\n        if should",
           replace="        rank = min(*matrix.shape, state.matrix_approximation_rank + 1)\n        if should"),
    Mutant("compress.powersgd", "rank_one_always", "compresses at rank 1 whatever matrix_approximation_rank says",
           find="    ranks = [min(*matrix.shape, state.matrix_approximation_rank) for matrix in matrices]\n",
           replace="    ranks = [1 for matrix in matrices]\n"),
    Mutant("compress.powersgd", "rate_ignored", "decides what to compress with a rate of 2 whatever min_compression_rate says",
           find="        if should_compress(*matrix.shape, rank, state.min_compression_rate):\n",
           replace="        if should_compress(*matrix.shape, rank, 2):\n"),
    Mutant("compress.powersgd", "compress_vectors", "compresses every tensor, biases and tiny matrices too",
           find="        if should_compress(*matrix.shape, rank, state.min_compression_rate):\n",
           replace="        if True:\n"),
    Mutant("compress.powersgd", "p_over_world", "all-reduces P over the world instead of the state's process group",
           find="dist.all_reduce(p_all, group=group, async_op=True)",
           replace="dist.all_reduce(p_all, async_op=True)"),
    Mutant("compress.powersgd", "divides_by_the_world", "divides by the world's size, not the group's",
           find="    world = dist.get_world_size(group)\n    buffer, index = bucket.buffer(), bucket.index()\n    if state.use_error_feedback:",
           replace="    world = dist.get_world_size(None)\n    buffer, index = bucket.buffer(), bucket.index()\n    if state.use_error_feedback:"),
    Mutant("compress.powersgd", "iter_not_advanced", "never advances state.iter after a compressed step",
           find="        state.maybe_increase_iter(bucket)\n        return buffer\n", replace="        return buffer\n"),
    Mutant("compress.powersgd", "blocks", "waits for its collectives and returns a completed future: DDP's backward stalls",
           find="    return after(both, compute_qs).then(decompress)\n",
           replace="    both.wait()\n    compute_qs(both).wait()\n    return completed(decompress(None))\n"),
    Mutant("compress.powersgd", "gram_schmidt_no_projection", "normalises the columns but does not remove the earlier ones",
           find="        rest -= column * (column * rest).sum(dim=0, keepdim=True)\n", replace=""),
    # compress.topk
    Mutant("compress.powersgd", "pq_in_float64", "allocates P and Q in float64 whatever the bucket's dtype (\"for "
           "accuracy\"), multiplies in float64 and casts back: right on float64 buckets, twice or four times the "
           "bytes of a float32 or 16-bit one",
           find='    fresh = not state.warm_start or index not in state.q_memory_dict\n    if fresh:\n        state.p_memory_dict[index] = buffer.new_empty(sum(m.shape[0] * r for m, r in zip(matrices, ranks)))\n        state.q_memory_dict[index] = buffer.new_empty(sum(m.shape[1] * r for m, r in zip(matrices, ranks)))\n    p_all, q_all = state.p_memory_dict[index], state.q_memory_dict[index]\n    ps, qs, p_at, q_at = [], [], 0, 0\n    for matrix, rank in zip(matrices, ranks):\n        (n, m) = matrix.shape\n        ps.append(p_all[p_at:p_at + n * rank].view(n, rank))\n        qs.append(q_all[q_at:q_at + m * rank].view(m, rank))\n        p_at, q_at = p_at + n * rank, q_at + m * rank\n    if fresh:\n        state.random_qs(qs)\n    for q in qs:\n        orthogonalize(q, state.orthogonalization_epsilon)\n    for matrix, p, q in zip(matrices, ps, qs):\n        torch.matmul(matrix, q, out=p)\n    p_future = dist.all_reduce(p_all, group=group, async_op=True).get_future()\n\n    def compute_qs(_):\n        flat.div_(world)\n        offset = 0\n        for grad in plain:\n            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))\n            offset += grad.numel()\n        for matrix, p, q in zip(matrices, ps, qs):\n            orthogonalize(p, state.orthogonalization_epsilon)\n            torch.matmul(matrix.t(), p, out=q)\n        return dist.all_reduce(q_all, group=group, async_op=True).get_future()\n\n    def decompress(_):\n        q_all.div_(world)\n        for matrix, p, q in zip(matrices, ps, qs):\n            torch.matmul(p, q.t(), out=matrix)\n        if state.use_error_feedback:\n            state.error_dict[index] = intended - buffer\n        if not state.warm_start:\n            state.p_memory_dict.clear()\n            state.q_memory_dict.clear()\n',
           replace='    fresh = not state.warm_start or index not in state.q_memory_dict\n    if fresh:\n        state.p_memory_dict[index] = buffer.new_empty(sum(m.shape[0] * r for m, r in zip(matrices, ranks)), dtype=torch.float64)\n        state.q_memory_dict[index] = buffer.new_empty(sum(m.shape[1] * r for m, r in zip(matrices, ranks)), dtype=torch.float64)\n    p_all, q_all = state.p_memory_dict[index], state.q_memory_dict[index]\n    ps, qs, p_at, q_at = [], [], 0, 0\n    for matrix, rank in zip(matrices, ranks):\n        (n, m) = matrix.shape\n        ps.append(p_all[p_at:p_at + n * rank].view(n, rank))\n        qs.append(q_all[q_at:q_at + m * rank].view(m, rank))\n        p_at, q_at = p_at + n * rank, q_at + m * rank\n    if fresh:\n        state.random_qs(qs)\n    for q in qs:\n        orthogonalize(q, state.orthogonalization_epsilon)\n    for matrix, p, q in zip(matrices, ps, qs):\n        torch.matmul(matrix.double(), q, out=p)\n    p_future = dist.all_reduce(p_all, group=group, async_op=True).get_future()\n\n    def compute_qs(_):\n        flat.div_(world)\n        offset = 0\n        for grad in plain:\n            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))\n            offset += grad.numel()\n        for matrix, p, q in zip(matrices, ps, qs):\n            orthogonalize(p, state.orthogonalization_epsilon)\n            torch.matmul(matrix.t().double(), p, out=q)\n        return dist.all_reduce(q_all, group=group, async_op=True).get_future()\n\n    def decompress(_):\n        q_all.div_(world)\n        for matrix, p, q in zip(matrices, ps, qs):\n            matrix.copy_(p @ q.t())\n        if state.use_error_feedback:\n            state.error_dict[index] = intended - buffer\n        if not state.warm_start:\n            state.p_memory_dict.clear()\n            state.q_memory_dict.clear()\n'),
    Mutant("compress.powersgd", "error_in_float64", "keeps the error-feedback copy, and so the error, in float64 "
           "whatever the bucket's dtype",
           find="        intended = buffer.clone()\n", replace="        intended = buffer.to(torch.float64, copy=True)\n"),
    Mutant("compress.powersgd", "pq_rebound_each_step", "with warm start copies P and Q into new tensors every step "
           "(same numbers): the state's tensors are not the ones it holds, and memory churns",
           find="    p_all, q_all = state.p_memory_dict[index], state.q_memory_dict[index]\n",
           replace="    if not fresh:\n        state.p_memory_dict[index] = state.p_memory_dict[index].clone()\n"
                   "        state.q_memory_dict[index] = state.q_memory_dict[index].clone()\n"
                   "    p_all, q_all = state.p_memory_dict[index], state.q_memory_dict[index]\n"),
    Mutant("compress.topk", "no_error_feedback", "never adds last step's error back: what was not sent is lost",
           find="    if index in state.error_dict:\n        buffer.add_(state.error_dict[index])\n", replace=""),
    Mutant("compress.topk", "k_plus_one", "sends one value more than k = ratio x numel",
           find="k = topk_count(buffer.numel(), state.ratio)", replace="k = topk_count(buffer.numel(), state.ratio) + 1"),
    Mutant("compress.topk", "k_floor_zero", "k = int(ratio x numel) without the floor of 1: a bucket smaller than 1/ratio sends nothing",
           find="k = topk_count(buffer.numel(), state.ratio)", replace="k = int(state.ratio * buffer.numel())"),
    Mutant("compress.topk", "all_reduce_dense", "scatters its k values into a dense buffer and all-reduces that: right sum, full bytes",
           find="    gathered = [dist.all_gather_single(all_indices, indices, group=group, async_op=True).get_future(),\n"
                "                dist.all_gather_single(all_values, values, group=group, async_op=True).get_future()]\n",
           replace="    dense = torch.zeros_like(buffer)\n    dense[indices] = values\n"
                   "    gathered = [dist.all_reduce(dense, group=group, async_op=True).get_future()]\n"
                   "    all_indices, all_values = torch.arange(buffer.numel()), dense\n"),
    Mutant("compress.topk", "no_divide", "sums the sparse contributions and never divides by N",
           find="        buffer.div_(world)\n        return buffer\n", replace="        return buffer\n"),
    Mutant("compress.topk", "overwrites_duplicates", "assigns the pairs instead of adding them: two ranks' values at one index, one is lost",
           find="buffer.zero_().index_add_(0, all_indices, all_values)", replace="buffer.zero_()[all_indices] = all_values"),
    Mutant("compress.topk", "largest_signed", "keeps the k largest signed values, not the largest magnitudes",
           find="indices = buffer.abs().topk(k).indices", replace="indices = buffer.topk(k).indices"),
    Mutant("compress.topk", "error_not_zeroed", "keeps the sent values in the error too: they are sent again next step",
           find="    error[indices] = 0\n", replace=""),
    Mutant("compress.topk", "ignores_the_group", "all-gathers over the world whatever the state's process group",
           find="    world = dist.get_world_size(group)\n    buffer, index = bucket.buffer(), bucket.index()\n    if index in state.error_dict:",
           replace="    group, world = None, dist.get_world_size(None)\n    buffer, index = bucket.buffer(), bucket.index()\n"
                   "    if index in state.error_dict:"),
    Mutant("compress.topk", "blocks", "waits for its all-gathers and returns a completed future: DDP's backward stalls",
           find="    return torch.futures.collect_all(gathered).then(scatter_add)\n",
           replace="    torch.futures.wait_all(gathered)\n    return completed(scatter_add(None))\n"),
    Mutant("compress.topk", "divides_by_the_world", "all-gathers over the group but divides the sum by the world's size",
           find="        buffer.div_(world)\n        return buffer\n",
           replace="        buffer.div_(dist.get_world_size())\n        return buffer\n"),
    Mutant("compress.topk", "values_in_float32", "sends the values as float32 whatever the bucket's dtype (cast back "
           "on arrival): twice the bytes of a 16-bit bucket, half the precision of a float64 one",
           find='    values = buffer[indices]\n    error = buffer.clone()\n    error[indices] = 0\n    state.error_dict[index] = error\n\n    all_indices = indices.new_empty(world * k)\n    all_values = values.new_empty(world * k)\n    gathered = [dist.all_gather_single(all_indices, indices, group=group, async_op=True).get_future(),\n                dist.all_gather_single(all_values, values, group=group, async_op=True).get_future()]\n\n    def scatter_add(_):\n        buffer.zero_().index_add_(0, all_indices, all_values)',
           replace='    values = buffer[indices].float()\n    error = buffer.clone()\n    error[indices] = 0\n    state.error_dict[index] = error\n\n    all_indices = indices.new_empty(world * k)\n    all_values = values.new_empty(world * k)\n    gathered = [dist.all_gather_single(all_indices, indices, group=group, async_op=True).get_future(),\n                dist.all_gather_single(all_values, values, group=group, async_op=True).get_future()]\n\n    def scatter_add(_):\n        buffer.zero_().index_add_(0, all_indices, all_values.to(buffer.dtype))'),
    Mutant("compress.topk", "error_in_float32", "keeps the error in float32 whatever the bucket's dtype",
           find="    state.error_dict[index] = error\n", replace="    state.error_dict[index] = error.float()\n"),
    # compress.hierarchical
    Mutant("compress.hierarchical", "across_over_world", "all-reduces the shard over the whole world instead of across nodes",
           find="dist.all_reduce(part, group=groups.across, async_op=True)", replace="dist.all_reduce(part, async_op=True)"),
    Mutant("compress.hierarchical", "no_all_gather", "skips the all-gather: each rank holds only its own shard's sum",
           find="    gathered = after(summed, lambda _: dist.all_gather_single(padded, part, group=groups.inside,\n"
                "                                                              async_op=True).get_future())\n",
           replace="    gathered = summed\n    padded.zero_()\n"
                   "    summed.then(lambda _: padded[dist.get_rank(groups.inside) * shard:][:shard].copy_(part))\n"),
    Mutant("compress.hierarchical", "flat_all_reduce", "one flat all-reduce of the whole tensor: right sum, slow links carry it all",
           find="    scattered = future_of(dist.reduce_scatter_single(part, padded, group=groups.inside, async_op=True))\n"
                "    summed = after(scattered, lambda _: dist.all_reduce(part, group=groups.across, async_op=True).get_future())\n"
                "    gathered = after(summed, lambda _: dist.all_gather_single(padded, part, group=groups.inside,\n"
                "                                                              async_op=True).get_future())\n",
           replace="    gathered = dist.all_reduce(padded, async_op=True).get_future()\n"),
    Mutant("compress.hierarchical", "whole_buffer_across", "all-reduces the whole node sum across nodes, not the shard",
           find="    summed = after(scattered, lambda _: dist.all_reduce(part, group=groups.across, async_op=True).get_future())\n"
                "    gathered = after(summed, lambda _: dist.all_gather_single(padded, part, group=groups.inside,\n"
                "                                                              async_op=True).get_future())\n",
           replace="    summed = after(scattered, lambda _: dist.all_gather_single(padded, part, group=groups.inside,\n"
                   "                                                              async_op=True).get_future())\n"
                   "    gathered = after(summed, lambda _: dist.all_reduce(padded, group=groups.across, async_op=True).get_future())\n"),
    Mutant("compress.hierarchical", "blocks", "always waits for the three steps and hands back a completed future: the hook stalls DDP",
           find="    if async_op:\n        return future\n    future.wait()\n",
           replace="    future.wait()\n    if async_op:\n        return completed(tensor)\n"),
    Mutant("compress.hierarchical", "sync_returns_early", "without async_op returns before its collectives are done: the sum may not be there yet",
           find="    if async_op:\n        return future\n    future.wait()\n",
           replace="    if async_op:\n        return future\n"),
    Mutant("compress.hierarchical", "not_padded", "reduce-scatters the unpadded tensor: sizes that L does not divide lose their tail",
           find="    shard = -(-flat.numel() // groups.ranks_per_node)\n",
           replace="    shard = max(1, flat.numel() // groups.ranks_per_node)\n"),
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
           find="        ctx.save_for_backward(x_local if regather else torch.cat(chunks, dim=1), weight)\n",
           replace="        check = x_local.new_empty((dist.get_world_size(group) * x_local.shape[0], *x_local.shape[1:]))\n"
                   "        dist.all_gather_into_tensor(check, x_local.contiguous(), group=group)\n"
                   "        ctx.save_for_backward(x_local if regather else torch.cat(chunks, dim=1), weight)\n"),
    Mutant("compress.ag_matmul", "no_reduce_in_backward", "backward keeps only its own chunk's grad_y W_r: the other ranks' contributions to grad_x are lost",
           find="        grad_x = ring_matmul_reduce_scatter(lambda c: grads[c] @ weight, ctx.group)  # every rank used every chunk\n",
           replace="        grad_x = grads[dist.get_rank(ctx.group)] @ weight\n"),
    Mutant("compress.ag_matmul", "global_rank_as_index", "files chunks by its global rank, not its rank in the group",
           find="    n, me = dist.get_world_size(group), dist.get_rank(group)\n    to_rank, from_rank = ring_peers(group)\n"
                "    outputs, chunks = [None] * n, [None] * n\n",
           replace="    n, me = dist.get_world_size(group), dist.get_rank() % dist.get_world_size(group)\n"
                   "    to_rank, from_rank = ring_peers(group)\n    outputs, chunks = [None] * n, [None] * n\n"),
    Mutant("compress.ag_matmul", "world_ring", "takes its ring neighbours in the world, whatever group the layer is on",
           find="    to_rank, from_rank = ring_peers(group)\n    outputs, chunks = [None] * n, [None] * n\n",
           replace="    to_rank, from_rank = ring_peers(None)\n    outputs, chunks = [None] * n, [None] * n\n"),
    Mutant("compress.ag_matmul", "regather_stashes_gathered", "with regather saves the shard and gathers it again, but "
           "also keeps the gathered x on ctx \"for reuse\": the trace and the gradients are right, the memory N times the shard",
           find="        ctx.group, ctx.has_bias, ctx.regather = group, bias is not None, regather\n",
           replace="        ctx.group, ctx.has_bias, ctx.regather = group, bias is not None, regather\n"
                   "        if regather:\n"
                   "            ctx.gathered = torch.cat(chunks, dim=1)\n"),
    Mutant("compress.ag_matmul", "regather_saves_gathered", "regather=True still saves the gathered x and skips the "
           "re-gather: the old memory under the new name",
           find="        ctx.save_for_backward(x_local if regather else torch.cat(chunks, dim=1), weight)\n",
           replace="        ctx.save_for_backward(torch.cat(chunks, dim=1), weight)\n"),
    Mutant("compress.ag_matmul", "regather_owner_up_the_ring", "pairs the chunk held at step s with grad_y's chunk r + s "
           "(the ring counted the wrong way): grad_W wrong for N >= 3",
           find="                c = (me - next(steps)) % n  # step s holds the chunk of rank r - s\n",
           replace="                c = (me + next(steps)) % n\n"),
    Mutant("compress.ag_matmul", "regather_overwrites", "each chunk's share of grad_W overwrites the buffer instead of "
           "adding to it: only the last chunk's rows count",
           find="                grad_w.add_(grads[c].flatten(0, 1).t() @ chunk.flatten(0, 1))\n",
           replace="                grad_w.copy_(grads[c].flatten(0, 1).t() @ chunk.flatten(0, 1))\n"),
    Mutant("compress.ag_matmul", "regather_then_matmul", "re-gathers x on the ring with nothing to compute per chunk, "
           "then one grad_W matmul: the re-gather's transfers are not overlapped",
           find="            ring_all_gather_matmul(x_saved, add_weight_grad, ctx.group)\n",
           replace="            gathered = torch.cat(ring_all_gather_matmul(x_saved, lambda chunk: chunk, ctx.group)[1], dim=1)\n"
                   "            grad_w = grad_y.flatten(0, 1).t() @ gathered.flatten(0, 1)\n"),
    Mutant("compress.ag_matmul", "regather_builtin", "re-gathers x with one dist.all_gather_into_tensor: right "
           "gradient, but an unsplit collective on the critical path",
           find="            ring_all_gather_matmul(x_saved, add_weight_grad, ctx.group)\n",
           replace="            front = x_saved.transpose(0, 1).contiguous()\n"
                   "            gathered = front.new_empty((n * front.shape[0], *front.shape[1:]))\n"
                   "            dist.all_gather_into_tensor(gathered, front, group=ctx.group)\n"
                   "            grad_w = grad_y.flatten(0, 1).t() @ gathered.transpose(0, 1).flatten(0, 1)\n"),
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

# Automatic mutants (``labkit mutate compress``) that cannot change a result. Ids from the
# generator of labkit/course/automut.py (branch wt-mut) on this module; each checked by hand.
EQUIVALENT = {
    "compress.fp16/int/1eafd0f5": "done.value()[-1] for [0]: an all-reduce future's value is a list of one tensor",
    "compress.powersgd/int/5ac51656": "range(matrix.shape[0]) for shape[1] in orthogonalize: n >= r, and the extra "
                                      "iterations slice empty columns (matrix[:, i:i + 1] with i >= r): no-ops",
    "compress.powersgd/bool/310c0251": "keepdim=False in Gram-Schmidt's projection: the [k] sum broadcasts against the "
                                       "[n, 1] column exactly as the [1, k] one does",
    "compress.powersgd/if_true/b0e85266": "the first use_error_feedback guard forced True: the error is stored only under "
                                          "the second guard, so with error feedback off error_dict stays empty and "
                                          "only a clone of the buffer is made (never read)",
    "compress.powersgd/swap/0110f2a2": "P's view as [r, n] instead of [n, r]: torch.matmul(matrix, q, out=p) resizes "
                                       "the out view in place to [n, r] on the same storage (same numel), and every "
                                       "later use goes through that same tensor object",
    "compress.topk/swap/d21dc1fc": "topk_count(ratio, numel) for topk_count(numel, ratio): it is max(1, int(ratio x numel)), "
                                   "symmetric in its two arguments",
    "compress.topk/int/f29abaa6": "index_add_ along dim -1 of the 1-D buffer is dim 0",
    "compress.ag_matmul/group/0372c009": "start_exchange(..., None) in the ring: P2POp's peers are global ranks, so the "
                                         "same message goes to the same rank over the world group instead of the "
                                         "subgroup; same bytes, same result (labkit.comm.Op identifies a send or "
                                         "receive by its peer alone for that reason)",
    "compress.ag_matmul/drop_call/4edf6698": "x_local without .contiguous(): start_exchange sends tensor.contiguous() "
                                             "itself, and F.linear and torch.cat take any strides",
}

# ============================================================================= compress.local_sgd
MUTANTS += [
    Mutant("compress.local_sgd", "sync_every_step", "averages after every inner step: H ignored (DDP-like bytes, "
           "and other parameters whenever H > 1)",
           find="        if self.local_steps % self.sync_every:\n            return False\n", replace=""),
    Mutant("compress.local_sgd", "counter_off_by_one", "syncs on steps 1, H + 1, 2H + 1, ... (the counter read before "
           "it is incremented)",
           find="        self.local_steps += 1\n        if self.local_steps % self.sync_every:\n",
           replace="        self.local_steps += 1\n        if (self.local_steps - 1) % self.sync_every:\n"),
    Mutant("compress.local_sgd", "averages_parameters", "all-reduces the parameters and takes their mean as the new "
           "start: right for plain averaging, but the outer momentum and lr are never applied",
           find="        self.outer.step()\n        for start, param in zip(self.start, self.params):\n",
           replace="        for start in self.start:\n            start.sub_(start.grad)\n"
                   "        for start, param in zip(self.start, self.params):\n"),
    Mutant("compress.local_sgd", "delta_sign_flipped", "outer gradient theta_local - theta_start: the outer step "
           "moves away from where the ranks went",
           find="deltas = [start - param for", replace="deltas = [param - start for"),
    Mutant("compress.local_sgd", "outer_state_reset", "builds a fresh outer optimizer every round: the Nesterov "
           "momentum is never carried across rounds",
           find="        self.outer.step()\n",
           replace="        self.outer = type(self.outer)(self.start, **self.outer.defaults)\n        self.outer.step()\n"),
    Mutant("compress.local_sgd", "inner_state_reset", "clears the inner optimizer's state at every sync (DiLoCo keeps "
           "AdamW's moments on each rank across rounds)",
           find="        self.outer.step()\n", replace="        self.outer.step()\n        self.inner.state.clear()\n"),
    Mutant("compress.local_sgd", "deltas_in_float64", "computes and all-reduces every delta in float64 \"for "
           "accuracy\": right on a float64 model, twice the bytes of a float32 layer",
           find="        deltas = [start - param for start, param in zip(self.start, self.params)]\n"
                "        works = [dist.all_reduce(delta, group=self.group, async_op=True) for delta in deltas]\n"
                "        for start, delta, work in zip(self.start, deltas, works):\n"
                "            work.wait()\n            start.grad = delta.div_(n)\n",
           replace="        deltas = [(start - param).double() for start, param in zip(self.start, self.params)]\n"
                   "        works = [dist.all_reduce(delta, group=self.group, async_op=True) for delta in deltas]\n"
                   "        for start, delta, work in zip(self.start, deltas, works):\n"
                   "            work.wait()\n            start.grad = delta.div_(n).to(start.dtype)\n"),
    Mutant("compress.local_sgd", "params_from_optimizer_groups", "takes the parameters from the inner optimizer's "
           "param groups, in their order: right with one group, paired with the wrong start with two",
           find="        deltas = [start - param for start, param in zip(self.start, self.params)]\n",
           replace="        self.params = [p for g in self.inner.param_groups for p in g['params'] if p.requires_grad]\n"
                   "        deltas = [start - param for start, param in zip(self.start, self.params)]\n"),
    Mutant("compress.local_sgd", "ignores_the_group", "all-reduces over the world whatever group it is given",
           find="dist.all_reduce(delta, group=self.group, async_op=True)", replace="dist.all_reduce(delta, async_op=True)"),
    Mutant("compress.local_sgd", "sum_not_mean", "never divides the summed deltas by N",
           find="start.grad = delta.div_(n)", replace="start.grad = delta"),
    Mutant("compress.local_sgd", "divides_by_the_world", "all-reduces over the group but divides by the world's size",
           find="n = dist.get_world_size(self.group)\n        deltas", replace="n = dist.get_world_size(None)\n        deltas"),
    Mutant("compress.local_sgd", "start_not_kept", "never copies the new start into the model: the ranks go on from "
           "their local parameters",
           find="            param.copy_(start)\n", replace="            pass\n"),
    Mutant("compress.local_sgd", "start_from_local", "takes theta_start as this rank's local parameters before the "
           "outer step (start = param): the delta is applied to the local model, ranks stay apart",
           find="        self.outer.step()\n",
           replace="        for start, param in zip(self.start, self.params):\n            start.copy_(param)\n"
                   "        self.outer.step()\n"),
    Mutant("compress.local_sgd", "one_flat_all_reduce", "packs every delta into one flat buffer: the same average, "
           "but not the per-tensor trace the docstring promises",
           find="        works = [dist.all_reduce(delta, group=self.group, async_op=True) for delta in deltas]\n",
           replace="        flat = torch.cat([d.reshape(-1) for d in deltas])\n"
                   "        dist.all_reduce(flat, group=self.group)\n"
                   "        for d, part in zip(deltas, flat.split([d.numel() for d in deltas])):\n"
                   "            d.copy_(part.view_as(d))\n"
                   "        works = [torch.futures.Future() for _ in deltas]\n"
                   "        [w.set_result(None) for w in works]\n"),
]
