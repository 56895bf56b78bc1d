"""Wrong implementations of chapter 10 that the grader must fail (see labkit.course.mutants)."""

from labkit.course.mutants import Mutant

MUTANTS = [
    # moe.router
    Mutant("moe.router", "no_renormalise", "keeps the raw top-k probabilities: the gate weights do not sum to 1",
           find="    weights, experts = probs.topk(k, dim=-1)\n    if k > 1:\n        weights = weights / weights.sum(dim=-1, keepdim=True)\n", replace="    weights, experts = probs.topk(k, dim=-1)\n"),
    Mutant("moe.router", "aux_without_E", "drops the factor E: the balanced loss is 1/E instead of 1",
           find="return num_experts * (fraction * probs.mean(dim=0)).sum()",
           replace="return (fraction * probs.mean(dim=0)).sum()"),
    Mutant("moe.router", "z_square_of_mean", "squares the mean logsumexp instead of averaging the squares",
           find="torch.logsumexp(logits, dim=-1).pow(2).mean()", replace="torch.logsumexp(logits, dim=-1).mean().pow(2)"),
    # moe.capacity
    Mutant("moe.capacity", "floor", "rounds C k T / E down: an expert takes fewer tokens than its capacity",
           find="math.ceil(capacity_factor * k * tokens / num_experts)",
           replace="int(capacity_factor * k * tokens / num_experts)"),
    Mutant("moe.capacity", "one_extra", "position <= capacity: each expert keeps one token too many",
           find="(position < capacity)", replace="(position <= capacity)"),
    Mutant("moe.capacity", "slot_major", "serves every token's first choice before any second choice (not the stated rule)",
           find="    flat = experts.reshape(-1)\n", replace="    flat = experts.t().reshape(-1)\n"),
    # moe.dispatch
    Mutant("moe.dispatch", "counts_by_all_gather", "gathers every rank's counts and slices its own: E x N int64s instead of E",
           find="    dist.all_to_all_single(received, counts.contiguous(), group=group)\n",
           replace="    gathered = counts.new_empty(n * counts.numel())\n"
                   "    dist.all_gather_into_tensor(gathered, counts.contiguous(), group=group)\n"
                   "    mine = counts.numel() // n * dist.get_rank(group)\n"
                   "    received = gathered.view(n, -1)[:, mine:mine + counts.numel() // n].reshape(-1)\n"),
    Mutant("moe.dispatch", "extra_barrier", "a barrier after each all-to-all 'to be safe': one more collective",
           find="        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)\n",
           replace="        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)\n"
                   "        dist.barrier(group=group)\n"),
    Mutant("moe.dispatch", "counts_transposed", "reads the received counts as [E/N, N]: sources and experts swapped",
           find="return received.view(n, -1)", replace="return received.view(-1, n).t()"),
    # moe.layer
    Mutant("moe.layer", "no_gate_weight", "adds the expert outputs without the gate weights",
           find="unsorted * plan.weight_of.unsqueeze(1)", replace="unsorted"),
    Mutant("moe.layer", "permutation_not_inverted", "applies the sort permutation again instead of its inverse",
           find="unsorted = torch.empty_like(back).index_copy(0, plan.order, back)", replace="unsorted = back[plan.order]"),
    Mutant("moe.layer", "no_regroup", "runs the received rows in arrival order: rows of other sources reach the wrong expert",
           find="by_expert = torch.argsort(local_expert, stable=True)",
           replace="by_expert = torch.arange(local_expert.numel())"),
    # moe.ep_dp
    Mutant("moe.ep_dp", "experts_over_world", "averages expert gradients over the world: different experts' gradients mixed",
           find="group=grid.group(DP_AXIS) if id(p) in experts else None", replace="group=None"),
    Mutant("moe.ep_dp", "experts_divided_by_dp", "divides expert gradients by dp, forgetting each copy already holds ep ranks' tokens",
           find="        p.grad /= n\n",
           replace="        p.grad /= grid.degrees[DP_AXIS] if id(p) in experts else n\n"),
    Mutant("moe.ep_dp", "dense_over_dp_group", "averages dense gradients over the DP group only: EP ranks drift apart",
           find="group=grid.group(DP_AXIS) if id(p) in experts else None",
           replace="group=grid.group(DP_AXIS)"),
    Mutant("moe.ep_dp", "axes_swapped", "puts EP on the slow axis and DP on the fast one: EP groups no longer consecutive ranks",
           find="return RankGrid(world_size, dp=dp, tp=ep)", replace="return RankGrid(world_size, dp=ep, tp=dp)"),
    Mutant("moe.ep_dp", "experts_not_averaged", "leaves expert gradients as the EP backward left them: no all-reduce over the DP group",
           find="        dist.all_reduce(p.grad, group=grid.group(DP_AXIS) if id(p) in experts else None)\n        p.grad /= n\n",
           replace="        if id(p) not in experts:\n            dist.all_reduce(p.grad)\n            p.grad /= n\n"),
]

# Wrong implementations the first version of the tests (defaults only: the world group, float64,
# k = 2 in the layer, no frozen parameter, ordinary logits) let through; each names what the
# reshaped tests exercise to kill it.
MUTANTS += [
    # moe.router
    Mutant("moe.router", "k1_renormalised", "renormalises at k = 1 too: every weight is 1, the router learns nothing "
           "from the task loss (k = 1 must keep the probability, as Switch does)",
           find="    weights, experts = probs.topk(k, dim=-1)\n    if k > 1:\n        weights = weights / weights.sum(dim=-1, keepdim=True)\n",
           replace="    weights, experts = probs.topk(k, dim=-1)\n    weights = weights / weights.sum(dim=-1, keepdim=True)\n"),
    Mutant("moe.router", "softmax_over_topk_logits", "Mixtral's form, softmax over the k chosen logits: the same for "
           "k >= 2, a constant weight of 1 at k = 1",
           find="    weights, experts = probs.topk(k, dim=-1)\n    if k > 1:\n        weights = weights / weights.sum(dim=-1, keepdim=True)\n",
           replace="    top_logits, experts = logits.topk(k, dim=-1)\n    weights = top_logits.softmax(dim=-1)\n"),
    Mutant("moe.router", "naive_softmax", "softmax as exp / sum exp without subtracting the max: NaN once logits "
           "overflow exp (about 89 in float32)",
           find="    probs = logits.softmax(dim=-1)\n    weights, experts = probs.topk(k, dim=-1)\n",
           replace="    probs = logits.exp() / logits.exp().sum(dim=-1, keepdim=True)\n    weights, experts = probs.topk(k, dim=-1)\n"),
    Mutant("moe.router", "naive_z_loss", "log(sum(exp)) instead of logsumexp: inf once logits overflow exp",
           find="return torch.logsumexp(logits, dim=-1).pow(2).mean()",
           replace="return logits.exp().sum(dim=-1).log().pow(2).mean()"),
    Mutant("moe.router", "router_in_fp32", "computes the router in (at least) float32 'for stability' and returns "
           "float32 logits, probs and weights for bfloat16 / float16 tokens",
           find="no gradient)\n    logits = x @ gate_weight.t()\n",
           replace="no gradient)\n    wide = torch.promote_types(x.dtype, torch.float32)\n"
                   "    logits = x.to(wide) @ gate_weight.to(wide).t()\n"),
    Mutant("moe.router", "bincount_no_minlength", "bincount without minlength: f is shorter than P when the last "
           "experts get no choice, and broadcasts into the wrong loss",
           find="torch.bincount(experts.reshape(-1), minlength=num_experts)",
           replace="torch.bincount(experts.reshape(-1))"),
    # moe.capacity
    Mutant("moe.capacity", "float_capacity", "ceil by floor division of negatives: a float (7.0), not the int row count",
           find="return math.ceil(capacity_factor * k * tokens / num_experts)",
           replace="return -(-capacity_factor * k * tokens // num_experts)"),
    Mutant("moe.capacity", "k_hardcoded_2", "reshapes the mask to [T, 2]: right only for top-2",
           find="return (position < capacity).reshape(experts.shape)",
           replace="return (position < capacity).reshape(-1, 2)"),
    # moe.dispatch
    Mutant("moe.dispatch", "backward_on_world", "the backward all-to-all forgets the group: right only on the world",
           find="return AllToAll.forward(ctx, grad, input_splits, output_splits, ctx.group)",
           replace="return AllToAll.forward(ctx, grad, input_splits, output_splits, None)"),
    Mutant("moe.dispatch", "counts_on_world", "exchange_counts runs on the world, not the group",
           find="    dist.all_to_all_single(received, counts.contiguous(), group=group)\n",
           replace="    dist.all_to_all_single(received, counts.contiguous())\n"),
    Mutant("moe.dispatch", "forward_on_world", "the forward all-to-all forgets the group: right only on the world",
           find="dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)",
           replace="dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits)"),
    Mutant("moe.dispatch", "not_contiguous", "sends x as it is: a strided view goes out as its underlying storage",
           find="dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)",
           replace="dist.all_to_all_single(out, x, output_splits, input_splits, group=group)"),
    # moe.layer
    Mutant("moe.layer", "dispatch_on_world", "dispatches over the world instead of the layer's group",
           find="rows = AllToAll.apply(tokens[plan.token_of[plan.order]], plan.recv_splits, plan.send_splits, self.group)",
           replace="rows = AllToAll.apply(tokens[plan.token_of[plan.order]], plan.recv_splits, plan.send_splits, None)"),
    Mutant("moe.layer", "counts_on_world", "exchanges the counts over the world instead of the layer's group",
           find="received = exchange_counts(counts, group)", replace="received = exchange_counts(counts)"),
    Mutant("moe.layer", "routed_rows_swapped", "records (received, sent) in routed_rows",
           find="        self.routed_rows = (sum(plan.send_splits), sum(plan.recv_splits))\n        # END SOLUTION\n        return y.reshape(shape), aux\n\n\nclass DispatchPlan",
           replace="        self.routed_rows = (sum(plan.recv_splits), sum(plan.send_splits))\n        # END SOLUTION\n        return y.reshape(shape), aux\n\n\nclass DispatchPlan"),
    Mutant("moe.layer", "k_hardcoded_2", "each token's choices as token index repeated twice: right only for top-2",
           find="token_of = torch.arange(experts.shape[0]).unsqueeze(1).expand_as(experts)[keep]",
           replace="token_of = torch.arange(experts.shape[0]).repeat_interleave(2)[keep.reshape(-1)]"),
    Mutant("moe.layer", "regroup_cached", "computes the regrouping permutation once and keeps it: right until a "
           "call brings another number of rows",
           find="    by_expert = torch.argsort(local_expert, stable=True)\n",
           replace="    global _by_expert\n    if '_by_expert' not in globals():\n"
                   "        _by_expert = torch.argsort(local_expert, stable=True)\n    by_expert = _by_expert\n"),
    # moe.ep_dp
    Mutant("moe.ep_dp", "frozen_not_skipped", "all-reduces every parameter's .grad: a frozen or unused one has None",
           find="        if p.grad is None:\n            continue\n", replace=""),
    Mutant("moe.ep_dp", "reverse_order", "all-reduces in reverse parameter order (as DDP's buckets do), not in "
           "model.parameters() order as the docstring states",
           find="    for p in model.parameters():\n        if p.grad is None:",
           replace="    for p in reversed(list(model.parameters())):\n        if p.grad is None:"),
    # moe.bias_balance
    Mutant("moe.bias_balance", "bias_in_weights", "adds the bias to the gate weights too: the bias changes the output and the gate's gradient",
           find="    weights = probs.gather(-1, experts)\n",
           replace="    weights = (probs + bias.to(probs.dtype)).gather(-1, experts)\n"),
    Mutant("moe.bias_balance", "bias_ignored", "chooses on the unbiased probabilities: the bias never balances anything",
           find="(probs.float() + bias.float()).topk(k, dim=-1)",
           replace="probs.float().topk(k, dim=-1)"),
    Mutant("moe.bias_balance", "sign_flipped", "raises over-loaded experts and lowers under-loaded ones",
           find="torch.sign(load.mean() - load)", replace="torch.sign(load - load.mean())"),
    Mutant("moe.bias_balance", "local_counts", "updates from this rank's counts alone: ranks' biases drift apart",
           find="        dist.all_reduce(load, group=self.group)\n", replace=""),
    Mutant("moe.bias_balance", "group_ignored", "sums the counts over the world, not the group",
           find="dist.all_reduce(load, group=self.group)", replace="dist.all_reduce(load)"),
    Mutant("moe.bias_balance", "difference_not_sign", "bias += gamma (mean - load): the step grows with the imbalance",
           find="torch.sign(load.mean() - load)", replace="(load.mean() - load)"),
    Mutant("moe.bias_balance", "update_per_call", "issue 42's bug: route updates the bias at every call (per micro-batch, "
           "and again in the recompute, which then chooses other experts than the forward)",
           find="        if torch.is_grad_enabled():\n            self.count(out[0])\n",
           replace="        self.count(out[0])\n        self.update()\n"),
    Mutant("moe.bias_balance", "update_before_route", "counts and updates with this call's choices, then routes again with the new bias",
           find="        out = route(x, gate_weight, k, bias=self.bias)\n        if torch.is_grad_enabled():\n",
           replace="        self.count(route(x, gate_weight, k, bias=self.bias)[0])\n        self.update()\n"
                   "        out = route(x, gate_weight, k, bias=self.bias)\n        if torch.is_grad_enabled():\n"),
    Mutant("moe.bias_balance", "count_every_routing", "counts under no_grad too: a checkpointed layer's tokens counted twice "
           "(forward and recompute), an evaluation forward's counted as training",
           find="        if torch.is_grad_enabled():\n            self.count(out[0])\n",
           replace="        self.count(out[0])\n"),
    Mutant("moe.bias_balance", "counts_kept", "never zeroes the counts: every update sees the load of all steps so far",
           find="        self.counts.zero_()\n", replace=""),
    Mutant("moe.bias_balance", "counts_replaced", "count() keeps only the last routing's choices (=, not +=): earlier micro-batches lost",
           find="        self.counts += torch.bincount(experts.reshape(-1), minlength=self.num_experts)\n",
           replace="        self.counts = torch.bincount(experts.reshape(-1), minlength=self.num_experts)\n"),
    Mutant("moe.bias_balance", "always_renormalise", "renormalises the k = 1 weight too: always 1, no router gradient",
           find="    if k > 1:\n        weights = weights / weights.sum(dim=-1, keepdim=True)\n    return experts, weights, probs, logits\n    # END SOLUTION\n\n\nclass BiasBalancer",
           replace="    weights = weights / weights.sum(dim=-1, keepdim=True)\n    return experts, weights, probs, logits\n    # END SOLUTION\n\n\nclass BiasBalancer"),
    Mutant("moe.bias_balance", "mean_over_tokens", "the mean load counted per rank (divides the global load by N): ties and signs shift",
           find="torch.sign(load.mean() - load)", replace="torch.sign(load.mean() / dist.get_world_size(self.group) - load)"),
    Mutant("moe.bias_balance", "bias_in_selection_dtype", "adds the bias in the input's dtype (bfloat16/float16): near choices round together",
           find="(probs.float() + bias.float()).topk(k, dim=-1).indices", replace="(probs + bias.to(probs.dtype)).topk(k, dim=-1).indices"),
]

# moe.shared_overlap
MUTANTS += [
    Mutant("moe.shared_overlap", "wait_at_once", "waits on the all-to-all right after posting it: the shared experts "
           "run after it arrived, nothing is hidden (right numbers, no overlap)",
           find="        work = dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group, async_op=True)\n",
           replace="        work = dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group, async_op=True)\n"
                   "        work.wait()\n"),
    Mutant("moe.shared_overlap", "shared_before_post", "runs the shared experts first, then a blocking all-to-all: "
           "the same numbers and bytes, nothing in flight while they compute",
           find="        work = dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group, async_op=True)\n"
                "        ctx.side_inputs = [t.detach().requires_grad_(t.requires_grad) for t in side_inputs]\n"
                "        with torch.enable_grad():  # a Function's forward runs without grad: record the side's graph\n"
                "            ctx.side_output = side_fn(*ctx.side_inputs)\n",
           replace="        ctx.side_inputs = [t.detach().requires_grad_(t.requires_grad) for t in side_inputs]\n"
                   "        with torch.enable_grad():\n"
                   "            ctx.side_output = side_fn(*ctx.side_inputs)\n"
                   "        work = dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group, async_op=True)\n"),
    Mutant("moe.shared_overlap", "backward_not_overlapped", "overlaps forward only: backward waits on the reverse "
           "all-to-all before computing the shared experts' gradients",
           find="        wanted = [t for t in ctx.side_inputs if t.requires_grad]\n",
           replace="        work.wait()\n        wanted = [t for t in ctx.side_inputs if t.requires_grad]\n"),
    Mutant("moe.shared_overlap", "shared_added_twice", "adds the shared output twice (once as the index_add's base, once more)",
           find="y = combine(back, plan, shared)", replace="y = shared + combine(back, plan, shared)"),
    Mutant("moe.shared_overlap", "recompute_before_post", "recomputes the shared experts' forward in backward (to "
           "keep no activations) before posting the reverse all-to-all: those FLOPs are not hidden",
           find="        work.wait()\n        return out, ctx.side_output.detach()\n        # END SOLUTION\n\n"
                "    @staticmethod\n    def backward(ctx, grad_out, grad_side):\n",
           replace="        work.wait()\n        ctx.side_fn = side_fn\n        return out, ctx.side_output.detach()\n        # END SOLUTION\n\n"
                   "    @staticmethod\n    def backward(ctx, grad_out, grad_side):\n"
                   "        with torch.enable_grad():\n"
                   "            ctx.side_output = ctx.side_fn(*ctx.side_inputs)\n"),
    Mutant("moe.shared_overlap", "shared_as_a_choice", "weights the shared experts like one more routed choice, "
           "1/(k+1), instead of adding them with weight 1 (DeepSeekMoE)",
           find="y = combine(back, plan, shared)", replace="y = combine(back, plan, shared / (self.k + 1))"),
    Mutant("moe.shared_overlap", "shared_skipped_in_backward", "returns no gradient for the side inputs: the shared "
           "experts are never trained and the tokens miss their gradient through them",
           find="        return (grad_x, None, None, None, None) + tuple(next(grads) if t.requires_grad else None\n",
           replace="        return (grad_x, None, None, None, None) + tuple(None if t.requires_grad else None\n"),
    Mutant("moe.shared_overlap", "backward_on_world", "the backward all-to-all forgets the group: right only on the world",
           find="                                      group=ctx.group, async_op=True)",
           replace="                                      group=None, async_op=True)"),
    Mutant("moe.shared_overlap", "side_not_detached", "runs the side on the original inputs: an input passed twice "
           "is one tensor in torch.autograd.grad's list, and each use gets the gradient of both",
           find="ctx.side_inputs = [t.detach().requires_grad_(t.requires_grad) for t in side_inputs]",
           replace="ctx.side_inputs = [t.requires_grad_(t.requires_grad) for t in side_inputs]"),
    Mutant("moe.shared_overlap", "grad_not_contiguous", "sends the incoming gradient as it is: a strided gradient "
           "goes out as its underlying storage",
           find="grad_x, grad_out.contiguous(), input_splits", replace="grad_x, grad_out, input_splits"),
    Mutant("moe.shared_overlap", "all_shared_in_dispatch", "runs the whole shared MLP behind the dispatch and a plain "
           "all-to-all for the combine: the combine (and its reverse) hides nothing",
           find="        back, shared = AllToAllOverlap.apply(results, plan.send_splits, plan.recv_splits, self.group,\n"
                "                                             shared_fc2, hidden, self.shared_w2)\n",
           replace="        shared = shared_fc2(hidden, self.shared_w2)\n"
                   "        back = AllToAll.apply(results, plan.send_splits, plan.recv_splits, self.group)\n"),
]

# Automatic mutants (labkit mutate moe) that change nothing a learner could get wrong.
EQUIVALENT = {
    "moe.layer/bool/c3eb7bf4": "argsort(expert_of, stable=False): the rows of one expert may leave in another order, "
                               "but combine un-permutes with the same `order` (index_copy) and an expert's MLP acts "
                               "row by row, so y, aux and every gradient are the same (w1/w2 gradients summed in "
                               "another order: rounding only)",
    "moe.layer/bool/7319cc33": "argsort(local_expert, stable=False): the regrouping by local expert is undone by "
                               "index_copy with the same `by_expert`, and rows within an expert are independent: "
                               "the same outputs and gradients up to summation order",
}

# Wrong implementations that the fixed cases let through and the drawn configurations
# (issue 39: ties, saturating logits, the tokens' gradient, other splits, exact boundaries) kill.
MUTANTS += [
    # moe.router
    Mutant("moe.router", "tokens_detached", "routes on x.detach() 'the router only trains the gate': the tokens get "
           "no gradient through the gate weights",
           find="no gradient)\n    logits = x @ gate_weight.t()\n", replace="no gradient)\n    logits = x.detach() @ gate_weight.t()\n"),
    Mutant("moe.router", "argmax_zero_masking", "picks the k experts by repeated argmax, masking each pick with 0: "
           "once probabilities underflow to 0 the same expert is picked again",
           find="    weights, experts = probs.topk(k, dim=-1)\n    if k > 1:\n        weights = weights / weights.sum(dim=-1, keepdim=True)\n    return experts, weights, probs, logits\n    # END SOLUTION\n\n\ndef biased_route",
           replace="    masked, picks = probs.detach().clone(), []\n    for _ in range(k):\n"
                   "        picks.append(masked.argmax(dim=-1))\n        masked.scatter_(-1, picks[-1].unsqueeze(-1), 0.0)\n"
                   "    experts = torch.stack(picks, dim=-1)\n    weights = probs.gather(-1, experts)\n"
                   "    if k > 1:\n        weights = weights / weights.sum(dim=-1, keepdim=True)\n    return experts, weights, probs, logits\n"
                   "    # END SOLUTION\n\n\ndef biased_route"),
]
MUTANTS += [
    # moe.capacity
    Mutant("moe.capacity", "divide_first", "ceil(T / E * k * C): the same formula in another order, one row too many "
           "where C k T / E is an exact integer and T / E is not exact in binary (T=29, E=7, k=7, C=1: 30, not 29)",
           find="return math.ceil(capacity_factor * k * tokens / num_experts)",
           replace="return math.ceil(tokens / num_experts * k * capacity_factor)"),
    Mutant("moe.capacity", "view_not_reshape", "flattens the choices with view(-1): refuses a [T, k] table that is not "
           "row-major (a transposed or sliced one)",
           find="    flat = experts.reshape(-1)\n    one_hot", replace="    flat = experts.view(-1)\n    one_hot"),
    Mutant("moe.capacity", "capped_at_tokens", "caps the capacity at T 'an expert never takes a token twice': the "
           "documented ceil(C k T / E) is larger once C k > E",
           find="return math.ceil(capacity_factor * k * tokens / num_experts)",
           replace="return min(tokens, math.ceil(capacity_factor * k * tokens / num_experts))"),
]
MUTANTS += [
    # moe.dispatch
    Mutant("moe.dispatch", "splits_on_class", "keeps the split sizes on the class, not on ctx: right for one call "
           "at a time, wrong once two calls (dispatch and combine) run forward before either backward",
           find="        ctx.splits, ctx.group = (output_splits, input_splits), group\n"
                "        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))\n"
                "        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)\n"
                "        return out\n        # END SOLUTION\n\n    @staticmethod\n    def backward(ctx, grad):\n"
                "        # BEGIN SOLUTION moe.dispatch: the same all-to-all with the split lists swapped\n"
                "        output_splits, input_splits = ctx.splits\n",
           replace="        AllToAll.splits, ctx.group = (output_splits, input_splits), group\n"
                   "        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))\n"
                   "        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)\n"
                   "        return out\n        # END SOLUTION\n\n    @staticmethod\n    def backward(ctx, grad):\n"
                   "        # BEGIN SOLUTION moe.dispatch: the same all-to-all with the split lists swapped\n"
                   "        output_splits, input_splits = AllToAll.splits\n"),
]
