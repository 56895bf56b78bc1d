"""``labkit bench`` rows of chapter 13 (rpc): RPC against the c10d way of doing the same.

* ``rpc_latency``: α of a round trip, ``rpc_sync`` of an 8-byte tensor to a function that
  returns it, against a gloo send and a gloo send back of the same bytes (medians);
* ``rpc_parameter_server``: one iteration of the synchronous batching server (chapter 13)
  against chapter 01's collective parameter server on the same model, data and ranks, with
  the bytes one trainer sends per iteration against the formula P x b (its gradient).
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.course.bench.runner import BenchRow, row
from labkit.launch import launch, rpc_name
from labkit.timing import interleaved_medians

PING_BYTES = 8


def echo(t: torch.Tensor) -> torch.Tensor:
    return t


def _latency(repeats: int) -> dict:
    from labkit import rpc as R
    rank = dist.get_rank()
    ping = torch.zeros(PING_BYTES // 8, dtype=torch.float64)

    def by_rpc(t):
        if rank == 0:
            R.rpc_sync(rpc_name(1), echo, t)

    def by_gloo(t):
        if rank == 0:
            dist.send(t, dst=1)
            dist.recv(t, src=1)
        elif rank == 1:
            dist.recv(t, src=0)
            dist.send(t, dst=0)

    medians = interleaved_medians({"ours": by_rpc, "builtin": by_gloo}, lambda: ping.clone(), repeats, warmup=5)
    with R.RpcTracer() as tracer:
        by_rpc(ping)
    return dict(medians, sent=tracer.totals()["sent"])


@row("rpc_latency", lambda n: n >= 2,
     "a round trip needs 2 ranks")
def rpc_latency_row(repeats: int = 51, world_size: int = 2) -> BenchRow:
    """a round trip by rpc_sync vs a gloo send + send back of the same 8 bytes"""
    r = launch(_latency, world_size, repeats, rpc=True)[0]
    return BenchRow(f"round trip of {PING_BYTES} B: rpc_sync vs gloo send/recv, {world_size} ranks",
                    r["ours"], r["builtin"], r["sent"], PING_BYTES,
                    extra=dict(alpha_rpc_us=r["ours"] / 2 * 1e6, alpha_gloo_us=r["builtin"] / 2 * 1e6))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))


def _servers(repeats: int, iterations: int) -> dict:
    from labkit import dp
    from labkit import rpc as R
    rank, n = dist.get_rank(), dist.get_world_size()
    trainers = list(range(1, n))
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16 * len(trainers), 64, generator=gen), torch.randn(16 * len(trainers), 64, generator=gen))
               for _ in range(iterations)]

    def loss(out, y):
        return ((out - y) ** 2).mean()

    runs = itertools.count()

    def by_rpc(_):
        name = f"bench_ps_{next(runs)}"  # a fresh server each run; every rank counts alike
        if rank == 0:
            server = R.start_batching_server(_model(), len(trainers), 0.01, name=name)
            server.wait_until_done(iterations, [rpc_name(t) for t in trainers])
        else:
            index = trainers.index(rank)
            shards = [(x.tensor_split(len(trainers))[index], y.tensor_split(len(trainers))[index]) for x, y in batches]
            R.train_batching(R.connect(rpc_name(0), name), rank, _model(), loss, shards)

    def by_collectives(_):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01) if rank == 0 else None
        dp.run_parameter_server(model, opt, lambda m, x, y: loss(m(x), y), batches, staleness=0)

    medians = interleaved_medians({"ours": by_rpc, "builtin": by_collectives}, lambda: None, repeats, warmup=1)
    from labkit.comm import CommTracer
    with R.RpcTracer() as tracer:  # after the timing: one more run of each, traced
        by_rpc(None)
    with CommTracer() as p2p:
        by_collectives(None)
    params = sum(p.numel() for p in _model().parameters())
    # per iteration, as rank 1 (a trainer) sees it; ch01 also broadcasts the final model once
    return dict(ours=medians["ours"] / iterations, builtin=medians["builtin"] / iterations,
                sent=tracer.totals()["sent"] / iterations, received=tracer.totals()["received"] / iterations,
                ch01_sent=(p2p.sent_bytes()) / iterations, grad_bytes=params * 4)


@row("rpc_parameter_server", lambda n: n >= 2,
     "a server and at least one trainer")
def rpc_parameter_server_row(repeats: int = 5, world_size: int = 3, iterations: int = 5) -> BenchRow:
    """one iteration of the synchronous batching server (RPC) vs chapter 01's (send/recv)"""
    r = launch(_servers, world_size, repeats, iterations, rpc=True)[1]
    return BenchRow(f"PS iteration, batching server (RPC) vs ch01 (p2p), {r['grad_bytes'] / 2**10:.0f} KB grads, "
                    f"{world_size - 1} trainers", r["ours"], r["builtin"], r["sent"], r["grad_bytes"],
                    extra={"trainer_received_B": r["received"], "ch01_trainer_sent_B": r["ch01_sent"]})
