"""The models the labs parallelise: a tiny GPT and a toy MLP with awkward parameters.

Both are built so that every process that calls `GPT(config, seed=0)` (or
`ToyModel(seed=0)`) holds bit-identical weights, whatever the global RNG has
been doing. That is what lets a learner compare a parallel run against a
single-process reference one number at a time.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 32
    block_size: int = 16  # longest sequence the position embedding covers
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    bias: bool = True  # biases in the Linear and LayerNorm layers
    tie_weights: bool = True  # lm_head reuses the token-embedding matrix
    # Mixture of experts (chapter 10): n_experts > 0 makes every block's MLP a top-k MoE
    # (MoEMLP below); 0 keeps the dense MLP, and then the model is exactly as before.
    n_experts: int = 0
    moe_k: int = 2  # experts per token
    moe_capacity_factor: float | None = None  # None: dropless
    moe_aux_weight: float = 0.01  # times each layer's load-balancing loss, added to the loss
    # No dropout on purpose: the labs compare runs step by step, so training
    # has to be a deterministic function of the seed and the data.


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.head_dim = config.n_embd // config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        # Count heads from the tensor, not the config: a tensor-parallel shard
        # of c_attn holds only some of the heads and then runs unchanged.
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, heads, T, head_dim]
        k = k.view(B, T, -1, self.head_dim).transpose(1, 2)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, -1)  # heads side by side again
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class MoEMLP(nn.Module):
    """A top-k mixture of experts in place of the MLP, one process holding every expert.

    A gate [E, H] sends each token to the k most probable of E expert MLPs
    gelu(x @ w1[e]) @ w2[e] (w1 [E, H, 4H], w2 [E, 4H, H], no biases), weighted by the k
    probabilities renormalised to sum to 1 (for k = 1 by the probability itself, as Switch
    does: a renormalised top-1 weight is always 1 and trains no router). With a capacity factor C an expert keeps at most
    ceil(C k T / E) of the call's T tokens, earliest (token, slot) first; a dropped choice adds
    nothing. After forward, ``aux`` holds the load-balancing loss E sum_e f_e P_e of the call's
    tokens (Switch, Fedus et al., 2021, arXiv:2101.03961), ``experts`` the k choices of each
    token [T, k] and ``kept_experts`` the expert of each kept choice, in (token, slot) order.

    This is the math of ``labkit.moe.reference_moe`` written again in plain torch: a tool may
    not import an exercise. ``labkit.moe.expert_parallel_gpt`` swaps it for the learner's
    ``ExpertParallelMoE``, copying the weights."""

    def __init__(self, config):
        super().__init__()
        e, h, k = config.n_experts, config.n_embd, config.moe_k
        if not 1 <= k <= e:
            raise ValueError(f"MoE: top-k {k} must be between 1 and the number of experts {e}")
        if config.moe_capacity_factor is not None and config.moe_capacity_factor <= 0:
            raise ValueError(f"MoE: capacity factor must be > 0, got {config.moe_capacity_factor}")
        self.num_experts, self.k, self.capacity_factor = e, k, config.moe_capacity_factor
        self.gate = nn.Parameter(torch.empty(e, h))
        self.w1 = nn.Parameter(torch.empty(e, h, 4 * h))
        self.w2 = nn.Parameter(torch.empty(e, 4 * h, h))

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        probs = (tokens @ self.gate.t()).softmax(dim=-1)
        weights, experts = probs.topk(self.k, dim=-1)
        if self.k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        keep = self._keep(experts)
        y = torch.zeros_like(tokens)
        for e in range(self.num_experts):
            token, slot = torch.nonzero((experts == e) & keep, as_tuple=True)
            out = F.gelu(tokens[token] @ self.w1[e]) @ self.w2[e]
            y = y.index_add(0, token, out * weights[token, slot].unsqueeze(1))
        fraction = torch.bincount(experts.reshape(-1), minlength=self.num_experts).to(probs.dtype) / experts.numel()
        self.aux = self.num_experts * (fraction * probs.mean(dim=0)).sum()
        self.experts, self.kept_experts = experts, experts[keep]
        return y.reshape(x.shape)

    def _keep(self, experts):
        """Bool [T, k]: each expert takes choices in (token, slot) order up to its capacity."""
        if self.capacity_factor is None:
            return torch.ones_like(experts, dtype=torch.bool)
        capacity = math.ceil(self.capacity_factor * self.k * experts.shape[0] / self.num_experts)
        one_hot = F.one_hot(experts.reshape(-1), self.num_experts)
        position = (one_hot.cumsum(dim=0) * one_hot).sum(dim=1) - 1  # place in its expert's queue
        return (position < capacity).reshape(experts.shape)


class Block(nn.Module):
    """One transformer layer, pre-LayerNorm: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MoEMLP(config) if config.n_experts else MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config, seed=0):
        super().__init__()
        self.config = config
        # nn.Linear and nn.Embedding draw their default init from the global
        # RNG; fork it so that building a model leaves the caller's stream as
        # it was. Every value is overwritten by _init_weights below anyway.
        with torch.random.fork_rng(devices=[]):
            self.wte = nn.Embedding(config.vocab_size, config.n_embd)
            self.wpe = nn.Embedding(config.block_size, config.n_embd)
            self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
            self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            # One Parameter, two modules: its gradient is the sum of both uses.
            self.lm_head.weight = self.wte.weight
        self._init_weights(seed)

    @torch.no_grad()
    def _init_weights(self, seed):
        gen = torch.Generator().manual_seed(seed)
        seen = set()  # a tied weight is drawn once, at its first owner
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                if id(module.weight) not in seen:
                    seen.add(id(module.weight))
                    module.weight.normal_(0.0, 0.02, generator=gen)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, MoEMLP):  # drawn like the Linears, in module order
                for weight in (module.gate, module.w1, module.w2):
                    weight.normal_(0.0, 0.02, generator=gen)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        assert T <= self.config.block_size, f"sequence of {T} tokens, block_size is {self.config.block_size}"
        positions = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(positions)  # [B, T, n_embd]
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # [B, T, vocab_size]
        if targets is None:
            return logits, None
        loss = self.loss(logits, targets)
        if self.config.n_experts:  # each MoE layer's load-balancing loss, kept by its forward
            loss = loss + self.config.moe_aux_weight * sum(block.mlp.aux for block in self.blocks)
        return logits, loss

    def loss(self, logits, targets):
        """Mean next-token cross-entropy over the batch. (Tensor parallelism, chapter 05,
        replaces it with one that works on a slice of the vocabulary.)"""
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def num_params(model):
    """Number of parameter values, frozen ones included, a tied Parameter counted once."""
    # model.parameters() already yields each Parameter object a single time.
    return sum(p.numel() for p in model.parameters())


class ToyModel(nn.Module):
    """A small MLP with every kind of parameter that trips up a parallel wrapper.

        h   = tanh(x @ shared.T + bias_in)        # [.., d_hidden]
        h   = tanh(frozen(h)) * scale
        out = h @ shared + bias_out               # [.., d_out], d_out == d_in

    - `shared` (Parameter [d_hidden, d_in]) is TIED: the input projection and
      the output projection (its transpose) are the same Parameter, so its
      gradient is the sum of two contributions.
    - `frozen` (nn.Linear d_hidden -> d_hidden) is FROZEN: weight and bias have
      requires_grad=False, never get a .grad, and must never change.
    - `unused` (Parameter [d_hidden]) is UNUSED: it requires grad but forward
      never reads it, so its .grad stays None after backward.
    - `bias_in`, `bias_out` are ordinary trainable biases.
    - `scale` is a BUFFER (state, not a parameter): saved in the state_dict,
      read in forward, never trained.
    """

    def __init__(self, d_in=8, d_hidden=16, d_out=8, seed=0):
        super().__init__()
        assert d_in == d_out, "the output projection is the transpose of the input one"
        gen = torch.Generator().manual_seed(seed)

        def draw(*shape, std):
            return torch.randn(*shape, generator=gen) * std

        self.shared = nn.Parameter(draw(d_hidden, d_in, std=1 / math.sqrt(d_in)))
        self.bias_in = nn.Parameter(draw(d_hidden, std=0.1))
        with torch.random.fork_rng(devices=[]):  # keep the global RNG untouched
            self.frozen = nn.Linear(d_hidden, d_hidden)
        with torch.no_grad():
            self.frozen.weight.copy_(draw(d_hidden, d_hidden, std=1 / math.sqrt(d_hidden)))
            self.frozen.bias.copy_(draw(d_hidden, std=0.1))  # non-zero, so a change shows
        self.frozen.requires_grad_(False)
        self.bias_out = nn.Parameter(draw(d_out, std=0.1))
        self.unused = nn.Parameter(draw(d_hidden, std=1.0))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d_hidden))

    def forward(self, x):
        h = torch.tanh(F.linear(x, self.shared, self.bias_in))
        h = torch.tanh(self.frozen(h)) * self.scale
        return F.linear(h, self.shared.t(), self.bias_out)


def toy_loss(model, x, y):
    return F.mse_loss(model(x), y)
