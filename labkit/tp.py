"""Chapter 05 exercises: tensor parallelism, Megatron-LM style, from scratch.

Data parallelism copies the whole model to every rank. When one layer's weights (or its
activations) no longer fit, split the *layer* instead: N ranks each hold 1/N of every weight
matrix and compute 1/N of every matmul (Shoeybi et al., 2019). Two ways to split Y = X W^T
(``nn.Linear``: W is [out, in]):

* column-parallel: rank r holds rows r of W's output features, W_r [out/N, in], and computes
  Y_r = X W_r^T, a slice of Y's columns. X must be whole on every rank.
* row-parallel: rank r holds W's input columns r, W_r [out, in/N], and computes the partial
  product X_r W_r^T from its slice of X; Y = the sum over ranks (an all-reduce).

Column then row needs no communication in between: the column layer leaves every rank with
exactly the slice of the hidden activations the row layer wants. So a transformer MLP (up
projection, GeLU, down projection) and attention (Q, K, V projections, the attention of each
head, output projection; heads split across ranks) each cost one all-reduce forward and one
backward. Four tiny autograd functions carry all of it (Megatron's ``mappings.py``):

    f = copy_to_parallel      forward: identity      backward: all-reduce  (before a column layer)
    g = reduce_from_parallel  forward: all-reduce    backward: identity    (after a row layer)
    gather_from_parallel      forward: all-gather the last dim   backward: keep my slice
    scatter_to_parallel       forward: keep my slice             backward: all-gather

f and g are conjugate: whatever one does forward the other does backward. The vocabulary is
split too: ``VocabParallelEmbedding`` holds rows [r V/N, (r+1) V/N) of the embedding table and
``vocab_parallel_cross_entropy`` computes the loss from the local slices of the logits with
three all-reduces of B·T numbers (max, sum of exponentials, the target's logit), never
gathering the B·T·V logits. LayerNorm, the position embedding and the row layers' biases stay
whole on every rank; they see identical inputs and identical gradients everywhere, so they
stay identical without any communication of their own.

Layout: a parameter split along ``dim`` gives rank r its r-th contiguous chunk; a fused
parameter such as attention's Q, K, V projection (``parts=3``) splits each part on its own, so
rank r gets [Q_r; K_r; V_r], its own heads. Every parallel module keeps ``tp_layout``
({parameter name: (dim, parts)}), from which ``full_state_dict`` rebuilds the full tensors.

Tasks (run ``labkit grade tp``; tests in ``tests/grading/test_tp.py``):
    tp.f_g        CopyToParallel, ReduceFromParallel (forward and backward)
    tp.column     ColumnParallelLinear.forward (its f is ``self.input_op``)
    tp.row        RowParallelLinear.forward (its g is ``self.output_op``)
    tp.mlp        ParallelMLP (__init__, forward)
    tp.attention  ParallelSelfAttention (__init__, forward)
    tp.vocab      VocabParallelEmbedding.forward, VocabParallelCrossEntropy (forward, backward)
    tp.model      tensor_parallel, full_state_dict
Every constructor checks that the dimensions it splits divide by the tensor-parallel degree
and raises ValueError naming the dimension, before any communication.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.models import GPT, CausalSelfAttention, MLP


# ----------------------------------------------------------------------------- layout


def degree_and_rank(group=None) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def per_rank(size: int, group, what: str) -> int:
    """size / N, or a ValueError that names the dimension that does not split."""
    n = dist.get_world_size(group)
    if size % n:
        raise ValueError(f"{what}={size} is not divisible by the tensor-parallel degree {n}")
    return size // n


def shard(full: torch.Tensor, dim: int, rank: int, world: int, parts: int = 1) -> torch.Tensor:
    """Rank ``rank``'s slice of ``full`` along ``dim`` (a copy). With ``parts > 1`` the dim
    holds ``parts`` stacked blocks (Q, K, V) and each block is split on its own."""
    blocks = full.chunk(parts, dim)
    return torch.cat([b.chunk(world, dim)[rank] for b in blocks], dim).detach().clone()


def unshard(pieces: list[torch.Tensor], dim: int, parts: int = 1) -> torch.Tensor:
    """The inverse of ``shard``: every rank's slice (in rank order) -> the full tensor."""
    blocks = [p.chunk(parts, dim) for p in pieces]
    return torch.cat([torch.cat([b[k] for b in blocks], dim) for k in range(parts)], dim)


def seeded_linear(in_features: int, out_features: int, bias: bool, seed: int) -> nn.Linear:
    """An ``nn.Linear`` with the same values on every rank (its own generator, seeded)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Linear(in_features, out_features, bias=bias)


# ----------------------------------------------------------------------------- f, g and friends


class CopyToParallel(torch.autograd.Function):
    """f: identity forward; backward, the all-reduce (sum) of the gradient over the group.

    Put before a column-parallel layer: every rank uses the whole input, so the input's
    gradient is the sum of every rank's contribution."""

    @staticmethod
    def forward(ctx, x, group):
        # BEGIN SOLUTION tp.f_g: forward returns x unchanged (x.view_as(x)); remember the group for backward
        ctx.group = group
        return x.view_as(x)
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        # BEGIN SOLUTION tp.f_g: backward all-reduces (sums) a copy of grad over ctx.group; None for the group argument
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
        # END SOLUTION


class ReduceFromParallel(torch.autograd.Function):
    """g: forward, the all-reduce (sum) of the partial results; backward, identity.

    Put after a row-parallel layer: each rank holds a partial sum of the output."""

    @staticmethod
    def forward(ctx, x, group):
        # BEGIN SOLUTION tp.f_g: forward returns the all-reduced sum of a copy of x over group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        # BEGIN SOLUTION tp.f_g: backward passes grad through unchanged (and None for the group)
        return grad, None
        # END SOLUTION


class GatherFromParallel(torch.autograd.Function):
    """Forward: all-gather the last dim (every rank's slice, in rank order). Backward: this
    rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        world = dist.get_world_size(group)
        pieces = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return torch.cat(pieces, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        world, rank = degree_and_rank(ctx.group)
        return grad.chunk(world, dim=-1)[rank].contiguous(), None


class ScatterToParallel(torch.autograd.Function):
    """Forward: this rank's slice of the last dim. Backward: all-gather the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        world, rank = degree_and_rank(group)
        return x.chunk(world, dim=-1)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return GatherFromParallel.forward(ctx, grad, ctx.group), None


def copy_to_parallel(x, group=None):
    return CopyToParallel.apply(x, group)


def reduce_from_parallel(x, group=None):
    return ReduceFromParallel.apply(x, group)


def gather_from_parallel(x, group=None):
    return GatherFromParallel.apply(x, group)


def scatter_to_parallel(x, group=None):
    return ScatterToParallel.apply(x, group)


# ----------------------------------------------------------------------------- linear layers


class ColumnParallelLinear(nn.Module):
    """Y = X W^T + b with W's output features split: rank r computes Y's columns r.

    ``ColumnParallelLinear(in, out, group)`` draws a full ``nn.Linear`` (the same on every
    rank: ``seed``) and keeps this rank's slice; ``from_linear(linear, group)`` slices a given
    one. ``gather_output=True`` all-gathers Y; by default each rank keeps its [.., out/N].
    """

    def __init__(self, in_features: int, out_features: int, group=None, *, bias: bool = True,
                 gather_output: bool = False, full: nn.Linear | None = None, parts: int = 1, seed: int = 0):
        super().__init__()
        if out_features % parts:
            raise ValueError(f"out_features={out_features} does not hold {parts} stacked parts of equal size")
        per_rank(out_features // parts, group, "out_features" if parts == 1 else f"out_features/{parts}")
        world, rank = degree_and_rank(group)
        full = full if full is not None else seeded_linear(in_features, out_features, bias, seed)
        self.group, self.gather_output = group, gather_output
        self.in_features, self.out_features = in_features, out_features
        # f by default; sequence parallelism (chapter 07) puts an all-gather of the sequence here
        self.input_op = copy_to_parallel
        self.weight = nn.Parameter(shard(full.weight, 0, rank, world, parts))
        self.bias = nn.Parameter(shard(full.bias, 0, rank, world, parts)) if bias else None
        self.tp_layout = {"weight": (0, parts), "bias": (0, parts)}

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, **kwargs) -> "ColumnParallelLinear":
        return cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None,
                   full=linear, **kwargs)

    def forward(self, x):
        # BEGIN SOLUTION tp.column: self.input_op (f, copy_to_parallel by default) on x, then F.linear with your slice; gather_from_parallel if gather_output
        x = self.input_op(x, self.group)  # f: backward sums the input's gradient over ranks
        y = F.linear(x, self.weight, self.bias)  # [.., out/N]: this rank's output features
        return gather_from_parallel(y, self.group) if self.gather_output else y
        # END SOLUTION


class RowParallelLinear(nn.Module):
    """Y = X W^T + b with W's input features split: rank r multiplies X's columns r by its
    slice and the partial products are summed (g). The bias is whole on every rank, added
    once after the sum. ``input_is_parallel=True``: X arrives already split (from a column
    layer); otherwise each rank first takes its slice of X."""

    def __init__(self, in_features: int, out_features: int, group=None, *, bias: bool = True,
                 input_is_parallel: bool = True, full: nn.Linear | None = None, seed: int = 0):
        super().__init__()
        per_rank(in_features, group, "in_features")
        world, rank = degree_and_rank(group)
        full = full if full is not None else seeded_linear(in_features, out_features, bias, seed)
        self.group, self.input_is_parallel = group, input_is_parallel
        self.in_features, self.out_features = in_features, out_features
        # g by default; sequence parallelism (chapter 07) puts a reduce-scatter of the sequence here
        self.output_op = reduce_from_parallel
        self.weight = nn.Parameter(shard(full.weight, 1, rank, world))
        self.bias = nn.Parameter(full.bias.detach().clone()) if bias else None  # replicated
        self.tp_layout = {"weight": (1, 1)}

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, **kwargs) -> "RowParallelLinear":
        return cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None,
                   full=linear, **kwargs)

    def forward(self, x):
        # BEGIN SOLUTION tp.row: scatter x unless input_is_parallel; F.linear without bias; self.output_op (g, reduce_from_parallel by default); then add the bias once
        if not self.input_is_parallel:
            x = scatter_to_parallel(x, self.group)
        y = self.output_op(F.linear(x, self.weight), self.group)  # g: the partial products summed
        return y + self.bias if self.bias is not None else y
        # END SOLUTION


# ----------------------------------------------------------------------------- blocks


class ParallelMLP(nn.Module):
    """``labkit.models.MLP`` split over the group: c_fc column-parallel, GeLU on the local
    slice of the hidden layer, c_proj row-parallel. One all-reduce forward (g), one backward (f)."""

    def __init__(self, mlp: MLP, group=None):
        super().__init__()
        per_rank(mlp.c_fc.out_features, group, "MLP hidden size (4 x n_embd)")
        # BEGIN SOLUTION tp.mlp: self.c_fc = ColumnParallelLinear.from_linear(...), self.c_proj = RowParallelLinear.from_linear(...)
        self.c_fc = ColumnParallelLinear.from_linear(mlp.c_fc, group)
        self.c_proj = RowParallelLinear.from_linear(mlp.c_proj, group)
        # END SOLUTION

    def forward(self, x):
        # BEGIN SOLUTION tp.mlp: c_proj(gelu(c_fc(x))): no communication between the two layers
        return self.c_proj(F.gelu(self.c_fc(x)))
        # END SOLUTION


class ParallelSelfAttention(nn.Module):
    """``labkit.models.CausalSelfAttention`` with its heads split over the group: rank r
    computes heads [r H/N, (r+1) H/N). c_attn (Q, K and V stacked) is column-parallel with
    each of Q, K, V split on its own (``parts=3``); c_proj is row-parallel."""

    def __init__(self, attn: CausalSelfAttention, group=None):
        super().__init__()
        n_embd = attn.c_proj.in_features
        self.n_head = n_embd // attn.head_dim
        self.head_dim = attn.head_dim
        per_rank(self.n_head, group, "n_head")
        # BEGIN SOLUTION tp.attention: c_attn column-parallel with parts=3 (so rank r gets Q_r, K_r, V_r: its own heads), c_proj row-parallel
        self.c_attn = ColumnParallelLinear.from_linear(attn.c_attn, group, parts=3)
        self.c_proj = RowParallelLinear.from_linear(attn.c_proj, group)
        # END SOLUTION

    def forward(self, x):
        # BEGIN SOLUTION tp.attention: q, k, v = c_attn(x).chunk(3, -1); causal SDPA on your n_head/N heads; c_proj of the [B, T, n_embd/N] result
        q, k, v = self.c_attn(x).chunk(3, dim=-1)  # each [B, T, n_embd/N]: this rank's heads
        B, T, _ = q.shape  # (T from q, not x: under sequence parallelism x holds T/N tokens)
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))
        # END SOLUTION


# ----------------------------------------------------------------------------- vocabulary


class VocabParallelEmbedding(nn.Module):
    """An embedding table whose rows (tokens) are split: rank r holds tokens
    [r V/N, (r+1) V/N). A token another rank owns looks up zeros here; the all-reduce (g)
    of the lookups gives every rank the full embedding."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group=None, *,
                 full: nn.Embedding | None = None, seed: int = 0):
        super().__init__()
        self.per_rank = per_rank(num_embeddings, group, "vocab_size")
        world, rank = degree_and_rank(group)
        if full is None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                full = nn.Embedding(num_embeddings, embedding_dim)
        self.group, self.num_embeddings, self.embedding_dim = group, num_embeddings, embedding_dim
        self.vocab_start = rank * self.per_rank
        self.weight = nn.Parameter(shard(full.weight, 0, rank, world))
        self.tp_layout = {"weight": (0, 1)}

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group=None) -> "VocabParallelEmbedding":
        return cls(embedding.num_embeddings, embedding.embedding_dim, group, full=embedding)

    def forward(self, idx):
        # BEGIN SOLUTION tp.vocab: mask ids outside [vocab_start, vocab_start + per_rank); look up (id - start) with masked ids at 0; zero masked rows; reduce_from_parallel
        outside = (idx < self.vocab_start) | (idx >= self.vocab_start + self.per_rank)
        local = (idx - self.vocab_start).masked_fill(outside, 0)
        rows = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_parallel(rows, self.group)
        # END SOLUTION


class VocabParallelHead(nn.Module):
    """The output layer tied to a ``VocabParallelEmbedding``: local logits [.., V/N] =
    f(x) @ (this rank's rows of the table)^T. Column-parallel over the vocabulary."""

    def __init__(self, embedding: VocabParallelEmbedding):
        super().__init__()
        self.group = embedding.group
        self.input_op = copy_to_parallel  # f (chapter 07 swaps in a sequence all-gather)
        self.weight = embedding.weight  # the same Parameter: tied, split the same way
        self.tp_layout = {"weight": (0, 1)}

    def forward(self, x):
        return F.linear(self.input_op(x, self.group), self.weight)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from vocabulary-parallel logits [.., V/N], never gathering the
    logits: three all-reduces of one number per token (the max, the sum of exponentials and
    the target's logit). Backward needs no communication: the gradient of each local logit is
    softmax - one_hot(target), both computable from the local slice and the global sums."""

    @staticmethod
    def forward(ctx, logits, targets, group):
        # BEGIN SOLUTION tp.vocab: all-reduce MAX of the local max; shifted = logits - max; all-reduce SUM of local sum exp; target logit (0 off-rank) all-reduced; loss = log(sum_exp) - target logit; save softmax, target positions for backward
        world, rank = degree_and_rank(group)
        start = rank * logits.shape[-1]
        logits_max = logits.detach().amax(dim=-1)
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)  # for stability only
        shifted = logits - logits_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        outside = (targets < start) | (targets >= start + logits.shape[-1])
        local_target = (targets - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(target_logit, group=group)  # exactly one rank holds each target
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_target, outside)
        return sum_exp.log() - target_logit
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad_loss):
        # BEGIN SOLUTION tp.vocab: grad = softmax, minus 1 at the target where this rank holds it, times grad_loss[..., None]; None for targets and group
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax.clone()
        one_hot = F.one_hot(local_target, grad.shape[-1]).to(grad.dtype)
        grad -= one_hot * (~outside).unsqueeze(-1).to(grad.dtype)
        return grad * grad_loss.unsqueeze(-1), None, None
        # END SOLUTION


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group=None) -> torch.Tensor:
    """Mean cross-entropy of vocabulary-parallel ``logits`` [B, T, V/N] against ``targets`` [B, T]."""
    return VocabParallelCrossEntropy.apply(logits, targets, group).mean()


# ----------------------------------------------------------------------------- the model


def check_gpt(config, group=None) -> None:
    """Every dimension tensor parallelism splits must divide by the degree (ValueError names it)."""
    per_rank(config.n_head, group, "n_head")
    per_rank(config.n_embd, group, "n_embd")
    per_rank(4 * config.n_embd, group, "MLP hidden size (4 x n_embd)")
    per_rank(config.vocab_size, group, "vocab_size")


def tensor_parallel(gpt: GPT, group=None) -> GPT:
    """Turn ``gpt`` into its tensor-parallel version, in place, and return it.

    Every block's attention and MLP become ``ParallelSelfAttention``/``ParallelMLP``; the token
    embedding becomes a ``VocabParallelEmbedding``; the output layer its tied
    ``VocabParallelHead`` (or a ``ColumnParallelLinear`` over the vocabulary if untied); the
    loss ``vocab_parallel_cross_entropy``. ``gpt(idx, targets)`` then returns this rank's
    slice of the logits [B, T, V/N] and the full loss, the same on every rank.
    """
    check_gpt(gpt.config, group)  # before any communication
    # BEGIN SOLUTION tp.model: replace block.attn / block.mlp, wte, lm_head (tied: VocabParallelHead(wte)); set gpt.loss to the vocabulary-parallel loss
    for block in gpt.blocks:
        block.attn = ParallelSelfAttention(block.attn, group)
        block.mlp = ParallelMLP(block.mlp, group)
    tied = gpt.lm_head.weight is gpt.wte.weight
    gpt.wte = VocabParallelEmbedding.from_embedding(gpt.wte, group)
    gpt.lm_head = VocabParallelHead(gpt.wte) if tied else ColumnParallelLinear.from_linear(gpt.lm_head, group)
    gpt.loss = functools.partial(vocab_parallel_cross_entropy, group=group)  # shadows GPT.loss
    return gpt
    # END SOLUTION


def full_state_dict(model: nn.Module, group=None, grads: bool = False) -> dict[str, torch.Tensor]:
    """The unsharded model's ``state_dict`` (or, ``grads=True``, its parameters' gradients),
    gathered from the shards: the same keys and shapes as before ``tensor_parallel``. A
    collective: every rank of the group must call it."""
    # BEGIN SOLUTION tp.model: for each state_dict key, find its module; if the module's tp_layout names it, all-gather the pieces and unshard(pieces, dim, parts); else keep it
    world = dist.get_world_size(group)
    modules = dict(model.named_modules())
    full = {}
    for key, value in model.state_dict(keep_vars=True).items():
        owner, _, name = key.rpartition(".")
        tensor = value.grad if grads else value.detach()
        if tensor is None:
            continue
        layout = getattr(modules[owner], "tp_layout", {}).get(name)
        if layout is None:
            full[key] = tensor.clone()
            continue
        pieces = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(pieces, tensor.contiguous(), group=group)
        full[key] = unshard(pieces, *layout)
    return full
    # END SOLUTION
