"""``labkit bench`` rows of chapter 12 (recompute): your activation checkpointing vs
``torch.utils.checkpoint`` (non-reentrant), step time and the activation bytes kept."""

from __future__ import annotations

import torch

from labkit.course.bench.runner import BenchRow, row
from labkit.launch import launch
from labkit.memory import PeakMemory
from labkit.models import GPTConfig
from labkit.oracles import builtin_checkpoint
from labkit.timing import interleaved_medians

RECOMPUTE_BENCH = dict(layers=4, hidden=128, heads=4, seq=256, batch=4, dropout=0.1)


def _saved_bytes(model, x, y) -> int:
    """Bytes autograd keeps for backward during one forward (each storage once, parameters left out)."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage._cdata not in params:
            storages[storage._cdata] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, y)[1]
    loss.backward()
    return sum(storages.values())


def _peak_bytes(model, x, y) -> int:
    """Peak of live tensor bytes during forward + backward (labkit.memory; on CUDA the allocator's)."""
    model.zero_grad(set_to_none=True)
    with PeakMemory(model, x, y) as peak:
        model(x, y)[1].backward()
    model.zero_grad(set_to_none=True)
    return peak.peak_bytes


def _ours_vs_torch(repeats: int) -> dict:
    from labkit.recompute import block_saved_bytes, checkpoint_every, memory_gpt
    b = RECOMPUTE_BENCH
    config = GPTConfig(vocab_size=64, block_size=b["seq"], n_layer=b["layers"], n_head=b["heads"], n_embd=b["hidden"])
    ours, theirs = memory_gpt(config, b["dropout"]), memory_gpt(config, b["dropout"])
    checkpoint_every(ours, 1)
    for i, block in enumerate(theirs.blocks):
        theirs.blocks[i] = builtin_checkpoint(block)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 64, (b["batch"], b["seq"] + 1), generator=gen)
    x, y = idx[:, :-1], idx[:, 1:]

    def step(model):
        def run(_):
            model(x, y)[1].backward()
        return run

    medians = interleaved_medians({"ours": step(ours), "builtin": step(theirs)}, lambda: None, repeats, warmup=1)
    plain = memory_gpt(config, b["dropout"])
    s, h, a, L = b["seq"], b["hidden"], b["heads"], b["layers"]
    return dict(medians, ours_bytes=_saved_bytes(ours, x, y), none_bytes=_saved_bytes(plain, x, y),
                peak_ours=_peak_bytes(ours, x, y), peak_torch=_peak_bytes(theirs, x, y), peak_none=_peak_bytes(plain, x, y),
                blocks_full=L * block_saved_bytes(s, b["batch"], h, a, "full"),
                blocks_none=L * block_saved_bytes(s, b["batch"], h, a, "none"))


@row("recompute_checkpoint")
def recompute_checkpoint_row(repeats: int = 5, world_size: int = 1) -> BenchRow:
    """activation checkpointing of every block (chapter 12) vs torch.utils.checkpoint (non-reentrant)"""
    r = launch(_ours_vs_torch, world_size, repeats, timeout=600)[0]
    b = RECOMPUTE_BENCH
    # bytes columns: activation bytes your checkpointed GPT keeps for backward (saved-tensor hooks) vs the
    # formula: 4 s b h per block plus what lies outside the blocks (embedding, ln_f, head, loss: measured with
    # no checkpointing minus the blocks' formula). torch's checkpoint hides its saved tensors from outer hooks,
    # so the two are compared by the peak of a step (extra columns).
    outside = r["none_bytes"] - r["blocks_none"]
    return BenchRow(f"checkpoint every block, GPT L={b['layers']} h={b['hidden']} a={b['heads']} s={b['seq']} "
                    f"b={b['batch']}, dropout {b['dropout']}: yours vs torch.utils.checkpoint",
                    r["ours"], r["builtin"], r["ours_bytes"],
                    r["blocks_full"] + outside,
                    extra=dict(no_checkpoint_bytes=r["none_bytes"], blocks_formula_none=r["blocks_none"],
                               peak_step_bytes_ours=r["peak_ours"], peak_step_bytes_torch=r["peak_torch"],
                               peak_step_bytes_none=r["peak_none"]))
