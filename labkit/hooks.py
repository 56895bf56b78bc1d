"""What a DDP communication hook is handed and what it returns (given code for chapter 11).

A hook is ``hook(state, bucket) -> torch.futures.Future[Tensor]``: ``bucket.buffer()`` is the
bucket's flat gradient, ``bucket.gradients()`` its per-parameter views; the hook leaves the
average of every rank's bucket in the buffer and returns a future whose value is that buffer,
still pending while its collectives are in flight. This module holds the plumbing every hook of
``labkit.compress`` shares, and none of the techniques:

* ``FlatBucket``: a ``dist.GradBucket`` you can build by hand from a list of tensors, so that a
  hook can be called (and compared with torch's) outside DDP;
* ``completed``, ``after``, ``future_of``: futures that already hold a value, that chain a
  collective on another's result without a thread waiting in between, and that wrap the gloo
  works that have no ``get_future``;
* ``in_turn``: the buckets' collectives issued in bucket order on every rank;
* ``average_future``: torch's default hook (divide by N, all-reduce).
"""

import threading

import torch
import torch.distributed as dist


class FlatBucket:
    """What a hook sees of a ``dist.GradBucket``: one flat buffer holding ``tensors``, views of
    it shaped like each (``gradients()``), its index and whether it is the step's last."""

    def __init__(self, tensors: list[torch.Tensor], index: int = 0, last: bool = True):
        self._buffer = torch.cat([t.reshape(-1) for t in tensors])
        self._views, offset = [], 0
        for t in tensors:
            self._views.append(self._buffer[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
        self._index, self._last = index, last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._views

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last


def completed(value: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A future that already holds ``value`` (for a hook with nothing to send). A hook that
    communicates returns the future of its collective instead, still pending: DDP's backward
    goes on computing the next buckets while it is in flight, and waits for it at the end."""
    future = torch.futures.Future()
    future.set_result(value)
    return future


def after(future: torch.futures.Future, start) -> torch.futures.Future:
    """Chain a collective that needs the result of another: when ``future`` completes, call
    ``start(future)``, which starts the next collective and returns its future (e.g.
    ``dist.all_reduce(t, group=g, async_op=True).get_future()``); the future returned here
    completes with that one's value. No thread waits in between (``future.then(f)`` completes
    when ``f`` returns, so ``f`` would have to wait for the collective it started, holding one
    of the backend's threads). An error in either completes it with that error."""
    result = torch.futures.Future()

    def forward(inner):
        try:
            result.set_result(inner.value())
        except Exception as error:  # noqa: BLE001 - handed to whoever waits on the result
            result.set_exception(error)

    def begin(done):
        try:
            done.value()  # an error of the step before completes the result with it; the next never starts
            start(done).add_done_callback(forward)
        except Exception as error:  # noqa: BLE001
            result.set_exception(error)

    future.add_done_callback(begin)
    return result


def future_of(work) -> torch.futures.Future:
    """``work.get_future()`` of an ``async_op=True`` collective, also for the gloo ops whose Work
    has none (reduce-scatter): then a helper thread waits on the work and completes the
    future. Its value: what ``get_future()`` gives (a list of the output tensors), or None."""
    try:
        return work.get_future()
    except RuntimeError:
        future = torch.futures.Future()

        def wait():
            try:
                work.wait()
                future.set_result(None)
            except Exception as error:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(error)

        threading.Thread(target=wait, daemon=True, name="labkit-future-of").start()
        return future


def in_turn(state, start) -> torch.futures.Future:
    """Call ``start()`` (it issues a bucket's collectives and returns their future) once the
    future of the previous call on ``state`` has completed, or now if it has. A hook whose
    callbacks issue collectives (PowerSGD's Q, the hierarchical all-reduce's second and third
    steps) runs them on the backend's threads; with several buckets in flight they would reach
    the group in a different order on different ranks, and collectives match by order. In
    turn, every rank issues bucket i's collectives before bucket i + 1's."""
    previous = getattr(state, "_in_flight", None)
    if previous is None or previous.done():
        future = start()
    else:
        future = after(previous, lambda _: start())
    state._in_flight = future
    return future


def average_future(buffer: torch.Tensor, group=None) -> torch.futures.Future[torch.Tensor]:
    """torch's default hook: divide ``buffer`` by the group size, start its all-reduce over
    ``group``; the future's value is ``buffer`` (pending until the all-reduce is done)."""
    buffer.div_(dist.get_world_size(group))
    work = dist.all_reduce(buffer, group=group, async_op=True)
    return work.get_future().then(lambda _: buffer)
