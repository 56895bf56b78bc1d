"""labkit.rpc.RequestBatcher (given code, not graded; lab 13's actor-learner section runs it):
batched inference behind RPC. In one process: a future waits until its batch is full, the batch
is in key order whatever the arrival order, every caller gets its own rows, flush serves a short
batch, an error in fn reaches every caller of its batch. Over RPC, one launch of 4 workers: three
callers' concurrent requests are served by one call of fn per round."""

import pytest
import torch
import torch.distributed as dist

import labkit
from labkit.rpc import RequestBatcher


def test_a_batch_waits_until_full_is_in_key_order_and_answers_each_caller_its_rows():
    seen = []

    def fn(x):
        seen.append(x.clone())
        return 10 * x

    batcher = RequestBatcher(fn, 3)
    arrivals = [(2, torch.tensor([[2.0], [2.5]])), (0, torch.tensor([[0.0]])), (1, torch.tensor([[1.0], [1.5], [1.25]]))]
    futures = []
    for key, x in arrivals:
        assert not seen, "fn ran before the batch was full"
        futures.append((x, batcher.submit(key, x)))
    assert [f.done() for _, f in futures] == [True] * 3
    assert torch.equal(seen[0], torch.tensor([[0.0], [1.0], [1.5], [1.25], [2.0], [2.5]])), seen[0]
    for x, future in futures:
        assert torch.equal(future.value(), 10 * x)
    assert (batcher.served, batcher.rows) == ([3], [6])
    # a short last batch waits for flush; flush with nothing pending runs nothing
    short = batcher.submit(5, torch.ones(1, 1))
    assert not short.done() and batcher.flush() == 1 and torch.equal(short.value(), 10 * torch.ones(1, 1))
    assert batcher.flush() == 0 and (batcher.served, batcher.rows) == ([3, 1], [6, 1])


def test_an_error_in_fn_or_a_wrong_row_count_reaches_every_caller_of_the_batch():
    def broken(x):
        raise RuntimeError("policy exploded")

    for fn, message in ((broken, "policy exploded"), (lambda x: x[:1], "returned 1 rows for 2 rows")):
        batcher = RequestBatcher(fn, 2)
        futures = [batcher.submit(k, torch.zeros(1, 3)) for k in (1, 0)]
        for future in futures:
            with pytest.raises(Exception, match=message):
                future.wait()
        assert batcher.served == [] and batcher.pending == []


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_batch_size_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="batch_size"):
        RequestBatcher(lambda x: x, bad)


ROUNDS = 4


def _batched_job():
    from labkit import rpc as R
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    if rank == 0:
        batcher = R.RequestBatcher(lambda x: x * 10 + 1, n - 1)
        R.serve(batcher, "batcher")
    dist.barrier()
    if rank > 0:
        handle = R.connect("worker0", "batcher")
        out["answers"] = []
        for i in range(ROUNDS):
            x = torch.full((rank, 2), float(100 * i + rank))   # caller r sends r rows
            out["answers"].append(bool(torch.equal(
                R.rpc_sync("worker0", R.RequestBatcher.request, handle, rank, x), x * 10 + 1)))
    dist.barrier()
    if rank == 0:
        out.update(served=batcher.served, rows=batcher.rows)
    return out


def test_concurrent_callers_over_rpc_share_one_call_of_fn_per_round():
    results = labkit.launch(_batched_job, 4, rpc=True, timeout=120)
    assert results[0]["served"] == [3] * ROUNDS and results[0]["rows"] == [6] * ROUNDS, results[0]
    for rank in (1, 2, 3):
        assert results[rank]["answers"] == [True] * ROUNDS, (rank, results[rank])
