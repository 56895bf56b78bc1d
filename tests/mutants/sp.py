"""Wrong implementations of chapter 07 that the grader must fail (see labkit.course.mutants)."""

from labkit.course.mutants import Mutant

MUTANTS = [
    # ------------------------------------------------------------------ sp.megatron
    Mutant("sp.megatron", "all_reduce_then_slice",
           "after the row layer I all-reduce the partial sums (as in TP) and keep my tokens: same numbers",
           find="        ctx.group = group\n        return _reduce_scatter_sequence(x, group)",
           replace="        ctx.group = group\n        n, me = degree(group), dist.get_rank(group)\n"
                   "        total = x.contiguous()\n        dist.all_reduce(total, group=group)\n"
                   "        return total.chunk(n, dim=1)[me].contiguous()"),
    Mutant("sp.megatron", "gathers_along_batch",
           "all-gathers x as it is (batch first) and views the result as [B, T, H]: tokens of the wrong rows",
           find="        shards = x.transpose(0, 1).contiguous()  # [T/N, B, H]: shards of dim 0 stack in rank order\n"
                "        full = shards.new_empty((n * shards.shape[0], *shards.shape[1:]))\n"
                "        dist.all_gather_single(full, shards, group=group)\n"
                "        return full.transpose(0, 1).contiguous()",
           replace="        full = x.new_empty((n * x.shape[0], *x.shape[1:]))\n"
                   "        dist.all_gather_single(full, x.contiguous(), group=group)\n"
                   "        return full.view(x.shape[0], n * x.shape[1], x.shape[2])"),
    Mutant("sp.megatron", "layernorm_grads_averaged",
           "averages the LayerNorm gradients over the group (as DDP does) instead of summing the partial sums",
           find="                dist.all_reduce(p.grad, group=group)",
           replace="                dist.all_reduce(p.grad, group=group)\n                p.grad /= degree(group)"),
    Mutant("sp.megatron", "layernorm_grads_all_gathered",
           "all-gathers every rank's LayerNorm gradient and sums them itself: an all-gather of N times the bytes",
           find="                dist.all_reduce(p.grad, group=group)",
           replace="                pieces = [torch.empty_like(p.grad) for _ in range(degree(group))]\n"
                   "                dist.all_gather(pieces, p.grad.contiguous(), group=group)\n"
                   "                p.grad.copy_(torch.stack(pieces).sum(0))"),
    Mutant("sp.megatron", "default_group",
           "the sequence collectives ignore group= (world size and default group): fine until SP runs on a sub-group",
           find="def gather_sequence(x, group=None):\n    return GatherSequence.apply(x, group)\n\n\n"
                "def reduce_scatter_sequence(x, group=None):\n    return ReduceScatterSequence.apply(x, group)",
           replace="def gather_sequence(x, group=None):\n    return GatherSequence.apply(x, None)\n\n\n"
                   "def reduce_scatter_sequence(x, group=None):\n    return ReduceScatterSequence.apply(x, None)"),
    Mutant("sp.megatron", "builtin_autograd_all_gather",
           "torch.distributed.nn's autograd all-gather in place of GatherSequence",
           find="def gather_sequence(x, group=None):\n    return GatherSequence.apply(x, group)",
           replace="def gather_sequence(x, group=None):\n"
                   "    import torch.distributed.nn.functional as dnn\n"
                   "    return torch.cat(dnn.all_gather(x.contiguous(), group or dist.group.WORLD), dim=1)"),
    # ------------------------------------------------------------------ sp.online_softmax
    Mutant("sp.online_softmax", "old_accumulator_not_rescaled",
           "adds the new block, rescaled, to the running output without rescaling the old one",
           find="    return w_a * out_a + w_b * out_b, lse", replace="    return out_a + w_b * out_b, lse"),
    Mutant("sp.online_softmax", "lse_not_updated",
           "merges the outputs right but returns the old log-sum-exp",
           find="    return w_a * out_a + w_b * out_b, lse", replace="    return w_a * out_a + w_b * out_b, lse_a"),
    Mutant("sp.online_softmax", "mask_without_block_offset",
           "masks each key block with positions counted from the block's start",
           find="mask = causal_mask(positions[:q.shape[-2]], positions[start:stop]) if causal else None",
           replace="mask = causal_mask(positions[:q.shape[-2]], positions[:stop - start]) if causal else None"),
    Mutant("sp.online_softmax", "scale_missing",
           "forgets the 1/sqrt(d) on the scores",
           find="    scores = (q @ k.transpose(-2, -1)) * scale\n    if mask is not None:\n        scores = scores.masked_fill",
           replace="    scores = q @ k.transpose(-2, -1)\n    if mask is not None:\n        scores = scores.masked_fill"),
    Mutant("sp.online_softmax", "all_keys_in_one_block",
           "one attention_block over every key, whatever the block size: the whole score matrix at once",
           find="    for start in range(0, T, block_size):\n        stop = min(start + block_size, T)",
           replace="    for start in range(0, T, T):\n        stop = T"),
    Mutant("sp.online_softmax", "builtin_sdpa",
           "returns F.scaled_dot_product_attention: PyTorch's attention instead of the online softmax",
           find="    out = lse = None\n    for start in range(0, T, block_size):",
           replace="    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)\n"
                   "    out = lse = None\n    for start in range(0, T, block_size):"),
    # ------------------------------------------------------------------ sp.zigzag
    Mutant("sp.zigzag", "mirrored_in_n_chunks",
           "takes chunks r and N-1-r (mirrored in N instead of 2N)",
           find="first, second = rank, 2 * world - 1 - rank", replace="first, second = rank, world - 1 - rank"),
    Mutant("sp.zigzag", "striped_not_mirrored",
           "takes chunks r and N+r: two chunks, but the causal work is not balanced",
           find="first, second = rank, 2 * world - 1 - rank", replace="first, second = rank, world + rank"),
    Mutant("sp.zigzag", "contiguous_shard",
           "zigzag_shard cuts a contiguous T/N piece",
           find="    return x.index_select(dim, zigzag_positions(x.shape[dim], rank, world).to(x.device))",
           replace="    return x.narrow(dim, rank * (x.shape[dim] // world), x.shape[dim] // world)"),
    Mutant("sp.zigzag", "unshard_with_positions_not_inverse",
           "unshard indexes with the positions themselves instead of their inverse permutation",
           find="    return stacked.index_select(dim, torch.argsort(order).to(stacked.device))",
           replace="    return stacked.index_select(dim, order.to(stacked.device))"),
    # ------------------------------------------------------------------ sp.ring_attention
    Mutant("sp.ring_attention", "contiguous_group_ring",
           "computes the ring's neighbours as if the group were a contiguous block of ranks "
           "(first rank = my rank - my group rank): right on the world and on [0,1] | [2,3] only",
           find="            pending = start_exchange(list(block), group) if step < n - 1 else None\n",
           replace="            pending = None\n"
                   "            if step < n - 1:\n"
                   "                me, base = dist.get_rank(group), dist.get_rank() - dist.get_rank(group)\n"
                   "                to_rank, from_rank = base + (me + 1) % n, base + (me - 1) % n\n"
                   "                received = [torch.empty_like(t) for t in block]\n"
                   "                ops = [dist.P2POp(dist.isend, t.contiguous(), to_rank, group) for t in block]\n"
                   "                ops += [dist.P2POp(dist.irecv, r, from_rank, group) for r in received]\n"
                   "                pending = received, dist.batch_isend_irecv(ops)\n"),
    Mutant("sp.ring_attention", "waits_before_computing",
           "waits for each K/V exchange before computing on the block in hand: no overlap at all",
           find="            pending = start_exchange(list(block), group) if step < n - 1 else None\n"
                "            k_j, v_j, pos_j = block\n",
           replace="            pending = start_exchange(list(block), group) if step < n - 1 else None\n"
                   "            k_j, v_j, pos_j = block\n"
                   "            if pending is not None:\n"
                   "                received, works = pending\n"
                   "                for work in works:\n"
                   "                    work.wait()\n"
                   "                pending = received, []\n"),
    Mutant("sp.ring_attention", "sends_to_previous",
           "passes K/V to the previous rank and receives from the next: the ring runs backwards (same numbers)",
           find="            pending = start_exchange(list(block), group) if step < n - 1 else None\n",
           replace="            pending = None\n"
                   "            if step < n - 1:\n"
                   "                to_rank, from_rank = ring_neighbours(group)[::-1]\n"
                   "                got = [torch.empty_like(t) for t in block]\n"
                   "                ops = [dist.P2POp(dist.isend, t.contiguous(), to_rank, group) for t in block]\n"
                   "                ops += [dist.P2POp(dist.irecv, r, from_rank, group) for r in got]\n"
                   "                pending = got, dist.batch_isend_irecv(ops)\n"),
    Mutant("sp.ring_attention", "all_gather_kv",
           "all-gathers every rank's K, V and positions and attends to all of them: no ring (the "
           "'context_parallel on CPU' shortcut)",
           find="        n = degree(group)\n        out = lse = None\n        block = (k, v, positions)\n",
           replace="        n = degree(group)\n        out = lse = None\n        block = (k, v, positions)\n"
                   "        gathered = []\n"
                   "        for t in block:\n"
                   "            parts = [torch.empty_like(t) for _ in range(n)]\n"
                   "            dist.all_gather(parts, t.contiguous(), group=group)\n"
                   "            gathered.append(torch.cat(parts, dim=-2 if t.dim() > 1 else 0))\n"
                   "        block, n = tuple(gathered), 1\n"),
    Mutant("sp.ring_attention", "skips_last_block",
           "N-1 steps: passes the last block on but never attends to it (right at N = 1 only)",
           find="        for step in range(n):\n            pending = start_exchange",
           replace="        for step in range(max(n - 1, 1)):\n            pending = start_exchange"),
    Mutant("sp.ring_attention", "local_causal_mask",
           "gives the block helper row indices within the block, not the global positions: every block "
           "looks like the diagonal",
           find="            part = visible_attention(q, k_j, v_j, positions, pos_j, causal)\n",
           replace="            part = visible_attention(q, k_j, v_j, torch.arange(q.shape[-2]), "
                   "torch.arange(k_j.shape[-2]), causal)\n"),
    Mutant("sp.ring_attention", "mask_only_own_block",
           "masks only the first block (its own, the diagonal) and attends to every other block whole",
           find="            part = visible_attention(q, k_j, v_j, positions, pos_j, causal)\n",
           replace="            part = visible_attention(q, k_j, v_j, positions, pos_j, causal and step == 0)\n"),
    Mutant("sp.ring_attention", "backward_without_mask",
           "backward recomputes every block whole, as if not causal: the forward was right",
           find="            grads = visible_attention_backward(grad_out, q, k_j, v_j, out, lse, positions, pos_j, causal)\n",
           replace="            grads = visible_attention_backward(grad_out, q, k_j, v_j, out, lse, positions, pos_j, False)\n"),
    Mutant("sp.ring_attention", "no_gradient_hop_home",
           "backward keeps the dK, dV it holds after the last step: they belong to the next rank",
           find="                received, works = start_exchange([dk_j, dv_j], group)\n"
                "                for work in works:\n                    work.wait()\n                dk_j, dv_j = received",
           replace="                pass"),
    Mutant("sp.ring_attention", "whole_block_hops_home",
           "backward's last hop sends K and V along with dK, dV: two messages too many",
           find="                received, works = start_exchange([dk_j, dv_j], group)\n"
                "                for work in works:\n                    work.wait()\n                dk_j, dv_j = received",
           replace="                received, works = start_exchange([k_j, v_j, dk_j, dv_j], group)\n"
                   "                for work in works:\n                    work.wait()\n                dk_j, dv_j = received[2:]"),
    Mutant("sp.ring_attention", "builtin_context_parallel",
           "PyTorch's context_parallel ring attention in place of RingAttention",
           find="def ring_attention(q, k, v, positions, causal: bool = False, group=None):\n",
           replace="def ring_attention(q, k, v, positions, causal: bool = False, group=None):\n"
                   "    from torch.distributed.tensor.experimental import context_parallel  # noqa: F401\n"),
    # ------------------------------------------------------------------ sp.ulysses
    Mutant("sp.ulysses", "scatters_head_dim",
           "scatters the last dim (head_dim) instead of the heads: each rank dots partial vectors",
           find="    q, k, v = (all_to_all(t, 1, 2, group) for t in (q, k, v))\n"
                "    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)\n"
                "    return all_to_all(out, 2, 1, group)",
           replace="    q, k, v = (all_to_all(t, 3, 2, group) for t in (q, k, v))\n"
                   "    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)\n"
                   "    return all_to_all(out, 2, 3, group)"),
    Mutant("sp.ulysses", "pieces_in_reverse",
           "sends piece j to rank N-1-j: right at N = 1, the wrong heads and rows at every N > 1",
           find="        send = torch.stack(x.chunk(n, scatter_dim)).contiguous()",
           replace="        send = torch.stack(x.chunk(n, scatter_dim)[::-1]).contiguous()"),
    Mutant("sp.ulysses", "all_gather_kv",
           "all-gathers K and V along the sequence and attends with its own queries: no all-to-all",
           find="    q, k, v = (all_to_all(t, 1, 2, group) for t in (q, k, v))\n"
                "    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)\n"
                "    return all_to_all(out, 2, 1, group)",
           replace="    n, me, rows = degree(group), dist.get_rank(group), q.shape[2]\n"
                   "    def gather(t):\n"
                   "        parts = [torch.empty_like(t) for _ in range(n)]\n"
                   "        dist.all_gather(parts, t.contiguous(), group=group)\n"
                   "        return torch.cat(parts, dim=2)\n"
                   "    k, v = gather(k), gather(v)\n"
                   "    mask = causal_mask(torch.arange(me * rows, (me + 1) * rows), torch.arange(n * rows)) if causal else None\n"
                   "    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)"),
    Mutant("sp.ulysses", "default_group",
           "forgets group= in the all-to-all (and splits by the world size): fine until Ulysses runs on a sub-group",
           find="        n = degree(group)\n        send = torch.stack(x.chunk(n, scatter_dim)).contiguous()  # piece j -> rank j\n"
                "        received = torch.empty_like(send)\n        dist.all_to_all_single(received, send, group=group)",
           replace="        n = degree()\n        send = torch.stack(x.chunk(n, scatter_dim)).contiguous()\n"
                   "        received = torch.empty_like(send)\n        dist.all_to_all_single(received, send)"),
    # Issue 39: what the drawn configurations (tests/grading/test_sp.py) kill
    Mutant("sp.ulysses", "all_to_all_fixed_dims",
           "AllToAll scatters along dim 1 and gathers along dim 2 whatever it is asked (what Ulysses' first call needs)",
           find="        send = torch.stack(x.chunk(n, scatter_dim)).contiguous()  # piece j -> rank j",
           replace="        send = torch.stack(x.chunk(n, 1 if scatter_dim < gather_dim else 2)).contiguous()"),
    Mutant("sp.online_softmax", "scores_of_4d_tensors",
           "transposes k with dims (2, 3): right only for [B, heads, T, d] tensors",
           find="    scores = (q @ k.transpose(-2, -1)) * scale",
           replace="    scores = (q @ k.transpose(2, 3)) * scale"),
    # Issue 39, items 2-3: what the drawn Megatron and zig-zag configurations kill (bias=False and
    # frozen row-layer biases; N, dims and dtypes for zig-zag)
    Mutant("sp.megatron", "layernorm_grads_named_list",
           "reduces the six replicated parameters by name (ln_1/ln_2 weight and bias, the c_proj biases) instead of "
           "layernorm_parameters(): breaks on a model without biases",
           find="        for p in block.layernorm_parameters():\n",
           replace="        for p in (block.ln_1.weight, block.ln_1.bias, block.ln_2.weight, block.ln_2.bias,\n"
                   "                  block.attn.c_proj.bias, block.mlp.c_proj.bias):\n"),
    Mutant("sp.megatron", "row_biases_always_reduced",
           "checks for a gradient on the LayerNorms only, and all-reduces the row layers' biases unconditionally: "
           "a frozen c_proj bias (or bias=False) breaks it",
           find="        for p in block.layernorm_parameters():\n"
                "            if p.grad is not None:\n"
                "                dist.all_reduce(p.grad, group=group)\n",
           replace="        for p in [*block.ln_1.parameters(), *block.ln_2.parameters()]:\n"
                   "            if p.grad is not None:\n"
                   "                dist.all_reduce(p.grad, group=group)\n"
                   "        for p in (block.attn.c_proj.bias, block.mlp.c_proj.bias):\n"
                   "            dist.all_reduce(p.grad, group=group)\n"),
    Mutant("sp.zigzag", "unshard_along_dim_1",
           "zigzag_unshard concatenates and permutes along dim 1 (the sequence dim of [B, T, H]) whatever dim it is given",
           find="    length = sum(s.shape[dim] for s in shards)\n"
                "    order = torch.cat([zigzag_positions(length, r, world) for r in range(world)])\n"
                "    stacked = torch.cat(shards, dim)\n"
                "    return stacked.index_select(dim, torch.argsort(order).to(stacked.device))\n",
           replace="    length = sum(s.shape[1] for s in shards)\n"
                   "    order = torch.cat([zigzag_positions(length, r, world) for r in range(world)])\n"
                   "    stacked = torch.cat(shards, 1)\n"
                   "    return stacked.index_select(1, torch.argsort(order).to(stacked.device))\n"),
    Mutant("sp.zigzag", "shard_along_dim_1",
           "zigzag_shard takes the rows along dim 1 whatever dim it is given",
           find="    return x.index_select(dim, zigzag_positions(x.shape[dim], rank, world).to(x.device))",
           replace="    return x.index_select(1, zigzag_positions(x.shape[1], rank, world).to(x.device))"),
    Mutant("sp.zigzag", "world_of_the_launch",
           "zigzag_positions takes N from the process group when there is one, not from its argument",
           find="    chunk = per_rank(length, 2 * world, \"sequence length (zig-zag needs 2N chunks)\")\n",
           replace="    world = dist.get_world_size() if dist.is_initialized() else world\n"
                   "    chunk = per_rank(length, 2 * world, \"sequence length (zig-zag needs 2N chunks)\")\n"),
]
