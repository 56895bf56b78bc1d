"""The memory budget of a training step, as formulas: one copy for chapters 08 and 12.

Pure arithmetic (no torch), in bytes per GPU. Two kinds of terms:

* **Model states** (ZeRO, Rajbhandari et al. 2020, arXiv:1910.02054): parameters, gradients
  and the optimizer state, each a number of bytes per parameter, and each sharded over the
  data-parallel ranks from a ZeRO stage on: stage 1 shards the optimizer state, stage 2 also
  the gradients, stage 3 also the parameters. AdamW keeps two moments per parameter in the
  master precision, plus a master copy of the weights when the model trains in fewer bytes
  (mixed precision, Micikevicius et al. 2018, arXiv:1710.03740): 2 + 2 + 12 = 16 bytes in
  bf16, 4 + 4 + 8 in fp32. (AdamW's 4-byte step counter is per *tensor*, not per parameter:
  add it yourself where you compare with a measurement.)

* **Activations** of one transformer layer, i.e. what forward saves for backward, for a
  micro-batch of b sequences of s tokens, width h, a heads. Two models of a layer, counted
  differently, so two functions:

  - ``explicit_layer_bytes``: this course's GPT block (``labkit.models.Block``) with attention
    written out and dropout after the softmax and after each residual branch, e bytes per
    activation element, m bytes per dropout-mask element, fp32 LayerNorm statistics
    (chapter 12, section 2, measured op by op):
        sb ((16e + 2m) h + (2e + m) a s + 16)
    Selective recomputation (Korthikanti et al. 2022, arXiv:2205.05198) drops the (2e + m) a s
    term. ``fused_layer_bytes``: the same block with the fused attention kernel in fp32, which
    keeps no s x s scores: sb (64h + 4a + 16).
  - ``korthikanti_layer_bytes``: Korthikanti et al.'s (2022) layer in 16-bit training with
    1-byte masks and no LayerNorm statistics, s b h (34 + 5 a s / h), with tensor + sequence
    parallelism dividing it by tp and context parallelism leaving each rank s/cp of the
    queries (its scores against all s keys); ``flash`` drops the 5as/h term (chapter 08's
    planner). It is ``explicit_layer_bytes`` with e = 2, m = 1 less the 16sb of statistics.

Full recomputation (Chen et al. 2016, arXiv:1604.06174) keeps only each layer's input (e s b h
bytes, 2 in 16 bits) plus one layer's activations while backward recomputes it.
"""

from __future__ import annotations

ZERO_STAGES = (0, 1, 2, 3)


def adamw_bytes(param_bytes: int, master_bytes: int = 4) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes per parameter for AdamW with parameters and
    gradients of ``param_bytes``: two moments in ``master_bytes``, and a master copy of the
    weights in ``master_bytes`` when the two differ. (2, 4) -> (2, 2, 12); (4, 4) -> (4, 4, 8)."""
    master_copy = 0 if param_bytes == master_bytes else master_bytes
    return param_bytes, param_bytes, 2 * master_bytes + master_copy


def model_state_bytes(params: float, element_bytes: tuple = (2, 2, 12), zero: int = 0,
                      shards: int = 1) -> dict[str, float]:
    """Bytes of one rank's parameters, gradients and optimizer state for ``params`` parameters
    at ``element_bytes`` = (parameter, gradient, optimizer) bytes each, ZeRO stage ``zero``
    sharding over ``shards`` ranks: stage >= 1 the optimizer state, >= 2 the gradients, 3 the
    parameters (Rajbhandari et al. 2020). Returns {"params", "grads", "optimizer"}."""
    if zero not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage must be one of {ZERO_STAGES}, got {zero}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    param_b, grad_b, optim_b = element_bytes
    return dict(params=param_b * params / (shards if zero >= 3 else 1),
                grads=grad_b * params / (shards if zero >= 2 else 1),
                optimizer=optim_b * params / (shards if zero >= 1 else 1))


# ----------------------------------------------------------------------------- the course GPT's block


def fused_layer_bytes(seq: int, micro: int, hidden: int, heads: int) -> int:
    """Bytes one ``labkit.models.Block`` saves for backward in fp32 with the fused attention
    kernel (inputs of the LayerNorms and linears, q k v, attention's output and log-sum-exp,
    GELU's input and output, LayerNorm statistics): sb (64h + 4a + 16) (chapter 12, section 2)."""
    return seq * micro * (64 * hidden + 4 * heads + 16)


def explicit_layer_bytes(seq: int, micro: int, hidden: int, heads: int, element_bytes: int = 4,
                         mask_bytes: int = 4, selective: bool = False) -> int:
    """Bytes one course block with attention written out and dropout (after the softmax and
    after each residual branch) saves for backward: sb ((16e + 2m) h + (2e + m) a s + 16) with e
    bytes per activation element, m per mask element, fp32 LayerNorm statistics (chapter 12,
    section 2). ``selective``: the attention core is recomputed (Korthikanti et al. 2022), the
    (2e + m) a s term goes. On a CPU in fp32, e = m = 4; bf16 with 1-byte masks, e = 2, m = 1."""
    e, m = element_bytes, mask_bytes
    scores = 0 if selective else (2 * e + m) * heads * seq
    return seq * micro * ((16 * e + 2 * m) * hidden + scores + 16)


def explicit_activation_bytes(layers: int, seq: int, micro: int, hidden: int, heads: int,
                              element_bytes: int = 2, mask_bytes: int = 1, recompute: str = "none") -> int:
    """Activations of ``layers`` explicit course blocks by recomputation mode: "none" keeps every
    layer's ``explicit_layer_bytes``, "selective" drops attention's a s terms, "full" keeps each
    layer's input (e s b h) plus one layer's activations while backward recomputes it."""
    s, b, h, a, e = seq, micro, hidden, heads, element_bytes
    if recompute == "selective":
        return layers * explicit_layer_bytes(s, b, h, a, e, mask_bytes, selective=True)
    per_layer = explicit_layer_bytes(s, b, h, a, e, mask_bytes)
    if recompute == "full":
        return layers * e * s * b * h + per_layer
    if recompute == "none":
        return layers * per_layer
    raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")


# ----------------------------------------------------------------------------- Korthikanti et al.'s layer, with tp and cp


def korthikanti_layer_bytes(seq: int, hidden: int, heads: int, micro: int = 1, tp: int = 1, cp: int = 1,
                            flash: bool = False) -> float:
    """Bytes one rank keeps for one layer in 16-bit training (Korthikanti et al. 2022, section 4,
    tensor + sequence parallelism): (s/cp) b h (34 + 5 a s / h) / tp. With context parallelism a
    rank keeps s/cp queries, whose scores run against all s keys; ``flash`` (fused attention)
    keeps no scores and drops the 5as/h term."""
    scores = 0 if flash else 5 * heads * seq / hidden
    return seq / cp * micro * hidden * (34 + scores) / tp


def korthikanti_activation_bytes(layers: int, seq: int, hidden: int, heads: int, micro: int = 1,
                                 tp: int = 1, cp: int = 1, held: float = 1, flash: bool = False,
                                 full: bool = False) -> float:
    """Activations one rank of a pipeline stage keeps: ``held`` micro-batches in flight (chapter
    06's schedule) x ``layers`` x ``korthikanti_layer_bytes``; with ``full`` recomputation each
    layer keeps only its 16-bit input, split over tp by sequence parallelism, 2 (s/cp) b h / tp,
    plus one layer's activations while backward recomputes it."""
    per_layer = korthikanti_layer_bytes(seq, hidden, heads, micro, tp, cp, flash)
    if full:
        return held * layers * 2 * (seq / cp) * micro * hidden / tp + per_layer
    return held * layers * per_layer
