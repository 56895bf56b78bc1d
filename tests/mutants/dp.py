"""Wrong implementations of chapter 01 that the grader must fail (see labkit.course.mutants)."""

from labkit.course.mutants import Mutant

MUTANTS = [
    # dp.data_parallel: a batch smaller than the devices
    Mutant("dp.data_parallel", "one_chunk_per_device",
           "one chunk per device, always (torch.chunk returns fewer when the batch is smaller)",
           find="    num_chunks = len(tensors[0].chunk(len(devices)))\n",
           replace="    num_chunks = len(devices)\n"),
    Mutant("dp.data_parallel", "buffers_shared",
           "buffers are not trained: every replica uses the master's own buffer tensors",
           find="                for name, t in source.items():\n                    if t is not None:\n                        slots[name] = copy(t)",
           replace="                for name, t in source.items():\n                    if t is not None:\n"
                   "                        slots[name] = t if slots is replica._buffers else copy(t)"),
    # dp.sampler
    Mutant("dp.sampler", "floor_shard_size", "floor(len / replicas) per rank even without drop_last: the tail is lost",
           find="    return math.ceil(dataset_len / num_replicas)\n    # END SOLUTION",
           replace="    return dataset_len // num_replicas\n    # END SOLUTION"),
    Mutant("dp.sampler", "pads_once", "pads by appending the start of the order once: too short for a tiny dataset",
           find="order = (order * math.ceil(total / len(order)))[:total]",
           replace="order = (order + order[:total - len(order)])[:total]"),
    Mutant("dp.sampler", "contiguous_slices", "rank r takes a contiguous block instead of every N-th index",
           find="return order[rank:total:num_replicas]",
           replace="return order[rank * (total // num_replicas):(rank + 1) * (total // num_replicas)]"),
    Mutant("dp.sampler", "seed_without_epoch", "seeds the permutation with seed only: every epoch repeats epoch 0",
           find="gen = torch.Generator().manual_seed(seed + epoch)",
           replace="gen = torch.Generator().manual_seed(seed)"),
    Mutant("dp.sampler", "broadcasts_the_order", "rank 0 draws the permutation and broadcasts it to the others",
           find="        order = torch.randperm(dataset_len, generator=gen).tolist()\n",
           replace="        order_t = torch.randperm(dataset_len, generator=gen)\n"
                   "        dist.broadcast(order_t, src=0)\n"
                   "        order = order_t.tolist()\n"),
    Mutant("dp.sampler", "builtin", "wraps torch's DistributedSampler instead of writing the three rules",
           find="    # BEGIN SOLUTION dp.sampler: randperm",
           replace="    from torch.utils.data import DistributedSampler\n"
                   "    sampler = DistributedSampler(range(dataset_len), num_replicas, rank, shuffle, seed, drop_last)\n"
                   "    sampler.set_epoch(epoch)\n"
                   "    return list(sampler)\n"
                   "    # BEGIN SOLUTION dp.sampler: randperm"),
    # dp.grad_average
    Mutant("dp.grad_average", "weighted_counts_over_the_world",
           "the weighted path agrees on flags and sample counts over every rank, not over group=",
           find="    dist.all_reduce(meta, group=group)",
           replace="    dist.all_reduce(meta, group=None if num_samples is not None else group)"),
    Mutant("dp.grad_average", "no_division", "sums the gradients and forgets to divide by the total weight",
           find="        p.grad.div_(total)\n", replace=""),
    Mutant("dp.grad_average", "global_world_size", "divides by the world size, not by the group's (or the samples')",
           find="    total = meta[-1].item()",
           replace="    total = float(dist.get_world_size()) if num_samples is None else meta[-1].item()"),
    Mutant("dp.grad_average", "world_group", "ignores group=: reduces each gradient over every rank",
           find="        dist.all_reduce(p.grad, group=group)", replace="        dist.all_reduce(p.grad)"),
    Mutant("dp.grad_average", "unweighted", "divides by the total samples but never multiplies by its own count",
           find="        if num_samples is not None:\n            p.grad.mul_(weight)\n", replace=""),
    Mutant("dp.grad_average", "weight_in_its_own_all_reduce",
           "one all-reduce for the flags, then another one just for the weight",
           find="    dist.all_reduce(meta, group=group)\n",
           replace="    dist.all_reduce(meta, group=group)\n"
                   "    again = torch.tensor([weight], dtype=torch.float64, device=meta.device)\n"
                   "    dist.all_reduce(again, group=group)\n"),
    Mutant("dp.grad_average", "skips_own_none", "no agreement step: each rank skips the gradients it lacks itself",
           find="    dist.all_reduce(meta, group=group)\n    total = meta[-1].item()\n"
                "    for p, ranks_with_grad in zip(params, meta[:-1].tolist()):\n        if ranks_with_grad == 0:",
           replace="    total = float(dist.get_world_size(group)) if num_samples is None else weight * dist.get_world_size(group)\n"
                   "    for p, ranks_with_grad in zip(params, meta[:-1].tolist()):\n        if p.grad is None:"),
    Mutant("dp.grad_average", "reduces_in_float64", "all-reduces a float64 copy of every gradient: twice the bytes in fp32",
           find="        dist.all_reduce(p.grad, group=group)\n",
           replace="        wide = p.grad.double()\n        dist.all_reduce(wide, group=group)\n"
                   "        p.grad.copy_(wide)\n"),
    # dp.data_parallel
    Mutant("dp.data_parallel", "shares_parameters", "replicas hold the master's Parameters themselves, not copies",
           find="copied[id(t)] = t.to(device, copy=True)", replace="copied[id(t)] = t"),
    Mutant("dp.data_parallel", "detached_copies", "copies with .detach(): no gradient reaches the master",
           find="copied[id(t)] = t.to(device, copy=True)", replace="copied[id(t)] = t.detach().to(device, copy=True)"),
    Mutant("dp.data_parallel", "sequential_apply", "runs the replicas one after another in the caller's thread",
           find="    grad_enabled = torch.is_grad_enabled()\n    outputs: list = [None] * len(inputs)",
           replace="    return [r(*i) for r, i in zip(replicas, inputs)]\n"
                   "    grad_enabled = torch.is_grad_enabled()\n    outputs: list = [None] * len(inputs)"),
    Mutant("dp.data_parallel", "grad_mode_not_carried", "threads start with grad mode on, whatever the caller's",
           find="            with torch.set_grad_enabled(grad_enabled):\n                outputs[i] = replicas[i](*inputs[i])",
           replace="            outputs[i] = replicas[i](*inputs[i])"),
    Mutant("dp.data_parallel", "tensor_split_scatter", "splits with tensor_split: 3, 3, 2, 2 instead of chunk's 3, 3, 3, 1",
           find="[c.to(d) for c, d in zip(a.chunk(len(devices)), devices)]",
           replace="[c.to(d) for c, d in zip(a.tensor_split(len(devices)), devices)]"),
    Mutant("dp.data_parallel", "builtin", "calls torch.nn.parallel.replicate instead of copying the tree",
           find="    # BEGIN SOLUTION dp.data_parallel: per device",
           replace="    return torch.nn.parallel.replicate(module, devices)\n"
                   "    # BEGIN SOLUTION dp.data_parallel: per device"),
    # dp.parameter_server
    Mutant("dp.parameter_server", "unweighted_mean", "averages the workers' gradients without weighting by samples",
           find="            acc[0] += samples * grad\n            acc[1] += samples\n",
           replace="            acc[0] += grad\n            acc[1] += 1\n"),
    Mutant("dp.parameter_server", "grad_from_any_source",
           "receives the gradient from whoever sends next, not from the worker whose header it read",
           find="dist.recv(grad, src=sender, tag=GRAD_TAG)", replace="dist.recv(grad, tag=GRAD_TAG)"),
    Mutant("dp.parameter_server", "pulls_once", "the worker pulls the parameters once and keeps computing on them",
           find="        send_header(PULL, iteration)\n        version = recv_params(model)\n",
           replace="        if iteration == 0:\n            send_header(PULL, iteration)\n"
                   "            version = recv_params(model)\n"),
    Mutant("dp.parameter_server", "logs_the_servers_version",
           "logs each gradient with the server's version when it arrives, not the version it was computed on: "
           "the same while no update lands between a worker's pull and its push",
           find="            log.applied.append((sender, iteration, read_version))",
           replace="            log.applied.append((sender, iteration, version))"),
    Mutant("dp.parameter_server", "staleness_off_by_one", "answers a pull one version too early: s + 1 stale",
           find="            if version >= iteration - staleness:",
           replace="            if version >= iteration - staleness - 1:"),
    # Contracts (labkit.runtime.contracts): the same indices, the caller's RNG changed.
    Mutant("dp.sampler", "seeds_the_global_generator",
           "seeds torch's global generator for its permutation: right indices, every later dropout mask and init changed",
           find="        gen = torch.Generator().manual_seed(seed + epoch)\n        order = torch.randperm(dataset_len, generator=gen).tolist()",
           replace="        torch.manual_seed(seed + epoch)\n        order = torch.randperm(dataset_len).tolist()"),
]
