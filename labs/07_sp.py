"""Lab 07 as a script: your sequence parallelism against the unsharded block and full attention, on N ranks.

    torchrun --standalone --nproc-per-node 4 labs/07_sp.py
    python labs/07_sp.py --world-size 4        # labkit.launch starts the ranks

On every rank, in float64 (``labkit/sp.py``):

* your Megatron-SP block (``sequence_parallel_block`` on this rank's T/N tokens, then
  ``reduce_layernorm_grads``) against the unsharded ``Block``: the output and input gradient of this
  rank's tokens, the LayerNorm and row-bias gradients, the column and row weight gradients gathered
  from every rank; its all-gathers and reduce-scatters traced against TP's bytes, 8(N-1)/N BTH b;
* your ring attention — non-causal and causal with contiguous rows, causal with zig-zag rows —
  against ``scaled_dot_product_attention`` over the whole sequence: output and dQ, dK, dV of this
  rank's rows; the bytes sent, (N-1)(2S + P) forward and (N-1)(4S + P) + 2S backward;
* your zig-zag split (``zigzag_positions``, ``zigzag_shard``, ``zigzag_unshard``) against its
  definition, with the causal work per rank it gives;
* your Ulysses attention, causal and not, against the same SDPA; 4 all-to-alls of one shard each way,
  8(N-1)/N S bytes.

Rank 0 prints; the exit status is 1 if a check fails or a task is not implemented yet. The backend
follows ``labkit.launch``'s "auto": NCCL with one GPU per rank (tensors on ``cuda:LOCAL_RANK``),
gloo on CPU otherwise; ``--backend`` overrides it.
"""

from __future__ import annotations

import math
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.check import mismatch
from labkit.comm import CommTracer
from labkit.course.labscript import lab_arguments, run_lab
from labkit.models import GPT, GPTConfig

B, HEADS, D = 2, 48, 4        # attention [B, HEADS, T, D]; 48 heads split over 1-4, 6, 8, 12, 16 ranks (Ulysses)
ROWS = 8                      # tokens per rank: T = 8 N, 2N zig-zag chunks of 4
BLOCK = GPTConfig(vocab_size=32, block_size=64, n_layer=1, n_head=48, n_embd=96)   # T = 4 N <= 64
TOKENS_PER_RANK = 4           # Megatron-SP block: T = 4 N
TASKS = ("sp.megatron", "sp.ring_attention", "sp.zigzag", "sp.ulysses")


# ----------------------------------------------------------------------------- on every rank


def rank_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def seeded(*shape, seed, device):
    """The same values on every rank (drawn on the CPU from a seeded generator)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(device)


def gap(actual, expected) -> tuple[float, bool]:
    """(max |difference|, within labkit.check's float64 tolerance?)"""
    if not isinstance(actual, torch.Tensor) or actual.shape != expected.shape:
        return float("inf"), False
    return (actual.detach() - expected.detach()).abs().max().item(), mismatch(actual, expected) is None


def zigzag_rows(T: int, rank: int, n: int) -> list[int]:
    """The zig-zag positions, written here independently of your sp.zigzag."""
    c = T // (2 * n)
    return list(range(rank * c, (rank + 1) * c)) + list(range((2 * n - 1 - rank) * c, (2 * n - rank) * c))


def full_attention(T, causal, device, seed=0):
    q, k, v = (seeded(B, HEADS, T, D, seed=seed + i, device=device).requires_grad_() for i in range(3))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    upstream = seeded(B, HEADS, T, D, seed=seed + 9, device=device)
    out.backward(upstream)
    return q, k, v, out.detach(), upstream


def check_megatron(device) -> dict:
    from labkit.sp import reduce_layernorm_grads, sequence_parallel_block, split_sequence
    from labkit.tp import unshard
    n, rank = dist.get_world_size(), dist.get_rank()
    T, H = TOKENS_PER_RANK * n, BLOCK.n_embd
    x_full, upstream = seeded(B, T, H, seed=1, device=device), seeded(B, T, H, seed=2, device=device)
    reference = GPT(BLOCK).double().to(device).blocks[0]
    x_ref = x_full.clone().requires_grad_()
    out_ref = reference(x_ref)
    out_ref.backward(upstream)
    rows = slice(rank * T // n, (rank + 1) * T // n)
    block = sequence_parallel_block(GPT(BLOCK).double().to(device).blocks[0])
    x = split_sequence(x_full).requires_grad_()
    with CommTracer() as fwd:
        y = block(x)
    with CommTracer() as bwd:
        y.backward(upstream[:, rows])
    reduce_layernorm_grads([block])
    checks = {"output": gap(y, out_ref[:, rows]), "input gradient": gap(x.grad, x_ref.grad[:, rows])}
    for name in ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "attn.c_proj.bias", "mlp.c_proj.bias"):
        checks[f"{name} gradient"] = gap(block.get_parameter(name).grad, reference.get_parameter(name).grad)
    for name, dim, parts in (("attn.c_attn.weight", 0, 3), ("mlp.c_fc.weight", 0, 1),
                             ("attn.c_proj.weight", 1, 1), ("mlp.c_proj.weight", 1, 1)):
        local = block.get_parameter(name).grad
        pieces = [torch.empty_like(local) for _ in range(n)]
        dist.all_gather(pieces, local.contiguous())
        checks[f"{name} gradient (gathered)"] = gap(unshard(pieces, dim, parts), reference.get_parameter(name).grad)
    kinds = fwd.kinds() | bwd.kinds()
    activation = B * T * H * 8
    return dict(checks=checks, kinds=sorted(kinds),
                kinds_ok=n == 1 or kinds == {"all_gather", "reduce_scatter"},
                bytes={"block forward + backward": (fwd.sent_bytes() + bwd.sent_bytes(), 8 * (n - 1) / n * activation)})


def check_ring(device) -> dict:
    from labkit.sp import ring_attention
    n, rank = dist.get_world_size(), dist.get_rank()
    T = ROWS * n
    checks, sent = {}, {}
    for causal, layout in ((False, "contiguous"), (True, "contiguous"), (True, "zig-zag")):
        what = f"causal={causal}, {layout}"
        q, k, v, expected, upstream = full_attention(T, causal, device)
        rows = zigzag_rows(T, rank, n) if layout == "zig-zag" else list(range(rank * ROWS, (rank + 1) * ROWS))
        rows = torch.tensor(rows, device=device)
        mine = [t.detach().index_select(2, rows).clone().requires_grad_() for t in (q, k, v)]
        with CommTracer() as fwd:
            y = ring_attention(*mine, rows, causal)
        with CommTracer() as bwd:
            y.backward(upstream.index_select(2, rows))
        checks[f"{what}: output"] = gap(y, expected.index_select(2, rows))
        for name, m, full in zip("qkv", mine, (q, k, v)):
            checks[f"{what}: d{name}"] = gap(m.grad, full.grad.index_select(2, rows))
        S, P = mine[1].nbytes, rows.nbytes
        only_p2p = (fwd.kinds() | bwd.kinds()) <= {"send", "recv"}
        sent[f"{what}: forward"] = (sum(e.bytes for e in fwd.events if e.kind == "send") if only_p2p else -1,
                                    (n - 1) * (2 * S + P))
        sent[f"{what}: backward"] = (sum(e.bytes for e in bwd.events if e.kind == "send") if only_p2p else -1,
                                     (n - 1) * (4 * S + P) + (2 * S if n > 1 else 0))
    return dict(checks=checks, bytes=sent)


def check_zigzag(device) -> dict:
    from labkit.sp import zigzag_positions, zigzag_shard, zigzag_unshard
    n, rank = dist.get_world_size(), dist.get_rank()
    T = ROWS * n
    positions = zigzag_positions(T, rank, n).tolist()
    x = seeded(2, T, 3, seed=5, device=device)
    shards = [zigzag_shard(x, 1, r, n) for r in range(n)]
    ok_shards = all(torch.equal(s, x[:, zigzag_rows(T, r, n)]) for r, s in enumerate(shards))
    ok_inverse = torch.equal(zigzag_unshard(shards, 1), x)
    pairs = sum(p + 1 for p in positions)
    return dict(checks={"zigzag_positions": (0.0 if positions == zigzag_rows(T, rank, n) else float("inf"),
                                             positions == zigzag_rows(T, rank, n)),
                        "zigzag_shard": (0.0 if ok_shards else float("inf"), ok_shards),
                        "zigzag_unshard inverts it": (0.0 if ok_inverse else float("inf"), ok_inverse),
                        "causal pairs = T(T+1)/(2N)": (abs(pairs - T * (T + 1) / (2 * n)), pairs == T * (T + 1) // (2 * n))},
                pairs=pairs, contiguous_pairs=sum(p + 1 for p in range(rank * ROWS, (rank + 1) * ROWS)))


def check_ulysses(device) -> dict:
    from labkit.sp import ulysses_attention
    n, rank = dist.get_world_size(), dist.get_rank()
    T = ROWS * n
    checks, sent = {}, {}
    for causal in (False, True):
        q, k, v, expected, upstream = full_attention(T, causal, device, seed=20)
        rows = slice(rank * ROWS, (rank + 1) * ROWS)
        mine = [t.detach()[:, :, rows].clone().requires_grad_() for t in (q, k, v)]
        with CommTracer() as fwd:
            y = ulysses_attention(*mine, causal)
        with CommTracer() as bwd:
            y.backward(upstream[:, :, rows])
        checks[f"causal={causal}: output"] = gap(y, expected[:, :, rows])
        for name, m, full in zip("qkv", mine, (q, k, v)):
            checks[f"causal={causal}: d{name}"] = gap(m.grad, full.grad[:, :, rows])
        S = mine[0].nbytes
        shape_ok = all(e.kind == "all_to_all" and e.bytes == S for e in fwd.events + bwd.events) \
            and len(fwd.events) == len(bwd.events) == 4
        sent[f"causal={causal}: forward + backward"] = (fwd.sent_bytes() + bwd.sent_bytes() if shape_ok else -1,
                                                       8 * (n - 1) / n * S)
    return dict(checks=checks, bytes=sent)


CHECKS = {"sp.megatron": check_megatron, "sp.ring_attention": check_ring, "sp.zigzag": check_zigzag,
          "sp.ulysses": check_ulysses}


def main() -> dict:
    warnings.filterwarnings("ignore", category=FutureWarning)   # all_gather_into_tensor & co. in torch 2.13
    torch.set_num_threads(1)
    device = rank_device()
    result = dict(backend=dist.get_backend(), device=str(device))
    for task, check in CHECKS.items():
        try:
            result[task] = check(device)
        except NotImplementedError as exc:   # a stub raises on every rank alike
            result[task] = dict(missing=str(exc))
    return result


# ----------------------------------------------------------------------------- report


def report(results: list[dict]) -> bool:
    n = len(results)
    print(f"Lab 07: sequence parallelism on {n} rank(s), backend {results[0]['backend']}, rank 0 on {results[0]['device']}")
    print(f"float64; attention [B={B}, heads={HEADS}, T={ROWS * n}, d={D}]; Megatron-SP block "
          f"{BLOCK.n_embd} wide, {BLOCK.n_head} heads, T={TOKENS_PER_RANK * n}\n")
    ok = True
    for task in TASKS:
        first = results[0][task]
        if "missing" in first:
            print(f"{task}: not implemented yet: {first['missing']}\n")
            ok = False
            continue
        task_ok = True
        print(f"{task}: max |yours - reference| over the ranks")
        for what in first["checks"]:
            worst = max(r[task]["checks"][what][0] for r in results)
            good = all(r[task]["checks"][what][1] for r in results)
            task_ok &= good
            print(f"  {what:<46} {worst:9.1e}  {'ok' if good else 'WRONG'}")
        if "kinds_ok" in first:
            good = all(r[task]["kinds_ok"] for r in results)
            task_ok &= good
            print(f"  {'collectives: ' + ', '.join(first['kinds']) if first['kinds'] else 'collectives: none':<46} "
                  f"{'':9}  {'ok' if good else 'WRONG (expected all-gathers and reduce-scatters only)'}")
        for what in first.get("bytes", {}):
            traced = [r[task]["bytes"][what][0] for r in results]
            formula = first["bytes"][what][1]
            good = all(math.isclose(t, formula, abs_tol=1e-6) for t in traced)
            task_ok &= good
            shown = f"{traced[0]:,.0f}" if traced[0] >= 0 else "unexpected ops"
            print(f"  bytes sent, {what:<34} {shown:>12} vs formula {formula:,.0f}  {'ok' if good else 'MISMATCH'}")
        if task == "sp.zigzag":
            print(f"  causal pairs per rank: zig-zag {[r[task]['pairs'] for r in results]}, "
                  f"contiguous {[r[task]['contiguous_pairs'] for r in results]}")
        print(f"  {'ok' if task_ok else 'WRONG'}\n")
        ok &= task_ok
    print("all checks passed" if ok else "some checks failed or tasks are still to do")
    return ok


if __name__ == "__main__":
    args = lab_arguments(__doc__).parse_args()
    run_lab(main, report, args)
