"""The command-line shell shared by the lab scripts in ``labs/``.

    parser = lab_arguments(__doc__)          # --world-size, --backend, --timeout
    parser.add_argument("--reps", ...)       # the lab's own options
    args = parser.parse_args()
    run_lab(main, report, args, args.reps)   # never returns: exits 0 if the checks passed

The same script runs as ``python labs/NN.py --world-size 4`` (labkit starts the ranks) and
under ``torchrun`` (each process is a rank; torchrun's WORLD_SIZE wins).

Before any process starts, ``parse_args`` checks the world size against the lab's entry in
``WORLD_SIZES`` (a size the lab cannot take exits 2 with one sentence saying which it takes;
``--help`` lists them too), then prints the line that names the labkit tree in use.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from labkit.launch import launch, release_process_groups, under_torchrun

LISTED_UP_TO = 16  # sizes listed in --help, in the refusal and in the README's table: two nodes of 8


@dataclass(frozen=True)
class WorldSizes:
    """The world sizes a lab takes: ``accepts(n)``, and ``because`` says why (for the message)."""
    accepts: Callable[[int], bool]
    because: str

    def listed(self, up_to: int = LISTED_UP_TO) -> list[int]:
        return [n for n in range(1, up_to + 1) if self.accepts(n)]

    def describe(self) -> str:
        """``1, 2, 4, 8 or 16 ranks (why)``, or ``any number of ranks from 2 (why)``."""
        sizes = [n for n in range(1, 4 * LISTED_UP_TO + 1) if self.accepts(n)]
        if sizes == list(range(sizes[0], 4 * LISTED_UP_TO + 1)):
            text = "any number of ranks" + (f" from {sizes[0]}" if sizes[0] > 1 else "")
        else:
            text = (", ".join(map(str, sizes[:-1])) + " or " if len(sizes) > 1 else "") + f"{sizes[-1]} ranks"
        return f"{text} ({self.because})"


def _divides(total: int) -> Callable[[int], bool]:
    return lambda n: n >= 1 and total % n == 0


def _hybrid_layouts(n: int) -> bool:
    """labs/08_hybrid.py's ``layouts(n)`` is not empty: n = dp x tp x pp with tp in 1, 2, 4, pp in
    1, 2, dp dividing the batch of 24, and 2 micro-batches per dp shard when pp = 2."""
    for tp in (1, 2, 4):
        for pp in (1, 2):
            dp, rest = divmod(n, tp * pp)
            if n >= 1 and not rest and 24 % dp == 0 and (pp == 1 or 24 // dp >= 2):
                return True
    return False


# Lab number -> the world sizes its script takes. Each entry mirrors the script's shapes (a
# test checks every lab takes 1, 2, 4, 8 and 16 here; tests/test_lab_scripts.py runs them).
WORLD_SIZES: dict[str, WorldSizes] = {
    "00": WorldSizes(lambda n: n >= 1, "each rank takes its share, whatever N"),
    "01": WorldSizes(_divides(48), "the global batch of 48 sequences splits evenly over the ranks"),
    "02": WorldSizes(_divides(48), "each micro-batch of 48 sequences splits evenly over the ranks"),
    "03": WorldSizes(_divides(48), "the global batch of 48 sequences splits evenly over the ranks"),
    "04": WorldSizes(lambda n: n >= 1, "each rank takes its share, whatever N"),
    "05": WorldSizes(lambda n: _divides(12)(n) or _divides(16)(n),
                     "12 heads of 4 channels, or 16 heads of 3 on 8 and 16 ranks, split evenly"),
    "06": WorldSizes(lambda n: n >= 1, "one pipeline stage per rank, any number"),
    "07": WorldSizes(lambda n: _divides(48)(n) and 4 * n <= 64,
                     "the 48 heads split evenly, and the block's 4 N tokens fit its 64 positions"),
    "08": WorldSizes(_hybrid_layouts, "dp x tp x pp with dp dividing the batch of 24, tp 1, 2 or 4, pp 1 or 2"),
    "09": WorldSizes(_divides(48), "the global batch of 48 sequences splits evenly over the ranks"),
    "10": WorldSizes(_divides(16), "the 16 experts split evenly over the ranks"),
    "11": WorldSizes(_divides(48), "the collective matmul's 48 tokens and 96 hidden channels split evenly"),
    "12": WorldSizes(lambda n: n >= 1, "each rank takes its share, whatever N"),
    "13": WorldSizes(lambda n: n >= 2, "a server and at least one trainer"),
    "14": WorldSizes(lambda n: n >= 1, "the ranks share the FLOP counts and take turns measuring the CPU, whatever N"),
}


def lab_number(script: str | None = None) -> str | None:
    """``"05"`` for ``labs/05_tp.py`` (default: the script Python is running), else None."""
    if script is None:
        script = getattr(sys.modules.get("__main__"), "__file__", None) or ""
    name = Path(script).name
    return name[:2] if name[:2].isdigit() and name.endswith(".py") else None


def requested_world_size(args) -> tuple[int, str]:
    """The world size this run asks for, and where it came from (torchrun's WORLD_SIZE wins)."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"]), "WORLD_SIZE"
    return args.world_size, "--world-size"


def world_size_error(lab: str | None, n: int, source: str = "--world-size") -> str | None:
    """One sentence when lab ``lab`` cannot run on ``n`` ranks, else None."""
    sizes = WORLD_SIZES.get(lab or "")
    if n >= 1 and (sizes is None or sizes.accepts(n)):
        return None
    what = f"lab {lab}" if lab else "a lab"
    takes = sizes.describe() if sizes else "any number of ranks"
    if n < 1:
        return f"{source} {n}: a run needs at least 1 rank; {what} runs on {takes}."
    return f"{what} runs on {takes}; {source} {n} is not one of them."


def tree_line() -> str:
    """Which course tree's labkit this process (and every rank it starts) runs."""
    from labkit.course.workspace import is_student_workspace
    from labkit.trees import package_dir
    root = package_dir().parent
    kind = "learner workspace" if is_student_workspace(root) else "reference solutions"
    return f"labkit from {root} ({kind})"


def _prints() -> bool:
    """One process of a run prints the shell's lines: the caller, or torchrun's rank 0."""
    return os.environ.get("RANK", "0") == "0"


def backend_error(backend: str, n: int) -> str | None:
    """One sentence when ``--backend`` cannot run here (NCCL without a GPU per rank), else None."""
    from labkit.runtime.launcher import resolve_backend
    local = int(os.environ.get("LOCAL_WORLD_SIZE", n))   # under torchrun: the ranks of this node
    try:
        resolve_backend(backend, local)
    except ValueError as error:
        return f"--backend {backend}: {error}"
    return None


class LabParser(argparse.ArgumentParser):
    """``parse_args`` also checks the world size and the backend before any process starts,
    and names the tree."""

    lab: str | None = None

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        n, source = requested_world_size(parsed)
        error = world_size_error(self.lab, n, source) or backend_error(parsed.backend, n)
        if error:
            if _prints():
                print(f"{self.prog}: {error}", file=sys.stderr)
            sys.exit(2)
        if _prints():
            print(tree_line(), flush=True)
            if self.lab and (uses := uses_line(self.lab)):
                print(uses, flush=True)
        return parsed


def uses_line(lab: str) -> str | None:
    """``lab 14 also runs these tasks of other chapters: compress.hierarchical (11), ...``
    (read from the code, ``catalog.lab_uses``), or None when the lab runs its chapter's alone."""
    from labkit.course import catalog
    from labkit.trees import package_dir
    if lab not in catalog.CHAPTERS:
        return None
    try:
        lines = catalog.format_earlier(package_dir().parent, [lab])
    except (OSError, SyntaxError, ValueError):   # the listing must never stop a lab
        return None
    return lines[0] + " (labkit tasks lists where they are)" if lines else None


# ----------------------------------------------------------------------------- the script's own tree

REEXEC_ENV = "LABKIT_LAB_TREE"   # set when a lab script ran itself again on its own tree


def _script_tree() -> Path | None:
    """The course tree whose ``labs/`` holds the script Python runs, or None (not a lab file)."""
    from labkit.trees import is_course_root
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    if not script:
        return None
    folder = Path(script).resolve().parent
    return folder.parent if folder.name == "labs" and is_course_root(folder.parent) else None


def run_on_the_scripts_tree() -> None:
    """A lab file always runs its own tree's labkit: ``python ../my-labs/labs/00_collectives.py``
    with the clone's environment active runs ../my-labs's code (the stubs you are filling in),
    never the clone's reference solutions, wherever you stand. If Python imported labkit from
    another tree, run this script again with its own tree first on the path, and say so."""
    from labkit.trees import package_dir
    tree, mine = _script_tree(), package_dir().parent
    if tree is None or tree == mine or "LABKIT_RANK" in os.environ or "LABKIT_RANK_SERVER" in os.environ:
        return
    script = Path(sys.modules["__main__"].__file__).name
    if os.environ.get(REEXEC_ENV) == str(tree):   # we did put it first: something else wins
        print(f"{script}: this lab belongs to {tree}, but Python imports labkit from {mine} even with {tree} "
              f"first on the path; activate {tree}'s own environment", file=sys.stderr)
        sys.exit(2)
    if _prints():
        print(f"{script}: this lab file belongs to {tree}: running it with that tree's labkit "
              f"(this environment's `import labkit` is {mine}'s)", flush=True)
    env = dict(os.environ, **{REEXEC_ENV: str(tree)})
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(tree), env.get("PYTHONPATH", "")] if p)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


# ----------------------------------------------------------------------------- Ctrl-C

INTERRUPTED = 130   # 128 + SIGINT: what a shell reports for Ctrl-C


def quiet_interrupt() -> None:
    """Ctrl-C on a lab: one line and exit status 130, no traceback. The launch already
    stopped its ranks and its rank server while the KeyboardInterrupt unwound it."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if not issubclass(exc_type, KeyboardInterrupt):
            return previous(exc_type, exc, tb)
        script = Path(getattr(sys.modules.get("__main__"), "__file__", "") or "lab").name
        if _prints():
            print(f"{script}: interrupted; ranks stopped", file=sys.stderr)
        import atexit
        atexit._run_exitfuncs()   # what a normal exit runs (os._exit below would skip it)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(INTERRUPTED)

    sys.excepthook = hook


if _script_tree() is not None:   # imported by a lab script (not by a notebook or a test)
    run_on_the_scripts_tree()
    quiet_interrupt()


def lab_arguments(doc: str, lab: str | None = None) -> LabParser:
    """The shared options; ``lab`` (default: from the script's file name) picks the sizes."""
    lab = lab or lab_number()
    sizes = WORLD_SIZES.get(lab or "")
    parser = LabParser(description=doc.split("\n\n")[0])
    parser.lab = lab
    parser.add_argument("--world-size", type=int, default=2, metavar="N",
                        help="ranks to start without torchrun (torchrun's WORLD_SIZE wins); default 2"
                        + (f"; this lab runs on {sizes.describe()}" if sizes else ""))
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
