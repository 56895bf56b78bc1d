"""Wrong implementations of chapter 13 that the grader must fail (see labkit.course.mutants).

The second half (after "what the first tests missed") are wrong versions that kept full marks
under the earlier tests, which traced only the module's own wrappers, used equal shards, plain
SGD, staleness bounds 0 and 1, two stages and three micro-batches, and never forced an
interleaving (issue 32)."""

from labkit.course.mutants import Mutant

_PUSH_UPDATE = '''            while self.version in self.rounds and self.rounds[self.version][1] == self.num_trainers:
                sums, _, total_rows = self.rounds.pop(self.version)
                for p, total in zip(self.model.parameters(), sums):
                    p.grad = total / total_rows if p.requires_grad else None
                self.optimizer.step()
                self.version += 1
            ready = [(it, f) for it, f in self.waiting if self.version >= it - self.staleness]
            self.waiting = [(it, f) for it, f in self.waiting if self.version < it - self.staleness]
            answer = self.snapshot() if ready else None
'''

MUTANTS = [
    # rpc.remote_ps
    Mutant("rpc.remote_ps", "local_autograd", "calls loss.backward() (local autograd) instead of dist_autograd.backward: "
           "the gradient never crosses the RPC to the server's parameters",
           find="        dist_autograd.backward(context_id, [loss])\n        optimizer.step(context_id)\n",
           replace="        loss.backward()\n        optimizer.step(context_id)\n"),
    Mutant("rpc.remote_ps", "step_before_backward", "steps the optimizer before the backward pass: the context holds no gradient yet",
           find="        dist_autograd.backward(context_id, [loss])\n        optimizer.step(context_id)\n",
           replace="        optimizer.step(context_id)\n        dist_autograd.backward(context_id, [loss])\n"),
    Mutant("rpc.remote_ps", "gradients_after_context", "fetches the server's gradients after the context closed: they are gone",
           find="        dist_autograd.backward(context_id, [loss])\n        return rpc_sync(server.owner(), server_gradients, server, context_id)\n",
           replace="        dist_autograd.backward(context_id, [loss])\n    return rpc_sync(server.owner(), server_gradients, server, context_id)\n"),
    # rpc.batching_ps
    Mutant("rpc.batching_ps", "update_per_trainer", "applies an update as soon as one gradient of the iteration is in, not once all n are",
           find="self.rounds[self.version][1] == self.num_trainers:", replace="self.rounds[self.version][1] >= 1:"),
    Mutant("rpc.batching_ps", "sum_not_mean", "applies the rows-weighted SUM of the gradients: missing the 1/rows, B times the step",
           find="p.grad = total / total_rows if p.requires_grad else None", replace="p.grad = total if p.requires_grad else None"),
    Mutant("rpc.batching_ps", "staleness_off_by_one", "lets a trainer run staleness + 1 versions ahead",
           find="            elif self.version >= iteration - self.staleness:\n",
           replace="            elif self.version >= iteration - self.staleness - 1:\n"),
    Mutant("rpc.batching_ps", "staleness_strict", "answers only when version > iteration - staleness: one version too cautious",
           find="            elif self.version >= iteration - self.staleness:\n",
           replace="            elif self.version > iteration - self.staleness:\n"),
    Mutant("rpc.batching_ps", "logs_received_version", "reports the version just received instead of the one the gradient was computed on",
           find="        versions.append(version)\n        params, version = rpc_sync(owner, BatchingServer.push_and_pull, server, trainer, iteration, version, grads,\n"
                "                                   len(x))\n",
           replace="        params, version = rpc_sync(owner, BatchingServer.push_and_pull, server, trainer, iteration, version + 1, grads,\n"
                   "                                   len(x))\n        versions.append(version)\n"),
    # rpc.pipeline
    Mutant("rpc.pipeline", "no_overlap", "waits for each micro-batch's output before sending the next: the stages never overlap",
           find="            futures.append(rpc_async(last.owner(), stage_forward, last, value))\n",
           replace="            futures.append(rpc_async(last.owner(), stage_forward, last, value))\n            futures[-1].wait()\n"),
    Mutant("rpc.pipeline", "relay_through_driver", "brings each activation back to the driver (rpc_sync) and sends it on: "
           "twice the bytes through the driver",
           find="                value = remote(stage.owner(), stage_forward, stage, value)\n",
           replace="                value = rpc_sync(stage.owner(), stage_forward, stage, value)\n"),
    Mutant("rpc.pipeline", "one_micro_batch", "sends the whole batch as one micro-batch: nothing to overlap",
           find="        for micro_batch in x.tensor_split(self.micro_batches):\n",
           replace="        for micro_batch in [x]:\n"),

    # ------------------------------------------------------------- what the first tests missed
    # rpc.remote_ps
    Mutant("rpc.remote_ps", "direct_rpc_extra_fetch", "calls torch.distributed.rpc directly, around the traced wrappers, to "
           "fetch the server's parameters after every step (a 'sanity check'): P x 8 B more per step, same numbers",
           find="        optimizer.step(context_id)\n    return loss.item()\n",
           replace="        optimizer.step(context_id)\n    torch_rpc.rpc_sync(server.owner(), server_parameters, args=(server,))\n"
                   "    return loss.item()\n"),
    Mutant("rpc.remote_ps", "gradients_by_local_autograd", "remote_gradients fetches the parameters (torch rpc directly) and "
           "runs local autograd on a copy: the right numbers, but no distributed autograd and the whole model moved",
           find="        return rpc_sync(server.owner(), server_gradients, server, context_id)\n",
           replace="        import copy\n"
                   "        params = torch_rpc.rpc_sync(server.owner(), server_parameters, args=(server,))\n"
                   "        model = copy.deepcopy(torch_rpc.rpc_sync(server.owner(), _model_of, args=(server,)))\n"
                   "        for p, v in zip(model.parameters(), params):\n"
                   "            p.data.copy_(v)\n"
                   "        model.zero_grad()\n"
                   "        loss_fn(model(x), y).backward()\n"
                   "        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]\n\n\n"
                   "def _model_of(server):\n    return server.local_value().model\n"),
    Mutant("rpc.remote_ps", "optimizer_class_ignored", "make_optimizer always builds plain SGD: momentum and AdamW "
           "(and their state on the server) are silently dropped",
           find="    return DistributedOptimizer(optimizer_class, rrefs, lr=lr, **optimizer_kwargs)\n",
           replace="    return DistributedOptimizer(torch.optim.SGD, rrefs, lr=lr)\n"),
    # rpc.batching_ps
    Mutant("rpc.batching_ps", "plain_mean_unequal_shards", "averages the trainers' gradients with equal weights: 7 + 6 rows "
           "(or 5 + 4 + 4) weighted like equal shards, about 5e-3 from global-batch SGD",
           find="                total += rows * g\n            entry[1] += 1\n            entry[2] += rows\n",
           replace="                total += g\n            entry[1] += 1\n            entry[2] += 1\n"),
    Mutant("rpc.batching_ps", "rows_not_sent", "the trainer never sends its shard's row count: the server weights every "
           "gradient by 1 (a plain mean)",
           find="        params, version = rpc_sync(owner, BatchingServer.push_and_pull, server, trainer, iteration, version, grads,\n"
                "                                   len(x))\n",
           replace="        params, version = rpc_sync(owner, BatchingServer.push_and_pull, server, trainer, iteration, version, grads)\n"),
    Mutant("rpc.batching_ps", "staleness_capped_at_one", "treats any bound above 1 as 1: right at bounds 0 and 1 (all the "
           "first tests tried), a straggler never lets a trainer run 2 or 3 ahead",
           find="            elif self.version >= iteration - self.staleness:\n",
           replace="            elif self.version >= iteration - min(self.staleness, 1):\n"),
    Mutant("rpc.batching_ps", "staleness_unbounded_above_one", "answers every pull at once for bounds of 2 and more "
           "(as if asynchronous): gradients staler than the bound",
           find="            elif self.version >= iteration - self.staleness:\n",
           replace="            elif self.staleness >= 2 or self.version >= iteration - self.staleness:\n"),
    Mutant("rpc.batching_ps", "fresh_optimizer_each_update", "builds a new optimizer of the same kind for every update: "
           "plain SGD is unchanged, momentum and Adam's state are dropped each step",
           find="                self.optimizer.step()\n",
           replace="                type(self.optimizer)(self.model.parameters(), **self.optimizer.defaults).step()\n"),
    Mutant("rpc.batching_ps", "frozen_gets_gradient", "gives a frozen parameter the (zero) gradient: weight decay moves "
           "what one process would leave alone",
           find="p.grad = total / total_rows if p.requires_grad else None", replace="p.grad = total / total_rows"),
    Mutant("rpc.batching_ps", "update_not_atomic", "applies the update after releasing the lock: a pull or push that "
           "arrives mid-update reads the old version and half-updated parameters",
           find=_PUSH_UPDATE,
           replace=_PUSH_UPDATE.replace("            while self.version in", "        while self.version in").replace(
               "                sums, _", "            sums, _").replace("                for p, total", "            for p, total").replace(
               "                    p.grad", "                p.grad").replace("                self.optimizer", "            self.optimizer").replace(
               "                self.version += 1", "            self.version += 1").replace(
               "            ready = [", "        with self.lock:\n            ready = ["),
           ),
    Mutant("rpc.batching_ps", "pull_without_lock", "pull reads the version and the parameters without the lock: a pull "
           "during an update can see half of it",
           find="        future = torch.futures.Future()\n        with self.lock:\n",
           replace="        future = torch.futures.Future()\n        if True:\n"),
    Mutant("rpc.batching_ps", "pull_blocks_after_death", "a pull made after a trainer died is queued like any other: it "
           "waits for a gradient that never comes (until the RPC timeout) instead of failing with TrainerLost",
           find="            if self.failure is not None:\n                future.set_exception(self.failure)\n            elif",
           replace="            if False:\n                future.set_exception(self.failure)\n            elif"),
    Mutant("rpc.batching_ps", "direct_rpc_extra_pull", "pulls the parameters again before every iteration with "
           "torch.distributed.rpc directly (around the traced wrappers): one more message and P x 8 B per iteration",
           find="    for iteration, (x, y) in enumerate(shards):\n        with torch.no_grad():\n",
           replace="    for iteration, (x, y) in enumerate(shards):\n"
                   "        params, version = torch_rpc.rpc_sync(owner, BatchingServer.push_and_pull,\n"
                   "                                             args=(server, trainer, iteration, -1, None))\n"
                   "        with torch.no_grad():\n"),
    # rpc.pipeline
    Mutant("rpc.pipeline", "stage_without_lock", "runs the module without the stage's lock: two micro-batches in one "
           "stage at once (right numbers on this model, a race on any stateful one)",
           find="        with self.lock:\n            return self.module(x)\n",
           replace="        return self.module(x)\n"),
    Mutant("rpc.pipeline", "chunk_not_tensor_split", "splits with x.chunk(M): 13 rows in 4 make 4, 4, 4, 1 (and 6 in 4 "
           "only 3 micro-batches), not M micro-batches within one row of each other",
           find="        for micro_batch in x.tensor_split(self.micro_batches):\n",
           replace="        for micro_batch in x.chunk(self.micro_batches):\n"),
    Mutant("rpc.pipeline", "two_stages_only", "runs the first and the last stage only: right for the two-stage pipeline "
           "the first tests used, a stage skipped in a longer one",
           find="            for stage in self.stages[:-1]:\n",
           replace="            for stage in self.stages[:1]:\n"),
    Mutant("rpc.pipeline", "direct_rpc_fetch_in_driver", "the driver brings each stage's output home with "
           "rref.to_here() (torch directly, around the traced wrappers) before sending it on",
           find="                value = remote(stage.owner(), stage_forward, stage, value)\n",
           replace="                value = remote(stage.owner(), stage_forward, stage, value).to_here()\n"),
    Mutant("rpc.pipeline", "stage_by_stage", "runs every micro-batch through stage 1 and waits for them all, then "
           "through stage 2, ...: right outputs and gradients, the right messages, nothing overlaps (a GPipe with "
           "a bubble of the whole batch)",
           find="        futures = []\n        for micro_batch in x.tensor_split(self.micro_batches):\n"
                "            value = micro_batch\n            for stage in self.stages[:-1]:\n"
                "                value = remote(stage.owner(), stage_forward, stage, value)\n",
           replace="        futures, values = [], list(x.tensor_split(self.micro_batches))\n"
                   "        for stage in self.stages[:-1]:\n"
                   "            values = [remote(stage.owner(), stage_forward, stage, v) for v in values]\n"
                   "            for v in values:  # the stage finishes the whole batch before the next begins\n"
                   "                v._get_future().wait()\n"
                   "        for value in values:\n            if True:\n                pass\n"),
]

# `labkit mutate rpc` survivors that no test can tell from the reference (labkit/course/automut.py).
EQUIVALENT = {
    "rpc.batching_ps/ifexp/4d040297":
        "push's `answer = self.snapshot() if ready else None` -> always snapshot(): the copy is only "
        "wasted work when no pull is waiting (answer is then never read); nothing observable changes",
    "rpc.batching_ps/int/2a4f795a":
        "train_batching's first pull asks for iteration -1 instead of 0: pull(i) is answered at once "
        "when version >= i - staleness, and version >= 0 >= i - staleness holds for i = 0 and i = -1 alike "
        "(same reply, same bytes, same RPC); 0 -> 1, which does wait, is killed",
    "rpc.batching_ps/int/9b86cc65":
        "the `version` argument of a pull-only push_and_pull (grads None) is -2 instead of -1: "
        "push_and_pull reads `version` only when it pushes gradients (grads not None)",
    "rpc.batching_ps/int/ad31e425":
        "the `version` argument of a pull-only push_and_pull (grads None) is 0 instead of -1: "
        "push_and_pull reads `version` only when it pushes gradients (grads not None)",
    "rpc.batching_ps/bool/d8eb315b":
        "model.zero_grad(set_to_none=False) instead of True before each local backward: the gradient "
        "then accumulates into exact zeros (0 + g == g in IEEE arithmetic), and a parameter with no "
        "gradient (frozen) keeps .grad None either way, so the pushed gradients are bit-identical",
}
