"""perf.flops: the FLOPs of a token (a model's parameters, attention, recomputation), MFU and HFU
(the overview and the task list: ``labkit/perf/__init__.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

RECOMPUTE = ("none", "selective", "full")


# ----------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class Model:
    """A decoder-only transformer as papers state it.

    ``heads`` query heads of ``head_dim`` (default hidden // heads; PaLM 540B has 48 x 256 on a
    width of 18432), ``kv_heads`` key/value heads (grouped-query attention; None = heads),
    an FFN of inner width ``ffn`` (None = 4 hidden), with three matrices when ``gated``
    (SwiGLU) instead of two. A mixture of experts: ``experts`` routed experts per MoE layer of
    inner width ``expert_ffn`` (None = ffn), ``top_k`` of them per token, ``shared_experts``
    always on, a router [hidden, experts]; the first ``dense_layers`` layers keep a dense FFN.
    ``tied``: the output layer is the token embedding. Biases, norms and learned position
    embeddings are left out of every count: none of them is a matmul, and in a large model they
    are a few parts in ten thousand of the parameters (the course's tiny GPT is the exception)."""
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    kv_heads: int | None = None
    ffn: int | None = None
    gated: bool = False
    experts: int = 0
    top_k: int = 1
    shared_experts: int = 0
    expert_ffn: int | None = None
    dense_layers: int = 0
    tied: bool = False
    name: str = ""
    head_dim: int | None = None

    def __post_init__(self):
        for field in ("layers", "hidden", "heads", "vocab", "seq"):
            if not isinstance(getattr(self, field), int) or getattr(self, field) < 1:
                raise ValueError(f"Model {self.name!r}: {field} must be a positive integer, got {getattr(self, field)!r}")
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"Model {self.name!r}: hidden {self.hidden} is not a multiple of heads {self.heads}; "
                             f"give head_dim")
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise ValueError(f"Model {self.name!r}: {self.heads} query heads do not split into {self.kv_heads} groups")
        if self.experts < 0 or self.shared_experts < 0:
            raise ValueError(f"Model {self.name!r}: experts and shared_experts must be >= 0")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"Model {self.name!r}: top_k {self.top_k} must be between 1 and experts {self.experts}")
        if not 0 <= self.dense_layers <= self.layers:
            raise ValueError(f"Model {self.name!r}: dense_layers {self.dense_layers} not in [0, {self.layers}]")

    # shapes
    @property
    def kv_heads_(self) -> int:
        """Key/value heads (``kv_heads``, else one per query head)."""
        return self.kv_heads or self.heads

    @property
    def head_size(self) -> int:
        """Width of one attention head (``head_dim``, else hidden // heads)."""
        return self.head_dim or self.hidden // self.heads

    @property
    def ffn_width(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def expert_width(self) -> int:
        return self.expert_ffn or self.ffn_width

    @property
    def moe_layers(self) -> int:
        """Layers whose FFN is a mixture of experts (0 for a dense model)."""
        return self.layers - self.dense_layers if self.experts else 0

    def attention_params(self) -> int:
        """One layer's attention projections: q and o are hidden x (heads x head_size) each;
        k and v hidden x (kv_heads x head_size) each (grouped-query attention shares them)."""
        # BEGIN SOLUTION perf.flops: q, o: hidden x heads x head_size; k, v: hidden x kv_heads_ x head_size
        return 2 * self.hidden * self.heads * self.head_size + 2 * self.hidden * self.kv_heads_ * self.head_size
        # END SOLUTION

    def ffn_params(self, width: int | None = None) -> int:
        """One FFN (or one expert) of inner ``width`` (None: ``ffn_width``): up and down
        projections hidden x width, and a gate of the same shape when ``gated`` (SwiGLU)."""
        # BEGIN SOLUTION perf.flops: 2 matrices hidden x width, 3 when gated
        return (3 if self.gated else 2) * self.hidden * (width or self.ffn_width)
        # END SOLUTION

    def params(self) -> int:
        """All parameters: token embedding, output layer (unless tied), every layer's attention,
        FFN, router and all experts (biases, norms, position embeddings left out)."""
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        dense = (self.layers - self.moe_layers) * self.ffn_params()
        moe = self.moe_layers * (self.hidden * self.experts
                                 + (self.experts + self.shared_experts) * self.ffn_params(self.expert_width))
        return embeddings + self.layers * self.attention_params() + dense + moe

    def active_params(self) -> int:
        """The matmul parameters one token's forward multiplies by: every layer's attention
        projections, the dense FFNs, in an MoE layer the router and the top_k routed + the
        shared experts, and the output layer (vocab x hidden, tied or not). The embedding lookup
        is not a matmul and is not counted."""
        # BEGIN SOLUTION perf.flops: layers x attention + dense FFNs + MoE layers x (router + (top_k + shared) experts) + the output layer
        dense = (self.layers - self.moe_layers) * self.ffn_params()
        moe = self.moe_layers * (self.hidden * self.experts
                                 + (self.top_k + self.shared_experts) * self.ffn_params(self.expert_width))
        return self.layers * self.attention_params() + dense + moe + self.vocab * self.hidden
        # END SOLUTION

    @classmethod
    def of_gpt(cls, config, seq: int | None = None) -> "Model":
        """The course GPT (``labkit.models.GPTConfig``): 4H MLP (or n_experts experts of 4H with
        a top-moe_k router, counted dropless), sequences of ``seq`` tokens (default block_size)."""
        return cls(layers=config.n_layer, hidden=config.n_embd, heads=config.n_head, vocab=config.vocab_size,
                   seq=seq or config.block_size, experts=config.n_experts,
                   top_k=config.moe_k if config.n_experts else 1, tied=config.tie_weights, name="labkit GPT")


# ----------------------------------------------------------------------------- perf.flops


def flops_per_token(model: Model, recompute: str = "none") -> float:
    """FLOPs of one token's forward + backward in a training step (PaLM, appendix B):
    6 x ``model.active_params()`` + 12 L (heads x head_size) s for attention's scores and
    weighted values (causal counted as the full square). ``recompute``: "none" (the model
    FLOPs), "selective" adds attention's forward again (4 L a d s; Korthikanti et al. 2022),
    "full" adds every layer's forward again (2 x the layers' matmul parameters + 4 L a d s; the
    output layer is not recomputed). Equals what ``torch.utils.flop_counter.FlopCounterMode``
    counts on ``labkit.models.GPT`` (math attention), per token."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    # BEGIN SOLUTION perf.flops: 6 x active params + 12 L (a d) s; selective: + attention's forward 4 L a d s; full: + 2 x (active params - output layer) + 4 L a d s
    attention_forward = 4 * model.layers * model.heads * model.head_size * model.seq
    flops = 6 * model.active_params() + 3 * attention_forward
    if recompute == "selective":
        flops += attention_forward
    elif recompute == "full":
        flops += 2 * (model.active_params() - model.vocab * model.hidden) + attention_forward
    return float(flops)
    # END SOLUTION


def model_flops_per_token(model: Model) -> float:
    """The model FLOPs of MFU: ``flops_per_token(model, "none")``, whatever the run recomputes."""
    return flops_per_token(model, "none")


def mfu(tokens_per_second: float, model: Model, gpus: int, peak_flops: float) -> float:
    """Model FLOPs utilization (PaLM, appendix B): the model FLOPs per second a run achieves
    (tokens/s x model FLOPs per token) over the peak FLOP/s of all its chips."""
    # BEGIN SOLUTION perf.flops: tokens/s x model FLOPs per token / (gpus x peak)
    return tokens_per_second * model_flops_per_token(model) / (gpus * peak_flops)
    # END SOLUTION


HFU_CONVENTIONS = ("palm", "korthikanti")


def hfu(tokens_per_second: float, model: Model, gpus: int, peak_flops: float, recompute: str,
        convention: str = "palm") -> float:
    """Hardware FLOPs utilization (PaLM, appendix B): as MFU, with the FLOPs the chips ran,
    recomputation's included (``flops_per_token(model, recompute)``: selective adds attention's
    forward, 4 L a d s). ``convention="korthikanti"``: Korthikanti et al. 2022's count of
    selective recomputation, which adds the whole attention term again, 12 L a d s a token (their
    hardware FLOPs 72 B s L h^2 (1 + s/3h + V/12hL) against the model's 1 + s/6h + V/12hL); the
    course's convention is PaLM's, offered theirs to compare with their HFU/MFU pairs. The two
    differ only for "selective"."""
    if convention not in HFU_CONVENTIONS:
        raise ValueError(f"convention must be one of {HFU_CONVENTIONS}, got {convention!r}")
    # BEGIN SOLUTION perf.flops: tokens/s x flops_per_token(model, recompute) / (gpus x peak); korthikanti + selective: + 8 L a d s more (12 in all)
    flops = flops_per_token(model, recompute)
    if convention == "korthikanti" and recompute == "selective":
        flops += 8 * model.layers * model.heads * model.head_size * model.seq
    return tokens_per_second * flops / (gpus * peak_flops)
    # END SOLUTION
