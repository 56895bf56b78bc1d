"""Tests for labkit.budget: the memory formulas against what labkit.memory and autograd's
saved-tensor hooks measure on a tiny course GPT, to the byte."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from labkit import budget
from labkit.memory import SavedBytes, memory_report
from labkit.models import GPT, Block, GPTConfig
from labkit.oracles import builtin_checkpoint


class ExplicitBlock(Block):
    """labkit.models.Block with attention written out, dropout after softmax and each branch (chapter 12)."""

    def __init__(self, config, p=0.1):
        super().__init__(config)
        self.p, self.heads = p, config.n_head

    def core(self, q, k, v):
        T = q.shape[-2]
        causal = torch.full((T, T), float("-inf")).triu(1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + causal
        return F.dropout(scores.softmax(-1), self.p) @ v

    def forward(self, x, selective=False):
        B, T, C = x.shape
        q, k, v = (t.reshape(B, T, self.heads, -1).transpose(1, 2)
                   for t in self.attn.c_attn(self.ln_1(x)).split(C, dim=-1))
        y = builtin_checkpoint(self.core)(q, k, v) if selective else self.core(q, k, v)
        x = x + F.dropout(self.attn.c_proj(y.transpose(1, 2).reshape(B, T, C)), self.p)
        return x + F.dropout(self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x)))), self.p)


SHAPES = [(16, 2, 32, 2), (32, 1, 64, 4), (64, 2, 32, 4)]      # (s, b, h, a)


def saved(block, x, **kwargs) -> int:
    with SavedBytes(block) as sv:
        block(x, **kwargs)
    return sv.bytes


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_model_states_match_memory_report_on_one_rank(zero):
    # one rank (shards = 1): every ZeRO stage leaves the whole states; fp32 AdamW, 4 + 4 + 8 bytes
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16))
    opt = torch.optim.AdamW(gpt.parameters(), lr=1e-3)
    idx = torch.randint(0, 32, (2, 8))
    gpt(idx, idx)[1].backward()
    opt.step()
    report = memory_report(gpt, opt)
    psi = sum(p.numel() for p in gpt.parameters())
    tensors = len(list(gpt.parameters()))
    want = budget.model_state_bytes(psi, budget.adamw_bytes(4), zero, shards=1)
    assert (report.params, report.grads, report.optimizer_state) == \
        (want["params"], want["grads"], want["optimizer"] + 4 * tensors)      # + AdamW's per-tensor step


def test_model_states_shard_by_zero_stage():
    psi, d = 1000, 8
    full = budget.model_state_bytes(psi, budget.adamw_bytes(2))
    assert full == dict(params=2000, grads=2000, optimizer=12000)
    for zero, sharded in ((1, {"optimizer"}), (2, {"optimizer", "grads"}), (3, {"optimizer", "grads", "params"})):
        got = budget.model_state_bytes(psi, budget.adamw_bytes(2), zero, shards=d)
        assert got == {k: v / d if k in sharded else v for k, v in full.items()}


def test_adamw_bytes():
    assert budget.adamw_bytes(2) == (2, 2, 12)        # bf16 + fp32 master and moments: 16 per parameter
    assert budget.adamw_bytes(4) == (4, 4, 8)
    assert budget.adamw_bytes(8, 8) == (8, 8, 16)


def test_bad_input_refused():
    with pytest.raises(ValueError, match="ZeRO stage"):
        budget.model_state_bytes(10, zero=4)
    with pytest.raises(ValueError, match="shards"):
        budget.model_state_bytes(10, zero=1, shards=0)
    with pytest.raises(ValueError, match="recompute"):
        budget.explicit_activation_bytes(2, 16, 1, 32, 2, recompute="some")


@pytest.mark.parametrize("s,b,h,a", SHAPES)
def test_fused_block_saves_its_formula(s, b, h, a):
    x = torch.randn(b, s, h, requires_grad=True)
    assert saved(Block(GPTConfig(block_size=s, n_head=a, n_embd=h)), x) == budget.fused_layer_bytes(s, b, h, a)


@pytest.mark.parametrize("s,b,h,a", SHAPES)
def test_explicit_block_saves_its_formula(s, b, h, a):
    # fp32 on a CPU: e = 4, and dropout keeps a 4-byte mask (m = 4)
    x = torch.randn(b, s, h, requires_grad=True)
    block = ExplicitBlock(GPTConfig(block_size=s, n_head=a, n_embd=h))
    assert saved(block, x) == budget.explicit_layer_bytes(s, b, h, a, element_bytes=4, mask_bytes=4)
    assert saved(block, x, selective=True) == budget.explicit_layer_bytes(s, b, h, a, 4, 4, selective=True)


@pytest.mark.parametrize("layers", [1, 3])
def test_activations_by_recompute_mode(layers):
    s, b, h, a = 16, 2, 32, 2
    blocks = [ExplicitBlock(GPTConfig(block_size=s, n_head=a, n_embd=h)) for _ in range(layers)]
    x = torch.randn(b, s, h, requires_grad=True)
    per_layer = {sel: saved(blocks[0], x, selective=sel) for sel in (False, True)}
    with SavedBytes(torch.nn.ModuleList(blocks)) as sv:       # full: each block keeps only its input
        y = x
        for block in blocks:
            y = builtin_checkpoint(block)(y)
    def formula(mode):
        return budget.explicit_activation_bytes(layers, s, b, h, a, element_bytes=4, mask_bytes=4, recompute=mode)
    assert formula("none") == layers * per_layer[False]
    assert formula("selective") == layers * per_layer[True]
    assert formula("full") == sv.bytes + per_layer[False]      # the inputs + one layer while it recomputes


def test_korthikanti_is_the_explicit_block_in_16_bits():
    # Korthikanti et al.'s sbh(34 + 5as/h): the explicit block at e = 2, m = 1, without the 16sb of statistics
    for s, b, h, a in SHAPES + [(4096, 1, 4096, 32)]:
        assert budget.korthikanti_layer_bytes(s, h, a, micro=b) == budget.explicit_layer_bytes(s, b, h, a, 2, 1) - 16 * s * b
        assert budget.korthikanti_layer_bytes(s, h, a, micro=b, flash=True) == 34 * s * b * h
        full = budget.korthikanti_activation_bytes(3, s, h, a, micro=b, full=True)
        assert full == 3 * 2 * s * b * h + budget.korthikanti_layer_bytes(s, h, a, micro=b)


def test_korthikanti_divides_by_tp_and_cp():
    s, h, a = 4096, 8192, 64
    whole = budget.korthikanti_layer_bytes(s, h, a)
    assert budget.korthikanti_layer_bytes(s, h, a, tp=8) == pytest.approx(whole / 8)
    # cp keeps s/cp queries, still scored against all s keys: the 34 term and the scores both shrink by cp
    assert budget.korthikanti_layer_bytes(s, h, a, cp=4) == pytest.approx(whole / 4)
    assert budget.korthikanti_activation_bytes(10, s, h, a, held=3) == pytest.approx(30 * whole)
