"""Lab 13 as a script: your RPC parameter servers and RPC pipeline against one process and chapter 01's server.

    python labs/13_rpc.py --world-size 3                     # labkit.launch(..., rpc=True) starts the ranks
    torchrun --standalone --nproc-per-node 3 labs/13_rpc.py  # RPC initialised from torchrun's environment

worker0 is the server (and the pipeline's driver), workers 1..n-1 the trainers; float64, a
4-6-2 tanh MLP, a global batch of 12, SGD with lr 0.1 (``labkit/rpc.py``):

* rpc.remote_ps: distributed autograd's gradients of the server's model equal local autograd's;
  5 steps in which the trainers take turns equal one process's SGD (loss by loss, and the
  server's parameters after every step); one traced rpc_sync per step, x there and the output back;
* rpc.batching_ps, synchronous: 5 iterations equal one process's SGD on the global batch; each
  trainer's trace is one pull (P x 8 bytes back) and one push_and_pull per iteration (P x 8 each way);
* rpc.batching_ps, asynchronous with a staleness bound of 1 and trainer 2 a straggler: every
  logged staleness is within the bound, some reaches it (with 2 or more trainers);
* rpc.pipeline: two stages on the last two workers, 3 micro-batches: output and gradients equal
  the unsplit model's, 3 DistributedOptimizer steps equal local SGD, stage 1 starts micro-batch
  i + 1 before stage 2 has finished micro-batch i, and the traced messages per micro-batch;
* chapter 01's collective parameter server (``labkit.dp``) on the same data in the same job:
  the same parameters as the synchronous RPC server;
* (3 or more workers, not under torchrun) a trainer that dies mid-step: the launch names it and
  the server raised ``TrainerLost`` naming it;
* actor-learner (given code, no task): workers 1..n-1 are actors, each stepping 4 copies of a
  seeded corridor and asking worker0's policy for action probabilities by RPC; worker0 runs the
  episodes (rpc_async to every actor), answers through ``labkit.rpc.RequestBatcher`` and
  updates the policy by REINFORCE. Batched, every policy forward serves all n-1 actors
  (HORIZON x EPISODES forwards); one by one, a forward per request, n-1 times as many; the two
  runs take the same actions and end with the same policy; the return improves over episodes.

Rank 0 prints; the exit status is 1 if a check fails or a task is not implemented yet.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import time
import warnings
from collections import Counter

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.nn as nn

from labkit.check import mismatch, not_implemented
from labkit.course.labscript import lab_arguments, report_checks
from labkit.launch import WorkerError, launch, release_process_groups, under_torchrun

H_IN, H_HID, H_OUT, BATCH, STEPS, LR = 4, 6, 2, 12, 5, 0.1
STALENESS, MICRO, PIPE_STEPS = 1, 3, 3
STAGE_WORK = 0.1  # seconds each stage "computes" per micro-batch in the first pipeline step (a sleep)
CELLS, START, SLIP, HORIZON, ENVS, EPISODES, POLICY_LR = 5, 1, 0.1, 8, 4, 15, 0.1  # the actor-learner section
TASKS = ("rpc.remote_ps", "rpc.batching_ps", "rpc.pipeline")


def mse(out, y):
    return ((out - y) ** 2).mean()


def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(H_IN, H_HID), nn.Tanh(), nn.Linear(H_HID, H_OUT)).double()


def batch(step: int, salt: int = 0, rows: int = BATCH):
    gen = torch.Generator().manual_seed(1000 * salt + step)
    return (torch.randn(rows, H_IN, generator=gen, dtype=torch.float64),
            torch.randn(rows, H_OUT, generator=gen, dtype=torch.float64))


def sgd_step(model: nn.Module, x, y) -> float:
    model.zero_grad()
    loss = mse(model(x), y)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return loss.item()


def gap(a, b) -> float:
    return max(float((x.detach() - y.detach()).abs().max()) for x, y in zip(a, b))


def same(a, b) -> bool:
    return all(mismatch(x.detach(), y.detach()) is None for x, y in zip(a, b))


def store():
    return dist.distributed_c10d._get_default_store()  # the job's store: one clock for every worker


def trainers_of(n: int) -> list[int]:
    return list(range(1, n))


def shards_of(batches, trainers, rank):
    index = trainers.index(rank)
    return [(x.tensor_split(len(trainers))[index], y.tensor_split(len(trainers))[index]) for x, y in batches]


def stub_message(error: BaseException) -> str | None:
    """A stub that raised on another worker comes back as a RuntimeError naming it."""
    found = re.search(r"NotImplementedError: (rpc\.\w+[^\n]*)", str(error))
    return found.group(1) if found else None


def publish(*objects) -> None:
    # RPC pickles classes and functions by reference (module + name). Under labkit.launch this
    # script is not the ranks' __main__: put what other workers will unpickle there, then wait
    # for everyone before anyone calls. (Under torchrun the script is __main__: a no-op.)
    main = sys.modules["__main__"]
    for obj in objects:
        setattr(main, obj.__name__, obj)
    dist.barrier()


# ----------------------------------------------------------------------------- rpc.remote_ps


def check_remote_ps(group) -> dict:
    from labkit import rpc as R
    rank, n = dist.get_rank(), dist.get_world_size()
    trainers = trainers_of(n)
    if rank == 0:
        R.start_server(small_model())
    out = dict(losses=[], traces_ok=True, params_ok=True, grads_ok=None, grad_gap=None)
    dist.barrier()
    if rank in trainers:
        server = R.connect("worker0", "ps")
        x, y = batch(99, rank)
        local = small_model()
        mse(local(x), y).backward()
        grads = R.remote_gradients(server, mse, x, y)
        out["grads_ok"] = same(grads, [p.grad for p in local.parameters()])
        out["grad_gap"] = gap(grads, [p.grad for p in local.parameters()])
        dist.barrier(group=group)
        optimizer = R.make_optimizer(server, LR)
        reference = small_model()
        for step in range(STEPS):
            for turn in trainers:  # one trainer at a time: the order one process replays
                x, y = batch(step, turn)
                want = sgd_step(reference, x, y)
                if rank == turn:
                    with R.RpcTracer() as tracer:
                        loss = R.remote_step(server, optimizer, mse, x, y)
                    out["losses"].append((step, loss, want))
                    expected = Counter([("rpc_sync", "worker0", "server_forward", x.nbytes, BATCH * H_OUT * 8)])
                    out["traces_ok"] &= Counter(m.key() for m in tracer.messages) == expected
                    out["trace"] = [m.key() for m in tracer.messages]
                dist.barrier(group=group)
            params = R.rpc_sync("worker0", R.server_parameters, server)
            out["params_ok"] &= same(params, list(reference.parameters()))
            out["params_gap"] = max(out.get("params_gap", 0.0), gap(params, list(reference.parameters())))
            dist.barrier(group=group)  # everyone has read them before the next step's first turn
    dist.barrier()
    return out


# ----------------------------------------------------------------------------- rpc.batching_ps


def straggler(trainer: int, iteration: int) -> None:
    """Trainer 2 pushes iteration 0 only once trainer 1 has reached iteration 1 (bounded wait)."""
    if trainer == 1 and iteration == 1:
        store().set("lab13/straggler", "go")
    if trainer == 2 and iteration == 0:
        end = time.monotonic() + 10.0
        while not store().check(["lab13/straggler"]) and time.monotonic() < end:
            time.sleep(0.005)


def global_sgd(batches) -> list[torch.Tensor]:
    model = small_model(1)
    for x, y in batches:
        sgd_step(model, x, y)
    return list(model.parameters())


def check_batching(staleness: int) -> dict:
    from labkit import rpc as R
    rank, n = dist.get_rank(), dist.get_world_size()
    trainers = trainers_of(n)
    batches = [batch(step, 7) for step in range(STEPS)]
    name = f"batching_ps_{staleness}"
    out = {}
    if rank == 0:
        server = R.start_batching_server(small_model(1), len(trainers), LR, staleness, name=name)
    dist.barrier()
    if rank in trainers:
        handle = R.connect("worker0", name)
        local = small_model(1)
        with R.RpcTracer() as tracer:
            out["versions"] = R.train_batching(handle, rank, local, mse, shards_of(batches, trainers, rank),
                                               before_push=straggler if staleness else None)
        P = sum(p.numel() for p in local.parameters()) * 8
        want = Counter([("rpc_sync", "worker0", "BatchingServer.push_and_pull", 0, P)]
                       + STEPS * [("rpc_sync", "worker0", "BatchingServer.push_and_pull", P, P)])
        out.update(traces_ok=Counter(m.key() for m in tracer.messages) == want, messages=len(tracer.messages),
                   bytes=sum(m.sent + m.received for m in tracer.messages), want_bytes=(2 * STEPS + 1) * P)
    if rank == 0:
        log = server.wait_until_done(STEPS, [f"worker{t}" for t in trainers])
        final = [p.detach().clone() for p in server.model.parameters()]
        out.update(staleness=list(log.staleness), applied=list(log.applied), final=final,
                   vs_one_process=gap(final, global_sgd(batches)), same_as_one_process=same(final, global_sgd(batches)))
    dist.barrier()
    return out


def check_dp_server(rpc_final) -> dict:
    """Chapter 01's parameter server on send/recv (your labkit.dp), same data, same job."""
    from labkit import dp
    rank = dist.get_rank()
    batches = [batch(step, 7) for step in range(STEPS)]
    model = small_model(1)
    opt = torch.optim.SGD(model.parameters(), lr=LR) if rank == 0 else None
    try:
        dp.run_parameter_server(model, opt, lambda m, x, y: mse(m(x), y), batches, staleness=0)
    except NotImplementedError as exc:  # chapter 01's stubs raise on every rank alike
        return dict(missing=str(exc))
    if rank != 0:
        return {}
    return dict(same=same(list(model.parameters()), rpc_final), gap=gap(list(model.parameters()), rpc_final))


# ----------------------------------------------------------------------------- rpc.pipeline


class TimedStage(nn.Module):
    """A stage's module that notes in the job's store when each micro-batch of the first step
    starts and ends, and "computes" STAGE_WORK seconds longer then (so that the overlap of the
    two stages shows on a timeline)."""

    def __init__(self, index: int, module: nn.Module):
        super().__init__()
        self.index, self.module, self.calls = index, module, 0

    def forward(self, x):
        micro, self.calls = self.calls, self.calls + 1
        timed = micro < MICRO
        if timed:
            store().set(f"lab13/pipe/{self.index}/{micro}/start", repr(time.time()))
        y = self.module(x)
        if timed:
            time.sleep(STAGE_WORK)
            store().set(f"lab13/pipe/{self.index}/{micro}/end", repr(time.time()))
        return y


def stage_modules():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(H_IN, H_HID), nn.Tanh()).double(), nn.Linear(H_HID, H_OUT).double()


def check_pipeline() -> dict:
    import copy

    from labkit import rpc as R
    rank, n = dist.get_rank(), dist.get_world_size()
    first, last = f"worker{n - 2}", f"worker{n - 1}"
    out = {}
    dist.barrier()
    with R.RpcTracer() as tracer:
        if rank == 0:
            m1, m2 = stage_modules()
            reference = nn.Sequential(copy.deepcopy(m1), copy.deepcopy(m2))
            pipe = R.RpcPipeline([R.start_stage(first, TimedStage(1, m1)), R.start_stage(last, TimedStage(2, m2))], MICRO)
            optimizer, losses, outputs_ok, grads_ok = None, [], True, True
            for step in range(PIPE_STEPS):
                x, y = batch(step, 11)
                with dist_autograd.context() as context_id:
                    with R.RpcTracer() as step_tracer:
                        output = pipe(x)
                    if step == 0:
                        out["driver_trace"] = [m.key() for m in step_tracer.messages]
                    want = reference(x)
                    outputs_ok &= mismatch(output, want) is None
                    loss = mse(output, y)
                    dist_autograd.backward(context_id, [loss])
                    grads = [g for stage in pipe.gradients(context_id) for g in stage]
                    reference.zero_grad()
                    ref_loss = mse(want, y)
                    ref_loss.backward()
                    grads_ok &= same(grads, [p.grad for p in reference.parameters()])
                    if optimizer is None:
                        optimizer = R.DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=LR)
                    optimizer.step(context_id)
                with torch.no_grad():
                    for p in reference.parameters():
                        p -= LR * p.grad
                losses.append((loss.item(), ref_loss.item()))
            params = [p for stage in pipe.parameters() for p in stage]
            out.update(losses=losses, outputs_ok=outputs_ok, grads_ok=grads_ok,
                       params_ok=same(params, list(reference.parameters())), rows=[len(c) for c in x.chunk(MICRO)])
        dist.barrier()
    if rank == n - 1:
        out["stage2_trace"] = [m.key() for m in tracer.messages]
    if rank == 0:
        s = store()
        out["spans"] = {(stage, micro): (float(s.get(f"lab13/pipe/{stage}/{micro}/start")),
                                         float(s.get(f"lab13/pipe/{stage}/{micro}/end")))
                        for stage in (1, 2) for micro in range(MICRO)}
    return out


def expected_pipeline_traces(rows: list[int], first: str, last: str) -> tuple[Counter, Counter]:
    driver, stage2 = Counter(), Counter()
    for r in rows:  # per micro-batch: x to stage 1 (its output stays there), the output back from stage 2
        driver[("remote", first, "stage_forward", r * H_IN * 8, 0)] += 1
        driver[("rpc_async", last, "stage_forward", 0, r * H_OUT * 8)] += 1
        stage2[("to_here", first, "", 0, r * H_HID * 8)] += PIPE_STEPS  # stage 2 fetches the activation
    return driver, stage2


# ----------------------------------------------------------------------------- a trainer dies


def die_before_push(trainer: int, iteration: int) -> None:
    if trainer == 2 and iteration == 1:
        os._exit(1)  # mid-step: its gradient of iteration 1 is computed, never pushed


def dying_job() -> None:
    from labkit import rpc as R
    rank, n = dist.get_rank(), dist.get_world_size()
    trainers = trainers_of(n)
    batches = [batch(step, 3) for step in range(STEPS)]
    if rank == 0:
        server = R.start_batching_server(small_model(1), len(trainers), LR, name="dying")
    dist.barrier()
    if rank == 0:
        server.wait_until_done(STEPS, [f"worker{t}" for t in trainers])
    else:
        R.train_batching(R.connect("worker0", "dying"), rank, small_model(1), mse,
                         shards_of(batches, trainers, rank), before_push=die_before_push)


def check_dying_trainer(args) -> bool:
    """A second job (not under torchrun, where a dead rank ends the whole run): worker2 exits
    before pushing; the launch must name it, and the server must have raised TrainerLost."""
    start = time.monotonic()
    try:
        relayed = io.StringIO()  # the ranks' output: TensorPipe logs the broken connection there
        with contextlib.redirect_stdout(relayed), contextlib.redirect_stderr(relayed):
            launch(dying_job, 3, backend=args.backend, timeout=args.timeout, rpc=True)
    except WorkerError as error:
        seconds, server_saw = time.monotonic() - start, error.peer_errors.get(0, "")
        print(f"\na trainer that dies mid-step: WorkerError after {seconds:.1f} s naming rank {error.rank}; "
              f"the server raised: {server_saw.split(':')[0] or 'nothing'}")
        ok = error.rank == 2 and server_saw.startswith("TrainerLost") and "worker2" in server_saw
        print(f"{'ok  ' if ok else 'FAIL'} a dead trainer: the launch names rank 2, the server's TrainerLost names worker2")
        return ok
    print("FAIL a dead trainer: the launch returned normally")
    return False


# ----------------------------------------------------------------------------- actor-learner
#
# PyTorch's RPC tutorial's agent and observers ("Implementing Batch RPC Processing Using
# Asynchronous Executions"), on a corridor: cells 0..CELLS-1, start in cell START, move left or
# right (a slip, probability SLIP, reverses the move; the walls stop it), reward = the cell
# reached / (CELLS - 1) after each of HORIZON steps. Always moving right is the best policy.


def policy_net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Linear(CELLS, 2).double()  # one-hot cell -> logits of (left, right)


def one_hot(cells: torch.Tensor) -> torch.Tensor:
    return nn.functional.one_hot(cells, CELLS).double()


def run_episode(batcher, actor: int, episode: int):
    """On an actor: ENVS corridors for HORIZON steps, one request per step for all ENVS rows;
    the actor draws its actions (and the slips) from its own seeded generator, so the run does
    not depend on the order in which requests reach the agent. Returns (states, actions, rewards),
    each ENVS x HORIZON."""
    from labkit import rpc as R
    gen = torch.Generator().manual_seed(10_000 * actor + episode)
    cells = torch.full((ENVS,), START)
    states, actions, rewards = [], [], []
    for _ in range(HORIZON):
        probs = R.rpc_sync(batcher.owner(), R.RequestBatcher.request, batcher, actor, cells)
        u, slip = torch.rand(2, ENVS, generator=gen, dtype=torch.float64)
        action = (u >= probs[:, 0]).long()  # 0 left, 1 right
        states.append(cells)
        actions.append(action)
        cells = (cells + (2 * action - 1) * torch.where(slip < SLIP, -1, 1)).clamp(0, CELLS - 1)
        rewards.append(cells.double() / (CELLS - 1))
    return torch.stack(states, 1), torch.stack(actions, 1), torch.stack(rewards, 1)


def reinforce_step(policy, optimizer, states, actions, rewards) -> None:
    returns = rewards.flip(1).cumsum(1).flip(1)  # reward-to-go of every step
    advantage = (returns - returns.mean()) / (returns.std() + 1e-9)
    logp = torch.log_softmax(policy(one_hot(states)), -1).gather(-1, actions[..., None])[..., 0]
    optimizer.zero_grad()
    (-(logp * advantage).mean()).backward()
    optimizer.step()


def train_actors(actors: list[int], batch_size: int, name: str) -> dict:
    """On worker0, the agent and the one controller: per episode, run_episode on every actor at
    once (rpc_async), answer their requests through a RequestBatcher of ``batch_size``, then one
    REINFORCE step on all the trajectories (in actor order)."""
    from labkit import rpc as R
    policy = policy_net()
    optimizer = torch.optim.Adam(policy.parameters(), lr=POLICY_LR)

    def act(cells):  # ONE forward for every row of the batch
        with torch.no_grad():
            return torch.softmax(policy(one_hot(cells)), -1)

    batcher = R.RequestBatcher(act, batch_size)
    handle = R.serve(batcher, name)
    returns = []
    for episode in range(EPISODES):
        futures = [R.rpc_async(f"worker{a}", run_episode, handle, a, episode) for a in actors]
        states, actions, rewards = (torch.cat(part) for part in zip(*torch.futures.wait_all(futures)))
        reinforce_step(policy, optimizer, states, actions, rewards)
        returns.append(rewards.sum(1).mean().item())
    return dict(returns=returns, served=list(batcher.served), rows=list(batcher.rows),
                params=[p.detach().clone() for p in policy.parameters()])


def expected_return(p_right: float) -> float:
    """The exact expected return of a policy that moves right with probability p_right."""
    where = torch.zeros(CELLS, dtype=torch.float64)
    where[START], total = 1.0, 0.0
    q = p_right * (1 - SLIP) + (1 - p_right) * SLIP  # the move goes right
    for _ in range(HORIZON):
        moved = torch.zeros_like(where)
        for cell in range(CELLS):
            moved[min(cell + 1, CELLS - 1)] += q * where[cell]
            moved[max(cell - 1, 0)] += (1 - q) * where[cell]
        where = moved
        total += float((where * torch.arange(CELLS) / (CELLS - 1)).sum())
    return total


def check_actor_learner() -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    dist.barrier()
    if rank == 0:
        actors = trainers_of(n)
        out = dict(batched=train_actors(actors, len(actors), "agent_batched"),
                   one_by_one=train_actors(actors, 1, "agent_one_by_one"))
    dist.barrier()
    return out


# ----------------------------------------------------------------------------- the job


def main() -> dict:
    warnings.filterwarnings("ignore", category=FutureWarning)
    import labkit.rpc  # noqa: F401 - importing it also drops torch's TorchScript-optimizer notice
    torch.set_num_threads(1)
    publish(TimedStage, run_episode)
    rank, n = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(trainers_of(n))  # the trainers' turns (every rank creates it)
    result = dict(world=n)
    try:
        result["remote_ps"] = check_remote_ps(group)
        result["sync"] = check_batching(0)
        result["async"] = check_batching(STALENESS)
        result["pipeline"] = check_pipeline()
        result["actor_learner"] = check_actor_learner()
    except RuntimeError as error:  # a stub on another worker: say which task
        missing = stub_message(error)
        if missing is None:
            raise
        raise NotImplementedError(missing) from None
    final = [None]
    if rank == 0:
        final = [result["sync"]["final"]]
    dist.broadcast_object_list(final, 0)
    result["dp"] = check_dp_server(final[0])
    return result


def report(results: list[dict]) -> bool:
    n = results[0]["world"]
    trainers = trainers_of(n)
    server = results[0]
    print(f"Lab 13: training over RPC on {n} workers (worker0 serves, {len(trainers)} trainer(s)), float64, "
          f"MLP {H_IN}-{H_HID}-{H_OUT}, batch {BATCH}, SGD lr {LR}\n")
    print("remote parameter server, trainers taking turns (loss over RPC / one process):")
    for t in trainers:
        losses = results[t]["remote_ps"]["losses"]
        print(f"  worker{t}: " + "  ".join(f"{a:.6f}/{b:.6f}" for _, a, b in losses))
        print(f"           traced per step: {results[t]['remote_ps']['trace']}; server's parameters vs one "
              f"process after each step: largest gap {results[t]['remote_ps']['params_gap']:.1e}")
    sync = server["sync"]
    print(f"batching server, synchronous: final parameters vs one process's SGD on the global batch: "
          f"largest gap {sync['vs_one_process']:.1e}")
    for t in trainers:
        r = results[t]["sync"]
        print(f"  worker{t}: {r['messages']} messages, {r['bytes']:,} B traced (formula (2 x {STEPS} + 1) P x 8 = "
              f"{r['want_bytes']:,} B)")
    stale = Counter(server["async"]["staleness"])
    print(f"batching server, staleness bound {STALENESS}: staleness histogram {dict(sorted(stale.items()))}")
    dp = server["dp"]
    if "missing" in dp:
        print(f"chapter 01's collective parameter server: not implemented yet ({dp['missing']})")
    else:
        print(f"chapter 01's collective parameter server vs the synchronous RPC server: largest gap {dp['gap']:.1e}")
    pipe = server["pipeline"]
    spans = pipe["spans"]
    t0 = min(start for start, _ in spans.values())
    print(f"RPC pipeline, {MICRO} micro-batches, stages on worker{n - 2} and worker{n - 1} (first step, ms from its start):")
    for (stage, micro), (start, end) in sorted(spans.items()):
        print(f"  stage {stage} micro-batch {micro}: {1e3 * (start - t0):7.1f} .. {1e3 * (end - t0):7.1f}")
    print("  loss pipeline/one process: " + "  ".join(f"{a:.6f}/{b:.6f}" for a, b in pipe["losses"]))
    al, actors = server["actor_learner"], len(trainers)
    batched, one = al["batched"], al["one_by_one"]
    first, last = sum(batched["returns"][:5]) / 5, sum(batched["returns"][-5:]) / 5
    best, coin = expected_return(1.0), expected_return(0.5)
    print(f"actor-learner, {actors} actor(s) x {ENVS} corridors, {EPISODES} episodes of {HORIZON} steps: "
          f"policy forwards batched {len(batched['served'])} (requests per forward {sorted(set(batched['served']))}, "
          f"rows {sorted(set(batched['rows']))}), one by one {len(one['served'])} "
          f"(requests per forward {sorted(set(one['served']))})")
    print("  mean return per episode: " + " ".join(f"{r:.2f}" for r in batched["returns"])
          + f"; first 5 {first:.2f}, last 5 {last:.2f}; always right {best:.2f}, a coin flip {coin:.2f} (exact)")
    driver_want, stage2_want = expected_pipeline_traces(pipe["rows"], f"worker{n - 2}", f"worker{n - 1}")
    overlap = all(spans[(1, i + 1)][0] < spans[(2, i)][1] for i in range(MICRO - 1))
    checks = {
        "remote PS: distributed autograd's gradients = local autograd's, on every trainer": all(
            results[t]["remote_ps"]["grads_ok"] for t in trainers),
        "remote PS: every trainer's loss at every step = one process's": all(
            mismatch(torch.tensor(a), torch.tensor(b)) is None for t in trainers for _, a, b in results[t]["remote_ps"]["losses"]),
        "remote PS: the server's parameters after every step = one process's SGD": all(
            results[t]["remote_ps"]["params_ok"] for t in trainers),
        "remote PS: one rpc_sync per step, x there and the output back, nothing else": all(
            results[t]["remote_ps"]["traces_ok"] for t in trainers),
        "batching PS, synchronous: = one process's SGD on the global batch after 5 iterations": sync["same_as_one_process"],
        "batching PS, synchronous: iteration i computed on version i, on every trainer": all(
            results[t]["sync"]["versions"] == list(range(STEPS)) for t in trainers),
        "batching PS: each trainer's trace = 1 pull + 5 push_and_pulls, P x 8 B each way": all(
            results[t][mode]["traces_ok"] for t in trainers for mode in ("sync", "async")),
        f"batching PS, bound {STALENESS}: every gradient's staleness within the bound": max(
            server["async"]["staleness"]) <= STALENESS,
        f"batching PS, bound {STALENESS}: the straggler makes some gradient {STALENESS} stale"
        + (" (n/a: one trainer is never stale)" if len(trainers) < 2 else ""): (
            len(trainers) < 2 or max(server["async"]["staleness"]) == STALENESS),
        "RPC pipeline: output and every stage's gradients = the unsplit model's": pipe["outputs_ok"] and pipe["grads_ok"],
        "RPC pipeline: 3 DistributedOptimizer steps = local SGD": pipe["params_ok"],
        "RPC pipeline: stage 1 starts micro-batch i+1 before stage 2 ends micro-batch i": overlap,
        "RPC pipeline: per micro-batch a remote to stage 1, an rpc_async to stage 2, one fetch by stage 2": (
            Counter(pipe["driver_trace"]) == driver_want and Counter(results[n - 1]["pipeline"]["stage2_trace"]) == stage2_want),
        "chapter 01's collective PS = the synchronous RPC server": "missing" not in dp and dp["same"],
        f"actor-learner: batched, each of the {HORIZON * EPISODES} policy forwards served all {actors} actor(s)": (
            batched["served"] == [actors] * HORIZON * EPISODES and batched["rows"] == [actors * ENVS] * HORIZON * EPISODES),
        f"actor-learner: one by one, {actors} x {HORIZON * EPISODES} forwards of one request each": (
            one["served"] == [1] * actors * HORIZON * EPISODES),
        "actor-learner: batched and one by one take the same actions and end with the same policy": (
            batched["returns"] == one["returns"]
            and all(torch.equal(a, b) for a, b in zip(batched["params"], one["params"]))),
        "actor-learner: REINFORCE improves the return (last 5 episodes > first 5, nearer always-right than a coin flip)": (
            last > first and abs(best - last) < abs(last - coin)),
    }
    return report_checks(checks)


def run(args) -> None:
    """``labkit.course.labscript.run_lab`` with ``rpc=True`` (its shell has no RPC option yet)."""
    world_size = int(os.environ.get("WORLD_SIZE", args.world_size))
    if world_size < 2:
        sys.exit("lab 13 needs at least 2 workers: worker0 serves, the others train (--world-size 2 or more)")
    try:
        results = launch(main, world_size, backend=args.backend, timeout=args.timeout, rpc=True)
    except (NotImplementedError, WorkerError) as error:
        missing = not_implemented(error)
        if missing is None:
            raise
        print(f"Lab 13: {', '.join(TASKS)}: {missing}")
        sys.exit(1)
    if not under_torchrun() or dist.get_rank() == 0:
        ok = report(results)
    else:
        with contextlib.redirect_stdout(io.StringIO()):
            ok = report(results)
    if not under_torchrun() and world_size >= 3:  # needs two trainers: one dies, one waits
        ok &= check_dying_trainer(args)
    release_process_groups()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    run(lab_arguments(__doc__).parse_args())
