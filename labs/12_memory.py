"""Lab 12 as a script: your recomputation, offloading and accumulation against PyTorch and the formulas, on N ranks.

    torchrun --standalone --nproc-per-node 2 labs/12_memory.py
    python labs/12_memory.py --world-size 2        # labkit.launch starts the ranks

On every rank, in float64 with dropout 0.2 (``labkit/recompute.py``), a 4-layer course GPT
written out op by op (``MemoryBlock``):

* 3 AdamW steps with your checkpointing of every 2nd block against torch.utils.checkpoint
  (non-reentrant) and against no checkpointing: the loss at each step and every gradient;
* the bytes autograd keeps per block, none / selective / full, against the chapter's formula
  s b (72 h + 12 a s + 16), s b (72 h + 16) and 4 s b h (fp32 on CPU; doubled in float64);
* your offload pool: the bytes on the host after forward (= the saved bytes of every layer)
  and the losses and gradients equal to the step without it;
* your offloaded AdamW on a bf16 GPT: fp32 masters after each step equal torch.optim.AdamW's on
  fp32 copies, 12 bytes per parameter on the host, 4 over the link per step;
* gradient accumulation over 3 micro-batches: the gradients of the whole global batch, and
  one all-reduce per parameter, after the last micro-batch only;
* Chen's segments (your checkpoint_segments) on 16 blocks that each save their input: the peak of
  saved bytes over forward and backward, measured, at every segment length k, against
  max(ceil(L/k), j + k_j) inputs, least at k = sqrt(16) = 4;
* time per step, yours vs torch.utils.checkpoint vs none, at three sequence lengths.

Rank 0 prints; the exit status is 1 if a check fails or a task is not implemented yet.
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.distributed as dist

from labkit.check import mismatch
from labkit.comm import CommTracer
from labkit.course.labscript import lab_arguments, report_checks, run_lab
from labkit.models import GPT, GPTConfig
from labkit.oracles import builtin_checkpoint

DROPOUT, STEPS, MICRO = 0.2, 3, 3
CONFIG = GPTConfig(vocab_size=32, block_size=16, n_layer=4, n_head=2, n_embd=16)
TASKS = ("recompute.checkpoint", "recompute.segments", "recompute.selective", "recompute.offload", "recompute.optimizer_offload",
         "recompute.accumulate")


def batch(rank: int, step: int, size: int = 2, seq: int = 16, vocab: int = 32):
    idx = torch.randint(0, vocab, (size, seq + 1), generator=torch.Generator().manual_seed(100 * rank + step))
    return idx[:, :-1], idx[:, 1:]


def training(model, rank, forward=None):
    """(losses, gradients after each step) of STEPS AdamW steps, the RNG seeded per step."""
    forward = forward or (lambda m, x, y: m(x, y)[1])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for step in range(STEPS):
        x, y = batch(rank, step)
        torch.manual_seed(step)
        loss = forward(model, x, y)
        opt.zero_grad()
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return losses, grads


def same(a, b) -> bool:
    return all(mismatch(x, y) is None for x, y in zip(a[0], b[0])) and all(
        mismatch(g, r) is None for gs, rs in zip(a[1], b[1]) for g, r in zip(gs, rs))


def check_recompute() -> dict:
    from labkit.recompute import (OffloadPool, SavedTensors, block_saved_bytes, checkpoint_every, memory_gpt,
                                  offloaded_forward)
    rank = dist.get_rank()
    make = lambda **kw: memory_gpt(CONFIG, DROPOUT, seed=rank, **kw).double()
    plain = training(make(), rank)
    ours = make()
    wrapped = checkpoint_every(ours, 2)
    theirs = make()
    for i in wrapped:
        theirs.blocks[i] = builtin_checkpoint(theirs.blocks[i])
    ours_run = training(ours, rank)
    result = dict(ours_vs_none=same(ours_run, plain), ours_vs_torch=same(ours_run, training(theirs, rank)),
                  selective_vs_none=same(training(make(selective=True), rank), plain))
    # bytes per block, each mode, against the formula (float64: twice the fp32 bytes)
    s, b, h, a = CONFIG.block_size, 2, CONFIG.n_embd, CONFIG.n_head
    rows = []
    for mode in ("none", "selective", "full"):
        model = make(selective=mode == "selective")
        if mode == "full":
            checkpoint_every(model, 1)
        x = torch.randn(b, s, h, dtype=torch.float64, requires_grad=True)
        with SavedTensors(model) as saved:
            model.blocks[0](x)
        rows.append((mode, saved.bytes, 2 * block_saved_bytes(s, b, h, a, mode)))
    result["bytes"] = rows
    # offload
    pool_bytes = []

    def offloaded(model, x, y):
        pool = OffloadPool(model)
        loss = offloaded_forward(model, pool, x, y)[1]
        pool_bytes.append(pool.host_bytes)
        return loss
    result["offload_same"] = same(training(make(), rank, offloaded), plain)
    result["offload_bytes"] = (pool_bytes[0], CONFIG.n_layer * 2 * block_saved_bytes(s, b, h, a, "none"))
    return result


def check_optimizer_offload() -> dict:
    from labkit.recompute import OffloadedAdamW
    rank = dist.get_rank()
    model = GPT(CONFIG, seed=rank).to(torch.bfloat16)
    params = list(model.parameters())
    psi = sum(p.numel() for p in params)
    opt = OffloadedAdamW(params, lr=1e-2)
    ref = [p.detach().float().clone().requires_grad_(True) for p in params]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2)
    masters_ok = True
    for step in range(STEPS):
        opt.zero_grad()
        model(*batch(rank, step))[1].backward()
        for w, p in zip(ref, params):
            w.grad = p.grad.float()
        opt.step()
        ref_opt.step()
        masters_ok &= all(mismatch(w, r.detach()) is None for w, r in zip(opt.master, ref))
    host = sum(t.nbytes for t in opt.master + opt.exp_avg + opt.exp_avg_sq)
    device = sum(p.nbytes for p in params)
    return dict(masters_ok=masters_ok, host=host, device=device, psi=psi, moved=opt.moved_bytes)


def check_against_fsdp_offload() -> dict:
    """Your OffloadedAdamW on a float64 GPT, gradients averaged over the ranks, against FSDP2
    with CPUOffloadPolicy (torch's optimizer step on the host) on the same data: the loss of
    every rank at every step. (On a CPU the "host" is the device: this checks the update, not
    the placement.)"""
    from labkit.oracles import builtin_fully_shard, cpu_offload_policy
    from labkit.recompute import OffloadedAdamW
    rank, n = dist.get_rank(), dist.get_world_size()
    ours = GPT(CONFIG, seed=0).double()
    theirs = builtin_fully_shard(GPT(CONFIG, seed=0).double(), offload_policy=cpu_offload_policy())
    opt, torch_opt = OffloadedAdamW(list(ours.parameters()), lr=1e-2), torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = ours(x, y)[1]
        loss.backward()
        for p in ours.parameters():   # the data-parallel average that FSDP2 does by reduce-scatter
            dist.all_reduce(p.grad)
            p.grad /= n
        opt.step()
        torch_opt.zero_grad()
        torch_loss = theirs(x, y)[1]
        torch_loss.backward()
        torch_opt.step()
        losses.append((loss.item(), torch_loss.item()))
    return dict(losses=losses, same=all(mismatch(torch.tensor(a), torch.tensor(b)) is None for a, b in losses))


def check_accumulate() -> dict:
    from labkit.recompute import accumulate
    rank, n = dist.get_rank(), dist.get_world_size()
    model, ref = GPT(CONFIG, seed=3).double(), GPT(CONFIG, seed=3).double()
    micro = {r: [batch(r, 50 + j) for j in range(MICRO)] for r in range(n)}
    before = []

    def loss_fn(m, x, y):
        before.append(len(tracer.events))
        return m(x, y)[1]
    with CommTracer() as tracer:
        accumulate(model, micro[rank], loss_fn)
    (sum(ref(x, y)[1] for r in range(n) for x, y in micro[r]) / (n * MICRO)).backward()
    grads_ok = all(mismatch(p.grad, q.grad) is None for p, q in zip(model.parameters(), ref.parameters()))
    params = len(list(model.parameters()))
    want = params if n > 1 else 0
    return dict(grads_ok=grads_ok, quiet_before_last=before == [0] * MICRO,
                all_reduces=tracer.count("all_reduce"), want_all_reduces=want, other_ops=len(tracer.events) - tracer.count("all_reduce"))


class Scale(torch.nn.Module):
    """x * w: a block that saves exactly its input (Chen's layers: activation = input)."""

    def __init__(self, h: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, h, dtype=torch.float64))

    def forward(self, x):
        return x * self.w


class Stack(torch.nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def segment_peaks(layers: int = 16, h: int = 64) -> list:
    """(k, measured peak in inputs, formula in inputs) for segments of k = 1..layers blocks."""
    from labkit.memory import SavedPeak
    from labkit.recompute import checkpoint_segments
    rows, given = [], 2 * h * 8
    for k in range(1, layers + 1):
        stack = Stack([Scale(h) for _ in range(layers)])
        checkpoint_segments(stack, k)
        peak = SavedPeak(stack)
        with peak.hooks():
            stack(torch.randn(2, h, dtype=torch.float64, requires_grad=True)).sum().backward()
        runs = [min(k, layers - i) for i in range(0, layers, k)]
        rows.append((k, peak.peak / given, max(len(runs), max(j + n for j, n in enumerate(runs)))))
    return rows


def timings() -> list:
    from labkit.recompute import checkpoint_every, memory_gpt
    rows = []
    for seq in (64, 128, 256):
        config = GPTConfig(vocab_size=32, block_size=seq, n_layer=4, n_head=4, n_embd=64)
        models = {"none": memory_gpt(config, 0.1), "yours": memory_gpt(config, 0.1), "torch": memory_gpt(config, 0.1)}
        checkpoint_every(models["yours"], 1)
        for i, block in enumerate(models["torch"].blocks):
            models["torch"].blocks[i] = builtin_checkpoint(block)
        x, y = batch(0, 0, 4, seq)
        seconds = {name: [] for name in models}
        for _ in range(3):
            for name, model in models.items():
                start = time.perf_counter()
                model(x, y)[1].backward()
                seconds[name].append(time.perf_counter() - start)
        rows.append((seq, {name: sorted(t)[1] for name, t in seconds.items()}))
    return rows


def main() -> dict:
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    result = dict(backend=dist.get_backend())
    try:
        result["recompute"] = check_recompute()
        result["optimizer"] = check_optimizer_offload()
        result["fsdp_offload"] = check_against_fsdp_offload()
        result["accumulate"] = check_accumulate()
        result["segments"] = segment_peaks()
        result["timings"] = timings() if dist.get_rank() == 0 else []
    except NotImplementedError as exc:  # a stub raises on every rank alike
        result["missing"] = str(exc)
    return result


def report(results: list[dict]) -> bool:
    n = len(results)
    print(f"Lab 12: memory on {n} rank(s), backend {results[0]['backend']}")
    print(f"float64, dropout {DROPOUT}, GPT L={CONFIG.n_layer} h={CONFIG.n_embd} a={CONFIG.n_head} s={CONFIG.block_size}\n")
    if "missing" in results[0]:
        print(f"{', '.join(TASKS)}: not implemented yet: {results[0]['missing']}")
        return False
    first = results[0]["recompute"]
    print("bytes one block keeps for backward (b=2), measured vs formula (float64):")
    for mode, got, want in first["bytes"]:
        print(f"  {mode:9s} {got:9,d}  formula {want:9,d}")
    print(f"offload: {first['offload_bytes'][0]:,} B on the host after forward, formula "
          f"{first['offload_bytes'][1]:,} B (L x the per-block bytes)")
    o = results[0]["optimizer"]
    print(f"optimizer offload (bf16 GPT, {o['psi']:,} parameters): host {o['host']:,} B (12 per parameter), "
          f"device parameters {o['device']:,} B (2 per parameter), {o['moved']:,} B over the link in {STEPS} steps")
    print("optimizer offload vs FSDP2 + CPUOffloadPolicy (float64, rank 0's loss per step): "
          + ", ".join(f"{a:.6f}/{b:.6f}" for a, b in results[0]["fsdp_offload"]["losses"]))
    acc = results[0]["accumulate"]
    print(f"accumulation over {MICRO} micro-batches: {acc['all_reduces']} all-reduces after the last one "
          f"({acc['want_all_reduces']} expected: one per parameter)")
    seg = results[0]["segments"]
    print("Chen's segments, 16 blocks that save their input: peak of saved bytes in inputs, measured / formula:")
    print("  " + "  ".join(f"k={k}: {got:g}/{want}" for k, got, want in seg))
    print("\ntime per forward+backward (rank 0, L=4 h=64 a=4 b=4, dropout 0.1), ms:")
    print("   seq    none   yours   torch  yours/torch")
    for seq, t in results[0]["timings"]:
        print(f"  {seq:4d}  {t['none'] * 1e3:6.1f}  {t['yours'] * 1e3:6.1f}  {t['torch'] * 1e3:6.1f}  {t['yours'] / t['torch']:6.2f}")
    checks = {
        "checkpointing: losses and gradients = no checkpointing (3 steps, dropout on)": all(r["recompute"]["ours_vs_none"] for r in results),
        "checkpointing: = torch.utils.checkpoint": all(r["recompute"]["ours_vs_torch"] for r in results),
        "selective recomputation: = keeping attention": all(r["recompute"]["selective_vs_none"] for r in results),
        "bytes per block = formula (none, selective, full)": all(g == w for r in results for _, g, w in r["recompute"]["bytes"]),
        "offloading: losses and gradients = without it": all(r["recompute"]["offload_same"] for r in results),
        "offloading: host bytes = formula": all(r["recompute"]["offload_bytes"][0] == r["recompute"]["offload_bytes"][1] for r in results),
        "optimizer offload: fp32 masters = torch.optim.AdamW's": all(r["optimizer"]["masters_ok"] for r in results),
        "optimizer offload: 12 B/parameter on the host, 4 B/parameter per step over the link": all(
            r["optimizer"]["host"] == 12 * r["optimizer"]["psi"] and r["optimizer"]["moved"] == 4 * STEPS * r["optimizer"]["psi"]
            for r in results),
        "optimizer offload: losses = FSDP2 with CPUOffloadPolicy at every step, every rank": all(
            r["fsdp_offload"]["same"] for r in results),
        "segments: measured peak = max(ceil(L/k), j + k_j) inputs at every k": all(
            got == want for r in results for _, got, want in r["segments"]),
        "segments: the least peak at k = sqrt(16) = 4": all(
            min(r["segments"], key=lambda row: row[1])[1] == r["segments"][3][1] for r in results),
        "accumulation: gradients of the global batch": all(r["accumulate"]["grads_ok"] for r in results),
        "accumulation: nothing communicated before the last micro-batch": all(r["accumulate"]["quiet_before_last"] for r in results),
        "accumulation: one all-reduce per parameter, nothing else": all(
            r["accumulate"]["all_reduces"] == r["accumulate"]["want_all_reduces"] and not r["accumulate"]["other_ops"] for r in results),
    }
    return report_checks(checks)


if __name__ == "__main__":
    parser = lab_arguments(__doc__)
    run_lab(main, report, parser.parse_args())
