"""Wrong implementations of chapter 06 that the grader must fail (see labkit.course.mutants)."""

from labkit.course.mutants import Mutant

MUTANTS = [
    # pp.split
    Mutant("pp.split", "strict_limit", "fills a stage only while it stays strictly under the limit: "
           "the search settles on a worse split",
           find="total + costs[end] <= limit", replace="total + costs[end] < limit"),
    Mutant("pp.split", "layers_not_costs", "balances the number of blocks per stage, whatever they cost",
           find="    ranges = partition(costs, num_stages)",
           replace="    ranges = partition([1] * len(costs), num_stages)"),
    Mutant("pp.split", "last_flag_off_by_one", "last=(s == num_stages): no stage returns logits",
           find="last=s == num_stages - 1) for s, r", replace="last=s == num_stages) for s, r"),
    # pp.p2p
    Mutant("pp.p2p", "peer_without_group", "the next stage's rank computed without the group: "
           "right on the whole world, wrong on any sub-group",
           find="dst=peer(stage + 1, num_ranks, group), group=group,",
           replace="dst=peer(stage + 1, num_ranks), group=group,"),
    Mutant("pp.p2p", "default_group", "the right global peer, but the message goes over the default group",
           find="dst=peer(stage - 1, num_ranks, group), group=group,",
           replace="dst=peer(stage - 1, num_ranks, group),"),
    Mutant("pp.p2p", "recv_backward_from_previous", "the gradient received from the previous stage "
           "(copied from recv_forward)",
           find="src=peer(stage + 1, num_ranks, group), group=group, tag=message_tag(microbatch, stage, True)",
           replace="src=peer(stage - 1, num_ranks, group), group=group, tag=message_tag(microbatch, stage, True)"),
    Mutant("pp.p2p", "blocking_send", "waits for the send before returning: nothing overlaps it",
           find="""    return dist.isend(grad.contiguous(), dst=peer(stage - 1, num_ranks, group), group=group,
                      tag=message_tag(microbatch, stage - 1, True))""",
           replace="""    work = dist.isend(grad.contiguous(), dst=peer(stage - 1, num_ranks, group), group=group,
                      tag=message_tag(microbatch, stage - 1, True))
    work.wait()
    return work"""),
    Mutant("pp.p2p", "sender_stage_tag", "tags the activation with the sending stage, not the receiving one",
           find="tag=message_tag(microbatch, stage + 1, False))",
           replace="tag=message_tag(microbatch, stage, False))"),
    Mutant("pp.p2p", "shape_first", "sends the activation's shape first, then the activation: "
           "an extra message per micro-batch",
           find="""    return dist.isend(activation.contiguous(), dst=peer(stage + 1, num_ranks, group), group=group,
                      tag=message_tag(microbatch, stage + 1, False))""",
           replace="""    dist.isend(torch.tensor(activation.shape), dst=peer(stage + 1, num_ranks, group), group=group,
               tag=message_tag(microbatch, stage + 1, False))
    return dist.isend(activation.contiguous(), dst=peer(stage + 1, num_ranks, group), group=group,
                      tag=message_tag(microbatch, stage + 1, False))"""),
    Mutant("pp.p2p", "recv_not_waited", "posts the receive with irecv and returns the buffer before it arrives",
           find="    dist.recv(buffer, src=peer(stage - 1, num_ranks, group), group=group,",
           replace="    dist.irecv(buffer, src=peer(stage - 1, num_ranks, group), group=group,"),
    # pp.gpipe
    Mutant("pp.gpipe", "backward_reversed", "runs the backwards last micro-batch first",
           find='+ [Action("B", i, s) for i in range(m)]\n            for s in range(num_ranks)]',
           replace='+ [Action("B", i, s) for i in reversed(range(m))]\n            for s in range(num_ranks)]'),
    Mutant("pp.gpipe", "no_flush", "forward then backward of each micro-batch in turn: no pipelining",
           find='    return [[Action("F", i, s) for i in range(m)] + [Action("B", i, s) for i in range(m)]',
           replace='    return [[a for i in range(m) for a in (Action("F", i, s), Action("B", i, s))]'),
    Mutant("pp.gpipe", "microbatches_shared_out", "divides the micro-batches among the ranks, as data parallel would",
           find="    m = num_microbatches\n    return [[Action(\"F\"",
           replace="    m = max(1, num_microbatches // num_ranks)\n    return [[Action(\"F\""),
    # pp.1f1b
    Mutant("pp.1f1b", "warmup_off_by_one", "p - s warm-up forwards instead of p - s - 1: one micro-batch too many in flight",
           find="        warmup = min(p - 1 - s, m)\n        actions = [Action(\"F\", i, s) for i in range(warmup)]",
           replace="        warmup = min(p - s, m)\n        actions = [Action(\"F\", i, s) for i in range(warmup)]"),
    Mutant("pp.1f1b", "warmup_not_capped", "p - s - 1 warm-up forwards even when there are fewer micro-batches",
           find="        warmup = min(p - 1 - s, m)\n        actions = [Action(\"F\", i, s) for i in range(warmup)]",
           replace="        warmup = p - 1 - s\n        actions = [Action(\"F\", i, s) for i in range(warmup)]"),
    Mutant("pp.1f1b", "warmup_from_the_wrong_end", "the last stage warms up longest (s forwards instead of p - 1 - s)",
           find="        warmup = min(p - 1 - s, m)\n        actions = [Action(\"F\", i, s) for i in range(warmup)]",
           replace="        warmup = min(s, m)\n        actions = [Action(\"F\", i, s) for i in range(warmup)]"),
    Mutant("pp.1f1b", "backward_first_in_steady_state", "steady state B then F instead of F then B",
           find='            actions += [Action("F", warmup + j, s), Action("B", j, s)]',
           replace='            actions += [Action("B", j, s), Action("F", warmup + j, s)]'),
    # pp.interleaved
    Mutant("pp.interleaved", "torch_schedule", "takes the order from torch.distributed.pipelining's "
           "ScheduleInterleaved1F1B (the same tables, not built)",
           find="    p, m, v = num_ranks, num_microbatches, num_chunks\n    total = m * v\n",
           replace="""    from types import SimpleNamespace
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B
    p, m, v = num_ranks, num_microbatches, num_chunks
    shape = SimpleNamespace(n_local_stages=v, pp_group_size=p, microbatches_per_round=p, _n_microbatches=m)
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B"}
    return [[Action(kinds[a.computation_type.name], a.microbatch_index, a.stage_index)
             for a in ScheduleInterleaved1F1B._calculate_single_rank_operations(shape, r) if a is not None]
            for r in range(p)]
    total = m * v
"""),
    Mutant("pp.interleaved", "contiguous_chunks", "rank r holds stages r v .. r v + v - 1 instead of r, r + p, ...",
           find="""        return Action("F", (k // (p * v)) * p + k % p, ((k // p) % v) * p + r)

    def backward(k: int, r: int) -> Action:
        return Action("B", (k // (p * v)) * p + k % p, (v - 1 - (k // p) % v) * p + r)""",
           replace="""        return Action("F", (k // (p * v)) * p + k % p, r * v + (k // p) % v)

    def backward(k: int, r: int) -> Action:
        return Action("B", (k // (p * v)) * p + k % p, r * v + v - 1 - (k // p) % v)"""),
    Mutant("pp.interleaved", "warmup_one_per_hop", "warm-up (v - 1) p + (p - 1 - r): one forward per hop instead of two",
           find="warmup = min((v - 1) * p + 2 * (p - 1 - r), total)",
           replace="warmup = min((v - 1) * p + (p - 1 - r), total)"),
    Mutant("pp.interleaved", "backward_chunks_not_reversed", "backwards visit the chunks first to last, like the forwards",
           find='return Action("B", (k // (p * v)) * p + k % p, (v - 1 - (k // p) % v) * p + r)',
           replace='return Action("B", (k // (p * v)) * p + k % p, ((k // p) % v) * p + r)'),
    # pp.zero_bubble
    Mutant("pp.zero_bubble", "w_before_its_b", "puts W(j - s) before B(j) instead of after it",
           find="""            out.append(action)
            if action.kind == "B" and action.microbatch >= s:
                out.append(Action("W", action.microbatch - s, s))
                next_w += 1""",
           replace="""            if action.kind == "B" and action.microbatch >= s:
                out.append(Action("W", action.microbatch - s, s))
                next_w += 1
            out.append(action)"""),
    Mutant("pp.zero_bubble", "trailing_ws_missing", "forgets the W's still pending at the end",
           find="        out += [Action(\"W\", i, s) for i in range(next_w, num_microbatches)]\n",
           replace=""),
    Mutant("pp.zero_bubble", "w_right_after_b", "W(j) straight after B(j): 1F1B with a split backward, no bubble filled",
           find="""            if action.kind == "B" and action.microbatch >= s:
                out.append(Action("W", action.microbatch - s, s))""",
           replace="""            if action.kind == "B":
                out.append(Action("W", action.microbatch, s))"""),
    Mutant("pp.zero_bubble", "w_delay_off_by_one", "W(i) after B(i + s + 1): one W too many pending",
           find="""            if action.kind == "B" and action.microbatch >= s:
                out.append(Action("W", action.microbatch - s, s))""",
           replace="""            if action.kind == "B" and action.microbatch > s:
                out.append(Action("W", action.microbatch - s - 1, s))"""),
    # Issue 39: what the drawn configurations (tests/grading/test_pp.py) kill
    Mutant("pp.p2p", "recv_shape_from_the_first_call",
           "recv_forward allocates its buffer with the shape and dtype of its first call (cached on the function)",
           find="    buffer = torch.empty(shape, dtype=dtype, device=device)\n"
                "    dist.recv(buffer, src=peer(stage - 1, num_ranks, group), group=group, tag=message_tag(microbatch, stage, False))",
           replace="    first = recv_forward.__dict__.setdefault('first', (shape, dtype))\n"
                   "    buffer = torch.empty(first[0], dtype=first[1], device=device)\n"
                   "    dist.recv(buffer, src=peer(stage - 1, num_ranks, group), group=group, tag=message_tag(microbatch, stage, False))"),
    Mutant("pp.1f1b", "warmup_capped_at_four",
           "1F1B's warm-up min(p - 1 - s, m, 3): right for the pipelines of up to 4 ranks the examples use",
           find="        warmup = min(p - 1 - s, m)",
           replace="        warmup = min(p - 1 - s, m, 3)"),
]
