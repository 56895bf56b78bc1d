"""Chapter 13 exercises: training over RPC (``torch.distributed.rpc``).

Collectives make every rank do the same thing at the same time (SPMD). RPC is the other way
PyTorch offers to spread training: one process *calls a function on another* and gets the
answer back, a future of it, or a remote reference (``RRef``) to a value that stays where it
was made. That fits what is not symmetric: a parameter server that owns the model while
trainers come and go, a pipeline whose stages live on different machines, state that one
process owns. Three pieces make training work across such calls:

* ``RRef``: a reference to a value owned by another worker. ``rref.owner()`` says who holds
  it, ``rref.to_here()`` copies the value over, ``rref.local_value()`` is the value itself
  on its owner. The owner keeps the value alive while any worker holds a reference to it
  (reference counting by messages between the workers).
* distributed autograd: inside ``with dist_autograd.context() as context_id``, every RPC that
  carries a tensor needing gradients records a send function on the caller and a recv
  function on the callee, both filed under that context id. ``dist_autograd.backward(
  context_id, [loss])`` then runs the backward pass across the workers along those edges,
  and each worker keeps the gradients of its own tensors in its copy of the context
  (``dist_autograd.get_gradients(context_id)``), not in ``.grad``: several trainers can
  backpropagate through one server at once without mixing their gradients.
* ``DistributedOptimizer(optimizer_class, parameter_rrefs, **kwargs)``: one local optimizer
  per owner of the parameters; ``step(context_id)`` asks each owner to apply the gradients
  of that context.

Names: under ``labkit.launch(fn, n, rpc=True)`` rank r is the RPC worker ``"worker{r}"``
(``labkit.launch.rpc_name``). Every RPC this module makes goes through ``rpc_sync``,
``rpc_async``, ``remote`` and ``fetch`` below, thin wrappers of torch's that an
``RpcTracer`` can count: messages, peers and tensor bytes, like ``labkit.comm`` does for
collectives (which cannot see RPC).

Tasks (run ``labkit grade rpc``; tests in ``tests/grading/test_rpc.py``):
    rpc.remote_ps      a parameter server as a remote object: remote_forward, remote_step,
                       remote_gradients, make_optimizer (trainers hold an RRef to it)
    rpc.batching_ps    BatchingServer.pull / .push (sum n trainers' gradients weighted by their
                       shards' rows, one atomic update, a staleness bound like chapter 01's) and
                       train_batching (a trainer)
    rpc.pipeline       Stage.forward and RpcPipeline.forward: stages on their workers (two or
                       more), micro-batches in flight at once through futures, one at a time
                       in each stage

Given, not graded: ``RequestBatcher``, batched inference behind RPC (many callers, one forward
for all of them), which lab 13's actor-learner section runs.
"""

from __future__ import annotations

import threading
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn as nn
from torch.distributed import rpc as torch_rpc
from torch.distributed.optim import DistributedOptimizer

from labkit.dp import ServerLog

# DistributedOptimizer builds TorchScript functional optimizers on the parameters' owners,
# and torch warns about that on every owner, inside ``catch_warnings`` + ``simplefilter
# ("always")``, so no filter can silence it. The API works (it is in maintenance mode), and
# the warning would fill every notebook cell: drop that one message where warnings are shown.
_SCRIPTED_OPTIMIZER_NOTE = "`TorchScript` support for functional optimizers is deprecated"


def _show_warning_but_the_scripted_optimizer_note(message, *args, _show=warnings.showwarning, **kwargs):
    if _SCRIPTED_OPTIMIZER_NOTE not in str(message):
        _show(message, *args, **kwargs)


if not getattr(warnings.showwarning, "_labkit_rpc", False):
    _show_warning_but_the_scripted_optimizer_note._labkit_rpc = True
    warnings.showwarning = _show_warning_but_the_scripted_optimizer_note

# ----------------------------------------------------------------------------- tracing RPCs


@dataclass
class Message:
    """One RPC this worker made. ``kind``: "rpc_sync", "rpc_async", "remote" or "to_here";
    ``peer``: the worker called; ``fn``: the function's name; ``sent``: tensor bytes in the
    arguments; ``received``: tensor bytes in the reply (a ``remote`` gets an RRef: 0)."""
    kind: str
    peer: str
    fn: str
    sent: int
    received: int = 0

    def key(self) -> tuple:
        return (self.kind, self.peer, self.fn, self.sent, self.received)


class RpcTracer:
    """Records every call made through this module's wrappers, on any thread of this worker,
    while active: ``with RpcTracer() as tracer: ...; tracer.messages``."""

    _active: list["RpcTracer"] = []
    _lock = threading.Lock()

    def __init__(self):
        self.messages: list[Message] = []

    def __enter__(self):
        with RpcTracer._lock:
            RpcTracer._active.append(self)
        return self

    def __exit__(self, *exc):
        with RpcTracer._lock:
            RpcTracer._active.remove(self)

    @classmethod
    def record(cls, message: Message) -> None:
        with cls._lock:
            for tracer in cls._active:
                tracer.messages.append(message)

    def totals(self) -> dict:
        return dict(messages=len(self.messages), sent=sum(m.sent for m in self.messages),
                    received=sum(m.received for m in self.messages))


def tensor_bytes(value) -> int:
    """Bytes of every tensor in ``value`` (nested tuples, lists, dicts); RRefs count 0."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(tensor_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    return 0


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _peer(to) -> str:
    return to.name if isinstance(to, torch_rpc.WorkerInfo) else str(to)


def _raise_if_error(value):
    """An ``@async_execution`` function whose future failed (``set_exception``) reaches the
    caller as the exception object, returned rather than raised (torch 2.13): raise it."""
    if isinstance(value, BaseException):
        raise value
    return value


def rpc_sync(to, fn, *args, **kwargs):
    """``torch.distributed.rpc.rpc_sync(to, fn, args, kwargs)``, traced."""
    message = Message("rpc_sync", _peer(to), _name(fn), tensor_bytes((args, kwargs)))
    RpcTracer.record(message)
    result = _raise_if_error(torch_rpc.rpc_sync(to, fn, args=args, kwargs=kwargs))
    message.received = tensor_bytes(result)
    return result


def rpc_async(to, fn, *args, **kwargs) -> torch.futures.Future:
    """``torch.distributed.rpc.rpc_async``, traced: the future returned completes after the
    reply's bytes are recorded."""
    message = Message("rpc_async", _peer(to), _name(fn), tensor_bytes((args, kwargs)))
    RpcTracer.record(message)

    def count_reply(fut):
        message.received = tensor_bytes(_raise_if_error(fut.value()))
        return fut.value()

    return torch_rpc.rpc_async(to, fn, args=args, kwargs=kwargs).then(count_reply)


def remote(to, fn, *args, **kwargs) -> torch_rpc.RRef:
    """``torch.distributed.rpc.remote``, traced: the value stays with ``to``."""
    RpcTracer.record(Message("remote", _peer(to), _name(fn), tensor_bytes((args, kwargs))))
    return torch_rpc.remote(to, fn, args=args, kwargs=kwargs)


def fetch(rref: torch_rpc.RRef):
    """``rref.to_here()``, traced (a local value costs no message)."""
    if rref.is_owner():
        return rref.local_value()
    value = rref.to_here()
    RpcTracer.record(Message("to_here", rref.owner().name, "", 0, tensor_bytes(value)))
    return value


def worker_name() -> str:
    return torch_rpc.get_worker_info().name


# ----------------------------------------------------------------------------- finding each other

_SERVED: dict[str, torch_rpc.RRef] = {}
_SERVED_CHANGED = threading.Condition()


def serve(obj, name: str) -> torch_rpc.RRef:
    """On the owner: keep ``obj`` under ``name`` for ``connect``; return the RRef to it."""
    rref = torch_rpc.RRef(obj)
    with _SERVED_CHANGED:
        _SERVED[name] = rref
        _SERVED_CHANGED.notify_all()
    return rref


def _served(name: str, timeout: float) -> torch_rpc.RRef:
    with _SERVED_CHANGED:
        if not _SERVED_CHANGED.wait_for(lambda: name in _SERVED, timeout):
            raise LookupError(f"{worker_name()} serves nothing called {name!r} after {timeout:g} s")
        return _SERVED[name]


def connect(owner: str, name: str, timeout: float = 60.0) -> torch_rpc.RRef:
    """On any worker: the RRef to what ``owner`` serves under ``name`` (waits until it does)."""
    return torch_rpc.rpc_sync(owner, _served, args=(name, timeout))


# ----------------------------------------------------------------------------- rpc.remote_ps
#
# The server owns the model. A trainer holds an RRef to the server: its forward is an RPC
# (the output comes back; under a dist_autograd context the RPC is an edge of the graph),
# the loss is computed locally, dist_autograd.backward sends the output's gradient back along
# that edge into the server's model, and a DistributedOptimizer applies it where the
# parameters live. Per step, per trainer: one rpc_sync carrying the batch x (B x H_in x b
# bytes) and bringing back the output (B x H_out x b); backward sends the output's gradient
# (B x H_out x b) to the server; the optimizer step is one message to the owner. (The design
# of PyTorch's tutorial "Implementing a Parameter Server Using Distributed RPC Framework",
# pytorch.org/tutorials/intermediate/rpc_param_server_tutorial.html.)


class ParameterServer:
    """The model and what trainers may ask of it; lives on its owner."""

    def __init__(self, model: nn.Module):
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def parameter_rrefs(self) -> list[torch_rpc.RRef]:
        return [torch_rpc.RRef(p) for p in self.model.parameters()]

    def gradients(self, context_id: int) -> list[torch.Tensor]:
        """The gradients of the parameters in distributed autograd context ``context_id``."""
        grads = dist_autograd.get_gradients(context_id)
        return [grads[p] if p in grads else torch.zeros_like(p) for p in self.model.parameters()]

    def parameters(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


# What a trainer runs on the server, by RPC: the RRef's owner calls the method on its object.
def server_forward(server: torch_rpc.RRef, x: torch.Tensor) -> torch.Tensor:
    return server.local_value().forward(x)


def server_parameter_rrefs(server: torch_rpc.RRef) -> list[torch_rpc.RRef]:
    return server.local_value().parameter_rrefs()


def server_gradients(server: torch_rpc.RRef, context_id: int) -> list[torch.Tensor]:
    return server.local_value().gradients(context_id)


def server_parameters(server: torch_rpc.RRef) -> list[torch.Tensor]:
    return server.local_value().parameters()


def start_server(model: nn.Module, name: str = "ps") -> torch_rpc.RRef:
    """On the server's worker: serve ``model`` (trainers ``connect(owner, name)``)."""
    return serve(ParameterServer(model), name)


def make_optimizer(server: torch_rpc.RRef, lr: float, optimizer_class=torch.optim.SGD,
                   **optimizer_kwargs) -> DistributedOptimizer:
    """A ``DistributedOptimizer`` running ``optimizer_class(lr=lr, **optimizer_kwargs)`` (SGD by
    default; momentum SGD, AdamW: its state lives with the parameters, on the server) on the
    server's parameters, from a trainer. Each trainer that calls it gets its own optimizer
    (and optimizer state) on the server."""
    # BEGIN SOLUTION rpc.remote_ps: the parameters' RRefs come from the server (rpc_sync server_parameter_rrefs); DistributedOptimizer(optimizer_class, rrefs, lr=lr, **optimizer_kwargs)
    rrefs = rpc_sync(server.owner(), server_parameter_rrefs, server)
    return DistributedOptimizer(optimizer_class, rrefs, lr=lr, **optimizer_kwargs)
    # END SOLUTION


def remote_forward(server: torch_rpc.RRef, x: torch.Tensor) -> torch.Tensor:
    """The server's model applied to ``x``, run on the server; the output comes back."""
    # BEGIN SOLUTION rpc.remote_ps: rpc_sync to server.owner() running server_forward(server, x)
    return rpc_sync(server.owner(), server_forward, server, x)
    # END SOLUTION


def remote_step(server: torch_rpc.RRef, optimizer: DistributedOptimizer, loss_fn, x, y) -> float:
    """One SGD step of the server's model on ``(x, y)``: forward by RPC, loss here, backward
    with distributed autograd, the step where the parameters live. Returns the loss."""
    # BEGIN SOLUTION rpc.remote_ps: with dist_autograd.context() as ctx: loss = loss_fn(remote_forward(server, x), y); dist_autograd.backward(ctx, [loss]); optimizer.step(ctx)
    with dist_autograd.context() as context_id:
        loss = loss_fn(remote_forward(server, x), y)
        dist_autograd.backward(context_id, [loss])
        optimizer.step(context_id)
    return loss.item()
    # END SOLUTION


def remote_gradients(server: torch_rpc.RRef, loss_fn, x, y) -> list[torch.Tensor]:
    """The gradient of ``loss_fn(model(x), y)`` for each of the server's parameters, computed
    by distributed autograd and fetched from the server; the parameters do not change."""
    # BEGIN SOLUTION rpc.remote_ps: in a dist_autograd context: forward by RPC, dist_autograd.backward; then rpc_sync server_gradients(server, ctx) before the context closes
    with dist_autograd.context() as context_id:
        loss = loss_fn(remote_forward(server, x), y)
        dist_autograd.backward(context_id, [loss])
        return rpc_sync(server.owner(), server_gradients, server, context_id)
    # END SOLUTION


def train_remote(server: torch_rpc.RRef, loss_fn, batches: list[tuple], lr: float,
                 optimizer_class=torch.optim.SGD, **optimizer_kwargs) -> list[float]:
    """A trainer: ``remote_step`` on each ``(x, y)`` with one ``make_optimizer(server, lr,
    optimizer_class, **optimizer_kwargs)``; returns the losses."""
    if lr <= 0:
        raise ValueError(f"lr must be positive, got {lr}")
    optimizer = make_optimizer(server, lr, optimizer_class, **optimizer_kwargs)
    return [remote_step(server, optimizer, loss_fn, x, y) for x, y in batches]


# ----------------------------------------------------------------------------- rpc.batching_ps
#
# Trainers keep a local copy of the model, compute gradients locally (plain autograd) and
# send them with their shard's row count; the server sums the n trainers' gradients of an
# iteration, each weighted by its rows, and applies ONE update (sum of rows_k * g_k over the sum
# of rows_k: the gradient of the mean loss over the global batch, so n trainers on shards of any
# sizes, 7 + 6 rows or 5 + 4 + 4, step like one process on the whole batch; a plain mean of the
# g_k would weight a 4-row shard like a 5-row one), then
# answers with the new parameters. It answers from @async_execution functions: such a
# function returns a Future, and the RPC's reply is sent when that future completes, so the
# server's thread is free while a trainer waits for the others (PyTorch's tutorial
# "Implementing Batch RPC Processing Using Asynchronous Executions",
# pytorch.org/tutorials/intermediate/rpc_async_execution.html).
#
# Versions and staleness as in chapter 01 (labkit.dp): version v is the model after v
# updates; update i averages the gradients of iteration i; a trainer asking for the
# parameters of iteration i gets version v once v >= i - staleness (staleness 0: synchronous
# SGD). The gradient of iteration i computed on version v has staleness i - v <= the bound
# (stale synchronous parallel, Ho et al., NeurIPS 2013).
# Per iteration, per trainer: one rpc_sync carrying the flat gradient (P x b bytes) and
# bringing back the flat parameters (P x b bytes): 2 n P b through the server per update.
# ``loss_fn`` is a mean over its rows (as the course's losses are). A frozen parameter
# (``requires_grad=False``) gets no gradient on the server (``.grad`` None), so an optimizer
# with weight decay or momentum leaves it where it is, as it would in one process.


class TrainerLost(RuntimeError):
    """A trainer stopped answering while the server waited for its gradient."""


class BatchingServer:
    """Parameters, one optimizer, and the gradients of iterations not yet complete."""

    def __init__(self, model: nn.Module, num_trainers: int, optimizer: torch.optim.Optimizer,
                 staleness: int = 0):
        if num_trainers < 1:
            raise ValueError(f"num_trainers must be at least 1, got {num_trainers}")
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        self.model, self.num_trainers, self.optimizer = model, num_trainers, optimizer
        self.staleness = staleness
        self.version = 0                         # updates applied so far
        self.rounds: dict[int, list] = {}        # iteration -> [sum of rows x gradient, how many, rows]
        self.waiting: list[tuple[int, torch.futures.Future]] = []  # pulls not answered yet
        self.log = ServerLog(staleness)          # (trainer, iteration, version) per gradient
        self.lock = threading.Lock()
        self.failure: BaseException | None = None

    def snapshot(self) -> tuple[list[torch.Tensor], int]:
        """(copies of the parameters, their version)."""
        return [p.detach().clone() for p in self.model.parameters()], self.version

    def pull(self, iteration: int) -> torch.futures.Future:
        """A future of ``snapshot()`` for a trainer starting ``iteration``: completed now if
        ``version >= iteration - staleness``, else kept in ``self.waiting`` for ``push``."""
        # BEGIN SOLUTION rpc.batching_ps: under self.lock: a torch.futures.Future(); set_result(self.snapshot()) if fresh enough, else append (iteration, future) to self.waiting
        future = torch.futures.Future()
        with self.lock:
            if self.failure is not None:
                future.set_exception(self.failure)
            elif self.version >= iteration - self.staleness:
                future.set_result(self.snapshot())
            else:
                self.waiting.append((iteration, future))
        return future
        # END SOLUTION

    def push(self, trainer: int, iteration: int, version: int, grads: list[torch.Tensor], rows: int = 1) -> None:
        """Trainer ``trainer``'s gradients of ``iteration`` (the mean loss over its ``rows``
        rows), computed on ``version``: log them, add ``rows x grads`` to the iteration's sum;
        while the next iteration to apply has all ``num_trainers`` gradients, apply the sum over
        the iteration's rows (``.grad``, None for a frozen parameter; ``optimizer.step()``) and
        count the version; then complete every waiting pull now fresh enough. Atomic: the
        whole update happens under ``self.lock``, so no pull or push sees half of it."""
        # BEGIN SOLUTION rpc.batching_ps: under self.lock: log (trainer, iteration, version); rounds[iteration] += rows x grads, rows; while rounds[self.version] is complete: p.grad = sum / total rows (None if frozen), step, version += 1; answer the waiting pulls with version >= it - staleness
        with self.lock:
            self.log.applied.append((trainer, iteration, version))
            entry = self.rounds.setdefault(iteration, [[torch.zeros_like(g) for g in grads], 0, 0])
            for total, g in zip(entry[0], grads):
                total += rows * g
            entry[1] += 1
            entry[2] += rows
            while self.version in self.rounds and self.rounds[self.version][1] == self.num_trainers:
                sums, _, total_rows = self.rounds.pop(self.version)
                for p, total in zip(self.model.parameters(), sums):
                    p.grad = total / total_rows if p.requires_grad else None
                self.optimizer.step()
                self.version += 1
            ready = [(it, f) for it, f in self.waiting if self.version >= it - self.staleness]
            self.waiting = [(it, f) for it, f in self.waiting if self.version < it - self.staleness]
            answer = self.snapshot() if ready else None
        for _, future in ready:
            future.set_result(answer)
        # END SOLUTION

    def fail(self, error: BaseException) -> None:
        """Every waiting pull, and every later one, fails with ``error``."""
        with self.lock:
            self.failure, waiting, self.waiting = error, self.waiting, []
        for _, future in waiting:
            future.set_exception(error)

    @staticmethod
    @torch_rpc.functions.async_execution
    def push_and_pull(server: torch_rpc.RRef, trainer: int, iteration: int, version: int,
                      grads: list[torch.Tensor] | None, rows: int = 1) -> torch.futures.Future:
        """By RPC from a trainer: push the gradients of ``iteration`` over ``rows`` rows (None:
        nothing to push), and get the parameters for the next iteration (``iteration`` itself
        when pulling only). The reply leaves when the returned future completes."""
        self = server.local_value()
        if grads is None:
            return self.pull(iteration)
        self.push(trainer, iteration, version, grads, rows)
        return self.pull(iteration + 1)

    def wait_until_done(self, num_steps: int, trainers: list[str], poll: float = 0.1) -> ServerLog:
        """On the owner: wait until ``num_steps`` updates are applied. A trainer that died is
        noticed by a ping every ``poll`` seconds: the waiting pulls fail with ``TrainerLost``,
        and so does this call (a dead trainer's gradient would never come)."""
        while True:
            with self.lock:
                if self.version >= num_steps:
                    return self.log
                version, have = self.version, self.rounds.get(self.version, [None, 0])[1]
            for trainer in trainers:
                try:
                    torch_rpc.rpc_sync(trainer, time.time, timeout=10)
                except RuntimeError as error:
                    lost = TrainerLost(
                        f"trainer {trainer} stopped answering while the server waited for update "
                        f"{version} ({have} of {self.num_trainers} gradients in): {str(error).splitlines()[0]}")
                    self.fail(lost)
                    raise lost from None
            time.sleep(poll)


def start_batching_server(model: nn.Module, num_trainers: int, lr: float, staleness: int = 0,
                          name: str = "batching_ps", optimizer_class=torch.optim.SGD,
                          **optimizer_kwargs) -> BatchingServer:
    """On the server's worker: a ``BatchingServer`` with ``optimizer_class(lr=lr,
    **optimizer_kwargs)`` (SGD by default), served under ``name``."""
    if lr <= 0:
        raise ValueError(f"lr must be positive, got {lr}")
    optimizer = optimizer_class(model.parameters(), lr=lr, **optimizer_kwargs)
    server = BatchingServer(model, num_trainers, optimizer, staleness)
    serve(server, name)
    return server


def train_batching(server: torch_rpc.RRef, trainer: int, model: nn.Module, loss_fn, shards: list[tuple],
                   before_push=None) -> list[int]:
    """A trainer of a batching server, on its local copy ``model``: pull the parameters of
    iteration 0; for each iteration i with ``(x, y) = shards[i]``: load them, compute the
    gradient of ``loss_fn(model(x), y)`` locally, call ``before_push(trainer, i)`` if given
    (a test's straggler), then push the gradients with the shard's row count ``len(x)`` (shards
    may differ in size) and pull iteration i + 1's parameters in one ``push_and_pull``. Leaves the last parameters received in ``model``; returns the
    version each iteration was computed on."""
    # BEGIN SOLUTION rpc.batching_ps: params, version = rpc_sync(owner, BatchingServer.push_and_pull, server, trainer, 0, -1, None); per shard: copy params into model, zero grads, backward, before_push, then push_and_pull(server, trainer, i, version, grads, len(x))
    owner = server.owner()
    params, version = rpc_sync(owner, BatchingServer.push_and_pull, server, trainer, 0, -1, None)
    versions = []
    for iteration, (x, y) in enumerate(shards):
        with torch.no_grad():
            for p, value in zip(model.parameters(), params):
                p.copy_(value)
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
        if before_push is not None:
            before_push(trainer, iteration)
        versions.append(version)
        params, version = rpc_sync(owner, BatchingServer.push_and_pull, server, trainer, iteration, version, grads,
                                   len(x))
    with torch.no_grad():
        for p, value in zip(model.parameters(), params):
            p.copy_(value)
    return versions
    # END SOLUTION


# ----------------------------------------------------------------------------- batched inference (given)
#
# The other half of PyTorch's tutorial "Implementing Batch RPC Processing Using Asynchronous
# Executions" (pytorch.org/tutorials/intermediate/rpc_async_execution.html): many actors
# (the tutorial's observers) each step an environment and ask one agent for actions by RPC.
# Answered one by one, the agent runs one policy forward per request; a batcher holds each
# request in a future (@async_execution: no agent thread waits) until ``batch_size`` of them are
# in, runs ONE forward on all their rows, and answers each caller with its own rows. The
# batch's rows are in the callers' key order, not arrival order, so a run does not depend on
# which request the network delivered first.


class RequestBatcher:
    """Batched inference behind RPC: ``fn`` (a tensor of rows -> a tensor with one row of
    output per row of input, e.g. a policy's forward) runs once per ``batch_size`` requests.

    ``submit(key, x)`` (on the owner) or ``RequestBatcher.request(rref, key, x)`` (by RPC from
    a caller, e.g. ``rpc_sync(owner, RequestBatcher.request, rref, actor, x)``) hands in ``x``,
    rows first, and returns a future of ``fn``'s rows for it. When ``batch_size`` requests are
    pending, they are concatenated in the order of their ``key`` (the caller's id: ties keep
    arrival order), ``fn`` runs once, and every future completes with its slice; if ``fn``
    raises, every one of them fails with the error. ``flush()`` serves what is pending now (a
    last, smaller batch). ``served`` holds the requests per call of ``fn`` and ``rows`` its rows.
    Callers that stop sending before a batch fills leave the others waiting: size ``batch_size``
    to the callers that will come (or call ``flush``)."""

    def __init__(self, fn, batch_size: int):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        self.fn, self.batch_size = fn, batch_size
        self.pending: list[tuple] = []           # (key, x, future), in arrival order
        self.served: list[int] = []              # requests answered by each call of fn
        self.rows: list[int] = []                # rows of each call of fn
        self.lock = threading.Lock()

    def submit(self, key, x: torch.Tensor) -> torch.futures.Future:
        """A future of ``fn``'s rows for ``x``; runs ``fn`` if this request fills the batch."""
        reply = torch.futures.Future()
        with self.lock:
            self.pending.append((key, x, reply))
            answers = self._serve() if len(self.pending) >= self.batch_size else []
        self._answer(answers)
        return reply

    def flush(self) -> int:
        """Serve every pending request now, in one call of ``fn``; returns how many there were."""
        with self.lock:
            count = len(self.pending)
            answers = self._serve() if count else []
        self._answer(answers)
        return count

    def _serve(self) -> list[tuple]:
        # Under self.lock, so fn runs one batch at a time; the futures are completed by
        # _answer after the lock is released (a future's callbacks may submit again).
        batch, self.pending = sorted(self.pending, key=lambda item: item[0]), []
        sizes = [len(x) for _, x, _ in batch]
        try:
            out = self.fn(torch.cat([x for _, x, _ in batch]))
            if len(out) != sum(sizes):
                raise ValueError(f"RequestBatcher: fn returned {len(out)} rows for {sum(sizes)} rows of input")
        except Exception as error:  # noqa: BLE001 - every caller of the batch gets it
            return [(future, error) for _, _, future in batch]
        self.served.append(len(batch))
        self.rows.append(sum(sizes))
        return [(future, part) for (_, _, future), part in zip(batch, out.split(sizes))]

    @staticmethod
    def _answer(answers: list[tuple]) -> None:
        for future, value in answers:
            if isinstance(value, BaseException):
                future.set_exception(value)
            else:
                future.set_result(value)

    @staticmethod
    @torch_rpc.functions.async_execution
    def request(batcher: torch_rpc.RRef, key, x: torch.Tensor) -> torch.futures.Future:
        """By RPC from a caller: ``submit(key, x)`` on the batcher's owner; the reply leaves when
        the batch it joined has been served."""
        return batcher.local_value().submit(key, x)


# ----------------------------------------------------------------------------- rpc.pipeline
#
# A model cut in stages, each stage an object on its own worker (an RRef held by the driver).
# The driver splits the batch into M micro-batches (``tensor_split``: 13 rows in 4 are 4, 3, 3,
# 3) and, for each one, asks stage 1 to run it with ``remote`` (the output stays on stage 1's
# worker, as an RRef), every later stage but the last to run the one before's output the same
# way, and the last stage to run it with ``rpc_async`` (each stage fetches its input straight
# from the stage before, and the driver gets a future of the output). It sends every micro-batch before waiting for any output, so
# stage 1 works on micro-batch i + 1 while stage 2 works on micro-batch i; a lock per stage
# keeps one micro-batch at a time in each stage. Under a dist_autograd context the backward
# pass follows the same edges in reverse. Per micro-batch: x to stage 1 (B/M x H x b), the
# activation from stage 1 to stage 2, the output back to the driver. (PyTorch's tutorial
# "Distributed Pipeline Parallelism Using RPC",
# pytorch.org/tutorials/intermediate/dist_pipeline_parallel_tutorial.html.)


class Stage:
    """One stage of a pipeline, on its worker: a module and a lock."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.lock = threading.Lock()

    def forward(self, x) -> torch.Tensor:
        """``module(x)``, ``x`` a tensor or an RRef to one (fetched first, from its owner),
        one micro-batch at a time."""
        # BEGIN SOLUTION rpc.pipeline: x = fetch(x) if it is an RRef; then under self.lock: self.module(x)
        if isinstance(x, torch_rpc.PyRRef):  # what arrives by RPC (RRef is its typed face)
            x = fetch(x)
        with self.lock:
            return self.module(x)
        # END SOLUTION

    def parameter_rrefs(self) -> list[torch_rpc.RRef]:
        return [torch_rpc.RRef(p) for p in self.module.parameters()]

    def gradients(self, context_id: int) -> list[torch.Tensor]:
        grads = dist_autograd.get_gradients(context_id)
        return [grads[p] if p in grads else torch.zeros_like(p) for p in self.module.parameters()]


def stage_forward(stage: torch_rpc.RRef, x) -> torch.Tensor:
    return stage.local_value().forward(x)


def stage_parameter_rrefs(stage: torch_rpc.RRef) -> list[torch_rpc.RRef]:
    return stage.local_value().parameter_rrefs()


def stage_gradients(stage: torch_rpc.RRef, context_id: int) -> list[torch.Tensor]:
    return stage.local_value().gradients(context_id)


def stage_parameters(stage: torch_rpc.RRef) -> list[torch.Tensor]:
    return [p.detach().clone() for p in stage.local_value().module.parameters()]


def start_stage(worker: str, module: nn.Module) -> torch_rpc.RRef:
    """Put ``module`` (a copy, sent by RPC) on ``worker`` as a ``Stage``; return its RRef."""
    return torch_rpc.remote(worker, Stage, args=(module,))


class RpcPipeline:
    """The driver's handle on a pipeline: stage RRefs in order, and the micro-batch count."""

    def __init__(self, stages: list[torch_rpc.RRef], micro_batches: int):
        if len(stages) < 2:
            raise ValueError(f"a pipeline needs at least 2 stages, got {len(stages)}")
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be a positive int, got {micro_batches!r}")
        self.stages, self.micro_batches = list(stages), micro_batches

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The pipeline's output for the batch ``x``, micro-batch by micro-batch, all in flight:
        ``x.tensor_split(micro_batches)``, M micro-batches whose sizes differ by at most one row
        (13 rows in 4: 4, 3, 3, 3), through every stage in order (2 or more)."""
        if x.shape[0] < self.micro_batches:
            raise ValueError(f"a batch of {x.shape[0]} cannot make {self.micro_batches} micro-batches")
        # BEGIN SOLUTION rpc.pipeline: per micro-batch of x.tensor_split(M): ref = remote(owner, stage_forward, stage, ref) through every stage but the last, rpc_async on the last; torch.cat(torch.futures.wait_all(futures)) after all are sent
        futures = []
        for micro_batch in x.tensor_split(self.micro_batches):
            value = micro_batch
            for stage in self.stages[:-1]:
                value = remote(stage.owner(), stage_forward, stage, value)
            last = self.stages[-1]
            futures.append(rpc_async(last.owner(), stage_forward, last, value))
        return torch.cat(torch.futures.wait_all(futures))
        # END SOLUTION

    __call__ = forward

    def parameter_rrefs(self) -> list[torch_rpc.RRef]:
        return [r for stage in self.stages for r in rpc_sync(stage.owner(), stage_parameter_rrefs, stage)]

    def gradients(self, context_id: int) -> list[list[torch.Tensor]]:
        """Per stage, its parameters' gradients in context ``context_id``."""
        return [rpc_sync(stage.owner(), stage_gradients, stage, context_id) for stage in self.stages]

    def parameters(self) -> list[list[torch.Tensor]]:
        """Per stage, copies of its parameters."""
        return [rpc_sync(stage.owner(), stage_parameters, stage) for stage in self.stages]
