"""Wrong implementations of chapter 12 that the grader must fail (see labkit.course.mutants)."""

from labkit.course.mutants import Mutant

MUTANTS = [
    # recompute.checkpoint
    Mutant("recompute.checkpoint", "every_input_requires_grad", "makes every tensor argument require a gradient in the "
           "recompute: integer ids and positions raise (only floating point tensors can require gradients)",
           find="        tensors = iter([t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors])\n",
           replace="        tensors = iter([t.detach().requires_grad_(True) for t in ctx.saved_tensors])\n"),
    Mutant("recompute.checkpoint", "ones_as_incoming_grad", "backpropagates the recomputed outputs with ones (as for a "
           "summed loss), not the gradients backward was handed",
           find="        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])\n",
           replace="        torch.autograd.backward([o for o, _ in pairs], [torch.ones_like(g) for _, g in pairs])\n"),
    Mutant("recompute.checkpoint", "rng_not_restored", "recomputes with the RNG as it is now: dropout draws a new mask",
           find="            torch.set_rng_state(ctx.cpu_rng)\n", replace=""),
    Mutant("recompute.checkpoint", "every_kth_off_by_one", "wraps blocks k-1, 2k-1, ... instead of 0, k, 2k, ...",
           find="if i % k == 0]", replace="if (i + 1) % k == 0]"),
    Mutant("recompute.checkpoint", "every_block", "wraps every block whatever k says",
           find="if i % k == 0]", replace="]"),
    Mutant("recompute.checkpoint", "keeps_activations", "runs the block with grad enabled: every activation is kept after all",
           find="        if not torch.is_grad_enabled():  # nothing would be saved anyway\n",
           replace="        if True:\n"),
    Mutant("recompute.checkpoint", "torch_checkpoint", "PyTorch's own torch.utils.checkpoint in place of the exercise",
           find="        return Checkpoint.apply(self.block, x)\n",
           replace="        from torch.utils.checkpoint import checkpoint\n"
                   "        return checkpoint(self.block, x, use_reentrant=False)\n"),
    Mutant("recompute.checkpoint", "autocast_not_restored", "recomputes outside the forward's autocast: backward runs in fp32",
           find="            with torch.enable_grad(), restore_autocast(ctx.autocast):\n",
           replace="            with torch.enable_grad():\n"),
    Mutant("recompute.checkpoint", "autocast_not_captured", "captures the autocast state in backward, where it is off",
           find="            with torch.enable_grad(), restore_autocast(ctx.autocast):\n",
           replace="            with torch.enable_grad(), restore_autocast(autocast_state()):\n"),
    Mutant("recompute.checkpoint", "rng_not_forked", "restores the forward's RNG state without a fork: the global stream is left rewound",
           find="        with torch.random.fork_rng(devices=ctx.devices):\n", replace="        if True:\n"),
    Mutant("recompute.checkpoint", "rng_reseeded", "forks the RNG but reseeds the global stream after the recompute",
           find="        outputs = outputs if isinstance(outputs, tuple) else (outputs,)\n",
           replace="        torch.set_rng_state(ctx.cpu_rng)\n"
                   "        outputs = outputs if isinstance(outputs, tuple) else (outputs,)\n"),
    Mutant("recompute.checkpoint", "first_output_only", "backpropagates through the first output only",
           find="        pairs = [(o, g) for o, g in zip(outputs, grads)\n",
           replace="        pairs = [(o, g) for o, g in zip(outputs[:1], grads)\n"),
    Mutant("recompute.checkpoint", "none_when_k_too_big", "wraps nothing when k exceeds the number of blocks",
           find="    wrapped = [i for i in range(len(gpt.blocks)) if i % k == 0]\n",
           replace="    wrapped = [i for i in range(len(gpt.blocks)) if i % k == 0 and k <= len(gpt.blocks)]\n"),
    Mutant("recompute.checkpoint", "inputs_on_ctx", "keeps the tensor args as ctx attributes too: saved-tensor hooks (offloading) cannot move them",
           find="        ctx.others = [(isinstance(a, torch.Tensor), None if isinstance(a, torch.Tensor) else a) for a in args]\n",
           replace="        ctx.others = [(isinstance(a, torch.Tensor), a) for a in args]\n"),
    Mutant("recompute.checkpoint", "recompute_twice", "re-runs the block outside the restored RNG (a second forward draws masks)",
           find="        outputs = outputs if isinstance(outputs, tuple) else (outputs,)\n",
           replace="        with torch.enable_grad():\n            outputs = ctx.fn(*args)\n"
                   "        outputs = outputs if isinstance(outputs, tuple) else (outputs,)\n"),
    # recompute.segments
    Mutant("recompute.segments", "checkpoint_each_block", "checkpoints each block of a segment on its own: every block's input kept",
           find="    model.blocks = nn.ModuleList(Checkpointed(nn.Sequential(*(blocks[i] for i in run))) for run in segments)\n",
           replace="    model.blocks = nn.ModuleList(nn.Sequential(*(Checkpointed(blocks[i]) for i in run)) for run in segments)\n"),
    Mutant("recompute.segments", "not_checkpointed", "groups the blocks into segments but runs them as they are: nothing recomputed",
           find="    model.blocks = nn.ModuleList(Checkpointed(nn.Sequential(*(blocks[i] for i in run))) for run in segments)\n",
           replace="    model.blocks = nn.ModuleList(nn.Sequential(*(blocks[i] for i in run)) for run in segments)\n"),
    Mutant("recompute.segments", "last_segment_dropped", "only whole segments of k: the blocks past the last multiple of k are lost",
           find="    segments = [list(range(i, min(i + k, len(blocks)))) for i in range(0, len(blocks), k)]\n",
           replace="    segments = [list(range(i, i + k)) for i in range(0, len(blocks) - len(blocks) % k, k)]\n"),
    Mutant("recompute.segments", "every_kth_alone", "Chen's scheme read as checkpoint_every: block 0, k, 2k, ... each on its own",
           find="    segments = [list(range(i, min(i + k, len(blocks)))) for i in range(0, len(blocks), k)]\n"
                "    model.blocks = nn.ModuleList(Checkpointed(nn.Sequential(*(blocks[i] for i in run))) for run in segments)\n"
                "    return segments\n",
           replace="    return [[i] for i in checkpoint_every(model, k)]\n"),
    Mutant("recompute.segments", "segments_of_k_minus_1", "segments one block short: range(i, i + k - 1)",
           find="    segments = [list(range(i, min(i + k, len(blocks)))) for i in range(0, len(blocks), k)]\n",
           replace="    segments = [list(range(i, min(i + max(k - 1, 1), len(blocks)))) for i in range(0, len(blocks), max(k - 1, 1))]\n"),
    # recompute.selective
    Mutant("recompute.selective", "keeps_softmax", "keeps the softmax output and recomputes only dropout and the last matmul",
           find="    return Checkpoint.apply(lambda q_, k_, v_: attention_core(q_, k_, v_, p), q, k, v)\n",
           replace="    mask = torch.full((q.shape[-2],) * 2, float('-inf'), dtype=q.dtype).triu(1)\n"
                   "    probs = ((q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1]) + mask).softmax(-1)\n"
                   "    return Checkpoint.apply(lambda pr, v_: F.dropout(pr, p) @ v_, probs, v)\n"),
    Mutant("recompute.selective", "detached_inputs", "detaches q, k, v before the checkpoint: no gradient reaches c_attn",
           find="    return Checkpoint.apply(lambda q_, k_, v_: attention_core(q_, k_, v_, p), q, k, v)\n",
           replace="    return Checkpoint.apply(lambda q_, k_, v_: attention_core(q_, k_, v_, p), q.detach(), k.detach(), v)\n"),
    Mutant("recompute.selective", "torch_checkpoint", "PyTorch's own torch.utils.checkpoint in place of the exercise",
           find="    return Checkpoint.apply(lambda q_, k_, v_: attention_core(q_, k_, v_, p), q, k, v)\n",
           replace="    import torch.utils.checkpoint\n"
                   "    return torch.utils.checkpoint.checkpoint(attention_core, q, k, v, p, use_reentrant=False)\n"),
    # recompute.offload
    Mutant("recompute.offload", "no_prefetch", "brings each layer back only when backward reaches it (no prefetch)",
           find="        if self.host.get(index - 1):\n            self._bring_back(index - 1, device, \"prefetch\")\n",
           replace=""),
    Mutant("recompute.offload", "never_brought_back", "hands backward the host copy: the device never gets the layer back",
           find="        if index not in self.fetched:\n            self._bring_back(index, device, \"fetch\")\n"
                "        if self.host.get(index - 1):\n            self._bring_back(index - 1, device, \"prefetch\")\n"
                "        return self.fetched[index][position]\n",
           replace="        return self.host[index][position]\n"),
    Mutant("recompute.offload", "prefetch_everything", "brings every layer back at the first unpack: the device holds them all",
           find="        if self.host.get(index - 1):\n            self._bring_back(index - 1, device, \"prefetch\")\n",
           replace="        for earlier in sorted((i for i in self.host if i < index and self.host[i]), reverse=True):\n"
                   "            self._bring_back(earlier, device, \"prefetch\")\n"),
    Mutant("recompute.offload", "device_tensor_kept", "copies to the host but keeps the device tensor referenced",
           find="        self.host[index].append(self._to_host(t))\n",
           replace="        self.host[index].append(self._to_host(t))\n"
                   "        self.__dict__.setdefault('originals', []).append(t)\n"),
    Mutant("recompute.offload", "prefetch_two_ahead", "prefetches layers i - 1 and i - 2",
           find="        if self.host.get(index - 1):\n            self._bring_back(index - 1, device, \"prefetch\")\n",
           replace="        for ahead in (index - 1, index - 2):\n"
                   "            if self.host.get(ahead):\n                self._bring_back(ahead, device, \"prefetch\")\n"),
    Mutant("recompute.offload", "handle_holds_tensor", "the handle autograd keeps holds the device tensor itself",
           find="        return (index, len(self.host[index]) - 1, t.device)\n",
           replace="        return (index, len(self.host[index]) - 1, t.device, t)\n"),
    Mutant("recompute.offload", "nothing_offloaded", "keeps the tensor on the device and only writes down its bytes",
           find="        self.host[index].append(self._to_host(t))\n",
           replace="        self.host[index].append(t)\n        return (\"kept\", t)\n"),
    # issue 39 item 2: killed by the drawn configurations only
    Mutant("recompute.checkpoint", "floats_are_the_only_constants", "takes every argument that is not a float for a "
           "tensor: an int argument (a repeat count, a layer index) goes to save_for_backward, which refuses it",
           find="        ctx.others = [(isinstance(a, torch.Tensor), None if isinstance(a, torch.Tensor) else a) for a in args]\n"
                "        ctx.save_for_backward(*[a for a in args if isinstance(a, torch.Tensor)])\n",
           replace="        ctx.others = [(not isinstance(a, float), a if isinstance(a, float) else None) for a in args]\n"
                   "        ctx.save_for_backward(*[a for a in args if not isinstance(a, float)])\n"),
    Mutant("recompute.checkpoint", "lone_tuple_unwrapped", "returns fn's one-element tuple as a lone tensor (fn's "
           "caller indexes [0] and gets a row)",
           find="        with torch.no_grad():\n            return fn(*args)\n",
           replace="        with torch.no_grad():\n            out = fn(*args)\n"
                   "            return out[0] if isinstance(out, tuple) and len(out) == 1 else out\n"),
    Mutant("recompute.selective", "only_with_dropout", "recomputes the core only when dropout is on (\"without "
           "dropout nothing random needs replaying\"): without dropout the scores and softmax are kept",
           find="    if not selective:\n        return attention_core(q, k, v, p)\n",
           replace="    if not selective or p == 0.0:\n        return attention_core(q, k, v, p)\n"),
    Mutant("recompute.offload", "host_buffers_reused", "keeps one host buffer per (layer, position) from the first "
           "step and copies into it (pinned buffers allocated once): the next step's other shape does not fit",
           find="        self.host[index].append(self._to_host(t))\n",
           replace="        buffers = self.__dict__.setdefault('buffers', {})\n"
                   "        key = (index, len(self.host[index]))\n"
                   "        if key in buffers:\n"
                   "            buffers[key].copy_(t)\n"
                   "            self.host[index].append(buffers[key])\n"
                   "        else:\n"
                   "            buffers[key] = self._to_host(t)\n"
                   "            self.host[index].append(buffers[key])\n"),
    # recompute.accumulate
    Mutant("recompute.accumulate", "loss_not_scaled", "backward of each micro-batch's loss unscaled: gradients m times too large",
           find="        loss = loss_fn(model, x, y) * (count / tokens)\n", replace="        loss = loss_fn(model, x, y)\n"),
    Mutant("recompute.accumulate", "mean_of_means", "divides each loss by m: unequal micro-batches weigh the same, not by tokens",
           find="        loss = loss_fn(model, x, y) * (count / tokens)\n", replace="        loss = loss_fn(model, x, y) / m\n"),
    Mutant("recompute.accumulate", "world_group", "all-reduces over every rank, whatever group says",
           find="                dist.all_reduce(p.grad, group=group)\n                p.grad.div_(n)\n    # END",
           replace="                dist.all_reduce(p.grad)\n                p.grad.div_(n)\n    # END"),
    Mutant("recompute.accumulate", "divide_by_world", "divides by the world size, not the group's",
           find="                p.grad.div_(n)\n", replace="                p.grad.div_(dist.get_world_size())\n"),
    Mutant("recompute.accumulate", "all_reduce_every_micro_batch", "all-reduces the gradients after every micro-batch",
           find="        total = total + loss.detach()\n    if n > 1:\n",
           replace="        total = total + loss.detach()\n        if n > 1:\n"
                   "            for p in model.parameters():\n"
                   "                if p.grad is not None:\n"
                   "                    dist.all_reduce(p.grad, group=group)\n"
                   "                    p.grad.div_(n)\n    if False:\n"),
    Mutant("recompute.accumulate", "weights_by_numel", "issue 42's bug: weighs each micro-batch by y.numel() / all targets, "
           "padding included (the mean loss of each excludes it)",
           find="        if count == 0:\n            continue\n        loss = loss_fn(model, x, y) * (count / tokens)\n",
           replace="        loss = loss_fn(model, x, y) * (y.numel() / sum(t.numel() for _, t in micro_batches))\n"),
    Mutant("recompute.accumulate", "numel_skipping_padding", "weighs by y.numel() over the micro-batches that have a counted "
           "target (the empty one skipped, padding still counted)",
           find="        loss = loss_fn(model, x, y) * (count / tokens)\n",
           replace="        loss = loss_fn(model, x, y) * (y.numel() / sum(t.numel() for _, t in micro_batches))\n"),
    Mutant("recompute.accumulate", "padding_only_not_skipped", "runs backward of a micro-batch of padding only: 0 x nan = nan gradients",
           find="        if count == 0:\n            continue\n", replace=""),
    Mutant("recompute.accumulate", "no_divide_by_n", "sums the ranks' gradients without dividing by N",
           find="                p.grad.div_(n)\n", replace=""),
    # recompute.optimizer_offload (issue 39: the bytes self-reported; now measured on an emulated device)
    Mutant("recompute.optimizer_offload", "update_on_device", "sends the fp32 master and moments to the device, updates "
           "there and copies them back, while moved_bytes still counts 2 + 2 bytes a parameter",
           find="            grad = p.grad.to(\"cpu\", torch.float32)\n"
                "            self.moved_bytes += p.grad.nbytes\n"
                "            w.mul_(1 - lr * weight_decay)\n"
                "            m.lerp_(grad, 1 - beta1)\n"
                "            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)\n"
                "            denominator = (v.sqrt() / math.sqrt(correction2)).add_(eps)\n"
                "            w.addcdiv_(m, denominator, value=-lr / correction1)\n"
                "            p.copy_(w.to(p.dtype).to(p.device))                  # cast on the host: 2 bytes go up, not 4\n",
           replace="            grad = p.grad.float()\n"
                   "            self.moved_bytes += p.grad.nbytes\n"
                   "            wd, md, vd = (t.to(p.device) for t in (w, m, v))\n"
                   "            wd.mul_(1 - lr * weight_decay)\n"
                   "            md.lerp_(grad, 1 - beta1)\n"
                   "            vd.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)\n"
                   "            denominator = (vd.sqrt() / math.sqrt(correction2)).add_(eps)\n"
                   "            wd.addcdiv_(md, denominator, value=-lr / correction1)\n"
                   "            w.copy_(wd)\n            m.copy_(md)\n            v.copy_(vd)\n"
                   "            p.copy_(wd.to(p.dtype))\n"),
    Mutant("recompute.optimizer_offload", "group_options_ignored", "decays every parameter with the optimizer's "
           "default lr and weight decay, not its param group's (biases decayed after all)",
           find="            w.mul_(1 - lr * weight_decay)\n",
           replace="            w.mul_(1 - self.lr * self.weight_decay)\n"),
    Mutant("recompute.optimizer_offload", "grad_cast_on_device", "casts the gradient to fp32 on the device, then sends it "
           "down: 4 bytes a parameter instead of 2, moved_bytes still 2",
           find="            grad = p.grad.to(\"cpu\", torch.float32)\n",
           replace="            grad = p.grad.float().to(\"cpu\")\n"),
    # recompute.optimizer_offload
    Mutant("recompute.optimizer_offload", "no_fp32_master", "updates the bf16 parameter itself: small updates round away",
           find="            w.addcdiv_(m, denominator, value=-lr / correction1)\n"
                "            p.copy_(w.to(p.dtype).to(p.device))                  # cast on the host: 2 bytes go up, not 4\n",
           replace="            p.addcdiv_(m.to(p.dtype), denominator.to(p.dtype), value=-lr / correction1)\n"
                   "            p.mul_(1 - lr * weight_decay)\n            w.copy_(p)\n"),
    Mutant("recompute.optimizer_offload", "not_copied_back", "updates the host master but never sends it back to the device",
           find="            p.copy_(w.to(p.dtype).to(p.device))                  # cast on the host: 2 bytes go up, not 4\n",
           replace=""),
    Mutant("recompute.optimizer_offload", "no_bias_correction", "leaves out Adam's bias correction",
           find="            denominator = (v.sqrt() / math.sqrt(correction2)).add_(eps)\n"
                "            w.addcdiv_(m, denominator, value=-lr / correction1)\n",
           replace="            denominator = v.sqrt().add_(eps)\n"
                   "            w.addcdiv_(m, denominator, value=-lr)\n"),
    Mutant("recompute.optimizer_offload", "moments_like_params", "keeps the moments like the parameters: bf16 on the device",
           find="        self.exp_avg = [torch.zeros_like(w) for w in self.master]\n"
                "        self.exp_avg_sq = [torch.zeros_like(w) for w in self.master]\n",
           replace="        self.exp_avg = [torch.zeros_like(p) for p in self.params]\n"
                   "        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]\n"),
    Mutant("recompute.optimizer_offload", "global_step_count", "bias corrections from the optimizer's step count, not each parameter's",
           find="            correction1, correction2 = 1 - beta1 ** self.param_steps[i], 1 - beta2 ** self.param_steps[i]\n",
           replace="            correction1, correction2 = 1 - beta1 ** self.steps, 1 - beta2 ** self.steps\n"),
    Mutant("recompute.optimizer_offload", "coupled_weight_decay", "L2 in the gradient (Adam) instead of AdamW's decoupled decay",
           find="            w.mul_(1 - lr * weight_decay)\n",
           replace="            grad = grad + weight_decay * w\n"),
    Mutant("recompute.optimizer_offload", "master_in_param_dtype", "keeps the master in the parameter's dtype (bf16 master)",
           find="        self.master = [torch.empty(p.shape, dtype=torch.float32,",
           replace="        self.master = [torch.empty(p.shape, dtype=p.dtype,"),
    Mutant("recompute.optimizer_offload", "betas_swapped", "uses beta2 for the first moment and beta1 for the second",
           find="            m.lerp_(grad, 1 - beta1)\n            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)\n",
           replace="            m.lerp_(grad, 1 - beta2)\n            v.mul_(beta1).addcmul_(grad, grad, value=1 - beta1)\n"),
    Mutant("recompute.optimizer_offload", "fp32_up_the_link", "sends the fp32 master up and casts on the device: 4 bytes instead of 2",
           find="            self.moved_bytes += p.nbytes\n", replace="            self.moved_bytes += w.nbytes\n"),
]

# Automatic mutants (labkit mutate) that no test can kill, with the reason (labkit/course/automut.py).
EQUIVALENT = {
    "recompute.checkpoint/delete/d88e1f19": "CUDA RNG restore: runs only for CUDA inputs; graded on CPU (coverage exclusion too)",
    "recompute.checkpoint/swap/e226dc26": "CUDA RNG restore: runs only for CUDA inputs; graded on CPU (coverage exclusion too)",
    "recompute.checkpoint/delete/3610718a": "CUDA RNG restore: runs only for CUDA inputs; graded on CPU (coverage exclusion too)",
    "recompute.checkpoint/swap/a0f7aed6": "CUDA RNG restore: runs only for CUDA inputs; graded on CPU (coverage exclusion too)",
    "recompute.segments/swap/91d9a4c1": "min(i + k, L) and min(L, i + k) are the same value",
}

# recompute.chunked_ce
MUTANTS += [
    Mutant("recompute.chunked_ce", "incoming_grad_ignored", "backward scales by 1 / count only, not by the incoming "
           "gradient: right for loss.backward(), wrong for a scaled loss",
           find="        scale = grad / keep.sum()\n", replace="        scale = 1.0 / keep.sum()\n"),
    Mutant("recompute.chunked_ce", "mean_of_chunk_means", "averages each chunk's mean: wrong when chunks differ in kept tokens",
           find="            total = total + torch.where(keep[rows], lse[rows] - picked, 0.0).sum()\n",
           replace="            total = total + torch.where(keep[rows], lse[rows] - picked, 0.0).sum() / keep[rows].sum().clamp(min=1) * count / -(-n // chunk_size)\n"),
    Mutant("recompute.chunked_ce", "ignored_in_denominator", "divides by every token, ignored ones included",
           find="        return total / count\n", replace="        return total / n\n"),
    Mutant("recompute.chunked_ce", "ignored_in_gradient", "ignored rows still get a gradient",
           find="            g = g * torch.where(keep[rows], scale, 0.0).unsqueeze(1)\n",
           replace="            g = g * scale\n"),
    Mutant("recompute.chunked_ce", "keeps_all_logits", "builds the whole [N, V] logits and lets autograd keep them",
           find="        for start in range(0, n, chunk_size):\n            rows = slice(start, start + chunk_size)\n            logits = hidden[rows].float() @ w.T\n",
           replace="        full = hidden.float() @ w.T\n        for start in range(0, n, chunk_size):\n            rows = slice(start, start + chunk_size)\n            logits = full[rows]\n"),
    Mutant("recompute.chunked_ce", "no_max_subtraction", "log of the sum of exp without the row's max: overflows at 1e4",
           find="            lse[rows] = torch.logsumexp(logits, dim=-1)\n",
           replace="            lse[rows] = logits.exp().sum(-1).log()\n"),
    Mutant("recompute.chunked_ce", "bias_dropped", "ignores the bias in the loss",
           find="            logits = hidden[rows].float() @ w.T\n            if b is not None:\n                logits = logits + b\n",
           replace="            logits = hidden[rows].float() @ w.T\n"),
    Mutant("recompute.chunked_ce", "bias_dropped_in_backward", "recomputes the logits without the bias",
           find="            logits = h @ w.T\n            if b is not None:\n                logits = logits + b\n",
           replace="            logits = h @ w.T\n"),
    Mutant("recompute.chunked_ce", "last_partial_chunk_lost", "only whole chunks: the last rows are dropped",
           find="        for start in range(0, n, chunk_size):\n",
           replace="        for start in range(0, n - n % chunk_size, chunk_size):\n"),
    Mutant("recompute.chunked_ce", "no_weight_grad_accumulation", "grad_w of the last chunk only",
           find="            grad_w += g.T @ h\n", replace="            grad_w = g.T @ h\n"),
    Mutant("recompute.chunked_ce", "ignored_times_inf", "scales ignored rows too, then zeroes them: all ignored gives 0 x inf = nan gradients",
           find="            g = g * torch.where(keep[rows], scale, 0.0).unsqueeze(1)\n",
           replace="            g = g * scale * keep[rows].unsqueeze(1)\n"),
    Mutant("recompute.chunked_ce", "logits_in_input_dtype", "the matmul in the inputs' dtype, upcast after: bf16/fp16 logits lose digits",
           find="            logits = hidden[rows].float() @ w.T\n",
           replace="            logits = (hidden[rows] @ weight.T).float()\n"),
]

EQUIVALENT.update({
    "recompute.chunked_ce/int/bda9dc89": "the class index put in ignored rows (0 -> 1) is gathered and then masked out: any valid class gives the same loss",
    "recompute.chunked_ce/int/23b3aedb": "the class index put in ignored rows (0 -> 1) gets the -1 and then the row is zeroed: same gradient",
    "recompute.chunked_ce/int/12f1c335": "ones_like(g[:, :2]) as scatter_add_'s src: only the index's [rows, 1] part of src is read",
    "recompute.chunked_ce/delete/a25c5e08": "del logits in forward: the name is rebound next chunk; at most one more chunk alive at once, "
                                            "within the measured bound of 4 chunks (a constant, not growing with N)",
    "recompute.chunked_ce/delete/e2938dcb": "del logits in backward: freed when the chunk ends anyway; at most one more chunk alive, within the 4-chunk bound",
    "recompute.chunked_ce/delete/d3d767ea": "del g: rebound next chunk; at most one more chunk alive, within the 4-chunk bound",
})
