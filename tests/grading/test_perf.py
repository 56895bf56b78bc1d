"""Graded tests for chapter 14: performance at scale (labkit/perf.py).

Pure arithmetic, so no launches: every function is called in the test process and checked
against numbers derived independently of its formula.

perf.flops: the FLOPs of a full forward + backward of ``labkit.models.GPT``, counted by
``torch.utils.flop_counter.FlopCounterMode`` with the math attention backend (on CPU the fused
kernel, ``_scaled_dot_product_flash_attention_for_cpu``, has no FLOP formula in torch 2.13 and
counts 0; the math backend runs the scores and the weighted sum as bmm, which is counted, causal
as the full square) equal ``flops_per_token`` EXACTLY, per token, for dense configs (tied and
untied, several widths, heads, lengths, vocabularies, batch > 1) and MoE configs (dropless, top-1
and top-2); with every block under ``torch.utils.checkpoint`` (full) or only the attention core
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
    from labkit.perf import Model, hfu, mfu
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
            # tree (chapter 00: binomial reduce + broadcast; recursive doubling/halving for AG/RS)
            rounds = math.ceil(math.log2(n))
            tree = collective_time("all_reduce", size, n, link, "tree")
            assert math.isclose(tree, 2 * rounds * (alpha + size / bandwidth), rel_tol=1e-12), \
                f"perf.comm: tree all_reduce of {size:g} B on {n}: {tree}, expected 2 x {rounds} rounds of alpha + S/B"
            for op in ("all_gather", "reduce_scatter"):
                got = collective_time(op, size, n, link, "tree")
                expected = rounds * alpha + wire_bytes(op, size, n) / bandwidth
                assert math.isclose(got, expected, rel_tol=1e-12), \
                    f"perf.comm: tree {op} of {size:g} B on {n}: {got}, expected {rounds} alpha + (N-1)/N S/B = {expected}"
    # the crossover of chapter 00: S* = (N-1-L) alpha / ((L - (N-1)/N) beta); the tree wins below it
    for n in (8, 64, 1024):
        L = math.ceil(math.log2(n))
        crossover = (n - 1 - L) * alpha / ((L - (n - 1) / n) / bandwidth)
        ring, tree = (collective_time("all_reduce", crossover, n, link, a) for a in ("ring", "tree"))
        assert math.isclose(ring, tree, rel_tol=1e-9), f"perf.comm: at chapter 00's S* = {crossover:g} B on {n}, ring {ring} != tree {tree}"
        assert collective_time("all_reduce", crossover / 2, n, link, "tree") < collective_time("all_reduce", crossover / 2, n, link), \
            f"perf.comm: below S* on {n} ranks the tree must win"
    # send: one message, whatever the algorithm; one rank: nothing crosses a link
    for algo in ("ring", "tree"):
        assert collective_time("send", 1e6, 2, link, algo) == alpha + 1e6 / bandwidth, f"perf.comm: send ({algo})"
        for op in OPS:
            if (op, algo) != ("all_to_all", "tree"):
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
        assert group_link(size, stride, dgx) == network, \
            f"perf.comm: a group of {size} ranks {stride} apart crosses nodes; with rails each GPU has its own NIC"
        sharers = min(stride, 8)
        assert group_link(size, stride, no_rails) == Link(network.alpha, network.bandwidth / sharers), (
            f"perf.comm: without rails, a group of {size} ranks {stride} apart: {sharers} GPUs of a node cross at once "
            f"through its one NIC; got {group_link(size, stride, no_rails)}")
    # group_time is collective_time over that link, for every op
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send"):
        for size, stride, cluster, link in ((8, 1, dgx, nvlink), (4, 8, dgx, network),
                                            (4, 8, no_rails, Link(network.alpha, network.bandwidth / 8)),
                                            (16, 1, no_rails, network)):
            got = group_time(op, 1e8, size, stride, cluster)
            assert got == collective_time(op, 1e8, size, link), \
                f"perf.comm: group_time({op}, size {size}, stride {stride}, rails={cluster.rails}) {got} != collective_time on {link}"
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


# ============================================================ perf.step, perf.search (appended below)
