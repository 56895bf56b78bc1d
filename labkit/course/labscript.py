"""The command-line shell shared by the lab scripts in ``labs/``.

    parser = lab_arguments(__doc__)          # --world-size, --backend, --timeout
    parser.add_argument("--reps", ...)       # the lab's own options
    args = parser.parse_args()
    run_lab(main, report, args, args.reps)   # never returns: exits 0 if the checks passed

The same script runs as ``python labs/NN.py --world-size 4`` (labkit starts the ranks) and
under ``torchrun`` (each process is a rank; torchrun's WORLD_SIZE wins).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys

import torch.distributed as dist

from labkit.launch import launch, release_process_groups, under_torchrun


def lab_arguments(doc: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2,
                        help="ranks to start without torchrun (torchrun's WORLD_SIZE wins)")
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    parser.add_argument("--timeout", type=float, default=300, help="seconds before a hang is reported")
    return parser


def report_checks(checks: dict[str, bool]) -> bool:
    """Print one line per check, ``ok  `` or ``FAIL`` then what it checked; True if all passed."""
    for what, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {what}")
    return all(checks.values())


def run_lab(main, report, args, *main_args, max_restarts: int = 0) -> None:
    """Run ``main(*main_args)`` on every rank, ``report(results)`` the outcome, and exit.

    Under torchrun every rank holds every result: rank 0 prints the report, the others
    reach the same verdict silently, so all exit with the same status. ``max_restarts``: as
    ``launch``'s (without torchrun; under torchrun use its ``--max-restarts``).
    """
    world_size = int(os.environ.get("WORLD_SIZE", args.world_size))
    results = launch(main, world_size, *main_args, backend=args.backend, timeout=args.timeout,
                     max_restarts=max_restarts)
    if not under_torchrun() or dist.get_rank() == 0:
        ok = report(results)
    else:
        with contextlib.redirect_stdout(io.StringIO()):
            ok = report(results)
    release_process_groups()  # a group left alive can abort the process at exit
    sys.exit(0 if ok else 1)
