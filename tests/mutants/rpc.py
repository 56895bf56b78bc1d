"""Wrong implementations of chapter 13 that the grader must fail (see labkit.course.mutants)."""

from labkit.course.mutants import Mutant

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
    Mutant("rpc.batching_ps", "sum_not_mean", "applies the SUM of the n gradients: missing 1/n, n times the step",
           find="p.grad = total / self.num_trainers", replace="p.grad = total"),
    Mutant("rpc.batching_ps", "staleness_off_by_one", "lets a trainer run staleness + 1 versions ahead",
           find="            elif self.version >= iteration - self.staleness:\n",
           replace="            elif self.version >= iteration - self.staleness - 1:\n"),
    Mutant("rpc.batching_ps", "staleness_strict", "answers only when version > iteration - staleness: one version too cautious",
           find="            elif self.version >= iteration - self.staleness:\n",
           replace="            elif self.version > iteration - self.staleness:\n"),
    Mutant("rpc.batching_ps", "logs_received_version", "reports the version just received instead of the one the gradient was computed on",
           find="        versions.append(version)\n        params, version = rpc_sync(owner, BatchingServer.push_and_pull, server, trainer, iteration, version, grads)\n",
           replace="        params, version = rpc_sync(owner, BatchingServer.push_and_pull, server, trainer, iteration, version + 1, grads)\n"
                   "        versions.append(version)\n"),
    # rpc.pipeline
    Mutant("rpc.pipeline", "no_overlap", "waits for each micro-batch's output before sending the next: the stages never overlap",
           find="            futures.append(rpc_async(last.owner(), stage_forward, last, value))\n",
           replace="            futures.append(rpc_async(last.owner(), stage_forward, last, value))\n            futures[-1].wait()\n"),
    Mutant("rpc.pipeline", "relay_through_driver", "brings each activation back to the driver (rpc_sync) and sends it on: "
           "twice the bytes through the driver",
           find="                value = remote(stage.owner(), stage_forward, stage, value)\n",
           replace="                value = rpc_sync(stage.owner(), stage_forward, stage, value)\n"),
    Mutant("rpc.pipeline", "one_micro_batch", "sends the whole batch as one micro-batch: nothing to overlap",
           find="        for micro_batch in x.chunk(self.micro_batches):\n",
           replace="        for micro_batch in [x]:\n"),
]
