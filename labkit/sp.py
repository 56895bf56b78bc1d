"""Chapter 07 exercises: sequence and context parallelism.

Long sequences make activations, not weights, the problem: a transformer block keeps
O(B·T·H) numbers per layer for backward, and attention's score matrix is O(B·heads·T²).
Three ways to split the *sequence* over N ranks:

* Megatron sequence parallelism (Korthikanti et al., 2022), on top of tensor parallelism
  (chapter 05): the parts TP leaves replicated (LayerNorm, residual adds, dropout) run on
  T/N tokens each. Where TP would all-reduce after a row-parallel layer, SP reduce-scatters
  along the sequence; before a column-parallel layer it all-gathers the sequence back. An
  all-reduce is a reduce-scatter plus an all-gather, so the bytes are the same, and the
  activations outside the TP region shrink by N — except the all-gathered input each column
  layer keeps for its weight gradient (Megatron-LM keeps only the shard and gathers it again
  in backward: one more all-gather for B·T·H less memory per layer). LayerNorm's weights see
  only T/N tokens per rank: their gradients are partial sums, added over the group after
  backward.
* Ring attention (Liu et al., 2023): each rank keeps its T/N queries and passes its keys and
  values around the ring; after N-1 steps every query has seen every key. Blockwise
  attention with an *online softmax* (Milakov & Gimelshein 2018; Dao et al. 2022) merges
  the blocks exactly, keeping per query a running max and a running sum of exponentials.
  Backward passes K/V around again, with their gradients riding along. Each step is one
  call of a fused kernel that returns the log-sum-exp (given: ``visible_attention``), on
  only the part of the block the causal mask lets through.
* Ulysses (Jacobs et al., 2023): an all-to-all turns sequence shards into head shards
  (every rank: all T tokens of H/N heads), attention runs locally, another all-to-all turns
  it back. Needs heads divisible by N.

With a causal mask, contiguous shards leave rank 0 almost idle (its queries see only its
own keys: half a block) and the last rank computing N - 1/2 blocks. The *zig-zag* split
gives rank r chunks r and 2N-1-r of 2N: every rank then gets the same amount of unmasked
work, its own block causally and half of every other rank's: N/2 blocks per rank.

Shapes: attention tensors are [B, heads, T_local, head_dim]; ``positions`` are the global
token indices of a rank's T_local rows (contiguous or zig-zag), which is all ring attention
needs to build its causal masks.

Tasks (run ``labkit grade sp``; tests in ``tests/grading/test_sp.py``):
    sp.megatron        GatherSequence, ReduceScatterSequence, sequence_parallel_block, reduce_layernorm_grads
    sp.online_softmax  attention_block, merge_blocks, blockwise_attention
    sp.ring_attention  RingAttention (forward and backward)
    sp.zigzag          zigzag_positions, zigzag_shard, zigzag_unshard
    sp.ulysses         AllToAll, ulysses_attention
Bad shapes (T not divisible by N, or by 2N for zig-zag; heads not divisible by N for
Ulysses) raise ValueError before any communication.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.models import Block
from labkit.tp import ParallelMLP, ParallelSelfAttention


def degree(group=None) -> int:
    return dist.get_world_size(group)


def per_rank(size: int, parts: int, what: str) -> int:
    if size % parts:
        raise ValueError(f"{what}={size} is not divisible by {parts}")
    return size // parts


# ----------------------------------------------------------------------------- Megatron-SP


class GatherSequence(torch.autograd.Function):
    """Forward: all-gather the sequence shards along dim 1 ([B, T/N, H] -> [B, T, H]).
    Backward: reduce-scatter the gradient along dim 1 (each rank used the whole sequence:
    the gradient of its shard is the sum over ranks)."""

    @staticmethod
    def forward(ctx, x, group):
        # BEGIN SOLUTION sp.megatron: all_gather_single of x with the sequence dim moved to the front (x.transpose(0, 1)), then back: [B, T, H]
        ctx.group = group
        n = degree(group)
        shards = x.transpose(0, 1).contiguous()  # [T/N, B, H]: shards of dim 0 stack in rank order
        full = shards.new_empty((n * shards.shape[0], *shards.shape[1:]))
        dist.all_gather_single(full, shards, group=group)
        return full.transpose(0, 1).contiguous()
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        # BEGIN SOLUTION sp.megatron: reduce-scatter the gradient along the sequence (same trick: sequence dim to the front)
        return _reduce_scatter_sequence(grad, ctx.group), None
        # END SOLUTION


class ReduceScatterSequence(torch.autograd.Function):
    """Forward: sum the partial results over ranks and keep this rank's sequence shard
    ([B, T, H] partial -> [B, T/N, H] summed). Backward: all-gather the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        # BEGIN SOLUTION sp.megatron: reduce_scatter_tensor along the sequence (dim 1 moved to the front)
        ctx.group = group
        return _reduce_scatter_sequence(x, group)
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        # BEGIN SOLUTION sp.megatron: all-gather the gradient along the sequence
        return GatherSequence.forward(ctx, grad, ctx.group), None
        # END SOLUTION


def _reduce_scatter_sequence(x, group):
    n = degree(group)
    full = x.transpose(0, 1).contiguous()  # [T, B, H]
    shard = full.new_empty((full.shape[0] // n, *full.shape[1:]))
    dist.reduce_scatter_single(shard, full, group=group)
    return shard.transpose(0, 1).contiguous()


def gather_sequence(x, group=None):
    return GatherSequence.apply(x, group)


def reduce_scatter_sequence(x, group=None):
    return ReduceScatterSequence.apply(x, group)


class SequenceParallelBlock(nn.Module):
    """A ``labkit.models.Block`` with Megatron tensor + sequence parallelism: the input and
    output are this rank's sequence shard [B, T/N, H]; LayerNorms and residual adds run on
    it; attention and MLP are the chapter-05 layers with their f replaced by ``gather_sequence``
    and their g by ``reduce_scatter_sequence``."""

    def __init__(self, block: Block, group=None):
        super().__init__()
        self.group = group
        self.ln_1, self.ln_2 = block.ln_1, block.ln_2   # replicated; gradients: reduce_layernorm_grads
        self.attn = ParallelSelfAttention(block.attn, group)
        self.mlp = ParallelMLP(block.mlp, group)
        # BEGIN SOLUTION sp.megatron: set input_op = gather_sequence on attn.c_attn and mlp.c_fc, output_op = reduce_scatter_sequence on attn.c_proj and mlp.c_proj
        for column in (self.attn.c_attn, self.mlp.c_fc):
            column.input_op = gather_sequence
        for row in (self.attn.c_proj, self.mlp.c_proj):
            row.output_op = reduce_scatter_sequence
        # END SOLUTION

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

    def layernorm_parameters(self) -> list[nn.Parameter]:
        """The replicated parameters that see only this rank's tokens (and the row layers'
        biases, added after the reduce-scatter to this rank's tokens only)."""
        return [*self.ln_1.parameters(), *self.ln_2.parameters(),
                *(p for p in (self.attn.c_proj.bias, self.mlp.c_proj.bias) if p is not None)]


def sequence_parallel_block(block: Block, group=None) -> SequenceParallelBlock:
    """Check the shapes (heads and MLP width by the degree), then build the SP block."""
    return SequenceParallelBlock(block, group)


def reduce_layernorm_grads(blocks, group=None) -> None:
    """After backward: sum, over the group, the gradients of every replicated parameter that
    saw only this rank's tokens (``layernorm_parameters``), so all ranks hold the full one."""
    # BEGIN SOLUTION sp.megatron: for each block, for each p in layernorm_parameters() with a grad: dist.all_reduce(p.grad, group=group)
    for block in blocks:
        for p in block.layernorm_parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
    # END SOLUTION


# ----------------------------------------------------------------------------- online softmax


def attention_block(q, k, v, mask=None, scale=None):
    """Attention of ``q`` against one block of keys/values, unnormalised across blocks:
    returns (out, lse), ``out`` = softmax over this block applied to v, ``lse`` [.., Tq] =
    log-sum-exp of this block's scores (-inf where a query sees none of the block).
    ``mask``: bool [Tq, Tk], True where a query may attend to a key."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    # BEGIN SOLUTION sp.online_softmax: scores = q k^T * scale (masked to -inf); lse = logsumexp(scores, -1); out = exp(scores - lse) v (0 where lse is -inf)
    scores = (q @ k.transpose(-2, -1)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)  # rows that see nothing: 0
    return weights @ v, lse
    # END SOLUTION


def merge_blocks(out_a, lse_a, out_b, lse_b):
    """Combine two blocks' (out, lse) into the attention over both, exactly: the online
    softmax step. out = (e^{lse_a} out_a + e^{lse_b} out_b) / (e^{lse_a} + e^{lse_b})."""
    # BEGIN SOLUTION sp.online_softmax: lse = logaddexp(lse_a, lse_b); weights exp(lse_a - lse) and exp(lse_b - lse) (0 where lse is -inf); out = w_a out_a + w_b out_b
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).nan_to_num(0.0).unsqueeze(-1)
    w_b = torch.exp(lse_b - lse).nan_to_num(0.0).unsqueeze(-1)
    return w_a * out_a + w_b * out_b, lse
    # END SOLUTION


def causal_mask(q_positions, k_positions):
    """True where the query at position i may see the key at position j (j <= i)."""
    return k_positions.unsqueeze(0) <= q_positions.unsqueeze(1)


def blockwise_attention(q, k, v, block_size: int, causal: bool = False):
    """Softmax attention computed block by block over the keys, in one process: equal to
    ``F.scaled_dot_product_attention(q, k, v, is_causal=causal)`` without ever holding more
    than one block of scores."""
    T = k.shape[-2]
    positions = torch.arange(T, device=q.device)
    # BEGIN SOLUTION sp.online_softmax: for each key block: attention_block (with causal_mask of the block's positions if causal) and merge_blocks into the running (out, lse)
    out = lse = None
    for start in range(0, T, block_size):
        stop = min(start + block_size, T)
        mask = causal_mask(positions[:q.shape[-2]], positions[start:stop]) if causal else None
        block = attention_block(q, k[..., start:stop, :], v[..., start:stop, :], mask)
        out, lse = block if out is None else merge_blocks(out, lse, *block)
    return out
    # END SOLUTION


# ----------------------------------------------------------------------------- zig-zag


def zigzag_positions(length: int, rank: int, world: int) -> torch.Tensor:
    """The global positions rank ``rank`` holds under the zig-zag split: chunks ``rank`` and
    ``2 world - 1 - rank`` of the sequence cut into 2·world equal chunks."""
    chunk = per_rank(length, 2 * world, "sequence length (zig-zag needs 2N chunks)")
    # BEGIN SOLUTION sp.zigzag: torch.cat of arange over chunk `rank` and chunk `2 world - 1 - rank`
    first, second = rank, 2 * world - 1 - rank
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk),
                      torch.arange(second * chunk, (second + 1) * chunk)])
    # END SOLUTION


def zigzag_shard(x: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """This rank's zig-zag shard of ``x`` along ``dim`` (the rows of ``zigzag_positions``)."""
    # BEGIN SOLUTION sp.zigzag: x.index_select(dim, zigzag_positions(x.shape[dim], rank, world))
    return x.index_select(dim, zigzag_positions(x.shape[dim], rank, world).to(x.device))
    # END SOLUTION


def zigzag_unshard(shards: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The inverse: every rank's zig-zag shard (in rank order) -> the full tensor."""
    # BEGIN SOLUTION sp.zigzag: place each shard's rows at its zigzag_positions along dim
    world = len(shards)
    length = sum(s.shape[dim] for s in shards)
    order = torch.cat([zigzag_positions(length, r, world) for r in range(world)])
    stacked = torch.cat(shards, dim)
    return stacked.index_select(dim, torch.argsort(order).to(stacked.device))
    # END SOLUTION


def contiguous_positions(length: int, rank: int, world: int) -> torch.Tensor:
    """The global positions of rank ``rank``'s rows when the sequence is cut in ``world``."""
    chunk = per_rank(length, world, "sequence length")
    return torch.arange(rank * chunk, (rank + 1) * chunk)


def split_sequence(x: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous shard of ``x`` along the sequence ``dim`` (ValueError if the
    length does not split evenly: checked before any communication)."""
    n, rank = degree(group), dist.get_rank(group)
    return x.index_select(dim, contiguous_positions(x.shape[dim], rank, n).to(x.device))


# ----------------------------------------------------------------------------- fused block kernels
#
# Given (not a task): what one ring step computes, in a fused kernel that returns the
# log-sum-exp (FlashAttention, Dao et al. 2022: the scores never leave the kernel's tiles),
# and only on the part of the block the causal mask lets through. ``attention_block`` above
# is the same computation written out, with every score of the block materialised.


def fused_attention(q, k, v, causal: bool = False):
    """(out, lse) of softmax attention of ``q`` over ``k``, ``v``, normalised over this block
    alone; ``causal``: query i sees keys 0..i (a square block on its own diagonal). On the CPU
    one call of PyTorch's flash kernel (any float dtype, float64 included); elsewhere the
    scores are materialised (the lse-returning CUDA kernels are not wired up here)."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return _math_attention(q, k, v, _diagonal(q, k) if causal else None)


def fused_attention_backward(grad_out, q, k, v, out, lse, causal: bool = False):
    """(dq, dk, dv) of one block's contribution, given the rows' *final* ``out`` and ``lse``
    over every block: exp(scores - lse) is then this block's share of the whole softmax, and
    the correction D = rowsum(dO * out) is the same in every block (Dao et al. 2022, appendix B),
    so the blocks' gradients simply add up."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal)
    return _math_attention_backward(grad_out, q, k, v, out, lse, _diagonal(q, k) if causal else None)


def _diagonal(q, k):
    return torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()


def _masked_scores(q, k, mask):
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


def _math_attention(q, k, v, mask=None):
    """``fused_attention`` with the scores materialised, under any bool ``mask`` [Tq, Tk]."""
    scores = _masked_scores(q, k, mask)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0) @ v, lse


def _math_attention_backward(grad_out, q, k, v, out, lse, mask=None):
    """``fused_attention_backward`` with the scores materialised (rows hidden by ``mask``: 0)."""
    p = torch.exp(_masked_scores(q, k, mask) - lse.unsqueeze(-1)).nan_to_num(0.0)
    ds = p * (grad_out @ v.transpose(-2, -1) - (grad_out * out).sum(-1, keepdim=True)) / math.sqrt(q.shape[-1])
    return ds @ k, ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ grad_out


def visible_part(q_positions, k_positions):
    """The part of a K/V block that queries at ``q_positions`` may see under the causal mask
    (positions in increasing order): None if nothing, else (rows, keys, kind), slices of the
    queries and keys to compute and how: ``True`` on the block's own diagonal (the same
    positions: causal within the slices), ``False`` where every (row, key) pair of the slices is
    visible, or else a bool mask of the slices. With zig-zag rows a block from another rank is
    half visible: from an earlier rank, the keys of its first chunk for all rows; from a later
    one, all its keys for this rank's second chunk."""
    if torch.equal(q_positions, k_positions):
        return slice(None), slice(None), True
    first_row = int(torch.searchsorted(q_positions, k_positions[0]))   # earlier rows see none of the keys
    end_key = int(torch.searchsorted(k_positions, q_positions[-1], right=True))  # later keys: no row sees them
    if first_row == len(q_positions) or end_key == 0:
        return None
    rows, keys = slice(first_row, len(q_positions)), slice(0, end_key)
    if q_positions[first_row] >= k_positions[end_key - 1]:
        return rows, keys, False
    return rows, keys, causal_mask(q_positions[rows], k_positions[keys])  # interleaved rows: masked


def visible_attention(q, k, v, q_positions, k_positions, causal: bool):
    """One ring step's forward: (out, lse) of this rank's queries over one K/V block, computed
    only where the mask lets through (rows that see none of it: out 0, lse -inf), or None when
    the causal mask hides the whole block."""
    part = visible_part(q_positions, k_positions) if causal else (slice(None), slice(None), False)
    if part is None:
        return None
    rows, keys, kind = part
    q_rows, k_keys, v_keys = q[..., rows, :], k[..., keys, :], v[..., keys, :]
    if isinstance(kind, torch.Tensor):
        out, lse = _math_attention(q_rows, k_keys, v_keys, kind)
    else:
        out, lse = fused_attention(q_rows, k_keys, v_keys, kind)
    if out.shape == q.shape:
        return out, lse
    full_out = out.new_zeros(q.shape)
    full_out[..., rows, :] = out
    full_lse = lse.new_full(q.shape[:-1], float("-inf"))
    full_lse[..., rows] = lse
    return full_out, full_lse


def visible_attention_backward(grad_out, q, k, v, out, lse, q_positions, k_positions, causal: bool):
    """One ring step's backward: (dq, dk, dv) of this block's part of the attention, given the
    final ``out`` and ``lse`` of this rank's rows (zero where the mask hides a row or a key),
    or None when the causal mask hides the whole block."""
    part = visible_part(q_positions, k_positions) if causal else (slice(None), slice(None), False)
    if part is None:
        return None
    rows, keys, kind = part
    inputs = (grad_out[..., rows, :], q[..., rows, :], k[..., keys, :], v[..., keys, :],
              out[..., rows, :], lse[..., rows])
    if isinstance(kind, torch.Tensor):
        dq, dk, dv = _math_attention_backward(*inputs, kind)
    else:
        dq, dk, dv = fused_attention_backward(*inputs, kind)
    if dq.shape == q.shape and dk.shape == k.shape:
        return dq, dk, dv
    grads = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    grads[0][..., rows, :] = dq
    grads[1][..., keys, :] = dk
    grads[2][..., keys, :] = dv
    return grads


def _visible_pairs(q_shape, k_shape, causal) -> int:
    """(query, key) pairs a fused kernel computes: all, or a causal block's lower triangle."""
    tq, tk = q_shape[-2], k_shape[-2]
    heads = math.prod(q_shape[:-2])
    if not causal:
        return heads * tq * tk
    m = min(tq, tk)
    return heads * (m * (m + 1) // 2 + (tq - m) * tk)


def _fused_forward_flops(q, k, v, dropout_p=0.0, is_causal=False, *args, out_shape=None, **kwargs) -> int:
    return 2 * _visible_pairs(q, k, is_causal) * (q[-1] + v[-1])           # q k^T, p v


def _fused_backward_flops(grad_out, q, k, v, out, lse, dropout_p=0.0, is_causal=False, *args,
                          out_shape=None, **kwargs) -> int:
    return 2 * _visible_pairs(q, k, is_causal) * (3 * q[-1] + 2 * v[-1])   # q k^T again, dO v^T, dV, dQ, dK


# ``torch.utils.flop_counter.FlopCounterMode(custom_mapping=FUSED_ATTENTION_FLOPS)``: PyTorch
# counts no FLOPs for the CPU flash kernel; these count the matmuls over the pairs it computes.
FUSED_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _fused_forward_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _fused_backward_flops,
}


# ----------------------------------------------------------------------------- ring attention


def ring_neighbours(group=None) -> tuple[int, int]:
    """Global ranks of the next and the previous rank on the group's ring."""
    me, n = dist.get_rank(group), degree(group)
    world = group or dist.group.WORLD
    return dist.get_global_rank(world, (me + 1) % n), dist.get_global_rank(world, (me - 1) % n)


def start_exchange(send: list[torch.Tensor], group=None):
    """Post the sends of ``send`` to the next rank and receives of same-shaped buffers from
    the previous one; returns (buffers, works). Wait on the works before using the buffers."""
    to_rank, from_rank = ring_neighbours(group)
    received = [torch.empty_like(t) for t in send]
    ops = [dist.P2POp(dist.isend, t.contiguous(), to_rank, group) for t in send]
    ops += [dist.P2POp(dist.irecv, r, from_rank, group) for r in received]
    return received, dist.batch_isend_irecv(ops)


class RingAttention(torch.autograd.Function):
    """Attention of this rank's queries over every rank's keys and values, passed around the
    ring. Inputs: q, k, v [B, heads, T/N, d] (this rank's rows), ``positions`` of those rows
    (contiguous or zig-zag), ``causal``. Output: this rank's rows of the attention output.

    Forward, step j = 0..N-1: this rank holds the K/V of rank (r - j) mod N (with its
    positions); it posts the exchange that passes them on, computes ``visible_attention`` on
    them (nothing for a block the causal mask hides entirely, the causal diagonal or the
    visible half of a zig-zag block otherwise), merges into its running (out, lse), then waits
    for the next block: N - 1 exchanges, each overlapped with a block.
    Backward: ``visible_attention_backward`` of each block against the final (out, lse) gives
    this block's share of dq, dk, dv; dq accumulates here, dK/dV travel with K/V, so each
    block's gradient gathers every rank's part; after the last step one more message hands
    dK/dV back to their owner."""

    @staticmethod
    def forward(ctx, q, k, v, positions, causal, group):
        # BEGIN SOLUTION sp.ring_attention: loop N steps: start_exchange([k, v, positions]) unless last step; visible_attention(q, k_j, v_j, positions, their positions, causal) (None: hidden, skip); merge; wait, take the received block; save q, k, v, positions, out, lse
        n = degree(group)
        out = lse = None
        block = (k, v, positions)
        for step in range(n):
            pending = start_exchange(list(block), group) if step < n - 1 else None
            k_j, v_j, pos_j = block
            part = visible_attention(q, k_j, v_j, positions, pos_j, causal)
            if part is not None:
                out, lse = part if out is None else merge_blocks(out, lse, *part)
            if pending is not None:
                received, works = pending
                for work in works:
                    work.wait()
                block = tuple(received)
        ctx.save_for_backward(q, k, v, positions, out, lse)
        ctx.causal, ctx.group = causal, group
        return out
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad_out):
        # BEGIN SOLUTION sp.ring_attention: per step: visible_attention_backward(grad_out, q, k_j, v_j, out, lse, positions, pos_j, causal) (None: hidden); dq += its dq, dk_j += its dk, dv_j += its dv; pass (k, v, positions, dk, dv) on; finally send dk, dv one more hop to their owner
        q, k, v, positions, out, lse = ctx.saved_tensors
        n, causal, group = degree(ctx.group), ctx.causal, ctx.group
        grad_out = grad_out.contiguous()
        dq = torch.zeros_like(q)
        block = (k, v, positions, torch.zeros_like(k), torch.zeros_like(v))
        for step in range(n):
            k_j, v_j, pos_j, dk_j, dv_j = block
            grads = visible_attention_backward(grad_out, q, k_j, v_j, out, lse, positions, pos_j, causal)
            if grads is not None:
                dq += grads[0]
                dk_j, dv_j = dk_j + grads[1], dv_j + grads[2]
            if step < n - 1:  # pass the block and its gradient so far to the next rank
                received, works = start_exchange([k_j, v_j, pos_j, dk_j, dv_j], group)
                for work in works:
                    work.wait()
                block = tuple(received)
            elif n > 1:  # the block of rank r + 1 (its owner): give it back its complete gradient
                received, works = start_exchange([dk_j, dv_j], group)
                for work in works:
                    work.wait()
                dk_j, dv_j = received
        return dq, dk_j, dv_j, None, None, None
        # END SOLUTION


def ring_attention(q, k, v, positions, causal: bool = False, group=None):
    """See ``RingAttention``. ``positions``: the global indices of this rank's rows, in
    increasing order (ValueError otherwise, before any communication)."""
    if positions.numel() > 1 and not bool((positions[1:] > positions[:-1]).all()):
        raise ValueError("ring attention: positions must be increasing (sort this rank's rows)")
    return RingAttention.apply(q, k, v, positions, causal, group)


# ----------------------------------------------------------------------------- Ulysses


class AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with autograd: split ``x`` along ``scatter_dim`` into N
    pieces, send piece j to rank j, and concatenate what arrives along ``gather_dim``.
    Backward is the same exchange with the two dims swapped."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        # BEGIN SOLUTION sp.ulysses: pieces = x.chunk(N, scatter_dim) stacked on a new dim 0; all_to_all_single; then cat the received pieces along gather_dim
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        n = degree(group)
        send = torch.stack(x.chunk(n, scatter_dim)).contiguous()  # piece j -> rank j
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)
        return torch.cat(received.unbind(0), dim=gather_dim)
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        # BEGIN SOLUTION sp.ulysses: the reverse all-to-all: scatter along gather_dim, gather along scatter_dim
        scatter_dim, gather_dim = ctx.dims
        return AllToAll.forward(ctx, grad, gather_dim, scatter_dim, ctx.group), None, None, None
        # END SOLUTION


def all_to_all(x, scatter_dim: int, gather_dim: int, group=None):
    return AllToAll.apply(x, scatter_dim, gather_dim, group)


def ulysses_attention(q, k, v, causal: bool = False, group=None):
    """Attention over the full sequence from sequence shards q, k, v [B, heads, T/N, d]:
    all-to-all to head shards [B, heads/N, T, d] (rank j gets heads j), local attention,
    all-to-all back. Positions must be contiguous (rank r holds rows r T/N .. (r+1) T/N)."""
    per_rank(q.shape[1], degree(group), "heads (Ulysses splits the heads over the ranks)")
    # BEGIN SOLUTION sp.ulysses: all_to_all(t, scatter_dim=1 (heads), gather_dim=2 (sequence)) for q, k, v; SDPA; all_to_all back (scatter 2, gather 1)
    q, k, v = (all_to_all(t, 1, 2, group) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return all_to_all(out, 2, 1, group)
    # END SOLUTION


def check_sequence(length: int, group=None, zigzag: bool = False) -> int:
    """T/N for this group (ValueError naming the sequence length if it does not split)."""
    n = degree(group)
    if zigzag:
        per_rank(length, 2 * n, f"sequence length (zig-zag cuts it into 2N = {2 * n} chunks)")
    return per_rank(length, n, f"sequence length (split over N = {n} ranks)")
