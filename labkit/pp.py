"""Chapter 06 exercises: pipeline parallelism, with schedules as data.

Cut the model by layers into p *stages*, one per rank: rank s runs layers [a_s, b_s) and
hands its output activation to rank s+1; in backward the gradient of that activation comes
back from s+1. Only these point-to-point messages cross ranks, which is why pipelines suit
slow links (between nodes). Run one batch through and p-1 of p ranks idle at any moment, so
the batch is cut into m *micro-batches* that follow each other through the stages. What is
left idle is the *bubble*: with equal stages, a forward F and a backward B per micro-batch,

    bubble fraction = (p - 1) / (m + p - 1)         (GPipe and 1F1B; Huang et al. 2019)

and a rank must keep the activations of every micro-batch it has run forward but not yet
backward: m of them for GPipe (all F, then all B), at most p - s for 1F1B on stage s (a
short warm-up of forwards, then one forward, one backward; Narayanan et al. 2019/2021).
Interleaving v chunks per rank (stage i on rank i mod p) divides the bubble by v at the cost
of v times more messages. Zero-bubble scheduling (Qi et al. 2023) splits backward into B,
the gradient of the stage's input (which the previous stage waits for), and W, the weight
gradients (which nobody waits for), and slides W's into the holes: ZB-H1 keeps 1F1B's
peak memory (p micro-batches, on the first stage; later stages now hold W's inputs longer, up
to p each) and cuts its bubble to about a third.

A schedule here is data: for every rank, the list of ``Action``s it runs, in order:
``Action("F", i, s)`` forward of micro-batch i through stage s, ``"B"`` its backward (the
full backward, or with deferred weights only the input gradient), ``"W"`` its weight
gradients. ``PipelineRunner.step`` (given) executes one rank's list: it receives what an
action needs just before running it, sends what it produced right after (asynchronously),
keeps each micro-batch's activations until its backward, and records every action's start
and end. ``simulate`` (given) runs all ranks' lists on a clock with unit costs: the same
data draws the diagrams and gives the bubble.

Tasks (run ``labkit grade pp``; tests in ``tests/grading/test_pp.py``):
    pp.split        partition (contiguous stages, balanced), split_gpt
    pp.p2p          send_forward, recv_forward, send_backward, recv_backward
    pp.gpipe        gpipe
    pp.1f1b         one_f_one_b
    pp.interleaved  interleaved_1f1b
    pp.zero_bubble  zero_bubble_h1
Every schedule function validates its arguments (ValueError) before anything runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.models import GPT


@dataclass(frozen=True)
class Action:
    kind: str        # "F" forward, "B" backward (input gradient only, when W is separate), "W" weights
    microbatch: int
    stage: int       # the global stage (model chunk) index

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}s{self.stage}"


Schedule = list[list[Action]]  # one list of actions per rank


def rank_of_stage(stage: int, num_ranks: int) -> int:
    """Stage s runs on pipeline rank s mod p (p stages: rank s; v chunks per rank: round robin)."""
    return stage % num_ranks


def peer(stage: int, num_ranks: int, group=None) -> int:
    """The global rank that runs ``stage`` when the pipeline is the process group ``group``
    (None: all ranks), e.g. the pipeline axis of a dp x pp x tp mesh (chapter 08)."""
    pipeline_rank = rank_of_stage(stage, num_ranks)
    return pipeline_rank if group is None else dist.get_global_rank(group, pipeline_rank)


# ----------------------------------------------------------------------------- splitting


def partition(costs: list[int], num_stages: int) -> list[range]:
    """Cut ``costs`` (one per layer, in order) into ``num_stages`` contiguous, non-empty
    ranges so that the most expensive stage costs as little as possible; on a tie, prefer
    the split whose earlier stages are larger. ValueError if there are fewer layers than stages.
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")
    if num_stages > len(costs):
        raise ValueError(f"{num_stages} stages but only {len(costs)} layers to split: at most one stage per layer")
    # BEGIN SOLUTION pp.split: binary-search (or scan) the smallest max stage cost for which a greedy left-to-right fill needs <= num_stages stages, then cut greedily keeping every stage non-empty
    def cuts_for(limit: int) -> list[int] | None:
        """Greedy: fill each stage up to ``limit``, leaving a layer for every later stage."""
        bounds, start = [], 0
        for stage in range(num_stages - 1):
            end, total = start, 0
            while end < len(costs) - (num_stages - 1 - stage) and total + costs[end] <= limit:
                total += costs[end]
                end += 1
            if end == start:
                return None
            bounds.append(end)
            start = end
        return bounds if sum(costs[start:]) <= limit else None

    low, high = max(costs), sum(costs)
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if cuts_for(mid) is not None else (mid + 1, high)
    edges = [0, *cuts_for(low), len(costs)]
    return [range(a, b) for a, b in zip(edges, edges[1:])]
    # END SOLUTION


class StageModule(nn.Module):
    """Blocks ``blocks[first:last]`` of a GPT; the first stage also embeds the tokens
    (wte, wpe), the last also holds ln_f and lm_head and returns logits."""

    def __init__(self, gpt: GPT, blocks: range, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        self.blocks = nn.ModuleList(gpt.blocks[i] for i in blocks)
        self.hidden_size = gpt.config.n_embd  # the activation between stages: [B, T, hidden_size]
        self.wte = gpt.wte if first else None
        self.wpe = gpt.wpe if first else None
        self.ln_f = gpt.ln_f if last else None
        self.lm_head = gpt.lm_head if last else None
        # A tied wte/lm_head split across ranks: each side holds a copy; their gradients are
        # summed between the two ranks after backward (PipelineRunner), as Megatron does.
        self.tied = gpt.config.tie_weights

    def forward(self, x):
        if self.first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.wte(x) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))
        return x

    def tied_weight(self) -> nn.Parameter | None:
        """The half of a tied embedding this stage holds, if any."""
        if not self.tied:
            return None
        return self.wte.weight if self.first else self.lm_head.weight if self.last else None


def layer_costs(gpt: GPT, balance: str) -> list[int]:
    """Cost of each block for ``partition``: its parameter count, or 1 per block ("layers").
    The embeddings count towards the first block, ln_f and lm_head towards the last."""
    if balance == "layers":
        return [1] * len(gpt.blocks)
    if balance != "params":
        raise ValueError(f"balance must be 'params' or 'layers', got {balance!r}")
    costs = [sum(p.numel() for p in b.parameters()) for b in gpt.blocks]
    costs[0] += gpt.wte.weight.numel() + gpt.wpe.weight.numel()
    if not gpt.config.tie_weights:
        costs[-1] += gpt.lm_head.weight.numel()
    costs[-1] += sum(p.numel() for p in gpt.ln_f.parameters())
    return costs


def split_gpt(gpt: GPT, num_stages: int, balance: str = "params") -> list[StageModule]:
    """Cut ``gpt`` into ``num_stages`` ``StageModule``s (contiguous blocks, balanced by
    ``layer_costs``), in order: stage 0 embeds, the last returns logits."""
    costs = layer_costs(gpt, balance)
    # BEGIN SOLUTION pp.split: ranges = partition(costs, num_stages); one StageModule per range, first=(s == 0), last=(s == num_stages - 1)
    ranges = partition(costs, num_stages)
    return [StageModule(gpt, r, first=s == 0, last=s == num_stages - 1) for s, r in enumerate(ranges)]
    # END SOLUTION


# ----------------------------------------------------------------------------- messages


def message_tag(microbatch: int, stage: int, backward: bool) -> int:
    """A tag unique to each message of a step, so that messages between the same two ranks
    (interleaved schedules send several streams each way) are never mixed up."""
    return 2 * (microbatch * 1024 + stage) + int(backward)


def send_forward(activation: torch.Tensor, microbatch: int, stage: int, num_ranks: int, group=None) -> dist.Work:
    """Send stage ``stage``'s output for ``microbatch`` to the rank of stage ``stage + 1``
    (``peer``) over ``group``, asynchronously (``dist.isend`` with ``message_tag(microbatch,
    stage + 1, False)``); return the work. The tensor must stay alive until the work completes."""
    # BEGIN SOLUTION pp.p2p: dist.isend the activation (contiguous) to peer(stage + 1, ...), tagged with the receiving stage
    return dist.isend(activation.contiguous(), dst=peer(stage + 1, num_ranks, group), group=group,
                      tag=message_tag(microbatch, stage + 1, False))
    # END SOLUTION


def recv_forward(shape, dtype, microbatch: int, stage: int, num_ranks: int, group=None,
                 device=None) -> torch.Tensor:
    """Receive (blocking, over ``group``) the input of stage ``stage`` for ``microbatch`` from
    the rank of stage ``stage - 1``: a new tensor of ``shape``, ``dtype`` and ``device``
    (NCCL: the GPU)."""
    # BEGIN SOLUTION pp.p2p: dist.recv into torch.empty(shape, dtype, device) from peer(stage - 1, ...), same tag as the sender's
    buffer = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(buffer, src=peer(stage - 1, num_ranks, group), group=group, tag=message_tag(microbatch, stage, False))
    return buffer
    # END SOLUTION


def send_backward(grad: torch.Tensor, microbatch: int, stage: int, num_ranks: int, group=None) -> dist.Work:
    """Send the gradient of stage ``stage``'s input for ``microbatch`` back to the rank of
    stage ``stage - 1`` (over ``group``, async, ``message_tag(microbatch, stage - 1, True)``);
    return the work."""
    # BEGIN SOLUTION pp.p2p: dist.isend the gradient to peer(stage - 1, ...), tagged with the receiving stage and backward=True
    return dist.isend(grad.contiguous(), dst=peer(stage - 1, num_ranks, group), group=group,
                      tag=message_tag(microbatch, stage - 1, True))
    # END SOLUTION


def recv_backward(shape, dtype, microbatch: int, stage: int, num_ranks: int, group=None,
                  device=None) -> torch.Tensor:
    """Receive (blocking, over ``group``) the gradient of stage ``stage``'s output for
    ``microbatch`` from the rank of stage ``stage + 1``."""
    # BEGIN SOLUTION pp.p2p: dist.recv into torch.empty(shape, dtype, device) from peer(stage + 1, ...), tag of (microbatch, stage, backward)
    buffer = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(buffer, src=peer(stage + 1, num_ranks, group), group=group, tag=message_tag(microbatch, stage, True))
    return buffer
    # END SOLUTION


# ----------------------------------------------------------------------------- schedules


def _check(num_ranks: int, num_microbatches: int) -> None:
    if num_ranks < 1 or num_microbatches < 1:
        raise ValueError(f"need at least one rank and one micro-batch, got p={num_ranks}, m={num_microbatches}")


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """GPipe: every rank runs the forwards of all m micro-batches, then their backwards, both
    in micro-batch order: rank s: F0 F1 ... F(m-1) B0 B1 ... B(m-1) (all on stage s)."""
    _check(num_ranks, num_microbatches)
    # BEGIN SOLUTION pp.gpipe: for each rank s: [Action("F", i, s) for i in range(m)] + [Action("B", i, s) for i in range(m)]
    m = num_microbatches
    return [[Action("F", i, s) for i in range(m)] + [Action("B", i, s) for i in range(m)]
            for s in range(num_ranks)]
    # END SOLUTION


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """1F1B: rank s runs w = min(p - 1 - s, m) warm-up forwards, then alternates one forward
    and one backward (F(w) B0 F(w+1) B1 ...) while forwards remain, then the remaining
    backwards. At most p - s micro-batches are in flight on stage s."""
    _check(num_ranks, num_microbatches)
    # BEGIN SOLUTION pp.1f1b: warm-up F0..F(w-1); then for j in range(m - w): F(w + j), B(j); then B(m - w) .. B(m - 1)
    p, m = num_ranks, num_microbatches
    schedule = []
    for s in range(p):
        warmup = min(p - 1 - s, m)
        actions = [Action("F", i, s) for i in range(warmup)]
        for j in range(m - warmup):
            actions += [Action("F", warmup + j, s), Action("B", j, s)]
        actions += [Action("B", i, s) for i in range(m - warmup, m)]
        schedule.append(actions)
    return schedule
    # END SOLUTION


def interleaved_1f1b(num_ranks: int, num_microbatches: int, num_chunks: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021): the model is cut into p*v stages and rank r
    holds stages r, r + p, ..., r + (v-1)p. Micro-batches go in rounds of p: rank r's k-th
    forward is micro-batch (k // (p v)) p + k % p on its chunk (k // p) % v; its k-th
    backward the same micro-batch order on chunk v - 1 - (k // p) % v. Warm-up: w =
    min((v - 1) p + 2 (p - 1 - r), m v) forwards, then alternate F and B while forwards
    remain, then the remaining B's. Needs m divisible by p."""
    _check(num_ranks, num_microbatches)
    if num_chunks < 1:
        raise ValueError(f"num_chunks (v) must be at least 1, got {num_chunks}")
    if num_microbatches % num_ranks:
        raise ValueError(f"the interleaved schedule needs the micro-batches (m={num_microbatches}) "
                         f"to be a multiple of the pipeline ranks (p={num_ranks})")
    # BEGIN SOLUTION pp.interleaved: per rank r: forward k -> (mb, chunk) = ((k // (p*v)) * p + k % p, (k // p) % v); backward k -> same mb, chunk v-1-(k // p) % v; stage = chunk * p + r; warm-up w, then F/B pairs, then B's
    p, m, v = num_ranks, num_microbatches, num_chunks
    total = m * v

    def forward(k: int, r: int) -> Action:
        return Action("F", (k // (p * v)) * p + k % p, ((k // p) % v) * p + r)

    def backward(k: int, r: int) -> Action:
        return Action("B", (k // (p * v)) * p + k % p, (v - 1 - (k // p) % v) * p + r)

    schedule = []
    for r in range(p):
        warmup = min((v - 1) * p + 2 * (p - 1 - r), total)
        actions = [forward(k, r) for k in range(warmup)]
        for j in range(total - warmup):
            actions += [forward(warmup + j, r), backward(j, r)]
        actions += [backward(k, r) for k in range(total - warmup, total)]
        schedule.append(actions)
    return schedule
    # END SOLUTION


def zero_bubble_h1(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023; PyTorch's ScheduleInterleavedZeroBubble with one chunk): the
    order of F's and B's of 1F1B, where B is now only the input gradient, and each W
    follows later: rank s runs W(i) right after B(i + s) (the first stage right after
    B(i)), and the W's still missing at the end close the list, in micro-batch order. Rank
    s thus keeps s weight gradients pending to fill its share of the bubble."""
    _check(num_ranks, num_microbatches)
    # BEGIN SOLUTION pp.zero_bubble: take 1F1B's list for rank s; after B(j) insert W(j - s) when j >= s; append the remaining W's in order
    schedule = []
    for s, actions in enumerate(one_f_one_b(num_ranks, num_microbatches)):
        out, next_w = [], 0
        for action in actions:
            out.append(action)
            if action.kind == "B" and action.microbatch >= s:
                out.append(Action("W", action.microbatch - s, s))
                next_w += 1
        out += [Action("W", i, s) for i in range(next_w, num_microbatches)]
        schedule.append(out)
    return schedule
    # END SOLUTION


# ----------------------------------------------------------------------------- the clock (given)


@dataclass
class Timeline:
    spans: list[tuple[int, float, float, Action]]   # (rank, start, end, action)
    makespan: float
    peak_in_flight: list[int]                         # per rank: most micro-batches holding activations

    def bubble(self) -> float:
        """Idle fraction of the ranks' time between 0 and the makespan."""
        busy = sum(end - start for _, start, end, _ in self.spans)
        ranks = 1 + max(rank for rank, *_ in self.spans)
        return 1.0 - busy / (ranks * self.makespan)


def simulate(schedule: Schedule, num_stages: int | None = None, cost: dict | None = None) -> Timeline:
    """Run every rank's list on a clock: an action starts when its rank is free and what it
    needs exists (F(i, s) after F(i, s-1); B(i, s) after F(i, s) and B(i, s+1); W(i, s)
    after B(i, s)). ``cost`` maps "F"/"B"/"W" to durations (default 1, 2 and 0 when B is the
    full backward; 1, 1, 1 when a schedule has W's). Raises ValueError if the lists can
    never finish (an action waits for one that comes later on the same rank: a deadlock)."""
    num_ranks = len(schedule)
    stages = num_stages or 1 + max(a.stage for actions in schedule for a in actions)
    split = any(a.kind == "W" for actions in schedule for a in actions)
    cost = cost or ({"F": 1.0, "B": 1.0, "W": 1.0} if split else {"F": 1.0, "B": 2.0, "W": 0.0})
    done: dict[tuple, float] = {}
    position, free_at = [0] * num_ranks, [0.0] * num_ranks
    spans, in_flight, peak = [], [0] * num_ranks, [0] * num_ranks
    release = "W" if split else "B"

    def ready(a: Action) -> float | None:
        needs = []
        if a.kind == "F" and a.stage > 0:
            needs.append(("F", a.microbatch, a.stage - 1))
        if a.kind == "B":
            needs.append(("F", a.microbatch, a.stage))
            if a.stage < stages - 1:
                needs.append(("B", a.microbatch, a.stage + 1))
        if a.kind == "W":
            needs.append(("B", a.microbatch, a.stage))
        if any(n not in done for n in needs):
            return None
        return max([done[n] for n in needs], default=0.0)

    remaining = sum(len(actions) for actions in schedule)
    while remaining:
        progressed = False
        for rank, actions in enumerate(schedule):
            while position[rank] < len(actions):
                action = actions[position[rank]]
                at = ready(action)
                if at is None:
                    break
                start = max(at, free_at[rank])
                end = start + cost[action.kind]
                done[(action.kind, action.microbatch, action.stage)] = end
                free_at[rank] = end
                spans.append((rank, start, end, action))
                in_flight[rank] += {"F": 1, release: -1}.get(action.kind, 0)
                peak[rank] = max(peak[rank], in_flight[rank])
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: actions[position[r]] for r, actions in enumerate(schedule) if position[r] < len(actions)}
            raise ValueError(f"this schedule can never finish: each rank waits on its next action {stuck}")
    return Timeline(spans, max(end for _, _, end, _ in spans), peak)


def bubble_formula(num_ranks: int, num_microbatches: int, num_chunks: int = 1) -> float:
    """(p - 1) / (v m + p - 1): the idle fraction of GPipe and 1F1B (v = 1) and of the
    interleaved schedule with v chunks per rank, for equal stages."""
    p, m, v = num_ranks, num_microbatches, num_chunks
    return (p - 1) / (v * m + p - 1)


# ----------------------------------------------------------------------------- deferred weights (given)


class _LinearWithDeferredWeight(torch.autograd.Function):
    """y = x W^T + b whose backward computes only dx, and leaves dW, db to a later W."""

    @staticmethod
    def forward(ctx, x, weight, bias, pending):
        ctx.save_for_backward(x, weight)
        ctx.bias, ctx.pending = bias, pending
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        ctx.pending.append((weight, ctx.bias, x, grad_out))  # the W pass computes these later
        return grad_out @ weight, None, None, None


def accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    param.grad = grad if param.grad is None else param.grad + grad


def run_weight_gradients(pending: list) -> None:
    """W: the weight and bias gradients the deferred Linear layers left behind."""
    for weight, bias, x, grad_out in pending:
        g, inp = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
        accumulate(weight, g.t() @ inp)
        if bias is not None:
            accumulate(bias, g.sum(0))
    pending.clear()


class DeferredWeights:
    """Makes every ``nn.Linear`` of a stage defer its weight gradients to a W action: the
    runner points ``current`` at the list of the micro-batch whose forward is running."""

    def __init__(self, stage: nn.Module):
        self.current: list = []
        for module in stage.modules():
            if isinstance(module, nn.Linear):
                module.forward = self._forward_of(module)

    def _forward_of(self, linear: nn.Linear):
        def forward(x):
            return _LinearWithDeferredWeight.apply(x, linear.weight, linear.bias, self.current)
        return forward


# ----------------------------------------------------------------------------- the runner (given)


@dataclass
class Trace:
    events: list[tuple[Action, float, float]] = field(default_factory=list)  # (action, start, end)
    waits: list[tuple[Action, float, float]] = field(default_factory=list)   # (action, start, end)
    peak_in_flight: dict[int, int] = field(default_factory=dict)             # stage -> micro-batches

    def order(self) -> list[Action]:
        return [a for a, _, _ in self.events]

    def busy(self) -> float:
        """Seconds spent computing (an event starts once its input has arrived; the time
        spent waiting for it is in ``waits``)."""
        return sum(end - start for _, start, end in self.events)


class PipelineRunner:
    """Runs this rank's actions of one training step.

    ``stages``: {global stage index: stage module} held by this rank; ``num_stages``: all of
    them; ``deferred_weights=True`` for schedules with W actions. ``step`` returns the step's
    loss on the rank of the last stage (None elsewhere) and a ``Trace``. A stage module is a
    ``StageModule`` or anything like it: ``forward`` (token ids in on the first stage, logits
    out of the last), ``hidden_size`` (activations between stages are [B, T, hidden_size]),
    and optionally ``tied``/``tied_weight()``. The batch is cut into m micro-batches with
    ``tensor_split`` (uneven when m does not divide B); each micro-batch's loss is weighted by
    its share of the batch's sequences, so that with a per-token mean ``loss_fn`` the step's
    loss and gradients are the whole batch's."""

    def __init__(self, stages: dict[int, StageModule], num_stages: int, *, deferred_weights: bool = False,
                 group=None):
        self.stages, self.num_stages, self.group = stages, num_stages, group
        self.num_ranks = dist.get_world_size(group)
        self.deferred = {s: DeferredWeights(m) for s, m in stages.items()} if deferred_weights else {}
        self.tied = [w for m in stages.values() if (w := getattr(m, "tied_weight", lambda: None)()) is not None]
        ends = sorted({rank_of_stage(0, self.num_ranks), rank_of_stage(num_stages - 1, self.num_ranks)})
        tied_model = any(getattr(m, "tied", False) for m in stages.values())
        if tied_model and group is not None and len(ends) == 2:
            raise ValueError("a tied embedding split over a pipeline subgroup is not supported here: "
                             "use GPTConfig(tie_weights=False) (every pipeline would need its own pair group)")
        # Every rank takes part in making a group, even those outside it.
        self.tied_group = dist.new_group(ends) if tied_model and len(ends) == 2 else None

    def step(self, actions: list[Action], inputs, targets, num_microbatches: int, loss_fn,
             after_action=None) -> tuple:
        m, last = num_microbatches, self.num_stages - 1
        micro_inputs, micro_targets = inputs.tensor_split(m), targets.tensor_split(m)
        kept, pending_w = {}, {}
        # Sends in flight. Gloo completes a send's bookkeeping only in wait(), and waiting
        # early could block on a peer that waits for us. An activation sent for (i, s) has
        # surely arrived once the gradient for (i, s) comes back: wait for it there. Gradients
        # sent backwards (input-sized) are waited for at the end of the step.
        forward_sends, backward_sends = {}, []
        trace, in_flight, total_loss = Trace(), {s: 0 for s in self.stages}, None
        if any(a.kind == "W" for a in actions) and not self.deferred:
            raise ValueError("this schedule has W actions: make the runner with deferred_weights=True")
        for action in actions:
            i, s = action.microbatch, action.stage
            stage, start = self.stages[s], time.perf_counter()
            if action.kind == "F":
                if s == 0:
                    x = micro_inputs[i]
                else:
                    shape = (*micro_inputs[i].shape[:2], stage.hidden_size)
                    x = recv_forward(shape, self._dtype(stage), i, s, self.num_ranks, self.group,
                                     device=self._device(stage)).requires_grad_()
                    start = self._waited(trace, action, start)
                if s in self.deferred:
                    self.deferred[s].current = pending_w.setdefault((i, s), [])
                out = stage(x)
                if s == last:  # weighted by its share of the batch (tensor_split is uneven if m does not divide B)
                    part = loss_fn(out, micro_targets[i])
                    out = part / m if len(targets) % m == 0 else part * (len(micro_targets[i]) / len(targets))
                    total_loss = out.detach() if total_loss is None else total_loss + out.detach()
                else:
                    forward_sends[(i, s)] = send_forward(out.detach(), i, s, self.num_ranks, self.group)
                kept[(i, s)] = (x, out)
                in_flight[s] += 1
                trace.peak_in_flight[s] = max(trace.peak_in_flight.get(s, 0), in_flight[s])
            elif action.kind == "B":
                x, out = kept.pop((i, s))
                grad = None if s == last else recv_backward(out.shape, out.dtype, i, s, self.num_ranks,
                                                            self.group, device=out.device)
                if s != last:
                    start = self._waited(trace, action, start)
                    forward_sends.pop((i, s)).wait()  # its gradient came back: it was received
                torch.autograd.backward(out, grad)
                if s > 0:
                    backward_sends.append((send_backward(x.grad, i, s, self.num_ranks, self.group), x.grad))
                del x, out
                if s not in self.deferred:
                    in_flight[s] -= 1
            elif action.kind == "W":
                run_weight_gradients(pending_w.pop((i, s)))
                in_flight[s] -= 1
            trace.events.append((action, start, time.perf_counter()))
            if after_action is not None:  # e.g. a memory probe
                after_action(action)
        for work in [*forward_sends.values(), *(w for w, _ in backward_sends)]:
            work.wait()  # the tensors stayed referenced until their sends completed
        if self.tied_group is not None:  # a tied wte/lm_head split over two ranks: sum the halves
            for weight in self.tied:
                dist.all_reduce(weight.grad, group=self.tied_group)
        return total_loss, trace

    @staticmethod
    def _waited(trace: Trace, action: Action, since: float) -> float:
        """Record the wait for an input that just arrived; the action's compute starts now."""
        now = time.perf_counter()
        trace.waits.append((action, since, now))
        return now

    @staticmethod
    def _dtype(stage: nn.Module) -> torch.dtype:
        return next(stage.parameters()).dtype

    @staticmethod
    def _device(stage: nn.Module) -> torch.device:
        return next(stage.parameters()).device


def gpt_loss(logits, targets):
    """The GPT's loss on a micro-batch (the last stage's output)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
