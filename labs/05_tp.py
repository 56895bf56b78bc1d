"""Lab 05 as a script: your tensor-parallel GPT vs a single process and parallelize_module, on N ranks.

    torchrun --standalone --nproc-per-node 2 labs/05_tp.py
    python labs/05_tp.py --world-size 2        # labkit.launch starts the ranks

It splits the lab GPT (vocabulary 48, 2 blocks of 48 channels, 12 heads: every split size divides
by 1, 2, 3, 4, 6 and 12; on 8 or 16 ranks 16 heads of 3 channels instead) with your ``tensor_parallel`` (``labkit/tp.py``); trains it for 5 AdamW steps
in float64 next to the single-process GPT, with the tied and with an untied head, and (untied) next
to the same GPT split by ``parallelize_module``; compares the losses of every step and, through your
``full_state_dict``, the parameters after the last one, on every rank. Then it traces one float32
training step and checks its all-reduces against the formula: 1 of B*T*H numbers for the embedding,
2 per block forward and 2 backward, 1 for the head, 3 of B*T for the loss, and 2(N-1)/N of those
bytes sent per rank each; reports each rank's parameter bytes against 1/N of the split parameters
plus the replicated ones; and times a training step of yours and of parallelize_module (median of
interleaved runs, slowest rank). Every rank gets the same batch. Rank 0 prints; the exit status is 1
if a check fails or a task is not implemented yet.

The backend follows ``labkit.launch``'s "auto": NCCL with one GPU per rank (the models on
``cuda:LOCAL_RANK``), gloo on CPU otherwise; ``--backend`` overrides it.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from labkit.check import mismatch
from labkit.comm import CommTracer
from labkit.course.labscript import lab_arguments, run_lab
from labkit.data import markov_tokens
from labkit.memory import param_bytes
from labkit.models import GPT, GPTConfig
from labkit.oracles import builtin_tensor_parallel, device_mesh, loss_parallel
from labkit.timing import interleaved_medians

SHAPE = dict(vocab_size=48, block_size=8, n_layer=2, n_head=12, n_embd=48)   # the grader's GPT
SHAPE_16 = dict(SHAPE, n_head=16)   # on 8 and 16 ranks, where 12 heads do not split evenly
B, STEPS = 3, 5                     # sequences per step (the same on every rank); AdamW steps
T, H, L = SHAPE["block_size"], SHAPE["n_embd"], SHAPE["n_layer"]
BTH, BT = B * T * H, B * T
REPLICATED = ("ln_", "wpe", "c_proj.bias")   # names of the parameters every rank keeps whole
EXPECTED = {"forward": {"embedding": [BTH]} | {f"block {i}": [BTH, BTH] for i in range(L)} | {"head + loss": [BT] * 3},
            "backward": {"head + loss": [BTH]} | {f"block {i}": [BTH, BTH] for i in reversed(range(L))}}


# ----------------------------------------------------------------------------- on every rank


def rank_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def shape(n: int) -> dict:
    """The lab GPT for n ranks: 12 heads where they split evenly, else 16 (labscript.WORLD_SIZES)."""
    return SHAPE if SHAPE["n_head"] % n == 0 else SHAPE_16


def gpt(tie: bool, device, dtype=torch.float32) -> GPT:
    return GPT(GPTConfig(**shape(dist.get_world_size()), tie_weights=tie)).to(device=device, dtype=dtype)


def batch(step: int, device):
    x, y = markov_tokens(B * STEPS, T, SHAPE["vocab_size"], seed=5)
    return x[step * B:(step + 1) * B].to(device), y[step * B:(step + 1) * B].to(device)


def mesh(device):
    return device_mesh(device_type=device.type)


def builtin_loss(model, x, y):
    with loss_parallel():   # forward and backward of the vocabulary-sharded loss inside it
        loss = model(x, y)[1]
        loss.backward()
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss


def check_training(tie: bool, device) -> dict:
    """Yours vs the single-process GPT, float64: losses every step, parameters at the end."""
    from labkit.tp import full_state_dict, tensor_parallel
    models = {"single": gpt(tie, device, torch.float64), "yours": tensor_parallel(gpt(tie, device, torch.float64))}
    optims = {name: torch.optim.AdamW(m.parameters(), lr=1e-2) for name, m in models.items()}
    losses = {name: [] for name in models}
    for step in range(STEPS):
        x, y = batch(step, device)
        for name, model in models.items():
            loss = model(x, y)[1]
            loss.backward()
            optims[name].step()
            optims[name].zero_grad()
            losses[name].append(loss.item())
    state, expected = full_state_dict(models["yours"]), models["single"].state_dict()
    if set(state) != set(expected):
        return dict(losses=losses, problem=f"full_state_dict keys differ: {sorted(set(state) ^ set(expected))}")
    problems = [f"{name}: {why}" for name, value in expected.items() if (why := mismatch(state[name], value))]
    gap = max((state[name] - value).abs().max().item() for name, value in expected.items())
    return dict(losses=losses, gap=gap, problem=problems[0] if problems else None)


def train_builtin(device) -> list[float]:
    model = builtin_tensor_parallel(gpt(False, device, torch.float64), mesh(device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        losses.append(builtin_loss(model, *batch(step, device)).item())
        opt.step()
        opt.zero_grad()
    return losses


def trace_step(device) -> dict:
    """One float32 forward + backward of your (untied) GPT under CommTracer; block hooks mark
    which segment issued each collective."""
    from labkit.tp import tensor_parallel
    model = tensor_parallel(gpt(False, device))
    tracer, marks = CommTracer(), []

    def mark(phase, segment):
        marks.append((len(tracer.events), phase, segment))

    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, a, i=i: mark("forward", f"block {i}"))
        block.register_full_backward_pre_hook(lambda m, g, i=i: mark("backward", f"block {i}"))
    model.blocks[-1].register_forward_hook(lambda m, a, o: mark("forward", "head + loss"))
    x, y = batch(0, device)
    with tracer:
        mark("forward", "embedding")
        loss = model(x, y)[1]
        mark("backward", "head + loss")
        loss.backward()
    marks.append((len(tracer.events), None, None))
    segments = {"forward": {}, "backward": {}}
    for (start, phase, segment), (stop, _, _) in zip(marks, marks[1:]):
        segments[phase][segment] = [e.bytes // 4 if e.kind == "all_reduce" else e.kind
                                    for e in tracer.events[start:stop]]
    return dict(segments=segments, sent=tracer.sent_bytes(), params=param_bytes(model))


def time_steps(device, repeats: int) -> dict:
    from labkit.tp import tensor_parallel
    models = {"yours": tensor_parallel(gpt(False, device)),
              "parallelize_module": builtin_tensor_parallel(gpt(False, device), mesh(device))}
    optims = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}

    def stepper(name):
        def step(b):
            if name == "yours":
                models[name](*b)[1].backward()
            else:
                builtin_loss(models[name], *b)
            optims[name].step()
            optims[name].zero_grad(set_to_none=True)
        return step

    return interleaved_medians({name: stepper(name) for name in models}, lambda: batch(0, device), repeats, warmup=3)


def main(repeats: int) -> dict:
    device = rank_device()
    if device.type == "cpu":
        torch.set_num_threads(1)   # tiny model: a second thread per rank only competes for the cores
    result = dict(backend=dist.get_backend(), device=str(device), missing=None)
    try:
        result["training"] = {tie: check_training(tie, device) for tie in (True, False)}
        result["traffic"] = trace_step(device)
        result["times"] = time_steps(device, repeats)
        result["builtin"] = train_builtin(device)
    except NotImplementedError as exc:  # a stub raises on every rank alike
        result["missing"] = str(exc)
    return result


# ----------------------------------------------------------------------------- report


def show(sizes: list) -> str:
    numbers = [s for s in sizes if not isinstance(s, str)]
    parts = [f"{numbers.count(s)} x {s:,}" for s in sorted(set(numbers), reverse=True)]
    return " + ".join(parts + [s for s in sizes if isinstance(s, str)]) or "-"


def as_tensor(losses: list[float]) -> torch.Tensor:
    return torch.tensor(losses, dtype=torch.float64)   # compared with the float64 tolerance


def report(results: list[dict]) -> bool:
    n = len(results)
    print(f"Lab 05: tensor parallelism on {n} rank(s), backend {results[0]['backend']}, rank 0 on {results[0]['device']}")
    print(f"GPT {shape(n)}, {B} sequences of {T} tokens per step, the same on every rank\n")
    if results[0]["missing"]:
        print(f"not implemented yet: {results[0]['missing']}")
        return False

    print(f"correctness: {STEPS} AdamW steps in float64 vs a single process (and parallelize_module, untied head)")
    print(f"  {'rank':>4} {'head':<7} {'max |loss - single|':>20} {'max |params - single|':>22} "
          f"{'max |loss - parallelize_module|':>32}")
    ok = True
    for rank, r in enumerate(results):
        for tie, run in r["training"].items():
            yours, single = run["losses"]["yours"], run["losses"]["single"]
            ok &= run["problem"] is None and mismatch(as_tensor(yours), as_tensor(single)) is None
            vs_torch = ""
            if not tie:
                ok &= mismatch(as_tensor(yours), as_tensor(r["builtin"])) is None
                vs_torch = f"{max(abs(a - b) for a, b in zip(yours, r['builtin'])):.1e}"
            params = f"{run['gap']:.1e}" if "gap" in run else "-"
            print(f"  {rank:>4} {'tied' if tie else 'untied':<7} {max(abs(a - b) for a, b in zip(yours, single)):>20.1e} "
                  f"{params:>22} {vs_torch:>32}")
    problems = [run["problem"] for r in results for run in r["training"].values() if run["problem"]]
    print(f"  {'ok' if ok else 'WRONG'} (float64 tolerance of labkit.check)" + (f"; {problems[0]}" if problems else "") + "\n")
    if not ok:
        print("fix correctness first: the measurements below assume a working tensor_parallel")
        return False

    t = results[0]["traffic"]
    print("collectives of one float32 training step, rank 0 (numbers per all-reduce), against the formula:")
    for phase, expected in EXPECTED.items():
        for segment, sizes in expected.items():
            print(f"  {phase:<8} {segment:<12} {show(t['segments'][phase].get(segment, [])):<24} formula {show(sizes)}")
    counts_ok = n == 1 or all(r["traffic"]["segments"] == EXPECTED for r in results)  # N = 1 may skip them
    formula = 2 * (n - 1) / n * 4 * ((1 + 2 * L) * 2 * BTH + 3 * BT)
    bytes_ok = all(abs(r["traffic"]["sent"] - formula) < 1e-6 for r in results)
    print(f"  bytes sent per rank (ring model): {t['sent']:,.0f}; formula 2(N-1)/N x 4 x [2(1+2L) BTH + 3 BT] "
          f"= {formula:,.0f}   {'ok' if counts_ok and bytes_ok else 'MISMATCH'}\n")

    full = GPT(GPTConfig(**shape(n), tie_weights=False))
    phi = sum(p.numel() for p in full.parameters())
    rep = sum(p.numel() for name, p in full.named_parameters() if any(k in name for k in REPLICATED))
    expected_bytes = 4 * ((phi - rep) / n + rep)
    measured = [r["traffic"]["params"] for r in results]
    params_ok = all(m == expected_bytes for m in measured)
    print(f"parameter bytes per rank (float32, untied): {sorted(set(measured))}; formula 4[(Phi - rep)/N + rep] = "
          f"{expected_bytes:,.0f} (Phi = {phi:,}, rep = {rep:,}; 4 Phi / N = {4 * phi / n:,.0f})   "
          f"{'ok' if params_ok else 'MISMATCH'}\n")

    med = results[0]["times"]
    print(f"time per step (median of interleaved runs, slowest rank): yours {med['yours'] * 1e3:.1f} ms, "
          f"parallelize_module {med['parallelize_module'] * 1e3:.1f} ms, "
          f"ratio {med['yours'] / med['parallelize_module']:.2f}")
    return counts_ok and bytes_ok and params_ok


if __name__ == "__main__":
    parser = lab_arguments(__doc__)
    parser.add_argument("--reps", type=int, default=10, help="timed steps per implementation")
    args = parser.parse_args()
    run_lab(main, report, args, args.reps)
