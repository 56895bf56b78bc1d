"""Lab 09 as a script: train under your resume_training, kill a rank, resume from your checkpoints.

    torchrun --standalone --nproc-per-node 2 --max-restarts 3 labs/09_elastic.py --fail-at 3
    python labs/09_elastic.py --world-size 2 --fail-at 3       # labkit.launch restarts the ranks

Every rank trains the chapter's small float64 GPT, sharded with your ``fully_shard``
(``labkit/fsdp.py``: each block and the root), with AdamW, through your ``resume_training``
(``labkit/elastic.py``): it resumes from the newest valid checkpoint under ``--checkpoint-dir``
and saves every ``--save-every`` steps. With ``--fail-at STEP``, rank 1 (rank 0 on a single
rank) SIGKILLs itself just before that step in the first attempt (``Job.fail_at``); the
launcher then restarts every rank — torchrun's agent under ``torchrun --max-restarts``,
``labkit.launch(..., max_restarts=)`` otherwise — and the new attempt resumes from your latest
checkpoint. At the end the losses of every step and the final checkpoint's parameters are
compared with one process that trains the unsharded GPT on the same global batches (float64,
``labkit.check``'s tolerance). Rank 0 prints the comparison and the final loss; the exit status
is 1 if they differ or a task is not implemented yet (under torchrun that counts as a failure
too: torchrun restarts the workers until ``--max-restarts`` is used up).

The checkpoint directory must be the same for every attempt. Without ``--checkpoint-dir`` the
script makes one and removes it at the end: under labkit's launcher a fresh temporary
directory; under torchrun ``<tmp>/labkit-elastic-<TORCHELASTIC_RUN_ID>`` (``--standalone`` gives
every torchrun invocation a new run id), which every attempt finds again (a torchrun job whose
restarts are all used up leaves it behind). A directory you pass is kept, and a later run with
the same directory resumes from it. On several nodes pass a
directory on storage that every node sees, and a ``--rdzv-id``.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from labkit.check import mismatch
from labkit.course.labscript import lab_arguments
from labkit.data import markov_tokens
from labkit.launch import launch, release_process_groups, restart_count, under_torchrun
from labkit.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)   # the grader's GPT
BATCH = 48   # sequences per global batch: divides by 1, 2, 3, 4, 6, 8, 12 and 16 ranks
LR = 1e-2


# ----------------------------------------------------------------------------- on every rank


def tokens(steps: int):
    return markov_tokens(steps * BATCH, CONFIG.block_size, CONFIG.vocab_size, seed=9)


def build():
    """This rank's model and optimizer: the GPT under your FSDP, one unit per block and the root."""
    from labkit.fsdp import fully_shard
    model = GPT(CONFIG).double()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


class Batches:
    """This rank's share of the global batch of a step (a class, so that ``Job`` pickles it).
    ``pause``: seconds to wait per step, so that a step lasts long enough to be interrupted."""

    def __init__(self, steps: int, pause: float = 0.0):
        self.x, self.y = tokens(steps)
        self.pause = pause

    def __call__(self, step: int):
        if self.pause:
            time.sleep(self.pause)
        rank, n = dist.get_rank(), dist.get_world_size()
        share = BATCH // n
        first = step * BATCH + rank * share
        return self.x[first:first + share], self.y[first:first + share]


def gpt_loss(model, x, y):
    return model(x, y)[1]


def single_process(steps: int):
    """The reference: the unsharded GPT on the whole global batch, step by step."""
    model = GPT(CONFIG).double()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x, y = tokens(steps)
    losses = []
    for step in range(steps):
        loss = gpt_loss(model, x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {name: p.detach() for name, p in model.named_parameters()}


def main(root: str, steps: int, save_every: int, fail_at: int | None, pause: float = 0.0) -> dict:
    from labkit.elastic import Job, latest_checkpoint, load_checkpoint, resume_training
    from labkit.fsdp import full_state_dict
    torch.set_num_threads(1)
    rank, n = dist.get_rank(), dist.get_world_size()
    out = dict(world=n, attempt=restart_count(), backend=dist.get_backend(), missing=None)
    try:
        latest = latest_checkpoint(root)
        if rank == 0:
            where = f"resuming from {latest.name}" if latest is not None else "no checkpoint yet, starting at step 0"
            print(f"attempt {restart_count()}: {where}", flush=True)
        victim = None if fail_at is None else (min(1, n - 1), fail_at)
        job = Job(build=build, batch=Batches(steps, pause), loss=gpt_loss, steps=steps, root=root,
                  save_every=save_every, samples_per_step=BATCH, fail_at=victim)
        out["losses"] = resume_training(job)
        model, opt = build()   # the final checkpoint, loaded into a fresh model: what a restart would see
        load_checkpoint(latest_checkpoint(root), model, opt)
        final = full_state_dict(model)
    except NotImplementedError as exc:   # a stub raises on every rank alike
        out["missing"] = str(exc)
        return out
    reference, params = single_process(steps)
    out["reference"] = reference
    out["param_gap"] = max((final[name] - p).abs().max().item() for name, p in params.items())
    out["param_ok"] = all(mismatch(final[name], p) is None for name, p in params.items())
    return out


# ----------------------------------------------------------------------------- report


def report(results: list[dict], fail_at: int | None) -> bool:
    first = results[0]
    print(f"Lab 09: resume_training on {first['world']} rank(s), backend {first['backend']}")
    if first["missing"]:
        print(f"not implemented yet: {first['missing']}")
        return False
    print(f"finished in attempt {first['attempt']} ({first['attempt']} restart(s))"
          + (f"; a rank was to die before step {fail_at}" if fail_at is not None else ""))
    losses, reference = first["losses"], first["reference"]
    same_everywhere = all(r["losses"] == losses for r in results)
    print(f"  {'step':>4} {'your run':>12} {'one process':>12} {'|diff|':>9}")
    for step, (a, b) in enumerate(zip(losses, reference)):
        print(f"  {step:>4} {a:>12.8f} {b:>12.8f} {abs(a - b):>9.1e}")
    curve_ok = len(losses) == len(reference) and mismatch(
        torch.tensor(losses, dtype=torch.float64), torch.tensor(reference, dtype=torch.float64)) is None
    params_ok = all(r["param_ok"] for r in results)
    print(f"  losses vs one process (float64 tolerance): {'ok' if curve_ok else 'WRONG'}; "
          f"the same on every rank: {'ok' if same_everywhere else 'WRONG'}")
    print(f"  final checkpoint's parameters vs one process: max |diff| "
          f"{max(r['param_gap'] for r in results):.1e}, {'ok' if params_ok else 'WRONG'}")
    print(f"final loss: {losses[-1]:.10f}")
    return curve_ok and same_everywhere and params_ok


# ----------------------------------------------------------------------------- the shell


def checkpoint_root(given: str | None) -> tuple[str, bool]:
    """(the checkpoint directory, whether this run made it and should remove it)."""
    if given is not None:
        return given, False
    if not under_torchrun():
        return tempfile.mkdtemp(prefix="labkit-elastic-"), True
    run_id = os.environ["TORCHELASTIC_RUN_ID"]
    if run_id in ("", "none"):   # torchrun without --standalone or --rdzv-id: no per-run name
        sys.exit("labs/09_elastic.py: under torchrun without --standalone, pass --checkpoint-dir "
                 "(a directory every node sees, the same for every restart)")
    return str(Path(tempfile.gettempdir()) / f"labkit-elastic-{run_id}"), True


def run(args) -> None:
    """Like ``labkit.course.labscript.run_lab``, with the launcher's restarts."""
    world = int(os.environ.get("WORLD_SIZE", args.world_size))   # checked by parse_args (labscript.WORLD_SIZES)
    root, made_here = checkpoint_root(args.checkpoint_dir)
    try:
        results = launch(main, world, root, args.steps, args.save_every, args.fail_at, args.step_pause,
                         backend=args.backend,
                         timeout=args.timeout, max_restarts=args.max_restarts)
    except BaseException:
        if made_here and not under_torchrun():   # under torchrun the next attempt needs the directory
            shutil.rmtree(root, ignore_errors=True)
        raise
    if not under_torchrun() or dist.get_rank() == 0:
        ok = report(results, args.fail_at)
        if made_here:   # every rank is done with it: launch returned on all of them
            shutil.rmtree(root, ignore_errors=True)
    else:   # under torchrun every rank holds every result: the same verdict, silently
        with contextlib.redirect_stdout(io.StringIO()):
            ok = report(results, args.fail_at)
    # A group left alive can abort a rank at exit (SIGABRT), and torchrun would restart the
    # whole job after it had finished: every rank releases its groups before it leaves.
    release_process_groups()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    parser = lab_arguments(__doc__)
    parser.add_argument("--steps", type=int, default=8, help="training steps in all")
    parser.add_argument("--save-every", type=int, default=2, help="save a checkpoint every this many steps")
    parser.add_argument("--fail-at", type=int, default=None, metavar="STEP",
                        help="rank 1 SIGKILLs itself before this step, in the first attempt")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="where the checkpoints go (default: a fresh directory, removed at the end)")
    parser.add_argument("--step-pause", type=float, default=0.0, metavar="SECONDS",
                        help="wait this long in every step (to have time to kill or add a node)")
    parser.add_argument("--max-restarts", type=int, default=3,
                        help="restarts without torchrun (under torchrun, torchrun's --max-restarts counts)")
    run(parser.parse_args())
