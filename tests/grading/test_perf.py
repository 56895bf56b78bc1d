"""Graded tests for chapter 14: performance at scale (labkit/perf.py).

Pure arithmetic, so no launches: every function is called in the test process and checked
against numbers derived independently of its formula.

perf.flops: the FLOPs of a full forward + backward of ``labkit.models.GPT``, counted by
``torch.utils.flop_counter.FlopCounterMode`` with the math attention backend (on CPU the fused
kernel, ``_scaled_dot_product_flash_attention_for_cpu``, has no FLOP formula in torch 2.13 and
counts 0; the math backend runs the scores and the weighted sum as bmm, which is counted, causal
as the full square) equal ``flops_per_token`` EXACTLY, per token, for dense configs (tied and
untied, several widths, heads, lengths, vocabularies, batch > 1) and MoE configs (dropless, top-1
and top-2), and on GPT configurations drawn from the run's seed (``drawn_gpts``); with every block under ``torch.utils.checkpoint`` (full) or only the attention core
(selective), through labkit.oracles.builtin_checkpoint with early stop off so that the whole
forward is run again. GQA, SwiGLU, shared experts,
dense leading layers and a head width other than hidden/heads are counted by FlopCounterMode on
a small transformer written here with plain Linears (the shapes a ``Model`` states), and checked
on published parameter counts (GPT-3 175B, Llama 3 405B, Mixtral 8x7B's 47B/13B, PaLM 540.35B) and
on Narayanan et al. (2021)'s closed forms (72 and 96 B s L h^2 (...)). MFU on PaLM's own figures
(238.3K tokens/s on 6144 TPU v4 chips of 275 TFLOP/s: 46.2%); HFU against PaLM's 57.8%, which lies
between selective and full rematerialization.
perf.roofline: both sides of the max reached, achieved vs peak figures (and None -> peak),
element sizes 1, 2 and 4, the ridge point against the datasheets, and a CPU measured here
classified (a large matmul above its ridge point, an addition below).
perf.comm: every op x algorithm against chapter 00 (its worked answers, the ring/tree crossover
size S*) and labkit.comm's ``ring_all_reduce_time`` and ``wire_bytes``; one rank; non-powers of
two; the link class of groups of every stride inside and across nodes, with and without rails.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
import types
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from labkit.course.grading import task
from labkit.oracles import builtin_checkpoint
from labkit.models import GPT, GPTConfig
from tests.grading import configs


# ----------------------------------------------------------------------------- perf.flops


def counted_per_token(model: nn.Module, vocab: int, batch: int, seq: int) -> float:
    """FlopCounterMode's count of one forward + backward of ``model`` on [batch, seq] tokens,
    per token (math attention: the fused CPU kernel has no FLOP formula)."""
    idx = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = model(idx, idx) if isinstance(model, GPT) else model(idx)
        loss = out[1] if isinstance(out, tuple) else out.float().pow(2).mean()
        loss.backward()
    return counter.get_total_flops() / (batch * seq)


def checkpoint_blocks(gpt: GPT) -> GPT:
    """Full recomputation: every block under torch.utils.checkpoint, early stop off (by default
    torch skips recomputing the ops after the last one that saves a tensor: here the MLP's
    output projection, 2 x 4h x h FLOPs per token and layer fewer than a whole forward)."""
    for block in gpt.blocks:  # the block stays in place (an MoE model reads block.mlp.aux)
        block.forward = lambda x, run=builtin_checkpoint(block.forward, early_stop=False): run(x)
    return gpt


def checkpoint_attention_core(gpt: GPT) -> GPT:
    """Selective recomputation: only scaled_dot_product_attention under checkpoint."""
    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in self.c_attn(x).chunk(3, dim=-1))
        y = builtin_checkpoint(functools.partial(F.scaled_dot_product_attention, is_causal=True), early_stop=False)(q, k, v)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))
    for block in gpt.blocks:
        block.attn.forward = types.MethodType(forward, block.attn)
    return gpt


# The pure arithmetic first (cheap), then the counts of FlopCounterMode.

@task("perf.flops", points=2)
def test_parameter_counts_and_closed_forms_of_published_models():
    from labkit.perf import Model, flops_per_token
    # GPT-3 175B (Brown et al. 2020, Table 2.1): 96 layers, d 12288, 96 heads, 2048 tokens, 50257-token vocabulary, tied
    gpt3 = Model(layers=96, hidden=12288, heads=96, vocab=50257, seq=2048, tied=True)
    assert round(gpt3.active_params() / 1e9) == 175, f"perf.flops: GPT-3 counts {gpt3.active_params() / 1e9:.1f}B, paper 175B"
    # Llama 3 405B (Dubey et al. 2024, Table 3): 126 layers, 16384, FFN 53248, 128 heads, 8 KV heads, vocab 128256
    llama = Model(layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, gated=True, vocab=128256, seq=8192)
    embedding = llama.vocab * llama.hidden
    assert round((llama.active_params() + embedding) / 1e9) == 406, \
        f"perf.flops: Llama 3 405B counts {(llama.active_params() + embedding) / 1e9:.2f}B (405.8B with its embedding)"
    # Mixtral 8x7B (Jiang et al. 2024): 47B parameters, 13B active per token (embedding counted)
    mixtral = Model(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, gated=True, experts=8, top_k=2,
                    vocab=32000, seq=4096)
    assert round(mixtral.params() / 1e9) == 47, f"perf.flops: Mixtral has {mixtral.params() / 1e9:.1f}B parameters, paper 47B"
    active = (mixtral.active_params() + mixtral.vocab * mixtral.hidden) / 1e9
    assert round(active) == 13, f"perf.flops: Mixtral's active parameters {active:.2f}B, paper 13B"
    # Narayanan et al. 2021 (eq. 3): a GPT layer of 12 h^2, output layer V h: per batch of B sequences
    # of s tokens, 72 B s L h^2 (1 + s/(6h) + V/(12 L h)) model FLOPs, 96 B s L h^2 (1 + s/(6h) + V/(16 L h))
    # with full recomputation. B s = tokens; exact in integers for these shapes.
    for L, h, a, s, V in ((128, 25600, 160, 2048, 51200), (24, 2304, 24, 2048, 51200), (3, 64, 4, 96, 48)):
        model = Model(layers=L, hidden=h, heads=a, vocab=V, seq=s)
        narayanan = 72 * L * h * h + 12 * L * h * s + 6 * V * h            # 72 L h^2 (1 + s/6h + V/12Lh)
        narayanan_full = 96 * L * h * h + 16 * L * h * s + 6 * V * h        # 96 L h^2 (1 + s/6h + V/16Lh)
        assert flops_per_token(model) == narayanan, f"perf.flops: L={L} h={h}: {flops_per_token(model)} vs {narayanan}"
        assert flops_per_token(model, "full") == narayanan_full, \
            f"perf.flops: L={L} h={h}, full recomputation: {flops_per_token(model, 'full')} vs {narayanan_full}"


PALM = dict(layers=118, hidden=18432, heads=48, head_dim=256, kv_heads=1, ffn=4 * 18432, gated=True,
            vocab=256000, seq=2048, tied=True, name="PaLM 540B")


@task("perf.flops", points=2)
def test_mfu_and_hfu_on_palms_published_run():
    """PaLM (Chowdhery et al. 2022, arXiv:2204.02311): 540.35B parameters; section 4 / appendix B:
    238.3K tokens/s on 6144 TPU v4 chips, 275 TFLOP/s bf16 peak each, 46.2% MFU, 57.8% HFU."""
    from labkit.perf import Model, flops_per_token, hfu, mfu
    palm = Model(**PALM)
    assert round(palm.active_params() / 1e7) == 54035, f"perf.flops: PaLM 540B counts {palm.active_params()}, paper 540.35B"
    tokens, chips, peak = 238.3e3, 6144, 275e12
    got = mfu(tokens, palm, chips, peak)
    assert round(100 * got, 1) == 46.2, f"perf.flops: PaLM 540B's MFU is {100 * got:.2f}%; the paper states 46.2%"
    assert hfu(tokens, palm, chips, peak, "none") == got, "perf.flops: without recomputation HFU must equal MFU"
    selective, full = (hfu(tokens, palm, chips, peak, r) for r in ("selective", "full"))
    assert got < selective < 0.578 < full, (
        f"perf.flops: PaLM rematerialized part of each layer (57.8% HFU): expected MFU < HFU(selective) < 57.8% < "
        f"HFU(full); got {100 * got:.2f}, {100 * selective:.2f}, {100 * full:.2f}")
    # utilization is linear in throughput and inverse in chips and peak
    half = mfu(tokens / 2, palm, chips, peak)
    assert math.isclose(half, got / 2, rel_tol=1e-12), f"perf.flops: MFU at half the throughput {half} vs {got / 2}"
    assert math.isclose(mfu(tokens, palm, 2 * chips, peak), got / 2, rel_tol=1e-12), "perf.flops: MFU must divide by the chips"
    assert math.isclose(hfu(tokens, palm, chips, 2 * peak, "full"), full / 2, rel_tol=1e-12), "perf.flops: HFU must divide by the peak"
    # Korthikanti et al.'s convention: selective recomputation counts the whole attention term again (12 L a d s)
    attention = 12 * 118 * 48 * 256 * 2048
    for r in ("none", "selective", "full"):
        theirs = hfu(tokens, palm, chips, peak, r, convention="korthikanti")
        extra = attention if r == "selective" else 0
        want = tokens * (flops_per_token(palm, "none" if r == "selective" else r) + extra) / (chips * peak)
        assert math.isclose(theirs, want, rel_tol=1e-12), \
            f"perf.flops: HFU(korthikanti, {r}) {theirs:.6f}, expected {want:.6f} (selective: + 12 L a d s)"
        assert math.isclose(hfu(tokens, palm, chips, peak, r, "palm"), hfu(tokens, palm, chips, peak, r), rel_tol=0), \
            "perf.flops: convention='palm' is the default"
    with pytest.raises(ValueError):
        hfu(tokens, palm, chips, peak, "selective", convention="megatron")
    assert math.isclose(full / got, 1 + (2 * (palm.active_params() - palm.vocab * palm.hidden) + 4 * 118 * 48 * 256 * 2048)
                        / (6 * palm.active_params() + 12 * 118 * 48 * 256 * 2048), rel_tol=1e-12), \
        "perf.flops: HFU(full)/MFU must be 1 + (one forward of the layers) / (model FLOPs)"


GPT_CONFIGS = [  # (config, batch)
    (GPTConfig(), 2),
    (GPTConfig(n_layer=3, n_head=4, n_embd=48, block_size=12, vocab_size=50, tie_weights=False), 3),
    (GPTConfig(n_layer=1, n_head=1, n_embd=16, block_size=20, vocab_size=7, bias=False), 1),
    (GPTConfig(n_layer=2, n_head=8, n_embd=64, block_size=8, vocab_size=100), 2),
    (GPTConfig(n_experts=4, moe_k=2), 2),
    (GPTConfig(n_layer=1, n_head=3, n_embd=24, n_experts=3, moe_k=1, vocab_size=40, tie_weights=False), 4),
    (GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=10, n_experts=5, moe_k=3), 3),
]


def describe(config: GPTConfig) -> str:
    moe = f", {config.n_experts} experts top-{config.moe_k}" if config.n_experts else ""
    return (f"GPT L={config.n_layer} h={config.n_embd} heads={config.n_head} s={config.block_size} "
            f"V={config.vocab_size} {'tied' if config.tie_weights else 'untied'}{moe}")


@task("perf.flops", points=3)
def test_flops_per_token_equal_flop_counter_on_the_course_gpt():
    from labkit.perf import Model, flops_per_token, model_flops_per_token
    for config, batch in GPT_CONFIGS:
        counted = counted_per_token(GPT(config).double(), config.vocab_size, batch, config.block_size)
        model = Model.of_gpt(config)
        for got, what in ((flops_per_token(model), "flops_per_token"), (model_flops_per_token(model), "model_flops_per_token")):
            assert got == counted, (f"perf.flops: {describe(config)}, batch {batch}: {what} gives {got:.0f}; "
                                    f"FlopCounterMode counts {counted:.0f} per token (off by {got - counted:+.0f})")
    # a shorter sequence than block_size: the attention term follows the tokens actually attended
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)
    counted = counted_per_token(GPT(config).double(), config.vocab_size, 2, 6)
    got = flops_per_token(Model.of_gpt(config, seq=6))
    assert got == counted, f"perf.flops: {describe(config)} on 6 tokens: {got:.0f} vs FlopCounterMode's {counted:.0f}"
    for config, batch, seq in drawn_gpts():  # drawn from the whole space, a new seed each run
        counted = counted_per_token(GPT(config).double(), config.vocab_size, batch, seq)
        got = flops_per_token(Model.of_gpt(config, seq=seq))
        assert got == counted, (f"perf.flops: drawn {describe(config)}, batch {batch} of {seq} tokens: flops_per_token "
                                f"gives {got:.0f}; FlopCounterMode counts {counted:.0f} {configs.replay()}")


def drawn_gpts() -> list[tuple]:
    """GPT configurations drawn from the run's seed: 1-3 layers, 1-4 heads of width 1-8, a block
    of 1-16 positions run on 1 to all of them, a vocabulary of 2-60, tied or not, biases or not,
    dense or 2-5 experts with k from 1 to all of them; batch 1-3."""
    rng = configs.rng("perf.flops")
    drawn = []
    for _ in range(configs.budget(ci=3, long=30)):
        heads, experts = rng.randint(1, 4), rng.choice([0, rng.randint(2, 5)])
        config = GPTConfig(n_layer=rng.randint(1, 3), n_head=heads, n_embd=heads * rng.randint(1, 8),
                           block_size=rng.randint(1, 16), vocab_size=rng.randint(2, 60),
                           tie_weights=rng.random() < 0.5, bias=rng.random() < 0.5,
                           n_experts=experts, moe_k=rng.randint(1, experts) if experts else 2)
        drawn.append((config, rng.randint(1, 3), rng.randint(1, config.block_size)))
    return drawn


@task("perf.flops", points=2)
def test_recomputation_flops_equal_flop_counter():
    from labkit.perf import Model, flops_per_token
    for config, batch in (GPT_CONFIGS[0], GPT_CONFIGS[1], GPT_CONFIGS[4]):
        model = Model.of_gpt(config)
        for recompute, wrap in (("full", checkpoint_blocks), ("selective", checkpoint_attention_core)):
            counted = counted_per_token(wrap(GPT(config).double()), config.vocab_size, batch, config.block_size)
            got = flops_per_token(model, recompute)
            assert got == counted, (f"perf.flops: {describe(config)}, recompute={recompute!r}: flops_per_token gives "
                                    f"{got:.0f}; FlopCounterMode counts {counted:.0f} (off by {got - counted:+.0f})")
    with pytest.raises(ValueError):
        flops_per_token(Model.of_gpt(GPTConfig()), "some")


class _FFN(nn.Module):
    def __init__(self, hidden: int, width: int, gated: bool):
        super().__init__()
        self.up, self.down = nn.Linear(hidden, width, bias=False), nn.Linear(width, hidden, bias=False)
        self.gate = nn.Linear(hidden, width, bias=False) if gated else None

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x) if self.gate is not None else F.gelu(self.up(x)))


class _Layer(nn.Module):
    def __init__(self, m, moe: bool):
        super().__init__()
        d, kv = m.head_dim or m.hidden // m.heads, m.kv_heads or m.heads
        self.heads, self.kv, self.d = m.heads, kv, d
        self.q, self.o = nn.Linear(m.hidden, m.heads * d, bias=False), nn.Linear(m.heads * d, m.hidden, bias=False)
        self.k, self.v = nn.Linear(m.hidden, kv * d, bias=False), nn.Linear(m.hidden, kv * d, bias=False)
        self.top_k, self.moe = m.top_k, moe
        if moe:
            width = m.expert_ffn or m.ffn or 4 * m.hidden
            self.router = nn.Linear(m.hidden, m.experts, bias=False)
            self.experts = nn.ModuleList(_FFN(m.hidden, width, m.gated) for _ in range(m.experts))
            self.shared = nn.ModuleList(_FFN(m.hidden, width, m.gated) for _ in range(m.shared_experts))
        else:
            self.ffn = _FFN(m.hidden, m.ffn or 4 * m.hidden, m.gated)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.heads, self.d).transpose(1, 2)
        k, v = (p(x).view(B, T, self.kv, self.d).transpose(1, 2) for p in (self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, -1))
        if not self.moe:
            return x + self.ffn(x)
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(tokens).softmax(-1).topk(self.top_k, dim=-1)
        out = sum((expert(tokens) for expert in self.shared), torch.zeros_like(tokens))
        for e, expert in enumerate(self.experts):  # dropless: each expert runs on exactly its tokens
            token, slot = torch.nonzero(chosen == e, as_tuple=True)
            out = out.index_add(0, token, expert(tokens[token]) * weights[token, slot].unsqueeze(1))
        return x + out.reshape(x.shape)


class ShapesLM(nn.Module):
    """The transformer a ``Model`` states, written with plain Linears: GQA attention, (gated)
    FFNs, MoE layers with a router, routed and shared experts after ``dense_layers`` dense ones."""

    def __init__(self, m):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(m.vocab, m.hidden)
        self.layers = nn.ModuleList(_Layer(m, bool(m.experts) and i >= m.dense_layers) for i in range(m.layers))
        self.head = nn.Linear(m.hidden, m.vocab, bias=False)
        if m.tied:
            self.head.weight = self.embed.weight

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@task("perf.flops", points=3)
def test_gqa_swiglu_moe_flops_equal_flop_counter_on_their_shapes():
    from labkit.perf import Model, flops_per_token
    models = [
        Model(layers=2, hidden=32, heads=8, kv_heads=2, ffn=40, gated=True, vocab=30, seq=6, name="GQA + SwiGLU"),
        Model(layers=1, hidden=24, heads=4, kv_heads=1, vocab=11, seq=5, tied=True, name="MQA, tied"),
        Model(layers=2, hidden=16, heads=2, head_dim=12, vocab=9, seq=4, name="head_dim != hidden/heads"),
        Model(layers=3, hidden=16, heads=4, kv_heads=2, ffn=48, gated=True, experts=6, top_k=2, shared_experts=1,
              expert_ffn=12, dense_layers=1, vocab=20, seq=5, name="DeepSeek-like MoE"),
        Model(layers=2, hidden=16, heads=2, experts=4, top_k=1, vocab=13, seq=7, name="Switch-like MoE"),
    ]
    for model in models:
        net = ShapesLM(model).double()
        matmul = sum(p.numel() for name, p in net.named_parameters() if not name.startswith("embed"))
        matmul += model.vocab * model.hidden if model.tied else 0   # the tied head is the embedding
        if model.experts:  # a token visits top_k of the routed experts
            per_expert = sum(p.numel() for p in net.layers[-1].experts[0].parameters())
            matmul -= (model.experts - model.top_k) * per_expert * (model.layers - model.dense_layers)
        assert model.active_params() == matmul, (f"perf.flops: {model.name}: active_params() = {model.active_params()}; "
                                                 f"the matmul weights a token multiplies by: {matmul}")
        for batch in ((1, 3) if model.experts else (2,)):  # routing differs with the batch
            counted = counted_per_token(net, model.vocab, batch, model.seq)
            got = flops_per_token(model)
            assert got == counted, (f"perf.flops: {model.name}, batch {batch}: flops_per_token gives {got:.0f}; "
                                    f"FlopCounterMode counts {counted:.0f} on its shapes (off by {got - counted:+.0f})")


# ----------------------------------------------------------------------------- perf.roofline


@task("perf.roofline", points=2)
def test_roofline_takes_the_slower_of_compute_and_memory():
    from labkit.perf import HARDWARE, Hardware, arithmetic_intensity, matmul_time, op_time, ridge_point
    h100 = HARDWARE["H100"]
    # compute-bound: 1e12 FLOPs over 1e6 bytes; memory-bound: 1e6 FLOPs over 1e9 bytes
    assert op_time(1e12, 1e6, h100) == 1e12 / 794.5e12, f"perf.roofline: compute-bound op on H100: {op_time(1e12, 1e6, h100)}"
    assert op_time(1e12, 1e6, h100, achieved=False) == 1e12 / 989e12, "perf.roofline: achieved=False must use the 989 TFLOP/s peak"
    assert op_time(1e6, 1e9, h100) == 1e9 / 3.35e12, \
        f"perf.roofline: memory-bound op on H100 (no achieved bandwidth cited: the 3.35 TB/s peak): {op_time(1e6, 1e9, h100)}"
    measured = Hardware("measured", peak_flops=100.0, memory_bandwidth=10.0, memory_bytes=1.0,
                        achieved_flops=50.0, achieved_bandwidth=4.0)
    for flops, nbytes, achieved, expected in ((100, 10, True, 2.5), (100, 10, False, 1.0), (100, 1, True, 2.0),
                                              (100, 1, False, 1.0), (10, 10, True, 2.5), (10, 10, False, 1.0),
                                              (0, 8, True, 2.0), (30, 0, False, 0.3)):
        got = op_time(flops, nbytes, measured, achieved)
        assert math.isclose(got, expected, rel_tol=1e-12), (
            f"perf.roofline: {flops} FLOPs, {nbytes} bytes on 100 FLOP/s (achieved 50), 10 B/s (achieved 4), "
            f"achieved={achieved}: {got} s, expected {expected} s")
    # a matmul: 2mnk FLOPs, (mk + kn + mn) elements moved
    for (m, n, k), e, achieved in (((4096, 4096, 4096), 2, True), ((1, 8192, 8192), 2, True), ((1, 8192, 8192), 4, False),
                                   ((16, 64, 32), 1, True), ((512, 1024, 256), 4, True)):
        flops, nbytes = 2 * m * n * k, (m * k + k * n + m * n) * e
        rate, bandwidth = (measured.achieved_flops, measured.achieved_bandwidth) if achieved else (100.0, 10.0)
        expected = max(flops / rate, nbytes / bandwidth)
        got = matmul_time(m, n, k, measured, element_bytes=e, achieved=achieved)
        assert math.isclose(got, expected, rel_tol=1e-12), \
            f"perf.roofline: matmul {m}x{k} @ {k}x{n}, {e}-byte elements, achieved={achieved}: {got} s, expected {expected} s"
    big = matmul_time(8192, 8192, 8192, h100)
    assert big == 2 * 8192 ** 3 / 794.5e12, f"perf.roofline: an 8192^3 bf16 matmul on H100 is compute-bound: {big}"
    skinny = matmul_time(1, 8192, 8192, h100)
    assert skinny == (8192 + 8192 * 8192 + 8192) * 2 / 3.35e12, f"perf.roofline: a 1x8192 @ 8192x8192 matmul reads the weight: {skinny}"
    assert arithmetic_intensity(2 * 8192 ** 3, 3 * 8192 ** 2 * 2) == 8192 / 3, "perf.roofline: arithmetic_intensity = flops / bytes"
    assert arithmetic_intensity(1.0, 4.0) == 0.25, "perf.roofline: arithmetic_intensity(1, 4) = 0.25"
    # ridge points: datasheet peaks (Modal's GPU glossary: A100 ~156, H100 ~295 FLOPs/byte) and measured MAMF
    for name, peak, achieved in (("A100", 312 / 2.039, 271.2 / 2.039), ("H100", 989 / 3.35, 794.5 / 3.35),
                                 ("H200", 989 / 4.8, 794.5 / 4.8)):
        assert math.isclose(ridge_point(HARDWARE[name], achieved=False), peak, rel_tol=1e-9), \
            f"perf.roofline: {name} peak ridge point {ridge_point(HARDWARE[name], achieved=False)}, expected {peak}"
        assert math.isclose(ridge_point(HARDWARE[name]), achieved, rel_tol=1e-9), \
            f"perf.roofline: {name} achieved ridge point {ridge_point(HARDWARE[name])}, expected {achieved}"
    assert ridge_point(measured) == 12.5 and ridge_point(measured, achieved=False) == 10.0, \
        f"perf.roofline: ridge of 50 FLOP/s over 4 B/s is 12.5 (peaks: 10); got {ridge_point(measured)}, {ridge_point(measured, False)}"


@task("perf.roofline", points=1)
def test_hardware_rows_cite_their_figures_and_a_measured_cpu_is_classified():
    from labkit.perf import HARDWARE, Hardware, arithmetic_intensity, op_time, ridge_point
    for key in ("A100", "H100", "H200", "H800"):
        hw = HARDWARE[key]
        assert hw.source and f"{hw.peak_flops / 1e12:g}" in hw.source.replace(",", ""), \
            f"perf.roofline: HARDWARE[{key!r}] must cite its peak {hw.peak_flops / 1e12:g} TFLOP/s in source"
        assert hw.achieved_flops is None or hw.achieved_flops < hw.peak_flops, f"perf.roofline: {key}: achieved above peak"
        if hw.fp8_flops is not None:   # FP8 doubles the dense tensor-core peak on Hopper (datasheets)
            assert abs(hw.fp8_flops / hw.peak_flops - 2) < 0.01 and f"{hw.fp8_flops / 1e12:g}" in hw.source.replace(",", ""), \
                f"perf.roofline: HARDWARE[{key!r}] must cite its FP8 peak {hw.fp8_flops / 1e12:g} TFLOP/s"
    # This CPU, measured: the best of a few runs of a large fp32 matmul and of a large copy.
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    x = torch.randn(4_000_000)
    best_mm = best_copy = math.inf
    for _ in range(5):
        start = time.perf_counter(); a @ b; best_mm = min(best_mm, time.perf_counter() - start)
        start = time.perf_counter(); x.clone(); best_copy = min(best_copy, time.perf_counter() - start)
    cpu = Hardware("this CPU", peak_flops=2 * 512 ** 3 / best_mm, memory_bandwidth=2 * x.numel() * 4 / best_copy,
                   memory_bytes=1e9)
    n = 8192  # a large matmul (not run): intensity n/6 = 1365 FLOPs/byte in fp32, ~100x a CPU's ridge point
    flops, nbytes = 2 * n ** 3, 3 * n * n * 4
    assert arithmetic_intensity(flops, nbytes) > ridge_point(cpu), \
        f"perf.roofline: a {n}^3 fp32 matmul ({flops / nbytes:.0f} FLOPs/byte) should be above this CPU's ridge ({ridge_point(cpu):.1f})"
    assert op_time(flops, nbytes, cpu) == flops / cpu.peak_flops, "perf.roofline: the large matmul is compute-bound"
    add_flops, add_bytes = x.numel(), 3 * x.numel() * 4   # x + y: one FLOP, three fp32 elements moved
    assert op_time(add_flops, add_bytes, cpu) == add_bytes / cpu.memory_bandwidth, "perf.roofline: an addition is memory-bound"


# ----------------------------------------------------------------------------- perf.comm


@task("perf.comm", points=3)
def test_collective_times_follow_chapter_00():
    from labkit.comm import ring_all_reduce_time, wire_bytes
    from labkit.perf import OPS, Link, collective_time
    alpha, bandwidth = 5e-6, 50e9
    link = Link(alpha, bandwidth)
    # chapter 00, Q1: 1 GB all-reduced over 8 GPUs with a ring: 14 alpha + 1.75 GB / 50 GB/s
    assert math.isclose(collective_time("all_reduce", 1e9, 8, link), 14 * alpha + 1.75e9 / 50e9, rel_tol=1e-12), \
        f"perf.comm: chapter 00's Q1 (1 GB, 8 GPUs, 5 us, 50 GB/s): {collective_time('all_reduce', 1e9, 8, link)}"
    for n in (2, 3, 5, 8, 64):
        for size in (8e3, 25e6, 1e9):
            expected = ring_all_reduce_time(size, n, alpha, 1 / bandwidth)
            got = collective_time("all_reduce", size, n, link)
            assert math.isclose(got, expected, rel_tol=1e-12), \
                f"perf.comm: ring all_reduce of {size:g} B on {n}: {got}, labkit.comm.ring_all_reduce_time {expected}"
            for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
                # bandwidth term alone (alpha 0): the bytes each rank sends (chapter 00), over the link
                bw_only = collective_time(op, size, n, Link(0.0, bandwidth))
                assert math.isclose(bw_only, wire_bytes(op, size, n) / bandwidth, rel_tol=1e-12), \
                    f"perf.comm: ring {op} of {size:g} B on {n}: bandwidth term {bw_only}, wire bytes / B = {wire_bytes(op, size, n) / bandwidth}"
                steps = 2 * (n - 1) if op == "all_reduce" else n - 1
                lat_only = collective_time(op, size, n, Link(alpha, math.inf))
                assert math.isclose(lat_only, steps * alpha, rel_tol=1e-12), \
                    f"perf.comm: ring {op} on {n} ranks: latency term {lat_only}, expected {steps} messages x alpha"
            # tree: NCCL's pipelined double binary tree (latency of 2 ceil(log2 N) hops, S up and S down
            # streamed in chunks); recursive doubling/halving for AG/RS
            rounds = math.ceil(math.log2(n))
            tree = collective_time("all_reduce", size, n, link, "tree")
            assert math.isclose(tree, 2 * rounds * alpha + 2 * size / bandwidth, rel_tol=1e-12), \
                f"perf.comm: tree all_reduce of {size:g} B on {n}: {tree}, expected 2 x {rounds} alpha + 2 S/B"
            for op in ("all_gather", "reduce_scatter"):
                got = collective_time(op, size, n, link, "tree")
                expected = rounds * alpha + wire_bytes(op, size, n) / bandwidth
                assert math.isclose(got, expected, rel_tol=1e-12), \
                    f"perf.comm: tree {op} of {size:g} B on {n}: {got}, expected {rounds} alpha + (N-1)/N S/B = {expected}"
    # ring = tree at S* = (N-1-L) alpha N B (ring 2(N-1) alpha + 2(N-1)/N S/B, tree 2 L alpha + 2 S/B);
    # the tree wins below it
    for n in (8, 64, 1024):
        L = math.ceil(math.log2(n))
        crossover = (n - 1 - L) * alpha * n * bandwidth
        ring, tree = (collective_time("all_reduce", crossover, n, link, a) for a in ("ring", "tree"))
        assert math.isclose(ring, tree, rel_tol=1e-9), f"perf.comm: at chapter 00's S* = {crossover:g} B on {n}, ring {ring} != tree {tree}"
        assert collective_time("all_reduce", crossover / 2, n, link, "tree") < collective_time("all_reduce", crossover / 2, n, link), \
            f"perf.comm: below S* on {n} ranks the tree must win"
    # in-network reduction (NVLS / SHARP): each rank sends S once and receives the reduced S once
    for n in (2, 5, 8, 72):
        for size in (8e3, 1e9):
            got = collective_time("all_reduce", size, n, link, "nvls")
            assert math.isclose(got, 2 * alpha + size / bandwidth, rel_tol=1e-12), \
                f"perf.comm: nvls all_reduce of {size:g} B on {n}: {got}, expected 2 alpha + S/B"
            for op in ("all_gather", "reduce_scatter"):
                got = collective_time(op, size, n, link, "nvls")
                assert math.isclose(got, alpha + (n - 1) / n * size / bandwidth, rel_tol=1e-12), \
                    f"perf.comm: nvls {op} of {size:g} B on {n}: {got}, expected alpha + (N-1)/N S/B"
        ring = collective_time("all_reduce", 1e9, n, Link(0.0, bandwidth))
        assert math.isclose(collective_time("all_reduce", 1e9, n, Link(0.0, bandwidth), "nvls") / ring,
                            n / (2 * (n - 1)), rel_tol=1e-12), "perf.comm: NVLS moves N / (2(N-1)) of a ring's bytes"
    with pytest.raises(ValueError):
        collective_time("all_to_all", 1e6, 4, link, "nvls")
    # send: one message, whatever the algorithm; one rank: nothing crosses a link
    for algo in ("ring", "tree", "nvls"):
        assert collective_time("send", 1e6, 2, link, algo) == alpha + 1e6 / bandwidth, f"perf.comm: send ({algo})"
        for op in OPS:
            if op != "all_to_all" or algo == "ring":
                assert collective_time(op, 1e6, 1, link, algo) == 0.0, f"perf.comm: {op} ({algo}) on one rank must take 0 s"
    with pytest.raises(ValueError):
        collective_time("all_to_all", 1e6, 4, link, "tree")
    with pytest.raises(ValueError):
        collective_time("broadcast", 1e6, 4, link)


@task("perf.comm", points=3)
def test_group_time_picks_the_link_of_the_group():
    from labkit.perf import CLUSTERS, Cluster, Link, collective_time, group_link, group_time
    dgx = CLUSTERS["dgx-h100"]
    nvlink, network = dgx.nvlink, dgx.network
    assert nvlink.bandwidth > network.bandwidth, "perf.comm: NVLink must be faster than the network"
    for key, cluster in CLUSTERS.items():
        assert f"{8 * cluster.network.bandwidth / 1e9:g} Gb/s" in cluster.source or \
            f"IB {cluster.network.bandwidth / 1e9:g} GB/s" in cluster.source, f"perf.comm: CLUSTERS[{key!r}] must cite its network"
    no_rails = replace(dgx, rails=False)
    # (group_size, stride) -> the link, on 8 GPUs per node
    inside = [(8, 1), (4, 1), (2, 4), (4, 2), (2, 1), (1, 8)]            # blocks of stride x size that divide a node
    across = [(4, 8), (2, 16), (16, 1), (8, 2), (3, 1), (2, 3), (6, 1)]  # some group spans nodes
    for size, stride in inside:
        for cluster in (dgx, no_rails):
            assert group_link(size, stride, cluster) == nvlink, \
                f"perf.comm: a group of {size} ranks {stride} apart lies in one node of 8: NVLink, got {group_link(size, stride, cluster)}"
    for size, stride in across:
        nics = max(1, min(size, 8 // stride))       # the group's members in a node, each with its NIC
        want = Link(network.alpha, min(nics * network.bandwidth, nvlink.bandwidth))
        assert group_link(size, stride, dgx) == want, (
            f"perf.comm: a group of {size} ranks {stride} apart crosses nodes; with rails NCCL runs one channel per "
            f"NIC over the {nics} member(s) of a node: {want}, got {group_link(size, stride, dgx)}")
        sharers = min(stride, 8)
        assert group_link(size, stride, no_rails) == Link(network.alpha, network.bandwidth / sharers), (
            f"perf.comm: without rails, a group of {size} ranks {stride} apart: {sharers} GPUs of a node cross at once "
            f"through its one NIC; got {group_link(size, stride, no_rails)}")
    # group_time is collective_time over that link, for every op
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send"):
        for size, stride, cluster, link in ((8, 1, dgx, nvlink), (4, 8, dgx, network),
                                            (16, 1, dgx, Link(network.alpha, min(8 * network.bandwidth, nvlink.bandwidth))),
                                            (6, 2, dgx, Link(network.alpha, 4 * network.bandwidth)),
                                            (4, 8, no_rails, Link(network.alpha, network.bandwidth / 8)),
                                            (16, 1, no_rails, network)):
            got = group_time(op, 1e8, size, stride, cluster)
            assert got == collective_time(op, 1e8, size, link), \
                f"perf.comm: group_time({op}, size {size}, stride {stride}, rails={cluster.rails}) {got} != collective_time on {link}"
    # NICs faster in sum than NVLink feeds them: the hop runs at NVLink's bandwidth
    fat = replace(dgx, network=Link(network.alpha, 100e9))
    assert group_link(16, 1, fat) == Link(network.alpha, nvlink.bandwidth), \
        f"perf.comm: 8 NICs of 100 GB/s behind NVLink at {nvlink.bandwidth:g} B/s: got {group_link(16, 1, fat)}"
    assert group_time("all_reduce", 1e8, 4, 8, dgx, "tree") == collective_time("all_reduce", 1e8, 4, network, "tree")
    assert group_time("all_reduce", 1e8, 1, 8, dgx) == 0.0, "perf.comm: a group of one rank sends nothing"
    # a 4-GPU node: DP over 2 nodes of TP=4 crosses; TP=2 x CP=2 stays inside
    small = Cluster(dgx.gpu, nvlink=Link(1e-6, 100e9), network=Link(2e-5, 10e9), gpus_per_node=4, rails=False)
    assert group_link(2, 4, small) == Link(2e-5, 10e9 / 4) and group_link(2, 2, small) == small.nvlink, \
        "perf.comm: on 4-GPU nodes, 2 ranks 4 apart cross (4 GPUs share the NIC), 2 ranks 2 apart do not"
    # the slow link costs: an 8-way all-reduce across nodes is slower than inside one
    assert group_time("all_reduce", 1e9, 8, 8, dgx) > group_time("all_reduce", 1e9, 8, 1, dgx)
    for size, stride in ((0, 1), (2, 0)):
        with pytest.raises(ValueError):
            group_time("all_reduce", 1e6, size, stride, dgx)
        with pytest.raises(ValueError):
            group_link(size, stride, dgx)


# ============================================================ perf.step, perf.search (perf-B)
#
# The step-time model is checked against things it does not compute itself: the pipeline's
# makespan and peak in-flight micro-batches from a brute-force simulation of the schedule
# (labkit.pp.simulate, the chapter-06 clock, on schedules built here), the FLOPs of the whole
# step (flops_per_token x tokens over all GPUs), the parameters of every rank summed back to
# Model.params(), the ZeRO sharding ratios, chapter 00's alpha-beta times of the bytes each
# chapter derived (on the link the test picks: NVLink inside a node, the network across), both
# branches of the DP overlap, and for the search a brute force over every layout of a small
# cluster. Tolerance: 1e-9 relative (pure float arithmetic, a few operations deep).

_REL = 1e-9


def _close(got, want, what):
    assert abs(got - want) <= _REL * max(abs(want), 1e-30), \
        f"{what}: got {got!r}, expected {want!r} (off by {got - want:+.3g})"


def _cluster(memory=80e9, achieved=50e12, nvlink=(2e-6, 100e9), network=(20e-6, 5e9), per_node=4, rails=True):
    from labkit.perf import Cluster, Hardware, Link
    gpu = Hardware("test GPU", peak_flops=100e12, memory_bandwidth=1e12, memory_bytes=memory, achieved_flops=achieved)
    return Cluster(gpu, nvlink=Link(*nvlink), network=Link(*network), gpus_per_node=per_node, rails=rails)


def _dense(**kw):
    from labkit.perf import Model
    return Model(**dict(dict(layers=8, hidden=256, heads=8, vocab=1000, seq=128, name="dense"), **kw))


def _moe(**kw):
    from labkit.perf import Model
    return Model(**dict(dict(layers=8, hidden=256, heads=8, kv_heads=2, vocab=1000, seq=128, gated=True, ffn=512,
                             experts=8, top_k=2, shared_experts=1, expert_ffn=128, dense_layers=1, name="moe"), **kw))


# the chapter-06 schedules, written here (the grader does not lean on the learner's labkit.pp)
def _schedule(kind, p, m, v):
    from labkit.pp import Action
    if kind == "gpipe":
        return [[Action("F", i, s) for i in range(m)] + [Action("B", i, s) for i in range(m)] for s in range(p)]
    if kind == "1f1b":
        out = []
        for s in range(p):
            w = min(p - 1 - s, m)
            acts = [Action("F", i, s) for i in range(w)]
            for j in range(m - w):
                acts += [Action("F", w + j, s), Action("B", j, s)]
            out.append(acts + [Action("B", i, s) for i in range(m - w, m)])
        return out
    out = []
    for r in range(p):
        def fwd(k):
            return Action("F", (k // (p * v)) * p + k % p, ((k // p) % v) * p + r)

        def bwd(k):
            return Action("B", (k // (p * v)) * p + k % p, (v - 1 - (k // p) % v) * p + r)
        w = min((v - 1) * p + 2 * (p - 1 - r), m * v)
        acts = [fwd(k) for k in range(w)]
        for j in range(m * v - w):
            acts += [fwd(w + j), bwd(j)]
        out.append(acts + [bwd(k) for k in range(m * v - w, m * v)])
    return out


def _per_microbatch(st, m):
    """One micro-batch's time on the pipeline's critical path: every term but the bubble and DP."""
    return (st.compute + st.recompute + st.elementwise + st.tp_comm + st.cp_comm + st.ep_comm + st.pp_comm) / m


def _kept_activations(model, p, tp, held, recompute, last):
    """Korthikanti's activations of one rank's L/p layers x ``held`` micro-batches of one sequence,
    + the last rank's fp32 logits."""
    from labkit import budget
    kept = budget.korthikanti_activation_bytes(model.layers // p, model.seq, model.hidden, model.heads, micro=1,
                                               tp=tp, held=held, flash=recompute == "selective",
                                               full=recompute == "full")
    return kept + (4 * model.seq * model.vocab / tp if last else 0)


def _terms(st):
    return st.compute + st.recompute + st.elementwise + st.tp_comm + st.cp_comm + st.ep_comm + st.pp_comm + st.bubble + st.dp_exposed


@task("perf.step", points=3)
def test_step_pipeline_matches_a_simulation_of_the_schedule():
    """For GPipe, 1F1B and interleaved (v = 1, 2, 4) over p = 2..4 and several m: the step's
    pipeline time (dp = 1: no DP term) equals the makespan of the schedule simulated with each
    micro-batch's forward and backward costs (split 1 : 2, over v chunks), and the activations
    the first and last ranks keep equal the simulated peak in-flight micro-batches."""
    from labkit import budget, pp
    from labkit.perf import Layout, in_flight, memory_per_gpu, step_time
    model, cluster = _dense(layers=8), _cluster()
    cases = [("gpipe", 2, 4, 1), ("gpipe", 4, 8, 1), ("1f1b", 2, 2, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 2, 1),
             ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2), ("interleaved", 2, 2, 4), ("interleaved", 4, 4, 1)]
    for kind, p, m, v in cases:
        for b in (1, 2):
            layout = Layout(pp=p, microbatch=b, schedule=kind, virtual=v, zero=0)
            where = f"perf.step: {layout}, m={m}"
            st = step_time(model, layout, cluster, global_batch=m * b)
            assert st.microbatches == m, f"{where}: microbatches={st.microbatches}, expected {m}"
            per_mb = _per_microbatch(st, m)
            timeline = pp.simulate(_schedule(kind, p, m, v), p * v, {"F": per_mb / 3 / v, "B": 2 * per_mb / 3 / v})
            _close(st.total, timeline.makespan, f"{where}: step time vs the simulated makespan")
            _close(st.bubble / st.total, timeline.bubble(), f"{where}: bubble fraction vs the simulation's idle share")
            _close(_terms(st), st.total, f"{where}: total vs the sum of its terms")
            for rank in (0, p - 1):
                held = timeline.peak_in_flight[rank] / v
                _close(in_flight(kind, p, m, v, rank), held, f"{where}: in_flight(rank {rank})")
                want = budget.korthikanti_activation_bytes(model.layers // p, model.seq, model.hidden, model.heads,
                                                           micro=b, held=held)
                if rank == p - 1:      # the last stage also keeps its micro-batch's fp32 logits
                    want += 4 * model.seq * b * model.vocab
                got = memory_per_gpu(model, layout, m * b, rank)["activations"]
                _close(got, want, f"{where}: activations of rank {rank}")


def _zb_h1(p, m):
    """ZB-H1 (Qi et al. 2024, arXiv:2401.10241), as chapter 06 builds it: 1F1B's order of F
    and B (B now the input gradient only); rank s runs W(i) right after B(i + s), and the W's
    still missing close its list in micro-batch order."""
    from labkit.pp import Action
    out = []
    for s, actions in enumerate(_schedule("1f1b", p, m, 1)):
        ordered, deferred = [], 0
        for action in actions:
            ordered.append(action)
            if action.kind == "B" and action.microbatch >= s:
                ordered.append(Action("W", action.microbatch - s, s))
                deferred += 1
        out.append(ordered + [Action("W", i, s) for i in range(deferred, m)])
    return out


@task("perf.step", points=2)
def test_step_zero_bubble_schedules():
    """ZB-H1: the step equals the makespan of the ZB-H1 schedule simulated with each
    micro-batch's F = stage / 3, W = compute / 3 (the weight-gradient matmuls), B = the rest
    (m below, at and above p; no, selective and full recomputation; tp 1 and 2), and every
    rank's in_flight and activations equal the simulated peak. DualPipe (DeepSeek-V3, Table 2):
    the bubble is (p/2 - 1)(F&B + B - 3W) with F&B = the stage and B = 2/3 of it; every rank
    holds min(p + 1, m) micro-batches and the 16-bit weights twice (the rest of the model state
    as 1F1B's); an odd p or an odd m is refused (ValueError)."""
    from labkit import pp
    from labkit.perf import Layout, in_flight, memory_per_gpu, step_time
    model, cluster = _dense(layers=8), _cluster()
    for p, m, tp, recompute in ((2, 2, 1, "none"), (2, 5, 2, "full"), (4, 2, 1, "selective"), (4, 3, 2, "none"),
                                (4, 4, 1, "full"), (4, 8, 2, "selective"), (8, 12, 1, "none")):
        layout = Layout(pp=p, tp=tp, schedule="zb-h1", zero=0, recompute=recompute)
        where = f"perf.step: {layout}, m={m}"
        st = step_time(model, layout, cluster, global_batch=m)
        stage = _per_microbatch(st, m)
        weights = st.compute / m / 3
        timeline = pp.simulate(_zb_h1(p, m), p, {"F": stage / 3, "B": 2 * stage / 3 - weights, "W": weights})
        _close(st.total, timeline.makespan, f"{where}: step time vs the simulated ZB-H1 makespan")
        _close(_terms(st), st.total, f"{where}: total vs the sum of its terms")
        for rank in range(p):
            held = timeline.peak_in_flight[rank]
            _close(in_flight("zb-h1", p, m, 1, rank), held, f"{where}: in_flight(rank {rank})")
            want = _kept_activations(model, p, tp, held, recompute, rank == p - 1)
            _close(memory_per_gpu(model, layout, m, rank)["activations"], want, f"{where}: activations of rank {rank}")
    for p, m, tp, recompute in ((2, 2, 1, "none"), (4, 4, 2, "full"), (4, 10, 1, "selective"), (8, 16, 2, "none")):
        layout = Layout(pp=p, tp=tp, schedule="dualpipe", zero=0, recompute=recompute)
        plain = replace(layout, schedule="1f1b")
        where = f"perf.step: {layout}, m={m}"
        st, base = step_time(model, layout, cluster, global_batch=m), step_time(model, plain, cluster, global_batch=m)
        stage = _per_microbatch(st, m)
        weights = st.compute / m / 3
        _close(st.bubble, (p / 2 - 1) * (stage + 2 * stage / 3 - 3 * weights), f"{where}: DualPipe's bubble")
        _close(st.total - st.bubble, base.total - base.bubble, f"{where}: all but the bubble as 1F1B's")
        for rank in range(p):
            _close(in_flight("dualpipe", p, m, 1, rank), min(p + 1, m), f"{where}: in_flight(rank {rank})")
            got, one = memory_per_gpu(model, layout, m, rank), memory_per_gpu(model, plain, m, rank)
            _close(got["params"], 2 * one["params"], f"{where}: rank {rank} keeps two copies of the weights")
            for part in ("grads", "optimizer"):
                _close(got[part], one[part], f"{where}: rank {rank}'s {part}")
            _close(got["activations"], _kept_activations(model, p, tp, min(p + 1, m), recompute, rank == p - 1),
                   f"{where}: activations of rank {rank}")
    for layout, batch in ((Layout(pp=3, schedule="dualpipe"), 6), (Layout(pp=2, schedule="dualpipe"), 3)):
        with pytest.raises(ValueError):
            step_time(_dense(layers=6), layout, cluster, global_batch=batch)


@task("perf.step", points=2)
def test_step_compute_recompute_throughput_and_mfu():
    """Compute = the step's FLOPs (flops_per_token x every token) over all GPUs at the achieved
    FLOP/s (the peak when achieved is None); recompute = the extra FLOPs of the mode; tokens/s
    and MFU from the total; for every axis and mode."""
    from labkit.perf import Layout, flops_per_token, step_time
    fast = _cluster(nvlink=(0.0, 1e18), network=(0.0, 1e18))
    layouts = [Layout(), Layout(dp=2, tp=2, zero=2, microbatch=2), Layout(tp=2, pp=2, recompute="selective"),
               Layout(dp=2, cp=2, zero=3, recompute="full"), Layout(pp=2, schedule="interleaved", virtual=2),
               Layout(dp=4, ep=2, zero=0, microbatch=4, recompute="full")]
    for model in (_dense(), _moe()):
        for layout in layouts:
            if layout.ep > 1 and not model.experts:
                continue
            for achieved in (50e12, None):
                cluster = _cluster(achieved=achieved) if achieved is None else fast
                rate = achieved or 100e12
                batch = 16
                where = f"perf.step: {model.name} {layout}, achieved={achieved}"
                st = step_time(model, layout, cluster, batch)
                tokens = batch * model.seq
                _close(st.compute, flops_per_token(model) * tokens / (layout.gpus * rate), f"{where}: compute")
                extra = flops_per_token(model, layout.recompute) - flops_per_token(model)
                _close(st.recompute, extra * tokens / (layout.gpus * rate), f"{where}: recompute")
                _close(st.tokens_per_second, tokens / st.total, f"{where}: tokens/s")
                _close(st.mfu, tokens / st.total * flops_per_token(model) / (layout.gpus * 100e12), f"{where}: MFU")
                _close(_terms(st), st.total, f"{where}: total vs the sum of its terms")
                assert layout.recompute != "none" or st.recompute == 0, f"{where}: recompute without recomputation"
                text = st.explain()
                for word in ("compute", "bubble", "tp_comm", "dp_exposed", "total", "GiB", "MFU"):
                    assert word in text, f"{where}: explain() does not mention {word!r}:\n{text}"


@task("perf.step", points=3)
def test_step_communication_terms_on_the_right_links():
    """TP/SP, CP, PP and EP terms against chapter 00's alpha-beta times of the bytes chapters
    05, 06, 07 and 10 derive, on the link each group must use: a group inside a node (4 GPUs
    here) on NVLink, one that spans nodes on the network (without rails: the node's NIC shared)."""
    from labkit.perf import Layout, collective_time, layers_on_rank, step_time
    e = 2
    for rails in (True, False):
        cluster = _cluster(rails=rails)
        nv, net = cluster.nvlink, cluster.network

        def link(size, stride):
            if 4 % (size * stride) == 0:
                return nv
            from labkit.perf import Link
            if rails:   # one NIC per member of the group in a node
                return Link(net.alpha, min(max(1, min(size, 4 // stride)) * net.bandwidth, nv.bandwidth))
            return Link(net.alpha, net.bandwidth / min(stride, 4))
        for model in (_dense(), _moe()):
            for layout in [Layout(tp=2, zero=0), Layout(tp=8, recompute="full"), Layout(tp=4, pp=2, microbatch=2),
                           Layout(dp=2, tp=2, cp=2, recompute="selective"), Layout(tp=2, cp=4, recompute="full"),
                           Layout(pp=2, cp=2, tp=2, schedule="interleaved", virtual=2),
                           Layout(dp=8, ep=4, recompute="full"), Layout(dp=4, tp=2, ep=2, zero=3),
                           Layout(dp=4, cp=2, ep=2, microbatch=2)]:
                if layout.ep > 1 and not model.experts:
                    continue
                m = 8
                batch = m * layout.dp * layout.microbatch
                st = step_time(model, layout, cluster, batch)
                where = f"perf.step: {model.name} {layout} rails={rails}"
                tp, cp, pp, v, b = layout.tp, layout.cp, layout.pp, layout.virtual, layout.microbatch
                full = layout.recompute == "full"
                act = model.seq // cp * b * model.hidden * e            # one layer's activation on a CP rank
                # TP + SP: the bytes of 4 all-reduces of the activation per layer (6 with full recompute),
                # and Megatron's re-gather (the default) all-gathers both column layers' inputs again in backward
                want = m * model.layers // pp * (6 if full else 4) * collective_time("all_reduce", act, tp, link(tp, 1))
                regather = m * model.layers // pp * 2 * collective_time("all_gather", act, tp, link(tp, 1))
                _close(st.tp_comm, want + regather, f"{where}: tp_comm (re-gather in backward)")
                kept = step_time(model, replace(layout, tp_regather=False), cluster, batch)
                _close(kept.tp_comm, want, f"{where}, tp_regather=False: tp_comm (the gathered input kept)")
                # ring attention: K and V of s/cp tokens, cp-1 hops forward, twice that backward (+1 full)
                kv = 2 * model.seq // cp * b * max(model.kv_heads_ // tp, 1) * model.head_size * e
                want = m * model.layers // pp * (cp - 1) * (4 if full else 3) * collective_time("send", kv, cp, link(cp, tp))
                _close(st.cp_comm, want, f"{where}: cp_comm")
                # PP: an activation shard forward, its gradient backward, per model chunk
                want = m * 2 * v * collective_time("send", act / tp, pp, link(pp, tp * cp)) if pp > 1 else 0.0
                _close(st.pp_comm, want, f"{where}: pp_comm")
                # EP: dispatch + combine, forward and backward (+ forward again with full recompute)
                moe_layers = max(layers_on_rank(model, layout, r)[1] for r in range(pp))
                tokens = model.seq // cp * b // tp * model.top_k * model.hidden * e
                want = m * moe_layers * (6 if full else 4) * collective_time(
                    "all_to_all", tokens, layout.ep, link(layout.ep, tp * cp * pp)) if layout.ep > 1 else 0.0
                _close(st.ep_comm, want, f"{where}: ep_comm")


@task("perf.step", points=3)
def test_step_data_parallel_bytes_and_overlap():
    """DP/ZeRO/FSDP: the gradient (and parameter) traffic of the rank's parameters over dp x cp
    ranks (experts over dp x cp / ep): ZeRO-0 an all-reduce, 1 and 2 a reduce-scatter + an
    all-gather, 3 per micro-batch two all-gathers and a reduce-scatter; exposed = what backward
    (ZeRO-0), backward + the first forward (1, 2), or every micro-batch (3) does not hide, with
    both branches reached: a slow network exposes part, a fast one hides all."""
    from labkit.perf import Layout, Link, collective_time, parameters_per_gpu, step_time
    model = _dense()
    m = 4
    for zero in (0, 1, 2, 3):
        for layout in (Layout(dp=8, zero=zero), Layout(dp=2, tp=2, pp=2, zero=zero, microbatch=2),
                       Layout(dp=2, cp=2, zero=zero, recompute="full"), Layout(dp=4, tp=2, zero=zero),
                       Layout(cp=2, tp=2, pp=2, zero=zero)):
            for network, exposed in (((20e-6, 1e9), True), ((0.0, 1e15), False)):
                cluster = _cluster(network=network, nvlink=(0.0, 1e15) if not exposed else (2e-6, 1e9))
                batch = m * layout.dp * layout.microbatch
                st = step_time(model, layout, cluster, batch)
                where = f"perf.step: {layout}, network={network}"
                dense = max(parameters_per_gpu(model, layout, r)[0] for r in range(layout.pp))
                size = layout.dp * layout.cp
                # the group of ranks sharing these weights: along dp (stride tp cp pp) and cp (stride tp)
                stride = layout.tp * layout.cp * layout.pp if layout.dp > 1 else layout.tp
                net = cluster.nvlink if 4 % (size * stride) == 0 else Link(
                    cluster.network.alpha, min(max(1, min(size, 4 // stride)) * cluster.network.bandwidth,
                                               cluster.nvlink.bandwidth))
                ar = collective_time("all_reduce", 2 * dense, size, net)
                want = {0: ar, 1: ar, 2: ar, 3: 1.5 * m * ar}[zero]
                _close(st.dp_comm, want, f"{where}: dp_comm")
                mb = (st.compute + st.recompute) / m
                hides = {0: st.compute / m * 2 / 3 + st.recompute / m, 1: mb, 2: mb, 3: m * mb}[zero]
                _close(st.dp_exposed, max(0.0, want - hides), f"{where}: dp_exposed (hidden behind {hides:.3g} s)")
                assert (st.dp_exposed > 0) == exposed, \
                    f"{where}: dp_exposed={st.dp_exposed:.3g} s of dp_comm={st.dp_comm:.3g} s; expected " \
                    + ("part of it exposed" if exposed else "all of it hidden")
    # experts: their gradients go over dp x cp / ep ranks, the dense ones over dp x cp
    moe, cluster = _moe(), _cluster()

    def link(size, stride):
        if 4 % (size * stride) == 0:
            return cluster.nvlink
        nics = max(1, min(size, 4 // stride))
        return Link(cluster.network.alpha, min(nics * cluster.network.bandwidth, cluster.nvlink.bandwidth))
    for layout in (Layout(dp=8, ep=2, zero=0), Layout(dp=4, ep=2, cp=2, zero=1), Layout(dp=8, ep=8, zero=2),
                   Layout(dp=2, ep=2, cp=2, tp=2, zero=1), Layout(dp=4, ep=2, pp=2, zero=0)):
        st = step_time(moe, layout, cluster, 8 * layout.dp)
        dense, experts = parameters_per_gpu(moe, layout, 0)
        tp, cp, pp = layout.tp, layout.cp, layout.pp
        want = collective_time("all_reduce", 2 * dense, layout.dp * cp, link(layout.dp * cp, tp * cp * pp))
        rest = layout.dp * cp // layout.ep          # replicas of an expert: dp / ep along dp, times cp
        if rest > 1:
            stride = tp * cp * pp * layout.ep if layout.dp > layout.ep else tp
            want += collective_time("all_reduce", 2 * experts, rest, link(rest, stride))
        _close(st.dp_comm, want, f"perf.step: MoE {layout}: dp_comm")


@task("perf.step", points=2)
def test_step_memory_parameters_and_zero():
    """Every rank's parameters, summed over the TP, EP and PP ranks of one replica, give back
    Model.params() (plus the output layer's own copy when a tied model is pipelined, and the
    router's copies on every TP rank); ZeRO
    shards the optimizer state from stage 1, the gradients from 2, the parameters at 3, over
    dp x cp (experts over dp x cp / ep); 16 bytes a parameter unsharded; fits <=> memory <= the GPU's."""
    from labkit.perf import Layout, memory_per_gpu, parameters_per_gpu, step_time
    for model in (_dense(), _dense(tied=True), _moe(), _moe(tied=True)):
        for tp, pp, v, ep in [(1, 1, 1, 1), (2, 2, 1, 1), (4, 1, 1, 2), (1, 4, 2, 2), (2, 2, 2, 4), (1, 8, 1, 1),
                              (2, 3, 1, 2), (1, 3, 2, 1), (1, 5, 1, 1)]:
            if ep > 1 and not model.experts:
                continue
            layout = Layout(dp=ep, tp=tp, pp=pp, ep=ep, schedule="interleaved" if v > 1 else "1f1b", virtual=v,
                            uneven=model.layers % (pp * v) != 0)
            total = sum(tp * d + tp * ep * x for d, x in (parameters_per_gpu(model, layout, r) for r in range(pp)))
            want = model.params() + (model.vocab * model.hidden if model.tied and pp > 1 else 0) \
                + (tp - 1) * model.moe_layers * model.hidden * model.experts     # every TP rank keeps the router
            _close(total, want, f"perf.step: {model.name} tied={model.tied} {layout}: parameters summed over the ranks")
    model = _moe()
    base = Layout(dp=4, cp=2, ep=2, tp=2, pp=2, zero=0, microbatch=2)
    for rank in (0, 1):
        ref = memory_per_gpu(model, base, 32, rank)
        dense, experts = parameters_per_gpu(model, base, rank)
        _close(ref["params"], 2 * (dense + experts), f"perf.step: {base} rank {rank}: 16-bit parameters")
        _close(ref["optimizer"], 12 * (dense + experts), f"perf.step: {base} rank {rank}: AdamW state")
        for zero in (1, 2, 3):
            got = memory_per_gpu(model, replace(base, zero=zero), 32, rank)
            for part, stage in (("optimizer", 1), ("grads", 2), ("params", 3)):
                factor = 2 if part != "optimizer" else 12
                want = factor * (dense / 8 + experts / 4) if zero >= stage else ref[part]
                _close(got[part], want, f"perf.step: ZeRO-{zero} rank {rank}: {part}")
            _close(got["activations"], ref["activations"], f"perf.step: ZeRO-{zero}: activations")
            _close(got["total"], got["params"] + got["grads"] + got["optimizer"] + got["activations"], "total")
    # the last rank of a 1F1B pipeline holds one micro-batch (no warm-up), plus its fp32 logits, both split
    # over tp (sequence parallel, vocabulary-parallel output) and cp
    from labkit import budget
    from labkit.perf import layers_on_rank
    s, b = model.seq, base.microbatch
    want = budget.korthikanti_activation_bytes(layers_on_rank(model, base, 1)[0], s, model.hidden, model.heads,
                                               micro=b, tp=2, cp=2, held=1) + 4 * (s / 2) * b * model.vocab / 2
    _close(memory_per_gpu(model, base, 32, 1)["activations"], want,
           f"perf.step: {base}: the last rank's activations and fp32 logits")
    # fits: the fullest rank against the GPU's memory, both ways; step_time's memory is the fullest rank's
    layout = Layout(dp=2, tp=2, pp=2, zero=1, microbatch=2, recompute="selective")
    fullest = max(memory_per_gpu(model, layout, 16, r)["total"] for r in range(2))
    for memory, fits in ((fullest * 1.001, True), (fullest, True), (fullest * 0.999, False)):
        st = step_time(model, layout, _cluster(memory=memory), 16)
        _close(st.memory, fullest, f"perf.step: {layout}: memory")
        assert st.fits == fits, f"perf.step: {layout}: {st.memory:.4g} bytes on a {memory:.4g}-byte GPU, fits={st.fits}"
    # recomputation shrinks activations: full < selective < none
    acts = [memory_per_gpu(model, replace(layout, recompute=r), 16, 0)["activations"]
            for r in ("none", "selective", "full")]
    assert acts[0] > acts[1] > acts[2], f"perf.step: activations none/selective/full = {acts}"


def _sp_block_traffic_on_rank():
    """torch's Megatron-SP plan (labkit.oracles.builtin_sequence_parallel) on one course Block,
    forward + backward traced, without and with full recomputation (torch's checkpoint): every
    all-gather and reduce-scatter as (kind, buffer bytes, wire bytes this rank sends)."""
    import torch
    import torch.distributed as dist

    from labkit.comm import CommTracer
    from labkit.models import GPT, GPTConfig
    from labkit.oracles import builtin_checkpoint, builtin_sequence_parallel, device_mesh
    torch.set_num_threads(1)
    n, out = dist.get_world_size(), []
    for full in (False, True):
        torch.manual_seed(0)
        block = GPT(GPTConfig(vocab_size=32, block_size=_SP_T, n_layer=1, n_head=_SP_HEADS, n_embd=_SP_H)).blocks[0]
        block = builtin_sequence_parallel(block, device_mesh())
        x = torch.randn(_SP_B, _SP_T // n, _SP_H, requires_grad=True)
        # early stop off: the recomputation runs the whole forward again, as Megatron's does (with it,
        # torch would skip the last reduce-scatter, whose output backward does not need)
        with CommTracer() as tracer:
            y = builtin_checkpoint(block, early_stop=False)(x) if full else block(x)
            y.backward(torch.ones_like(y))
        out.append([(e.kind, e.bytes, e.wire_bytes) for e in tracer.events if e.kind != "barrier"])
    return out


_SP_B, _SP_T, _SP_H, _SP_HEADS = 2, 8, 16, 4


@task("perf.step", points=2)
def test_step_tp_traffic_equals_traced_sequence_parallel_block():
    """The TP/SP term against the traffic of a real sequence-parallel layer: torch's Megatron-SP
    plan on a course Block at tp = 2 (one launch), forward + backward, traced with CommTracer,
    and again under full recomputation (torch's checkpoint, without early stop, runs the whole
    forward, and its collectives, again, as Megatron-LM does). On a link of alpha 0 and 1 byte/s, step_time's tp_comm for a 1-layer
    model of the block's shape is the bytes each rank sends (scaled from fp32 to the model's
    16-bit activations): every all-gather and reduce-scatter moves the B x T x H activation."""
    from labkit.course.grading import run_graded
    traced = run_graded("perf.step", _sp_block_traffic_on_rank, 2)
    # torch's plan keeps the gathered input: Layout(tp_regather=False); Megatron's re-gather adds
    # one all-gather per column layer (QKV, the MLP's first) in backward, as traced ones cost
    # The learner's step_time runs in a rank too: the judge's process imports no submission.
    run_graded("perf.step", _tp_comm_matches_traced, 1, traced)


def _tp_comm_matches_traced(traced) -> None:
    from labkit.perf import Layout, Model, step_time
    model = Model(layers=1, hidden=_SP_H, heads=_SP_HEADS, vocab=32, seq=_SP_T)
    cluster = _cluster(nvlink=(0.0, 1.0))
    activation = _SP_B * _SP_T * _SP_H * 4                          # fp32 bytes of the whole sequence
    for rank, runs in enumerate(traced):
        for recompute, events in zip(("none", "full"), runs):
            where = f"perf.step: tp=2, recompute={recompute}, rank {rank}"
            kinds = sorted({kind for kind, _, _ in events})
            assert kinds == ["all_gather", "reduce_scatter"] and all(b == activation for _, b, _ in events), \
                f"{where}: test set-up: torch's SP block traced {events}"
            layout = Layout(tp=2, microbatch=_SP_B, zero=0, recompute=recompute, tp_regather=False)
            st = step_time(model, layout, cluster, _SP_B)
            sent = sum(wire for _, _, wire in events) * 2 / 4            # fp32 traced, 16-bit modelled
            _close(st.tp_comm, sent, f"{where}, tp_regather=False: tp_comm on a 1 byte/s link vs the bytes the "
                                     f"traced layer (torch's plan) sent ({len(events)} collectives)")
            gather = next(wire for kind, _, wire in events if kind == "all_gather") * 2 / 4
            st = step_time(model, replace(layout, tp_regather=True), cluster, _SP_B)
            _close(st.tp_comm, sent + 2 * gather, f"{where}, tp_regather=True: tp_comm vs the traced bytes + "
                                                  f"2 re-gathers")


@task("perf.step", points=2)
def test_step_elementwise_roofline_and_flash():
    """Memory-bound work priced by the roofline: per micro-batch, 3 passes (4 with full
    recomputation) over Korthikanti's bytes of the rank's layers (s/cp queries, split over tp,
    scores unless flash) at the achieved HBM bandwidth (the datasheet's when None); flash
    attention drops the scores from memory and adds attention's forward to the recomputation
    unless selective recomputation already runs it."""
    from labkit import budget
    from labkit.perf import Hardware, Layout, flops_per_token, layers_on_rank, memory_per_gpu, step_time
    model = _dense()
    for achieved_bw in (None, 4e11):
        cluster = _cluster()
        cluster = replace(cluster, gpu=replace(cluster.gpu, achieved_bandwidth=achieved_bw))
        bandwidth = achieved_bw or cluster.gpu.memory_bandwidth
        for layout in (Layout(), Layout(tp=2, microbatch=2), Layout(cp=2, recompute="full", flash=True),
                       Layout(pp=2, tp=2, recompute="selective"), Layout(dp=2, tp=4, flash=True),
                       Layout(pp=2, cp=2, recompute="full"), Layout(tp=2, recompute="selective", flash=True)):
            m = 4
            batch = m * layout.dp * layout.microbatch
            st = step_time(model, layout, cluster, batch)
            where = f"perf.step: {layout}, achieved bandwidth {achieved_bw}"
            layers = layers_on_rank(model, layout, 0)[0]
            passes = 4 if layout.recompute == "full" else 3
            per_layer = budget.korthikanti_layer_bytes(model.seq, model.hidden, model.heads, layout.microbatch,
                                                       layout.tp, layout.cp, flash=layout.flash)
            _close(st.elementwise, m * passes * layers * per_layer / bandwidth, f"{where}: elementwise")
            _close(_terms(st), st.total, f"{where}: total vs the sum of its terms")
            extra = flops_per_token(model, layout.recompute) - flops_per_token(model)
            if layout.flash and layout.recompute != "selective":
                extra += flops_per_token(model, "selective") - flops_per_token(model)
            rate = cluster.gpu.achieved_flops
            _close(st.recompute, extra * batch * model.seq / (layout.gpus * rate), f"{where}: recompute (flash)")
            plain = memory_per_gpu(model, replace(layout, flash=False), batch)["activations"]
            fused = memory_per_gpu(model, replace(layout, flash=True), batch)["activations"]
            if layout.recompute == "none":
                want = budget.korthikanti_activation_bytes(layers, model.seq, model.hidden, model.heads,
                                                           micro=layout.microbatch, tp=layout.tp, cp=layout.cp,
                                                           held=1, flash=True)
                _close(fused, want + (4 * model.seq / layout.cp * layout.microbatch * model.vocab / layout.tp
                                      if layout.pp == 1 else 0.0), f"{where}: flash activations")
                assert fused < plain, f"{where}: flash attention must drop the s x s scores ({fused} vs {plain})"
    # flash alone costs what selective recomputation costs (its backward recomputes the scores)
    a = step_time(model, Layout(flash=True), _cluster(), 4)
    b = step_time(model, Layout(recompute="selective"), _cluster(), 4)
    _close(a.recompute, b.recompute, "perf.step: flash's recomputation vs selective's")


@task("perf.step", points=1)
def test_step_fp32_gradients_bytes_and_memory():
    """Layout(grad_bytes=4): gradients accumulated and reduced in fp32 (Megatron with bf16,
    Llama 3): the gradient reduction moves 4 bytes a parameter (the weights' all-gather still 2),
    and the gradients take 4 bytes a parameter of memory (18 B unsharded; 6 + 12/d with ZeRO-1)."""
    from labkit.perf import Layout, Link, collective_time, memory_per_gpu, parameters_per_gpu, step_time
    model, cluster, m = _dense(), _cluster(network=(20e-6, 1e9)), 4
    for zero in (0, 1, 2, 3):
        for base in (Layout(dp=8, zero=zero), Layout(dp=2, tp=2, pp=2, zero=zero, microbatch=2)):
            layout = replace(base, grad_bytes=4)
            batch = m * layout.dp * layout.microbatch
            st, st16 = step_time(model, layout, cluster, batch), step_time(model, base, cluster, batch)
            where = f"perf.step: {layout}"
            dense = max(parameters_per_gpu(model, layout, r)[0] for r in range(layout.pp))
            size, stride = layout.dp, layout.tp * layout.cp * layout.pp
            net = cluster.nvlink if 4 % (size * stride) == 0 else Link(
                cluster.network.alpha, min(max(1, min(size, 4 // stride)) * cluster.network.bandwidth,
                                           cluster.nvlink.bandwidth))
            rs, ag = (collective_time(op, b * dense, size, net) for op, b in (("reduce_scatter", 4), ("all_gather", 2)))
            want = {0: collective_time("all_reduce", 4 * dense, size, net), 1: rs + ag, 2: rs + ag,
                    3: m * (2 * ag + rs)}[zero]
            _close(st.dp_comm, want, f"{where}: dp_comm with fp32 gradients")
            assert st.dp_comm > st16.dp_comm, f"{where}: fp32 gradients must cost more than 16-bit ones"
            mem, mem16 = memory_per_gpu(model, layout, batch), memory_per_gpu(model, base, batch)
            _close(mem["grads"], 2 * mem16["grads"], f"{where}: fp32 gradient memory (twice the 16-bit)")
            _close(mem["params"], mem16["params"], f"{where}: the weights stay 16-bit")
            _close(mem["optimizer"], mem16["optimizer"], f"{where}: the optimizer state is unchanged")
    with pytest.raises(ValueError):
        step_time(model, Layout(grad_bytes=3), cluster, 4)


@task("perf.step", points=1)
def test_step_tp_overlap_exposes_only_the_excess():
    """Layout(tp_overlap=True): the TP/SP collectives run behind the micro-batch's matmuls
    (collective matmul, async TP); per micro-batch only max(0, TP time - (compute + recompute))
    is on the critical path, in both regimes (a slow NVLink exposes part, a fast one none)."""
    from labkit.perf import Layout, step_time
    model, m = _dense(), 4
    for nvlink, exposed in (((2e-6, 2e8), True), ((0.0, 1e15), False)):
        cluster = _cluster(nvlink=nvlink)
        for base in (Layout(tp=2), Layout(tp=4, recompute="full", microbatch=2), Layout(tp=2, pp=2, flash=True),
                     Layout(dp=2, tp=2, recompute="selective")):
            layout = replace(base, tp_overlap=True)
            batch = m * layout.dp * layout.microbatch
            plain, st = step_time(model, base, cluster, batch), step_time(model, layout, cluster, batch)
            where = f"perf.step: {layout}, NVLink {nvlink}"
            want = m * max(0.0, plain.tp_comm / m - (plain.compute + plain.recompute) / m)
            _close(st.tp_comm, want, f"{where}: exposed tp_comm")
            _close(_terms(st), st.total, f"{where}: total vs the sum of its terms")
            assert (st.tp_comm > 0) == exposed, f"{where}: tp_comm {st.tp_comm:.3g} s; expected " + \
                ("part of it exposed" if exposed else "all of it hidden")


@task("perf.step", points=1)
def test_step_tp_regather_is_one_choice_for_traffic_and_memory():
    """Layout(tp_regather=...): ONE implementation of TP + SP for both traffic and memory
    (chapter 11, section 5). True (Megatron-LM): each column layer keeps its input's 1/tp shard
    and all-gathers it again in backward (2 more all-gathers per layer and micro-batch, also
    with full recomputation), and the activations are Korthikanti's 34 sbh/tp. False (torch's
    plan): no re-gather, and the two column layers' gathered inputs are kept whole, + 2 x 2 (s/cp)
    b h (1 - 1/tp) bytes per layer kept (per layer x in-flight micro-batch; with full
    recomputation only in the one layer being recomputed); no difference at tp = 1."""
    from labkit import budget
    # in_flight is checked against a simulation of the schedule (test_step_pipeline_matches_a_simulation...)
    from labkit.perf import Layout, collective_time, in_flight, layers_on_rank, memory_per_gpu, step_time
    cluster, e = _cluster(), 2
    for model in (_dense(), _moe()):
        for base in (Layout(tp=2), Layout(tp=4, recompute="full", microbatch=2), Layout(tp=2, pp=2, cp=2, flash=True),
                     Layout(dp=2, tp=2, pp=4, recompute="selective", schedule="interleaved", virtual=2),
                     Layout(pp=2, microbatch=2), Layout(tp=4, pp=2, recompute="full")):
            m = 8
            batch = m * base.dp * base.microbatch
            mega, kept = (replace(base, tp_regather=flag) for flag in (True, False))
            where = f"perf.step: {model.name} {base}"
            st_mega, st_kept = step_time(model, mega, cluster, batch), step_time(model, kept, cluster, batch)
            act = model.seq // base.cp * base.microbatch * model.hidden * e
            layers = max(layers_on_rank(model, base, r)[0] for r in range(base.pp))
            _close(st_mega.tp_comm - st_kept.tp_comm, m * layers * 2 * collective_time("all_gather", act, base.tp,
                                                                                         cluster.nvlink),
                   f"{where}: tp_comm(re-gather) - tp_comm(gathered input kept) = 2 all-gathers per layer")
            _close(_terms(st_kept), st_kept.total, f"{where}, tp_regather=False: total vs the sum of its terms")
            for rank in range(base.pp):
                a, b = (memory_per_gpu(model, layout, batch, rank) for layout in (mega, kept))
                mine = layers_on_rank(model, base, rank)[0]
                held = 1 if base.recompute == "full" else in_flight(
                    base.schedule, base.pp, m, base.virtual, rank) * mine
                # chapter 11: the gathered input of each of the 2 column layers, (1 - 1/tp) of it beyond the shard
                extra = held * 2 * (model.seq / base.cp * base.microbatch * model.hidden * e) * (1 - 1 / base.tp)
                _close(b["activations"] - a["activations"], extra,
                       f"{where}, rank {rank}: activations without the re-gather - with it")
                want = budget.korthikanti_activation_bytes(
                    mine, model.seq, model.hidden, model.heads, micro=base.microbatch, tp=base.tp, cp=base.cp,
                    held=in_flight(base.schedule, base.pp, m, base.virtual, rank),
                    flash=base.flash or base.recompute == "selective", full=base.recompute == "full")
                if rank == base.pp - 1:
                    want += 4 * model.seq / base.cp * base.microbatch * model.vocab / base.tp
                _close(a["activations"], want, f"{where}, rank {rank}, tp_regather=True: Korthikanti's activations")
                _close(b["total"], b["params"] + b["grads"] + b["optimizer"] + b["activations"],
                       f"{where}, rank {rank}: total memory")
            assert (st_kept.memory > st_mega.memory) == (base.tp > 1), \
                f"{where}: memory {st_kept.memory:.4g} (gathered kept) vs {st_mega.memory:.4g} (re-gather)"
            assert (st_kept.tp_comm < st_mega.tp_comm) == (base.tp > 1), \
                f"{where}: tp_comm {st_kept.tp_comm:.4g} (gathered kept) vs {st_mega.tp_comm:.4g} (re-gather)"
    with pytest.raises(ValueError):
        step_time(_dense(), Layout(tp=2, tp_regather="no"), cluster, 4)


def _scaled(cluster, factor):
    """``cluster`` with both link classes ``factor`` times faster (every group's bandwidth scales)."""
    return replace(cluster, nvlink=replace(cluster.nvlink, bandwidth=cluster.nvlink.bandwidth * factor),
                   network=replace(cluster.network, bandwidth=cluster.network.bandwidth * factor))


_SIDE = 0.02      # the checks sit 2 % on either side of the predicted threshold


@task("perf.step", points=2)
def test_thresholds_are_where_step_time_exposes_communication():
    """dp_critical_tokens, tp_max_degree and ep_min_expert_width against step_time itself:
    each threshold is proportional to C / W (t* - 1 for TP), so the links are scaled to put a
    layout 2 % above, then 2 % below its threshold, and step_time must hide the strategy's
    traffic on one side and expose it on the other. DP (every ZeRO stage, 16-bit and fp32
    gradients, groups inside a node, over rails and over a shared NIC): dp_exposed = 0 above,
    > 0 below (the model's attention FLOPs, which the 6-FLOPs-a-parameter count leaves out, are
    computed and allowed for). TP (tp 2, 4, 8; every recomputation mode; with and without the
    re-gather): overlapped tp_comm = 0 below t*, > 0 above. EP (inside a node, over rails, over
    one NIC a GPU; gated or not; with and without full recomputation): the routed experts'
    compute, measured from step_time as the slope of compute in the expert width, is above the
    all-to-alls' ep_comm above F_e* and below it under."""
    from labkit.perf import Layout, Model, dp_critical_tokens, ep_min_expert_width, step_time, \
        tp_max_degree
    # data parallelism: a tied model, whose every parameter a token multiplies (6 FLOPs each)
    model = Model(layers=2, hidden=512, heads=8, vocab=512, seq=16, tied=True, name="tied")
    slack = 12 * model.layers * model.hidden * model.seq / (6 * model.active_params())   # attention's FLOPs
    for rails in (True, False):
        base = _cluster(nvlink=(0.0, 40e9), network=(0.0, 3e9), per_node=4, rails=rails)
        for dp, tp in ((8, 1), (4, 2), (2, 2), (4, 1), (2, 4)):
            for zero, grads, b in itertools.product((0, 1, 2, 3), (2, 4), (1, 4)):
                layout = Layout(dp=dp, tp=tp, zero=zero, grad_bytes=grads, microbatch=b)
                tokens = b * model.seq                                  # tokens each GPU's shard multiplies
                critical = dp_critical_tokens(base, dp, tp, zero, grads)
                where = f"perf.step: dp_critical_tokens({dp} ranks, stride {tp}, ZeRO-{zero}, {grads}-byte grads, " \
                        f"rails={rails}) = {critical:.4g}"
                for side, target in (("above", tokens / (1 + _SIDE)), ("below", tokens * (1 + slack) * (1 + _SIDE))):
                    cluster = _scaled(base, critical / target)         # now the threshold is `target` tokens
                    st = step_time(model, layout, cluster, 4 * dp * b)
                    assert (st.dp_exposed == 0) == (side == "above"), \
                        f"{where}: {tokens} tokens a GPU, 2 % {side} the threshold, yet step_time's dp_exposed " \
                        f"is {st.dp_exposed:.3g} s of {st.dp_comm:.3g} s"
    _close(dp_critical_tokens(base, 8, 1, 3, experts_per_token=4), 4 * dp_critical_tokens(base, 8, 1, 3),
           "perf.step: dp_critical_tokens(experts_per_token=E/k): routed experts see k/E of the tokens")
    assert dp_critical_tokens(base, 1) == 0, "perf.step: dp_critical_tokens of one rank (nothing to reduce)"
    with pytest.raises(ValueError):
        dp_critical_tokens(base, 8, 1, zero=4)
    # tensor parallelism, overlapped: hidden below t*, exposed above
    model = _dense(heads=8)
    base = _cluster(nvlink=(0.0, 40e9), per_node=8)
    for recompute, regather, tp in itertools.product(RECOMPUTE_MODES, (True, False), (2, 4, 8)):
        degree = tp_max_degree(model, base, recompute, regather)
        layout = Layout(tp=tp, recompute=recompute, tp_regather=regather, tp_overlap=True)
        where = f"perf.step: tp_max_degree(recompute={recompute}, regather={regather}) = {degree:.4g}, tp={tp}"
        for side, target in (("below", tp * (1 + _SIDE)), ("above", tp / (1 + _SIDE))):
            cluster = _scaled(base, (target - 1) / (degree - 1))      # now t* = target
            st = step_time(model, layout, cluster, 4)
            assert (st.tp_comm == 0) == (side == "below"), \
                f"{where}: tp 2 % {side} t*, yet step_time's overlapped tp_comm is {st.tp_comm:.3g} s"
    # expert parallelism: the experts' compute (slope in the expert width) against the all-to-alls
    for gated, recompute, (dp, ep, tp) in itertools.product((True, False), ("none", "full"),
                                                            ((2, 2, 1), (8, 8, 1), (8, 4, 1), (2, 2, 4))):
        moe = _moe(gated=gated, shared_experts=0, dense_layers=0, experts=8)
        base = _cluster(nvlink=(0.0, 40e9), network=(0.0, 3e9), per_node=4)
        layout = Layout(dp=dp, ep=ep, tp=tp, recompute=recompute, zero=0)
        width = ep_min_expert_width(base, ep, tp, gated, recompute)
        where = f"perf.step: ep_min_expert_width(ep={ep}, stride {tp}, gated={gated}, {recompute}) = {width:.4g}"
        for side, target in (("above", 128 / (1 + _SIDE)), ("below", 128 * (1 + _SIDE))):
            cluster = _scaled(base, width / target)                    # now F_e* = target; the experts are 128 wide
            st1, st2 = (step_time(replace(moe, expert_ffn=f), layout, cluster, 2 * dp) for f in (128, 256))
            experts = (st2.compute + st2.recompute) - (st1.compute + st1.recompute)   # the 128 extra = the 128 there
            assert (experts > st1.ep_comm) == (side == "above"), \
                f"{where}: experts 2 % {side} F_e*, yet their compute is {experts:.4g} s against " \
                f"{st1.ep_comm:.4g} s of all-to-alls"
    assert ep_min_expert_width(base, 1) == 0, "perf.step: ep_min_expert_width of one rank (no all-to-all)"


RECOMPUTE_MODES = ("none", "selective", "full")


@task("perf.step", points=2)
def test_step_uneven_stages():
    """Layers that pp x v does not divide: refused unless Layout(uneven=True); then the chunks
    differ by at most one layer, every layer sits on exactly one rank, and the fullest rank
    sets the pace: its share of the FLOPs, its layers' TP traffic, its activations; the step is
    the simulated 1F1B/interleaved makespan with every stage as slow as the fullest."""
    from labkit import budget, pp
    from labkit.perf import Layout, collective_time, flops_per_token, layers_on_rank, memory_per_gpu, step_time
    cluster = _cluster()
    for model in (_dense(layers=7), _moe(layers=7, dense_layers=3)):
        for p, v, kind in ((2, 1, "1f1b"), (2, 2, "interleaved"), (4, 1, "1f1b"), (3, 2, "interleaved")):
            layout = Layout(pp=p, tp=2, virtual=v, schedule=kind, microbatch=2)
            with pytest.raises(ValueError, match="uneven"):
                step_time(model, layout, cluster, 12)
                pytest.fail(f"perf.step: {layout} accepted {model.layers} layers that pp x v does not divide")
            layout = replace(layout, uneven=True)
            where = f"perf.step: {model.name} with {model.layers} layers, {layout}"
            counts = [layers_on_rank(model, layout, r) for r in range(p)]
            # the chunks, in order: rank r holds chunks r, r + p, ...; sizes within one of each other
            sizes = sorted(layers for layers, _ in counts)
            assert sum(sizes) == model.layers and sizes[-1] - sizes[0] <= v, f"{where}: layers per rank {counts}"
            assert sum(moe for _, moe in counts) == model.moe_layers, f"{where}: MoE layers per rank {counts}"
            fullest = max(sizes)
            m = 6 if kind == "1f1b" else p * 2
            batch = m * layout.microbatch
            st = step_time(model, layout, cluster, batch)
            tokens = batch * model.seq
            _close(st.compute, flops_per_token(model) * tokens / 2 * fullest / model.layers / 50e12,
                   f"{where}: compute of the fullest rank ({fullest} layers)")
            act = model.seq * layout.microbatch * model.hidden * 2
            _close(st.tp_comm, m * fullest * (4 * collective_time("all_reduce", act, 2, cluster.nvlink)
                                              + 2 * collective_time("all_gather", act, 2, cluster.nvlink)),
                   f"{where}: tp_comm (with Megatron's re-gather)")
            per_mb = _per_microbatch(st, m)
            timeline = pp.simulate(_schedule(kind, p, m, v), p * v, {"F": per_mb / 3 / v, "B": 2 * per_mb / 3 / v})
            _close(st.total, timeline.makespan, f"{where}: step vs the simulated makespan at the fullest rank's pace")
            held = timeline.peak_in_flight[0] / v
            want = budget.korthikanti_activation_bytes(counts[0][0], model.seq, model.hidden, model.heads,
                                                       micro=layout.microbatch, tp=2, held=held)
            _close(memory_per_gpu(model, layout, batch, 0)["activations"], want, f"{where}: rank 0's activations")
        with pytest.raises(ValueError):
            step_time(model, Layout(pp=8, uneven=True), cluster, 8)       # an empty stage


@task("perf.step", points=1)
def test_step_refuses_bad_layouts():
    """A layout that cannot run the model or the batch raises ValueError, naming the problem."""
    from labkit.perf import Layout, step_time
    model, cluster = _moe(), _cluster()
    bad = [(Layout(dp=0), 8, None, "dp"), (Layout(tp=3), 12, None, "heads"), (Layout(pp=3), 12, None, "layers"),
           (Layout(pp=2, schedule="interleaved", virtual=8), 8, None, "layers"),
           (Layout(dp=2, tp=2), 8, 8, "8"), (Layout(dp=3), 8, None, "batch"),
           (Layout(dp=2, microbatch=3), 8, None, "batch"), (Layout(cp=3), 9, None, "cp"),
           (Layout(zero=4), 8, None, "ZeRO"), (Layout(schedule="zigzag"), 8, None, "schedule"),
           (Layout(recompute="some"), 8, None, "recompute"), (Layout(pp=2, virtual=2), 8, None, "interleaved"),
           (Layout(schedule="interleaved"), 8, None, "pp"), (Layout(pp=4, schedule="interleaved"), 6, None, "multiple"),
           (Layout(dp=2, ep=4), 8, None, "ep"), (Layout(dp=4, ep=3), 12, None, "ep"), (Layout(), 0, None, "batch")]
    for layout, batch, gpus, word in bad:
        with pytest.raises(ValueError) as error:
            step_time(model, layout, cluster, batch, gpus=gpus)
            pytest.fail(f"perf.step: {layout} with a batch of {batch} (gpus={gpus}) did not raise ValueError")
        assert word.lower() in str(error.value).lower(), \
            f"perf.step: {layout} (batch {batch}, gpus {gpus}) raised {error.value!r}, which does not name {word!r}"
    with pytest.raises(ValueError):
        step_time(_dense(), Layout(dp=2, ep=2), cluster, 8)          # experts in a dense model


# ----------------------------------------------------------------------------- perf.search


def _brute_force(model, cluster, gpus, batch, zeros, micro, schedules, virtuals, recomputes, max_cp, uneven=False):
    """Every Layout the search's limits allow, tried with step_time (ValueError: not a layout)."""
    from labkit.perf import Layout, step_time
    found = []
    for dp, tp, pp, cp in itertools.product(range(1, gpus + 1), repeat=4):
        if dp * tp * pp * cp != gpus or cp > max_cp:
            continue
        for ep, zero, b, schedule, v, r, cut in itertools.product(range(1, dp + 1), zeros, micro, schedules,
                                                            (1,) + virtuals, recomputes, (False, True)[:1 + uneven]):
            if (schedule == "interleaved") != (v > 1):
                continue
            layout = Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, microbatch=b, schedule=schedule,
                            virtual=v, recompute=r, uneven=cut)
            try:
                st = step_time(model, layout, cluster, batch, gpus=gpus)
            except ValueError:
                continue
            if st.fits:
                found.append((layout, st))
    return found


@task("perf.search", points=3)
def test_search_equals_brute_force():
    """On 8 GPUs in nodes of 4, for a dense and an MoE model: the search's ranking equals a
    brute force over every layout step_time accepts (the search's own conventions: one ZeRO
    stage when dp x cp = 1, "1f1b" only without a pipeline), the best is the minimum of
    step_time over ALL valid layouts, every result fits, ties go to less memory then Layout.key,
    and ``top`` cuts the list."""
    from labkit.perf import search_layouts
    limits = dict(zero=(0, 1, 3), microbatch=(1, 2), schedules=("gpipe", "1f1b", "interleaved"), virtual=(2,),
                  recompute=("none", "full"), max_cp=2)
    for model, memory, uneven in ((_dense(layers=4, hidden=512, seq=256), 0.2e9, False),
                                  (_moe(layers=4), 0.05e9, False), (_dense(layers=3, hidden=512, seq=256), 0.06e9, True)):
        cluster = _cluster(memory=memory)
        batch = 8
        everything = _brute_force(model, cluster, 8, batch, limits["zero"], limits["microbatch"],
                                  limits["schedules"], limits["virtual"], limits["recompute"], 2, uneven)
        assert everything, "test set-up: some layout must fit"
        unlimited = _brute_force(model, _cluster(memory=1e15), 8, batch, limits["zero"], limits["microbatch"],
                                 limits["schedules"], limits["virtual"], limits["recompute"], 2, uneven)
        assert len(everything) < len(unlimited), "test set-up: the memory limit must rule some layouts out"
        assert not uneven or any(l.uneven for l, _ in everything), "test set-up: some uneven layout must fit"
        kept = [(l, st) for l, st in everything
                if (l.zero == limits["zero"][0] or l.dp * l.cp > 1) and (l.pp > 1 or l.schedule == "1f1b")
                and l.uneven == (model.layers % (l.pp * l.virtual) != 0)]
        kept.sort(key=lambda item: (item[1].total, item[1].memory, item[0].key()))
        for top in (1, 4, len(kept) + 3):
            got = search_layouts(model, cluster, 8, batch, top=top, uneven=uneven, **limits)
            want = kept[:top]
            where = f"perf.search: {model.name}, top={top}"
            if [l for l, _ in got] != [l for l, _ in want]:
                i = next((i for i, (a, b) in enumerate(zip(got, want)) if a[0] != b[0]), min(len(got), len(want)))
                pytest.fail(f"{where}: {len(got)} layouts ranked, the brute force ranks {len(want)}; first difference "
                             f"at place {i + 1}: {[str(l) for l, _ in got[i:i + 3]]}, the brute force "
                             f"{[(str(l), st.total, st.memory) for l, st in want[i:i + 3]]}")
            for (layout, st), (_, ref) in zip(got, want):
                _close(st.total, ref.total, f"{where}: {layout} total")
                assert st.fits, f"{where}: {layout} does not fit ({st.memory:.3g} bytes)"
            best = min(st.total for _, st in everything)
            _close(got[0][1].total, best, f"{where}: the best layout's step vs the minimum over all valid layouts")
    with pytest.raises(ValueError):
        search_layouts(_dense(), _cluster(), 8, 8, top=0)


@task("perf.search", points=2)
def test_search_candidates_are_every_valid_layout():
    """candidate_layouts yields every layout step_time accepts for the limits given, each once,
    and nothing else (besides the search's conventions: one ZeRO stage when dp x cp = 1, "1f1b"
    without a pipeline, uneven=True exactly when pp x v does not divide the layers), on 12 GPUs
    for uneven factors: every tp | heads, cp | seq (max_cp=None), pp and v with and without
    uneven stages, ep | dp and experts; the default schedules (``SEARCHED``) and all of them
    (``SCHEDULES``: ZB-H1, and DualPipe only where pp and m are even)."""
    from labkit.perf import SCHEDULES, Layout, candidate_layouts, step_time
    cluster = _cluster(memory=1e15)
    limits = dict(zero=(0, 3), microbatch=(1, 2), virtual=(2, 3), recompute=("none",), max_cp=None)
    for model, uneven, schedules in ((_dense(layers=6, heads=12, hidden=240, seq=24), False, None),
                                     (_dense(layers=6, heads=12, hidden=240, seq=24), True, SCHEDULES),
                                     (_moe(layers=6, seq=24), False, None), (_moe(layers=6, seq=24), False, SCHEDULES)):
        batch = 12
        chosen = {} if schedules is None else {"schedules": schedules}
        got = list(candidate_layouts(model, 12, batch, uneven=uneven, **limits, **chosen))
        where = f"perf.search: {model.name} layers={model.layers} uneven={uneven} schedules={schedules or 'default'}"
        assert len(got) == len(set(got)), f"{where}: candidate_layouts repeats layouts"
        want = set()
        for dp, tp, pp, cp in itertools.product(range(1, 13), repeat=4):
            if dp * tp * pp * cp != 12:
                continue
            for ep, zero, b, schedule, v, cut in itertools.product(range(1, dp + 1), (0, 3), (1, 2),
                                                              schedules or _SCHEDULES_ALL, (1, 2, 3), (False, True)):
                if (schedule == "interleaved") != (v > 1) or (zero and dp * cp == 1) or (pp == 1 and schedule != "1f1b"):
                    continue
                if cut != (model.layers % (pp * v) != 0) or (cut and not uneven):
                    continue
                layout = Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, microbatch=b, schedule=schedule,
                                virtual=v, uneven=cut)
                try:
                    step_time(model, layout, cluster, batch, gpus=12)
                except ValueError:
                    continue
                want.add(layout)
        missing, extra = want - set(got), set(got) - want
        assert not missing and not extra, \
            f"{where}: candidate_layouts misses {sorted(map(str, missing))[:4]} and adds {sorted(map(str, extra))[:4]}"
    # max_tp, max_cp and max_ep bound their axis, and nothing else
    model = _moe(layers=6, seq=24)
    every = list(candidate_layouts(model, 16, 32, max_cp=None))
    for axis, limit in (("tp", 2), ("cp", 2), ("ep", 2), ("tp", 4)):
        bounded = list(candidate_layouts(model, 16, 32, **{"max_cp": None, f"max_{axis}": limit}))
        want = [layout for layout in every if getattr(layout, axis) <= limit]
        same = bounded == want  # a bool: pytest would diff two lists of thousands of layouts
        assert same, f"perf.search: max_{axis}={limit}: {len(bounded)} candidates, expected {len(want)}"
    # the stack's options reach every layout: Megatron's TP re-gather (the default) or torch's plan
    for flag in (True, False):
        got = list(candidate_layouts(model, 16, 32, max_cp=None, tp_regather=flag))
        want = [replace(layout, tp_regather=flag) for layout in every]
        same = got == want
        assert same, f"perf.search: candidate_layouts(tp_regather={flag}) yields other layouts " \
                     f"({sorted({layout.tp_regather for layout in got})} for tp_regather)"


_SCHEDULES_ALL = ("gpipe", "1f1b", "interleaved")


@task("perf.search", points=2)
def test_search_default_limits_and_the_winner():
    """With its default limits the search agrees with step_time on what it returns, never
    returns a layout that does not fit, returns nothing when nothing fits, and moves TP off a
    slow network: with nodes of 2 GPUs and a slow network its winner keeps tp inside a node,
    with nodes of 8 it may use tp up to 8."""
    from labkit.perf import search_layouts, step_time
    model = _dense(layers=8, hidden=1024, heads=16, seq=512)
    for per_node, network in ((2, (50e-6, 1e8)), (8, (50e-6, 1e8))):
        cluster = _cluster(per_node=per_node, network=network, nvlink=(1e-6, 300e9), memory=4e9)
        got = search_layouts(model, cluster, 16, 64)
        assert len(got) == 5, f"perf.search: {len(got)} layouts returned, expected the default top 5"
        for layout, st in got:
            again = step_time(model, layout, cluster, 64, gpus=16)
            _close(st.total, again.total, f"perf.search: {layout}: its StepTime vs step_time's")
            assert st.fits and layout.gpus == 16 and layout.cp == 1, f"perf.search: {layout} (default max_cp=1)"
        totals = [st.total for _, st in got]
        assert totals == sorted(totals), f"perf.search: not fastest first: {totals}"
        assert per_node == 8 or got[0][0].tp <= per_node, \
            f"perf.search: nodes of {per_node}, slow network, but the winner is {got[0][0]}"
    assert search_layouts(model, _cluster(memory=1e6), 16, 64) == [], "perf.search: nothing fits in 1 MB"
    # max_tp and max_ep cut the candidates, nothing else: the limited ranking is the full one filtered
    for model, limit, axis in ((model, 2, "tp"), (_moe(layers=4), 2, "ep")):
        cluster = _cluster(per_node=2, memory=4e9)
        full = search_layouts(model, cluster, 16, 64, top=10**6)
        limited = search_layouts(model, cluster, 16, 64, top=5, **{f"max_{axis}": limit})
        want = [layout for layout, _ in full if getattr(layout, axis) <= limit][:5]
        assert [layout for layout, _ in limited] == want, \
            f"perf.search: max_{axis}={limit} returned {[str(l) for l, _ in limited]}, expected {[str(l) for l in want]}"
        assert any(getattr(layout, axis) > limit for layout, _ in full), f"test set-up: some layout has {axis} > {limit}"
