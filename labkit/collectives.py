"""Chapter 00 exercises: ring collectives built from point-to-point messages only.

Picture the N ranks of ``group`` on a ring: rank r sends to r+1 and receives from r-1
(mod N). Cut every buffer into N chunks. Then

* reduce-scatter: in N-1 steps each chunk travels once around the ring, picking up every
  rank's contribution on the way, and ends fully reduced on the rank that owns it;
* all-gather: in N-1 more steps every owned chunk travels around the ring again, so that
  every rank ends with all of them;
* all-reduce = reduce-scatter + all-gather.

Each step moves one chunk (S/N bytes) per rank, so an all-reduce sends 2(N-1)/N * S bytes
per rank whatever N is: that is why the ring is bandwidth-optimal.

Tasks (run ``labkit grade collectives``; tests in ``tests/grading/test_collectives.py``):
    collectives.reduce_scatter   ring_reduce_scatter
    collectives.all_gather       ring_all_gather
    collectives.all_reduce       ring_all_reduce
Use only ``dist.isend``/``dist.irecv``/``dist.send``/``dist.recv``: the grader traces your
communication and refuses built-in collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def ring_neighbours(group=None) -> tuple[int, int]:
    """Global ranks of the next and previous rank on the ring of ``group``."""
    me, n = dist.get_rank(group), dist.get_world_size(group)
    return (dist.get_global_rank(group or dist.group.WORLD, (me + 1) % n),
            dist.get_global_rank(group or dist.group.WORLD, (me - 1) % n))


def exchange(send_buf: torch.Tensor, recv_buf: torch.Tensor, to_rank: int, from_rank: int) -> None:
    """Send to one neighbour while receiving from the other.

    Both must be in flight at once: if every rank first did a blocking send, all would
    wait for a receiver and the ring would deadlock.
    """
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send_buf, to_rank),
                                   dist.P2POp(dist.irecv, recv_buf, from_rank)])
    for req in reqs:
        req.wait()


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """Like ``dist.reduce_scatter_single`` (``reduce_scatter_tensor``) with SUM.

    ``input`` holds N equal chunks (``input.numel() == N * output.numel()``); chunk r of
    the sum over ranks lands in ``output`` on rank r. Any shape and dtype that can be summed.
    Writes ``output`` only: ``input`` is the caller's and stays as it was, except that
    ``output`` may be a view of ``input``'s own chunk (in place, as with
    ``reduce_scatter_tensor``), so read that chunk before you write ``output``.
    """
    # BEGIN SOLUTION collectives.reduce_scatter: pass a running sum around the ring for N-1 steps; rank r must end with chunk r
    me, n = dist.get_rank(group), dist.get_world_size(group)
    if input.numel() != n * output.numel():
        raise ValueError(f"input has {input.numel()} elements; expected {n} x {output.numel()}")
    chunks = input.reshape(n, -1)
    if n == 1:
        output.copy_(chunks[0].view_as(output))
        return
    to_rank, from_rank = ring_neighbours(group)
    # Start with the chunk that, after N-1 hops and additions, arrives complete at its owner.
    # Two buffers of one chunk, made once and reused: the running sum we send, and what
    # arrives. ``input`` is only read (it is the caller's), so ``output`` may be a view of it.
    partial = chunks[(me - 1) % n].clone()
    incoming = torch.empty_like(partial)
    for step in range(1, n):
        exchange(partial, incoming, to_rank, from_rank)
        # What arrives is the running sum of chunk (me - 1 - step) from the ranks behind us.
        torch.add(incoming, chunks[(me - 1 - step) % n], out=partial)
    output.copy_(partial.view_as(output))
    # END SOLUTION


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """Like ``dist.all_gather_single`` (``all_gather_into_tensor``).

    ``output`` (contiguous, N times the size of ``input``) receives every rank's ``input``, in rank order.
    Any shape and dtype. Writes ``output`` only; ``input`` may be a view of ``output``'s own
    chunk (in place, as ``all_gather_into_tensor`` allows), so do not clear ``output`` first.
    """
    # BEGIN SOLUTION collectives.all_gather: forward the chunk you received last step to the next rank, N-1 times
    me, n = dist.get_rank(group), dist.get_world_size(group)
    if output.numel() != n * input.numel():
        raise ValueError(f"output has {output.numel()} elements; expected {n} x {input.numel()}")
    chunks = output.view(n, -1)  # a view: receiving into a row fills ``output`` directly
    chunks[me].copy_(input.reshape(-1))
    to_rank, from_rank = ring_neighbours(group)
    for step in range(n - 1):
        # Forward the chunk that arrived last step (our own at first); receive the one behind.
        exchange(chunks[(me - step) % n], chunks[(me - step - 1) % n], to_rank, from_rank)
    # END SOLUTION


def ring_all_reduce(tensor: torch.Tensor, group=None) -> None:
    """Like ``dist.all_reduce`` with SUM, in place, for a tensor of any shape, size and dtype
    (contiguous or not): the result is written into ``tensor``'s own memory."""
    # BEGIN SOLUTION collectives.all_reduce: in place on a view of N chunks: N-1 exchanges into one reused receive buffer, add_ into the chunk that arrived; then ring_all_gather your chunk into the tensor (input a view of output). Pad only when N does not divide the size
    n, me = dist.get_world_size(group), dist.get_rank(group)
    chunk = -(-tensor.numel() // n)  # ceil(S/N)
    # Work on the tensor's own memory when we can: a flat view of N chunks. Only a tensor
    # that is not contiguous, or whose size N does not divide, costs a padded copy in and out.
    if tensor.is_contiguous() and tensor.numel() == n * chunk:
        flat = tensor.view(-1)
    else:
        flat = tensor.new_zeros(n * chunk)
        flat[: tensor.numel()] = tensor.reshape(-1)
    chunks = flat.view(n, chunk)
    if n > 1:
        to_rank, from_rank = ring_neighbours(group)
        incoming = torch.empty_like(chunks[0])  # the one receive buffer, reused every step
        for step in range(1, n):
            # Reduce-scatter in place: send our running sum of chunk me - step, add the one
            # that arrives (chunk me - step - 1, summed over the ranks behind us) into ours.
            exchange(chunks[(me - step) % n], incoming, to_rank, from_rank)
            chunks[(me - step - 1) % n].add_(incoming)
        ring_all_gather(flat, chunks[me], group)  # our chunk is complete: pass it around
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat[: tensor.numel()].view_as(tensor))
    # END SOLUTION


# ----------------------------------------------------------------------------- given: where the time goes (lab 00)

def pipelined_ring_all_reduce(tensor: torch.Tensor, group=None, segments: int = 2) -> None:
    """A ring all-reduce that overlaps its additions with its transfers (lab 00, "where the
    time goes"): every chunk is cut into ``segments`` (at least 2), and each segment moves on to the
    next step as soon as it has been added, instead of the whole chunk waiting for the whole
    step. The reduce-scatter and all-gather steps run as one pipeline; the bytes on the wire
    are the ring's 2 (N-1)/N S, in 2 (N-1) x segments messages. In place, like the ring."""
    if segments < 2:  # one segment is the plain ring: that one is yours to write
        raise ValueError(f"pipelined_ring_all_reduce: segments={segments}; a pipeline needs at least 2")
    n, me = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:
        return
    flat, chunk = _padded_view(tensor, n)
    chunks = flat.view(n, chunk)
    seg = -(-chunk // segments)
    bounds = [(a, min(a + seg, chunk)) for a in range(0, chunk, seg)]
    to, frm = ring_neighbours(group)
    steps = 2 * (n - 1)
    incoming = torch.empty(chunk, dtype=flat.dtype, device=flat.device)

    def sent_chunk(k):  # reduce-scatter step k sends the partial sum of chunk me - k; all-gather forwards
        return (me - k) % n if k < n - 1 else (me + 1 - (k - (n - 1))) % n

    def received_chunk(k):
        return (me - k - 1) % n if k < n - 1 else (me - (k - (n - 1))) % n

    def post(k, j):  # step k's segment j: send it, and receive the neighbour's
        a, b = bounds[j]
        tag = k * len(bounds) + j
        into = incoming[a:b] if k < n - 1 else chunks[received_chunk(k), a:b]
        return (dist.isend(chunks[sent_chunk(k), a:b], dst=to, group=group, tag=tag),
                dist.irecv(into, src=frm, group=group, tag=tag))

    pending = {(0, j): post(0, j) for j in range(len(bounds))}
    sends = []
    for k in range(steps):
        for j, (a, b) in enumerate(bounds):
            send, received = pending.pop((k, j))
            received.wait()
            sends.append(send)
            if k < n - 1:
                chunks[received_chunk(k), a:b].add_(incoming[a:b])
            if k + 1 < steps:
                pending[(k + 1, j)] = post(k + 1, j)
    for send in sends:
        send.wait()
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat[: tensor.numel()].view_as(tensor))


def _padded_view(tensor: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """(a flat tensor of N equal chunks holding ``tensor``, the chunk length). The tensor's own
    memory (a view) when it is contiguous and N divides its size; otherwise a zero-padded
    copy, which the caller copies back."""
    chunk = -(-tensor.numel() // n)  # ceil(S/N)
    if tensor.is_contiguous() and tensor.numel() == n * chunk:
        return tensor.view(-1), chunk
    padded = tensor.new_zeros(n * chunk)
    padded[: tensor.numel()] = tensor.reshape(-1)
    return padded, chunk
