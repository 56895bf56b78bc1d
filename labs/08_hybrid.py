"""Lab 08 as a script: your hybrid layouts (labkit/mesh.py) against init_device_mesh and one process, on N ranks.

    torchrun --standalone --nproc-per-node 4 labs/08_hybrid.py
    python labs/08_hybrid.py --world-size 8        # labkit.launch starts the ranks

For the world size it gets, it runs every (dp, tp, pp) layout of the lab GPT that uses all the
ranks (4 heads and 2 layers: tp in 1, 2, 4 and pp in 1, 2; a global batch of 24 sequences, so dp
may be 1, 2, 3, 4, 6 or 8): 8 ranks give 6 layouts, 4 give 5, 2 give 3. For each it checks your
``RankGrid``'s coordinates and groups against ``init_device_mesh`` for the same (dp, pp, cp, tp)
shape; trains the GPT for 5 AdamW steps in float64 with your ``train_2d`` (pp = 1, FSDP x TP, tied
head) or ``train_3d`` (pp = 2, DP x PP x TP with 1F1B over 2 micro-batches, untied head) and
compares every rank's loss curve with one process on the global batch; and compares the parameter,
gradient and AdamW bytes every rank holds with your ``parameters_on_rank``. Rank 0 prints; the exit
status is 1 if a check fails, a task is not implemented yet, or no layout uses exactly N ranks.

The models are built on the CPU (``train_2d``/``train_3d`` make them there), so the backend
defaults to gloo; ``--backend`` overrides it.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from labkit.check import mismatch
from labkit.course.labscript import lab_arguments, run_lab
from labkit.data import markov_tokens
from labkit.models import GPT, GPTConfig
from labkit.oracles import device_mesh

STEPS, GLOBAL_BATCH, MICROBATCHES, T = 5, 24, 2, 8
AXES = ("dp", "pp", "cp", "tp")


def gpt_config(tie: bool) -> GPTConfig:
    return GPTConfig(vocab_size=32, block_size=T, n_layer=2, n_head=4, n_embd=16, tie_weights=tie)


def layouts(world: int) -> list[tuple[int, int, int]]:
    """Every (dp, tp, pp) with dp * tp * pp == world that the lab GPT and the batch allow."""
    found = []
    for pp in (1, 2):
        for tp in (1, 2, 4):
            dp, rest = divmod(world, tp * pp)
            if rest or dp < 1 or GLOBAL_BATCH % dp:
                continue
            if pp > 1 and GLOBAL_BATCH // dp < MICROBATCHES:
                continue
            found.append((dp, tp, pp))
    return found


def batches():
    x, y = markov_tokens(STEPS * GLOBAL_BATCH, T, 32, seed=8)
    return x.view(STEPS, GLOBAL_BATCH, T), y.view(STEPS, GLOBAL_BATCH, T)


def single_process(tie: bool) -> list[float]:
    """The reference: one process, the whole global batch."""
    model = GPT(gpt_config(tie)).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = batches()
    losses = []
    for step in range(STEPS):
        loss = model(x[step], y[step])[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# ----------------------------------------------------------------------------- on every rank


def check_groups(grid, shape) -> str | None:
    """None if this rank's coordinates and groups equal init_device_mesh's, else what differs."""
    rank = dist.get_rank()
    mesh = device_mesh(shape, AXES)
    theirs = dict(zip(AXES, mesh.get_coordinate()))
    if grid.coords(rank) != theirs:
        return f"rank {rank} at {grid.coords(rank)}, init_device_mesh puts it at {theirs}"
    for axis in AXES:
        ours, expected = dist.get_process_group_ranks(grid.group(axis)), dist.get_process_group_ranks(mesh.get_group(axis))
        if ours != expected or grid.axis_ranks(axis, rank) != expected:
            return f"rank {rank}'s {axis} group is {ours} (axis_ranks {grid.axis_ranks(axis, rank)}), init_device_mesh's {expected}"
    return None


def run_layout(dp: int, tp: int, pp: int) -> dict:
    from labkit.mesh import Layout, ModelShape, RankGrid, parameters_on_rank, train_2d, train_3d
    grid = RankGrid(dist.get_world_size(), dp=dp, tp=tp, pp=pp).make_groups()
    groups = check_groups(grid, (dp, pp, 1, tp))
    x, y = batches()
    if pp == 1:
        trained = train_2d(gpt_config(True), grid, x, y, STEPS)
    else:
        trained = train_3d(gpt_config(False), grid, x, y, STEPS, microbatches=MICROBATCHES)
    stage = grid.coords(dist.get_rank())["pp"]
    plan = parameters_on_rank(ModelShape.of(gpt_config(pp == 1)), Layout(dp=dp, tp=tp, pp=pp, zero=3 if pp == 1 else 0), stage)
    return dict(groups=groups, losses=trained.losses, stage=stage,
                measured=(trained.param_bytes, trained.grad_bytes, trained.optimizer_bytes),
                planned=(8 * plan["params"], 8 * plan["grads"], 8 * plan["optimizer"] + 4 * plan["tensors"]))


def main() -> dict:
    torch.set_num_threads(1)
    result = dict(backend=dist.get_backend(), runs={}, missing=None,
                  reference={tie: single_process(tie) for tie in (True, False)})
    for layout in layouts(dist.get_world_size()):
        try:
            result["runs"][layout] = run_layout(*layout)
        except NotImplementedError as exc:  # a stub raises on every rank alike
            result["missing"] = str(exc)
            break
    return result


# ----------------------------------------------------------------------------- report


def report(results: list[dict]) -> bool:
    n = len(results)
    found = layouts(n)
    print(f"Lab 08: hybrid layouts on {n} rank(s), backend {results[0]['backend']}")
    print(f"GPT {gpt_config(True)}; {STEPS} AdamW steps in float64 on {GLOBAL_BATCH} sequences per step\n")
    if not found:
        sizes = ", ".join(str(w) for w in range(1, 17) if layouts(w))
        print(f"no (dp, tp, pp) layout of the lab GPT uses exactly {n} ranks; world sizes that have some: {sizes}")
        return False
    if results[0]["missing"] and not results[0]["runs"]:
        print(f"not implemented yet: {results[0]['missing']}")
        return False
    ok = True
    print(f"{'layout (dp, tp, pp)':<21}{'groups vs init_device_mesh':<28}{'max |loss - one process|':>25}"
          f"{'bytes vs your plan':>20}")
    for layout in found:
        runs = [r["runs"].get(layout) for r in results]
        if any(run is None for run in runs):
            print(f"{str(layout):<21}not run")
            continue
        groups = next((run["groups"] for run in runs if run["groups"]), None)
        expected = torch.tensor(results[0]["reference"][layout[2] == 1], dtype=torch.float64)
        curves = [torch.tensor(run["losses"], dtype=torch.float64) for run in runs]
        gap = max((curve - expected).abs().max().item() for curve in curves)
        curves_ok = all(mismatch(curve, expected) is None for curve in curves)
        wrong_bytes = [(rank, run["stage"], run["measured"], run["planned"]) for rank, run in enumerate(runs)
                       if run["measured"] != run["planned"]]
        ok &= groups is None and curves_ok and not wrong_bytes
        print(f"{str(layout):<21}{'same' if groups is None else 'DIFFERENT':<28}{gap:>25.1e}"
              f"{'equal on every rank' if not wrong_bytes else 'DIFFERENT':>20}"
              f"{'' if curves_ok else '   loss curve off'}")
        if groups:
            print(f"    {groups}")
        for rank, stage, measured, planned in wrong_bytes[:2]:
            print(f"    rank {rank} (stage {stage}): measured (params, grads, AdamW) bytes {measured}, plan {planned}")
    if results[0]["missing"]:
        print(f"\nnot implemented yet: {results[0]['missing']}")
        return False
    print(f"\n{'ok' if ok else 'WRONG'}: loss curves within labkit.check's float64 tolerance "
          f"(rtol 1e-10, atol 1e-12), groups and bytes exact")
    return ok


if __name__ == "__main__":
    parser = lab_arguments(__doc__)
    parser.set_defaults(backend="gloo")
    args = parser.parse_args()
    run_lab(main, report, args)
