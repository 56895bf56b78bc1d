"""Lab 01 as a script: your data-parallel pieces on N real ranks, against one process.

    torchrun --standalone --nproc-per-node 4 labs/01_dp.py
    python labs/01_dp.py --world-size 4        # labkit.launch starts the ranks

Checks, on every rank: ``shard_indices`` against ``DistributedSampler``; a GPT trained for a
few steps with ``ShardSampler`` + ``average_gradients`` against one process on the global
batch; and, with gloo, the parameter server at staleness 0 against the same single process.
Then it times one training step with ``average_gradients`` next to
``DistributedDataParallel``. Rank 0 prints; the exit status is 1 if a check fails.

The backend follows ``labkit.launch``'s "auto": NCCL with one GPU per rank (the model on
``cuda:LOCAL_RANK``), gloo on CPU otherwise. The parameter server needs gloo (it receives
from any source), so under NCCL it is skipped.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from labkit.data import markov_tokens
from labkit.dp import ShardSampler, average_gradients, run_parameter_server, shard_indices
from labkit.course.labscript import lab_arguments, run_lab
from labkit.models import GPT, GPTConfig
from labkit.oracles import builtin_ddp

CONFIG = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32)
GLOBAL_BATCH, STEPS = 48, 8  # 48 splits evenly over 1, 2, 3, 4, 6, 8, 12 and 16 ranks
TOLERANCE = 1e-4  # float32 parameters after a few AdamW steps, summed in another order


def rank_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


def attempt(fn, *args):
    try:
        return fn(*args), None
    except NotImplementedError as exc:
        return None, f"not implemented: {exc}"


def check_sampler() -> bool:
    n, rank = dist.get_world_size(), dist.get_rank()
    for length in (0, 1, 7, 10, 33):
        for drop_last in (False, True):
            for epoch in (0, 3):
                builtin = DistributedSampler(range(length), n, rank, True, 0, drop_last)
                builtin.set_epoch(epoch)
                if shard_indices(length, n, rank, True, 0, epoch, drop_last) != list(builtin):
                    return False
    return True


def train(device, data, reference: bool):
    """AdamW on the global batch: here, or on this rank's shard with average_gradients."""
    n = 1 if reference else dist.get_world_size()
    model = GPT(CONFIG, seed=0).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sampler = (DistributedSampler(data, 1, 0, shuffle=True, seed=0) if reference
               else ShardSampler(data, shuffle=True, seed=0))
    losses = []
    for x, y in DataLoader(data, batch_size=GLOBAL_BATCH // n, sampler=sampler):
        opt.zero_grad(set_to_none=True)
        loss = model(x.to(device), y.to(device))[1]
        loss.backward()
        if not reference:
            average_gradients(model)
        opt.step()
        losses.append(loss.item())
    return flat(model)


def parameter_server(data):
    batches = [(data.tensors[0][i:i + GLOBAL_BATCH], data.tensors[1][i:i + GLOBAL_BATCH])
               for i in range(0, STEPS * GLOBAL_BATCH, GLOBAL_BATCH)]
    model = GPT(CONFIG, seed=0)
    run_parameter_server(model, torch.optim.AdamW(model.parameters(), lr=3e-3),
                         lambda m, x, y: m(x, y)[1], batches, staleness=0)
    ref = GPT(CONFIG, seed=0)
    opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        ref(x, y)[1].backward()
        opt.step()
    return (flat(model) - flat(ref)).abs().max().item()


def time_steps(device, data, repeats: int) -> dict:
    """Median time of one step (forward, backward, gradient sync), interleaved with DDP."""
    ours = GPT(CONFIG, seed=0).to(device)
    ddp = builtin_ddp(GPT(CONFIG, seed=0).to(device))
    n, rank = dist.get_world_size(), dist.get_rank()
    x, y = (t[:GLOBAL_BATCH].tensor_split(n)[rank].to(device) for t in data.tensors)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step(model, manual):
        model.zero_grad(set_to_none=True)
        model(x, y)[1].backward()
        if manual:
            average_gradients(model)

    times = {"average_gradients": [], "DDP": []}
    for rep in range(repeats + 1):
        for name in (("average_gradients", "DDP") if rep % 2 == 0 else ("DDP", "average_gradients")):
            sync()
            dist.barrier()
            start = time.perf_counter()
            step(ours, True) if name == "average_gradients" else step(ddp, False)
            sync()
            slowest = torch.tensor([time.perf_counter() - start], device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if rep:  # the first round warms up
                times[name].append(slowest.item())
    return {name: statistics.median(t) for name, t in times.items()}


def main(repeats: int) -> dict:
    if GLOBAL_BATCH % dist.get_world_size():
        raise ValueError(f"the global batch of {GLOBAL_BATCH} does not split evenly over {dist.get_world_size()} ranks")
    device = rank_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    data = TensorDataset(*markov_tokens(STEPS * GLOBAL_BATCH, CONFIG.block_size, CONFIG.vocab_size, seed=0))
    out = dict(backend=dist.get_backend(), device=str(device))
    out["sampler"], out["sampler_note"] = attempt(check_sampler)
    params, out["train_note"] = attempt(train, device, data, False)
    if params is not None:
        out["train_gap"] = (params - train(device, data, True)).abs().max().item()
        out["timing"] = time_steps(device, data, repeats)
    if dist.get_backend() == "gloo" and dist.get_world_size() > 1:
        out["ps_gap"], out["ps_note"] = attempt(parameter_server, data)
    return out


def report(results: list[dict]) -> bool:
    n, first = len(results), results[0]
    print(f"Lab 01: data parallelism on {n} rank(s), backend {first['backend']}, rank 0 on {first['device']}\n")
    ok = True

    def verdict(name, note, good):
        nonlocal ok
        ok &= bool(good) and not note
        print(f"  {name:<58} {note or ('ok' if good else 'WRONG')}")

    verdict("shard_indices == DistributedSampler, every rank",
            first["sampler_note"], all(r["sampler"] for r in results))
    gap = max((r.get("train_gap", float("inf")) for r in results))
    verdict(f"GPT, {STEPS} AdamW steps, every rank vs one process (< {TOLERANCE:g})",
            first["train_note"], gap < TOLERANCE)
    if "ps_gap" in first:
        verdict(f"parameter server, staleness 0, vs one process (< {TOLERANCE:g})",
                first["ps_note"], first["ps_gap"] is not None and first["ps_gap"] < TOLERANCE)
    else:
        print("  parameter server: skipped (needs gloo and at least 2 ranks)")
    if "timing" in first:
        t = first["timing"]
        print(f"\none step, batch {GLOBAL_BATCH // n} per rank (median, slowest rank): average_gradients "
              f"{t['average_gradients'] * 1e3:.2f} ms, DDP {t['DDP'] * 1e3:.2f} ms, "
              f"ratio {t['average_gradients'] / t['DDP']:.2f}")
    return ok


if __name__ == "__main__":
    parser = lab_arguments(__doc__)
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per side")
    args = parser.parse_args()
    run_lab(main, report, args, args.repeats)
