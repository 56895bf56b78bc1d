"""Wrong implementations of chapter 05 that the grader must fail (see labkit.course.mutants)."""

from labkit.course.mutants import Mutant

MUTANTS = [
    # tp.f_g
    Mutant("tp.f_g", "g_reduces_backward_too",
           "g all-reduces in backward as well, like f: the gradient comes back N times too big",
           find="        # BEGIN SOLUTION tp.f_g: backward passes grad through unchanged (and None for the group)\n"
                "        return grad, None",
           replace="        grad = grad.clone()\n        dist.all_reduce(grad)\n        return grad, None"),
    Mutant("tp.f_g", "f_silent_backward",
           "f is the identity both ways: the input's gradient is only this rank's part",
           find="        grad = grad.clone()\n        dist.all_reduce(grad, group=ctx.group)\n        return grad, None",
           replace="        return grad, None"),
    Mutant("tp.f_g", "f_averages_forward",
           "f also averages its input over the ranks in forward, to be safe: the same numbers, an extra all-reduce",
           find="        ctx.group = group\n        return x.view_as(x)",
           replace="        ctx.group = group\n        x = x.clone()\n        dist.all_reduce(x, group=group)\n"
                   "        return x / dist.get_world_size(group)"),
    Mutant("tp.f_g", "builtin_all_reduce",
           "g's forward is torch.distributed.nn.functional.all_reduce, torch's autograd-aware all-reduce",
           find="        x = x.clone()\n        dist.all_reduce(x, group=group)\n        return x\n",
           replace="        from torch.distributed.nn.functional import all_reduce\n"
                   "        return all_reduce(x, group=group or dist.group.WORLD)\n"),
    Mutant("tp.f_g", "f_ignores_group", "f's backward all-reduces over every rank, not over its group",
           find="        dist.all_reduce(grad, group=ctx.group)\n", replace="        dist.all_reduce(grad)\n"),
    # tp.column
    Mutant("tp.column", "no_f", "skips f: every rank uses the whole input, but its gradient is never summed",
           find="        x = self.input_op(x, self.group)  # f: backward sums the input's gradient over ranks\n",
           replace=""),
    Mutant("tp.column", "gather_by_all_reduce",
           "gathers the output by writing its slice into zeros and all-reducing the whole [.., out]: right "
           "numbers, an all-reduce of N x the data instead of an all-gather",
           find="        return gather_from_parallel(y, self.group) if self.gather_output else y\n",
           replace="        if not self.gather_output:\n            return y\n"
                   "        world, rank = degree_and_rank(self.group)\n"
                   "        full = y.new_zeros(*y.shape[:-1], world * y.shape[-1])\n"
                   "        full[..., rank * y.shape[-1]:(rank + 1) * y.shape[-1]] = y\n"
                   "        return reduce_from_parallel(full, self.group)\n"),
    Mutant("tp.column", "gathers_always", "all-gathers the output even without gather_output",
           find="        return gather_from_parallel(y, self.group) if self.gather_output else y\n",
           replace="        return gather_from_parallel(y, self.group)\n"),
    Mutant("tp.column", "gathers_along_batch",
           "gathers the output pieces along the wrong dimension (the batch, dim 0) instead of the features",
           find="        return gather_from_parallel(y, self.group) if self.gather_output else y\n",
           replace="        if not self.gather_output:\n            return y\n"
                   "        pieces = [torch.empty_like(y) for _ in range(dist.get_world_size(self.group))]\n"
                   "        dist.all_gather(pieces, y.contiguous(), group=self.group)\n"
                   "        return torch.cat(pieces, dim=0)\n"),
    Mutant("tp.column", "builtin_all_gather",
           "gathers the output with torch.distributed.nn's autograd-aware all_gather",
           find="        return gather_from_parallel(y, self.group) if self.gather_output else y\n",
           replace="        if not self.gather_output:\n            return y\n"
                   "        from torch.distributed.nn.functional import all_gather\n"
                   "        return torch.cat(all_gather(y, group=self.group or dist.group.WORLD), -1)\n"),
    Mutant("tp.column", "f_without_group", "calls f without the layer's group: the input's gradient is summed over every rank",
           find="        x = self.input_op(x, self.group)  # f: backward sums the input's gradient over ranks\n",
           replace="        x = self.input_op(x)\n"),
    # tp.row
    Mutant("tp.row", "bias_on_every_rank", "adds the bias before the all-reduce: it is summed N times",
           find="        y = self.output_op(F.linear(x, self.weight), self.group)  # g: the partial products summed\n"
                "        return y + self.bias if self.bias is not None else y\n",
           replace="        return self.output_op(F.linear(x, self.weight, self.bias), self.group)\n"),
    Mutant("tp.row", "slices_input_by_hand",
           "takes its slice of a whole input with chunk(): the input's gradient is never gathered",
           find="            x = scatter_to_parallel(x, self.group)\n",
           replace="            x = x.chunk(dist.get_world_size(self.group), -1)[dist.get_rank(self.group)]\n"),
    Mutant("tp.row", "reduce_by_all_gather",
           "all-gathers every rank's partial product and sums them: right numbers, N x the bytes of an all-reduce",
           find="        y = self.output_op(F.linear(x, self.weight), self.group)  # g: the partial products summed\n",
           replace="        partial = F.linear(x, self.weight)\n"
                   "        y = gather_from_parallel(partial, self.group).unflatten(-1, (-1, partial.shape[-1])).sum(-2)\n"),
    Mutant("tp.row", "builtin_all_reduce", "sums the partial products with torch.distributed.nn's all_reduce",
           find="        y = self.output_op(F.linear(x, self.weight), self.group)  # g: the partial products summed\n",
           replace="        import torch.distributed.nn.functional as dist_nn\n"
                   "        y = dist_nn.all_reduce(F.linear(x, self.weight), group=self.group or dist.group.WORLD)\n"),
    Mutant("tp.row", "g_without_group", "calls g without the layer's group: partial products summed over every rank",
           find="        y = self.output_op(F.linear(x, self.weight), self.group)  # g: the partial products summed\n",
           replace="        y = self.output_op(F.linear(x, self.weight))\n"),
    # tp.mlp
    Mutant("tp.mlp", "gathers_hidden",
           "gathers the hidden layer between c_fc and c_proj (an extra all-gather per block, and another "
           "in backward)",
           find="        self.c_fc = ColumnParallelLinear.from_linear(mlp.c_fc, group)\n"
                "        self.c_proj = RowParallelLinear.from_linear(mlp.c_proj, group)\n",
           replace="        self.c_fc = ColumnParallelLinear.from_linear(mlp.c_fc, group, gather_output=True)\n"
                   "        self.c_proj = RowParallelLinear.from_linear(mlp.c_proj, group, input_is_parallel=False)\n"),
    Mutant("tp.mlp", "whole_c_proj",
           "keeps c_proj whole on every rank and gathers the hidden layer for it",
           find="        self.c_fc = ColumnParallelLinear.from_linear(mlp.c_fc, group)\n"
                "        self.c_proj = RowParallelLinear.from_linear(mlp.c_proj, group)\n",
           replace="        self.c_fc = ColumnParallelLinear.from_linear(mlp.c_fc, group, gather_output=True)\n"
                   "        self.c_proj = mlp.c_proj\n"),
    Mutant("tp.mlp", "builtin_parallelize_module", "parallelize_module with ColwiseParallel/RowwiseParallel",
           find="        self.c_fc = ColumnParallelLinear.from_linear(mlp.c_fc, group)\n"
                "        self.c_proj = RowParallelLinear.from_linear(mlp.c_proj, group)\n",
           replace="        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module\n"
                   "        from torch.distributed.tensor import DeviceMesh\n"
                   "        self.c_fc, self.c_proj = mlp.c_fc, mlp.c_proj\n"
                   "        mesh = DeviceMesh('cpu', dist.get_process_group_ranks(group or dist.group.WORLD))\n"
                   "        parallelize_module(self, mesh, {'c_fc': ColwiseParallel(), 'c_proj': RowwiseParallel()})\n"),
    Mutant("tp.mlp", "layers_without_group", "builds c_fc and c_proj without the group: split over every rank",
           find="        self.c_fc = ColumnParallelLinear.from_linear(mlp.c_fc, group)\n"
                "        self.c_proj = RowParallelLinear.from_linear(mlp.c_proj, group)\n",
           replace="        self.c_fc = ColumnParallelLinear.from_linear(mlp.c_fc)\n"
                   "        self.c_proj = RowParallelLinear.from_linear(mlp.c_proj)\n"),
    # tp.attention
    Mutant("tp.attention", "contiguous_qkv",
           "splits c_attn in N contiguous row blocks (no parts=3): rank 0 gets Q and part of K, not its heads",
           find="        self.c_attn = ColumnParallelLinear.from_linear(attn.c_attn, group, parts=3)\n",
           replace="        self.c_attn = ColumnParallelLinear.from_linear(attn.c_attn, group)\n"),
    Mutant("tp.attention", "all_heads_everywhere",
           "every rank computes every head: all-gathers q, k, v, runs all heads, keeps its slice",
           find="        q, k, v = self.c_attn(x).chunk(3, dim=-1)  # each [B, T, n_embd/N]: this rank's heads\n",
           replace="        group = self.c_attn.group\n"
                   "        q, k, v = (gather_from_parallel(t, group) for t in self.c_attn(x).chunk(3, dim=-1))\n"
                   "        B, T, _ = q.shape\n"
                   "        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))\n"
                   "        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)\n"
                   "        world, rank = degree_and_rank(group)\n"
                   "        return self.c_proj(y.chunk(world, -1)[rank])\n"),
    Mutant("tp.attention", "heads_of_the_whole_model",
           "views the local q, k, v as n_head heads (not n_head/N): heads of the wrong size",
           find="        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))\n"
                "        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)\n",
           replace="        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))\n"
                   "        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)\n"),
    Mutant("tp.attention", "builtin_parallelize_module", "parallelize_module on c_attn and c_proj",
           find="        self.c_attn = ColumnParallelLinear.from_linear(attn.c_attn, group, parts=3)\n"
                "        self.c_proj = RowParallelLinear.from_linear(attn.c_proj, group)\n",
           replace="        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module\n"
                   "        from torch.distributed.tensor import DeviceMesh\n"
                   "        self.c_attn, self.c_proj = attn.c_attn, attn.c_proj\n"
                   "        mesh = DeviceMesh('cpu', dist.get_process_group_ranks(group or dist.group.WORLD))\n"
                   "        parallelize_module(self, mesh, {'c_attn': ColwiseParallel(), 'c_proj': RowwiseParallel()})\n"),
    Mutant("tp.attention", "layers_without_group",
           "builds c_attn and c_proj without the group: the heads split over every rank",
           find="        self.c_attn = ColumnParallelLinear.from_linear(attn.c_attn, group, parts=3)\n"
                "        self.c_proj = RowParallelLinear.from_linear(attn.c_proj, group)\n",
           replace="        self.c_attn = ColumnParallelLinear.from_linear(attn.c_attn, parts=3)\n"
                   "        self.c_proj = RowParallelLinear.from_linear(attn.c_proj)\n"),
    # tp.vocab
    Mutant("tp.vocab", "embedding_mask_off_by_one",
           "masks ids <= vocab_start: the first token of every slice is looked up nowhere",
           find="        outside = (idx < self.vocab_start) | (idx >= self.vocab_start + self.per_rank)\n",
           replace="        outside = (idx <= self.vocab_start) | (idx >= self.vocab_start + self.per_rank)\n"),
    Mutant("tp.vocab", "loss_target_off_by_one",
           "the target's slice ends one id early: the last token of every slice has no target logit",
           find="        outside = (targets < start) | (targets >= start + logits.shape[-1])\n",
           replace="        outside = (targets < start) | (targets >= start + logits.shape[-1] - 1)\n"),
    Mutant("tp.vocab", "sum_of_maxes",
           "all-reduces the max with SUM: the shift is N maxes and the exponentials underflow",
           find="        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)  # for stability only\n",
           replace="        dist.all_reduce(logits_max, group=group)\n"),
    Mutant("tp.vocab", "gathers_logits",
           "all-gathers the B x T x V logits and takes the ordinary cross-entropy: right numbers, V/N times the traffic",
           find="        logits_max = logits.detach().amax(dim=-1)\n",
           replace="        pieces = [torch.empty_like(logits) for _ in range(world)]\n"
                   "        dist.all_gather(pieces, logits.detach().contiguous(), group=group)\n"
                   "        whole = torch.cat(pieces, -1)\n"
                   "        softmax = whole.softmax(-1).chunk(world, -1)[rank]\n"
                   "        outside = (targets < start) | (targets >= start + logits.shape[-1])\n"
                   "        ctx.save_for_backward(softmax, (targets - start).masked_fill(outside, 0), outside)\n"
                   "        return -whole.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)\n"
                   "        logits_max = logits.detach().amax(dim=-1)\n"),
    Mutant("tp.vocab", "builtin_all_reduce", "sums the embedding's lookups with torch.distributed.nn's all_reduce",
           find="        return reduce_from_parallel(rows, self.group)\n",
           replace="        from torch.distributed.nn.functional import all_reduce\n"
                   "        return all_reduce(rows, group=self.group or dist.group.WORLD)\n"),
    Mutant("tp.vocab", "loss_slice_of_the_world", "the loss finds its vocabulary slice from its rank in the world, not in the group",
           find="        world, rank = degree_and_rank(group)\n        start = rank * logits.shape[-1]\n",
           replace="        world, rank = degree_and_rank()\n        start = rank * logits.shape[-1]\n"),
    Mutant("tp.vocab", "loss_slice_global_rank_mod",
           "the loss's vocabulary slice from the global rank modulo the group's size: the group rank of "
           "contiguous groups ({0,1} | {2,3}) only",
           find="        world, rank = degree_and_rank(group)\n        start = rank * logits.shape[-1]\n",
           replace="        world = dist.get_world_size(group)\n        rank = dist.get_rank() % world\n"
                   "        start = rank * logits.shape[-1]\n"),
    # tp.model
    Mutant("tp.model", "unties_head",
           "always gives the GPT a ColumnParallelLinear head: a tied table gets two copies",
           find="    gpt.lm_head = VocabParallelHead(gpt.wte) if tied else ColumnParallelLinear.from_linear(gpt.lm_head, group)\n",
           replace="    gpt.lm_head = ColumnParallelLinear.from_linear(gpt.lm_head, group)\n"),
    Mutant("tp.model", "gathers_logits",
           "all-gathers the logits after the head and keeps GPT's ordinary cross-entropy: right loss, "
           "B*T*V numbers moved and every rank holding all the logits",
           find="    gpt.loss = functools.partial(vocab_parallel_cross_entropy, group=group)  # shadows GPT.loss\n",
           replace="    head = gpt.lm_head\n"
                   "    head.forward = lambda x, local=head.forward: gather_from_parallel(local(x), group)\n"),
    Mutant("tp.model", "state_dict_gathers_everything",
           "full_state_dict all-gathers every entry, replicated ones too (keeping rank 0's copy)",
           find="        layout = getattr(modules[owner], \"tp_layout\", {}).get(name)\n"
                "        if layout is None:\n            full[key] = tensor.clone()\n            continue\n"
                "        pieces = [torch.empty_like(tensor) for _ in range(world)]\n"
                "        dist.all_gather(pieces, tensor.contiguous(), group=group)\n",
           replace="        layout = getattr(modules[owner], \"tp_layout\", {}).get(name)\n"
                   "        pieces = [torch.empty_like(tensor) for _ in range(world)]\n"
                   "        dist.all_gather(pieces, tensor.contiguous(), group=group)\n"
                   "        if layout is None:\n            full[key] = pieces[0].clone()\n            continue\n"),
    Mutant("tp.model", "embedding_without_group", "tensor_parallel splits the embedding over every rank, not over the group",
           find="    gpt.wte = VocabParallelEmbedding.from_embedding(gpt.wte, group)\n",
           replace="    gpt.wte = VocabParallelEmbedding.from_embedding(gpt.wte)\n"),
    Mutant("tp.model", "builtin_parallelize_module", "parallelize_module over a device mesh in place of the blocks' rewrite",
           find="    for block in gpt.blocks:\n        block.attn = ParallelSelfAttention(block.attn, group)\n"
                "        block.mlp = ParallelMLP(block.mlp, group)\n",
           replace="    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module\n"
                   "    from torch.distributed.tensor import DeviceMesh\n"
                   "    mesh = DeviceMesh('cpu', dist.get_process_group_ranks(group or dist.group.WORLD))\n"
                   "    for block in gpt.blocks:\n"
                   "        parallelize_module(block, mesh, {'attn.c_attn': ColwiseParallel(), 'attn.c_proj': RowwiseParallel(),\n"
                   "                                         'mlp.c_fc': ColwiseParallel(), 'mlp.c_proj': RowwiseParallel()})\n"),
    # Issue 39: what the drawn configurations (tests/grading/test_tp.py, drawn_*) kill
    Mutant("tp.vocab", "loss_backward_assumes_the_mean",
           "the loss's backward divides by the number of tokens instead of using grad_loss: right only "
           "when the incoming gradient is the mean's 1/(B*T) everywhere",
           find="        return grad * grad_loss.unsqueeze(-1), None, None",
           replace="        return grad / grad.shape[:-1].numel(), None, None"),
    Mutant("tp.vocab", "embedding_assumes_2d_ids",
           "flattens the ids and reshapes the lookups to [B, T, dim] from idx.shape: ids of another rank fail",
           find="        rows = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)",
           replace="        B, T = idx.shape[0], idx.shape[-1]\n"
                   "        rows = F.embedding(local.reshape(-1), self.weight).masked_fill(outside.reshape(-1, 1), 0.0)\n"
                   "        rows = rows.view(B, T, -1)"),
    Mutant("tp.f_g", "f_backward_reduces_grad_in_place",
           "f's backward all-reduces the incoming gradient in place: the caller's tensor is overwritten",
           find="        grad = grad.clone()\n        dist.all_reduce(grad, group=ctx.group)",
           replace="        dist.all_reduce(grad, group=ctx.group)"),
    Mutant("tp.f_g", "g_sums_in_float64",
           "g all-reduces a float64 copy for accuracy and returns it: the output is float64 whatever came in",
           find="        x = x.clone()\n        dist.all_reduce(x, group=group)",
           replace="        x = x.to(torch.float64, copy=True)\n        dist.all_reduce(x, group=group)"),
    Mutant("tp.row", "bias_always_added",
           "adds self.bias unconditionally: a row layer without bias fails",
           find="        return y + self.bias if self.bias is not None else y",
           replace="        return y + self.bias"),
    Mutant("tp.column", "assumes_3d_input",
           "multiplies x viewed as [B*T, in] and views the result as [B, T, out/N]: only 3-D inputs work",
           find="        y = F.linear(x, self.weight, self.bias)  # [.., out/N]: this rank's output features",
           replace="        B, T = x.shape[0], x.shape[1]\n"
                   "        y = F.linear(x.reshape(B * T, -1), self.weight, self.bias).view(B, T, -1)"),
    # issue 39 item 2: low precision, killed by the drawn bf16/fp16 configurations only
    Mutant("tp.column", "upcasts_low_precision",
           "multiplies in at least float32 for accuracy and forgets to cast back: a bf16/fp16 layer returns float32",
           find="        y = F.linear(x, self.weight, self.bias)  # [.., out/N]: this rank's output features",
           replace="        up = torch.promote_types(x.dtype, torch.float32)\n"
                   "        y = F.linear(x.to(up), self.weight.to(up), None if self.bias is None else self.bias.to(up))"),
    Mutant("tp.row", "reduces_in_fp32",
           "sums the partial products in at least float32 (fewer roundings) and returns that: bf16/fp16 in, float32 out",
           find="        y = self.output_op(F.linear(x, self.weight), self.group)  # g: the partial products summed",
           replace="        partial = F.linear(x, self.weight)\n"
                   "        y = self.output_op(partial.to(torch.promote_types(partial.dtype, torch.float32)), self.group)"),
    Mutant("tp.attention", "softmax_in_fp32_not_cast_back",
           "attention in at least float32 for a stable softmax, the result left in float32: c_proj gets float32 "
           "beside bf16/fp16 weights",
           find="        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)\n",
           replace="        up = torch.promote_types(q.dtype, torch.float32)\n"
                   "        y = F.scaled_dot_product_attention(q.to(up), k.to(up), v.to(up), is_causal=True)\n"),
    # Contracts (labkit.runtime.contracts): the right sum, the caller's partial result overwritten.
    Mutant("tp.f_g", "g_reduces_its_input_in_place",
           "g all-reduces the row-parallel layer's output in place: right forward, the caller's tensor overwritten",
           find="        x = x.clone()\n        dist.all_reduce(x, group=group)\n        return x",
           replace="        dist.all_reduce(x, group=group)\n        return x.view_as(x)"),
]
