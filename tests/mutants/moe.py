"""Wrong implementations of chapter 10 that the grader must fail (see labkit.course.mutants)."""

from labkit.course.mutants import Mutant

MUTANTS = [
    # moe.router
    Mutant("moe.router", "no_renormalise", "keeps the raw top-k probabilities: the gate weights do not sum to 1",
           find="    weights = weights / weights.sum(dim=-1, keepdim=True)\n", replace=""),
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
           find="unsorted * weight_of.unsqueeze(1)", replace="unsorted"),
    Mutant("moe.layer", "permutation_not_inverted", "applies the sort permutation again instead of its inverse",
           find="unsorted = torch.empty_like(back).index_copy(0, order, back)", replace="unsorted = back[order]"),
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
