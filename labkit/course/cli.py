"""The ``labkit`` command: grade, coverage, tasks, workspace, autograder, mutate, bench, doctor.

Every command works on the course tree you stand in (a clone or a learner workspace; the
nearest parent folder with ``labkit/``, ``tests/grading/`` and ``pyproject.toml``), or the
one ``--root`` names, whichever ``labkit`` happens to be installed: if Python imported
labkit from another tree, the command runs itself again with that tree's code first on
the path. Grading a stubbed workspace with the reference solutions (or the other way round)
is therefore impossible, and the header says which tree was used.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from labkit.course import grading, workspace
from labkit.course.chapters import file_label

REEXEC_ENV = "LABKIT_CLI_TREE"  # set when the command re-ran itself on another tree


def tree_label(root: Path) -> str:
    kind = "learner workspace" if workspace.is_student_workspace(root) else "reference solutions"
    return f"{root} ({kind})"


# ----------------------------------------------------------------------------- commands


def _writable_file(path: str) -> None:
    """ValueError unless ``path`` can be written (checked before grading, not after)."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise ValueError(f"--json {path} is a folder; name a file in it (e.g. {target / 'results.json'})")
    folder = target.parent if str(target.parent) else Path(".")
    file_above = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if file_above is not None:
        raise ValueError(f"--json {path}: {file_above} is a file, not a folder; pick another path")
    if not folder.is_dir():
        raise ValueError(f"--json {path}: the folder {folder} does not exist; create it or pick another path")
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ValueError(f"--json {path}: no permission to write there")


def cmd_grade(args, root: Path) -> int:
    chapters, tasks = grading.resolve_selection(args.selection, root)   # exit 2 on a bad name, at once
    if args.json:
        _writable_file(args.json)
    files = grading.grading_files(chapters, root)
    print(f"labkit grade: grading {tree_label(root)}")
    print(f"  tests: {', '.join(str(f.relative_to(root)) for f in files)}"
          + (f"; tasks: {', '.join(tasks)}" if tasks else ""), flush=True)
    extra = ["-k", args.k] if args.k else []
    if args.judge:  # as the autograder grades: the policy first, nothing of the submission in this process
        from labkit.course import judge
        broken = judge.check_submission(root / "labkit", chapters or None)
        for module, found in broken.items():
            print(f"POLICY {file_label(root / 'labkit', module)}: none of its tasks earn points:\n"
                  + "\n".join(f"  {v}" for v in found))
    records, output = grading.run_tests(files, root, extra, tasks, verbose=args.verbose, judge=args.judge)
    if not records and output:  # nothing graded: say why (an import error, a broken environment)
        print("\nno graded test ran; pytest said:\n" + "\n".join(output.rstrip().splitlines()[-25:]))
    if any(r["outcome"] != "passed" for r in records) and not args.verbose:
        print()
        print(with_stub_places(grading.failure_report(records), root))
        print("\n(labkit grade --verbose shows full tracebacks and every rank's stack)")
    scores = grading.score_by_task(records)
    print()
    print(grading.format_table(scores), flush=True)   # first: nothing after it can lose it
    status = 0 if scores and all(s.score == s.max_score for s in scores) else 1
    if args.json:
        try:
            Path(args.json).expanduser().write_text(json.dumps(grading.gradescope_results(records), indent=2) + "\n")
            print(f"wrote {args.json}")
        except OSError as error:
            print(f"labkit grade: could not write {args.json}: {error.strerror or error}", file=sys.stderr)
            status = 2
    print(f"graded: {tree_label(root)}")
    return status


def with_stub_places(report: str, root: Path) -> str:
    """Every ``NOT IMPLEMENTED <task>`` line says where the stub is: a test that calls the
    exercise in the test process (no rank, no frame from a rank's traceback) gets its
    ``labkit/<module>.py:<line>`` from the tree, as ``labkit tasks`` shows it."""
    from labkit.course import catalog
    places = None
    lines = []
    for line in report.splitlines():
        if line.startswith("NOT IMPLEMENTED ") and " · " not in line:
            places = places or {t.task: t.where for t in catalog.tasks(root)}
            task = line.removeprefix("NOT IMPLEMENTED ").split(":")[0]
            if ":" in places.get(task, ""):
                line += f" · {places[task]}"
        lines.append(line)
    return "\n".join(lines)


def cmd_coverage(args, root: Path) -> int:
    import tempfile

    from labkit.course import coverage
    if workspace.is_student_workspace(root):
        raise ValueError("coverage measures the reference solutions: run it in a clone, not a workspace")
    chapters, tasks = grading.resolve_selection(args.selection, root)   # a typo: exit 2, a did-you-mean
    files = grading.grading_files(chapters, root)
    modules = {f.stem.removeprefix("test_") for f in files}
    wanted = tasks or sorted((t for t in grading.known_tasks(root) if t.split(".")[0] in modules),
                             key=grading.task_order)
    print(f"labkit coverage: the graded tests of {', '.join(wanted)} on {tree_label(root)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="labkit-coverage-") as folder:
        env = {k: v for k, v in os.environ.items() if k != coverage.OWNER_ENV}
        env[coverage.DIR_ENV] = folder
        extra = ["-k", args.k] if args.k else []
        records, _ = grading.run_tests(files, root, extra, tasks, env=env)
        results, errors = coverage.measure(folder, root, wanted)
    failed = [r for r in records if r["outcome"] == "failed"]
    print()
    print(coverage.format_report(results, errors))
    if failed:
        print(f"{len(failed)} graded test(s) failed, so the coverage above is partial: labkit grade says why")
    return 0 if not failed and not errors and all(r.complete for r in results) else 1


def cmd_tasks(args, root: Path) -> int:
    from labkit.course import catalog
    infos = catalog.tasks(root)
    if not infos:
        raise RuntimeError(f"no exercises found in {root / 'labkit'}")
    if args.selection:  # `labkit tasks moe`, `labkit tasks memory moe.router`: checked like grade's
        grading.resolve_selection(args.selection, root)   # exit 2 with a did-you-mean on a bad name
        whole = {grading.chapter_module(name) for name in args.selection} - {None}
        infos = [t for t in infos if t.task in args.selection or t.task.split(".")[0] in whole]
    print(f"exercises in {tree_label(root)}  (grade one: labkit grade <task id>)")
    if args.contracts:   # what each exercise may write or consume, the grader's catalogue
        from labkit.course import contracts
        modules = list(dict.fromkeys(t.task.split(".")[0] for t in infos))
        print("while grading, every call of an exercise leaves the caller's tensors, the global random "
              "generators and its module's state as they were, except:")
        for module in modules:
            for line in contracts.describe(module + "."):
                print(f"  {line}")
        print("  (any nn.Module __init__ may draw its initial weights from torch's global generator)")
        return 0
    print(catalog.format_tasks(infos))
    print("points: a task earns them only when all of its tests pass, at every world size")
    for line in catalog.format_earlier(root, list(dict.fromkeys(t.chapter for t in infos))):
        print(line)   # what a lab also needs: a stub there says "not implemented yet" in that lab
    listed = {t.task for t in infos}
    hidden = {t: p for t, p in catalog.static_points(root, visible=False).items() if p and t in listed}
    total = sum(t.points or 0 for t in infos)
    if hidden:
        print(f"total {total:g} points, of which {sum(hidden.values()):g} from hidden tests "
              f"(tests/grading/hidden/: {', '.join(sorted(hidden))}); `labkit grade` and the autograder "
              "count them, learner workspaces do not have them")
    else:
        print(f"total {total:g} points in this tree; an autograder built from the course's clone may add "
              "hidden tests (its tests/grading/hidden/), so a course's total can be higher than this")
    return 0


def cmd_workspace(args, root: Path) -> int:
    try:
        regions = workspace.make_workspace(Path(args.dest), root=root, force=args.force)
        from labkit.course import catalog
        catalog.write_uses(root, Path(args.dest))   # what each lab runs of other chapters, read before the stubs
    except OSError as error:   # a folder it may not create, a disk full, a file in the way
        where = f" ({error.filename})" if error.filename else ""
        raise ValueError(f"cannot write the workspace at {args.dest}: {error.strerror or error}{where}") from None
    tasks = sorted({r.task for r in regions})
    print(f"learner workspace written to {args.dest}: {len(regions)} solution regions "
          f"stubbed across {len(tasks)} tasks")
    print(f"next, in an environment of its own (with this clone's torch build, from {workspace.TORCH_FILE}): "
          f"cd {args.dest} && python3 -m venv .venv && . .venv/bin/activate && "
          f"{workspace.INSTALL_LINE} && labkit tasks")
    return 0


def cmd_autograder(args, root: Path) -> int:
    from labkit.course import autograder
    bundle = autograder.make_bundle(Path(args.output), root, args.chapters, timeout=args.timeout)
    print(f"Gradescope autograder for {', '.join(args.chapters) or 'every chapter'} "
          f"written to {bundle} (from {tree_label(root)})")
    return 0


def cmd_doctor(args, root: Path | None) -> int:
    from labkit.course import doctor
    return doctor.main(args.world_size, args.megabytes, args.repeats, run=not args.no_run)


def cmd_bench(args, root: Path | None) -> int:
    from labkit.course import bench
    from labkit.course.bench.runner import FAILED, SIZES, check_names
    check_names(args.rows)   # a typo: exit 2 before anything prints or runs
    if args.list:
        width = max(map(len, bench.ROWS)) + 2
        for name, fn in bench.ROWS.items():
            doc = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
            sizes = SIZES.get(name)
            fits = f"  [ranks: {', '.join(str(n) for n in range(1, 17) if sizes[0](n))}]" if sizes else ""
            print(f"{name:<{width}}{doc}{fits}")
        return 0
    if args.world_size is not None and args.world_size < 1:
        raise ValueError(f"--world-size {args.world_size}: a world size is at least 1")
    if root is not None:
        print(f"labkit bench: the implementations of {tree_label(root)}", flush=True)
    options = {k: v for k, v in (("repeats", args.repeats), ("world_size", args.world_size)) if v}
    results = bench.run(args.rows, **options)
    print(bench.format_table(results))
    return 1 if any(isinstance(r, str) and f": {FAILED} " in r for r in results) else 0


# ----------------------------------------------------------------------------- parser


def cmd_mutate(args, root: Path) -> int:
    from labkit.course import automut
    return automut.run(root, args.selection, sample=args.sample, seed=args.seed, jobs=args.jobs,
                       timeout=args.timeout, batch=args.batch, list_only=args.list, ids=args.id)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="labkit", description="Parallelism Labs tools")
    parser.add_argument("--root", help="the course tree to use (default: the one you are in)")
    sub = parser.add_subparsers(dest="command", required=True)

    grade = sub.add_parser("grade", help="run the graded tests and print points per task")
    grade.add_argument("selection", nargs="*", metavar="chapter|task",
                       help="chapters by number, module, title or lab name (12, recompute, memory, "
                            "12_memory) or task ids (ddp.bucketed); default: all")
    grade.add_argument("--json", metavar="PATH", help="also write Gradescope's results.json here")
    grade.add_argument("-k", metavar="EXPR", help="only tests matching this pytest -k expression")
    grade.add_argument("--verbose", "-v", action="store_true", help="pytest's full output and tracebacks")
    grade.add_argument("--judge", action="store_true",
                       help="grade as the autograder does: the submission policy first, no submitted module "
                            "in the grading process, results as plain data (labkit.course.judge)")
    grade.set_defaults(run=cmd_grade)

    cov = sub.add_parser("coverage", help="lines and branches of each task's solution regions its own tests run")
    cov.add_argument("selection", nargs="*", metavar="chapter|task",
                     help="chapter numbers or names (10, moe) or task ids (moe.router); default: all")
    cov.add_argument("-k", metavar="EXPR", help="only tests matching this pytest -k expression")
    cov.set_defaults(run=cmd_coverage)

    tasks = sub.add_parser("tasks", help="list the exercises: task id, file and line, hint")
    tasks.add_argument("selection", nargs="*", metavar="chapter|task",
                       help="only these chapters (10, moe, memory) or task ids; default: all")
    tasks.add_argument("--contracts", action="store_true",
                       help="what each exercise may write or consume (the grader checks every call)")
    tasks.set_defaults(run=cmd_tasks)

    ws = sub.add_parser("workspace", help="write a learner workspace with every solution stubbed")
    ws.add_argument("dest", help="directory to create")
    ws.add_argument("--force", action="store_true", help="replace dest if it exists")
    ws.set_defaults(run=cmd_workspace)

    ag = sub.add_parser("autograder", help="build a Gradescope autograder bundle (zip)")
    ag.add_argument("chapters", nargs="*", help="chapters to grade (default: all)")
    ag.add_argument("-o", "--output", default="autograder.zip", help="zip to write")
    ag.add_argument("--timeout", type=float, default=60, help="seconds per graded launch")
    ag.set_defaults(run=cmd_autograder)

    mutate = sub.add_parser("mutate", help="grade mechanical mutations of every solution region; print survivors")
    mutate.add_argument("selection", nargs="*", metavar="chapter|task",
                        help="chapter numbers or names (10, moe) or task ids (moe.router); default: all")
    mutate.add_argument("--sample", type=int, metavar="N", help="only N mutants per task, at random")
    mutate.add_argument("--seed", type=int, default=0, help="seed of --sample")
    mutate.add_argument("--jobs", "-j", type=int, default=2, help="pytest processes at once")
    mutate.add_argument("--timeout", type=float, default=600,
                        help="seconds per mutant; one that takes longer counts as killed (and is named)")
    mutate.add_argument("--batch", type=int, default=8, help="mutants of one task per pytest process")
    mutate.add_argument("--id", action="append", default=[], metavar="ID",
                        help="only this mutant (<task>/<op>/<hash>, as printed; repeatable)")
    mutate.add_argument("--list", action="store_true", help="only list the mutants")
    mutate.set_defaults(run=cmd_mutate)

    doctor = sub.add_parser("doctor", help="versions, GPUs, the backend launch picks, and a measured all-reduce")
    doctor.add_argument("--world-size", type=int, help="ranks for the measurement (default: GPUs, or 2)")
    doctor.add_argument("--megabytes", type=float, default=16, help="message size")
    doctor.add_argument("--repeats", type=int, default=5, help="timed repetitions")
    doctor.add_argument("--no-run", action="store_true", help="only the facts; start no process")
    doctor.set_defaults(run=cmd_doctor, outside_ok=True)

    bench = sub.add_parser(
        "bench", help="time course implementations against PyTorch built-ins",
        description="Each row times a course implementation against the PyTorch built-in in one launch, "
                    "interleaved, and prints medians, ours / torch, and the bytes one rank sent next to "
                    "the formula; an indented line under a row holds its own figures, explained under "
                    "the table.")
    bench.add_argument("rows", nargs="*", help="rows to run (default: all; --list names them)")
    bench.add_argument("--repeats", type=int, metavar="N",
                       help="timed repetitions per side (default: each row's own, 5 to 51)")
    bench.add_argument("--world-size", type=int, metavar="N",
                       help="ranks for every row (default: each row's own, mostly 2); a row that cannot "
                            "take N is skipped with a line saying why")
    bench.add_argument("--list", action="store_true", help="list the rows, and the sizes each takes, and exit")
    bench.set_defaults(run=cmd_bench, outside_ok=True)
    return parser


def _reexec_on(root: Path, argv: list[str]) -> None:
    """Run this command again with ``root``'s labkit first on the path (never returns)."""
    env = dict(os.environ, **{REEXEC_ENV: str(root), REEXEC_ENV + "_FROM": str(workspace.package_dir().parent)})
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(root), env.get("PYTHONPATH", "")] if p)
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "labkit.course.cli", *argv], env)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    root = workspace.find_course_root(Path(args.root) if args.root else None)
    if args.root and (root is None or root != Path(args.root).resolve()):
        print(f"labkit {args.command}: {args.root} is not a course tree "
              "(a clone or a learner workspace: labkit/, tests/grading/, pyproject.toml)", file=sys.stderr)
        return 2
    if root is None and not getattr(args, "outside_ok", False):
        print(f"labkit {args.command}: {Path.cwd()} is not inside a course tree. cd into your clone "
              "or your learner workspace (labkit workspace DEST makes one), or pass --root PATH.",
              file=sys.stderr)
        return 2
    if root is not None and workspace.package_dir().parent != root:
        if os.environ.get(REEXEC_ENV) == str(root):
            print(f"labkit {args.command}: could not import labkit from {root}", file=sys.stderr)
            return 2
        _reexec_on(root, argv)
    installed = os.environ.get(REEXEC_ENV + "_FROM")
    if root is not None and os.environ.get(REEXEC_ENV) == str(root) and installed and installed != str(root):
        print(f"labkit {args.command}: using {root}'s labkit, the tree you are in "
              f"(this environment's `import labkit` is {installed}'s)", flush=True)
    interrupted, previous = _on_interrupt()
    try:
        status = args.run(args, root)
        sys.stdout.flush()   # here, where a closed pipe is caught, not at exit
    except KeyboardInterrupt:
        status = INTERRUPTED
    except BrokenPipeError:   # `labkit tasks | head`: the reader has all it wanted
        _silence(sys.stdout)
        return 1
    except (ValueError, FileExistsError, RuntimeError) as error:
        if interrupted.is_set():   # the child pytest was interrupted too: that is all there is to say
            status = INTERRUPTED
        else:
            print(f"labkit {args.command}: {error}", file=sys.stderr)
            return 2
    finally:
        if previous is not None:   # main() called in a process of its own making (a test): give it back
            import signal
            signal.signal(signal.SIGINT, previous)
    if interrupted.is_set() or status == INTERRUPTED:
        print(f"labkit {args.command}: interrupted; ranks stopped", file=sys.stderr)
        return INTERRUPTED
    return status


INTERRUPTED = 130   # 128 + SIGINT, what a shell reports for Ctrl-C


def _silence(stream) -> None:
    """Point ``stream``'s file descriptor at /dev/null (nothing more reaches the reader)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _children() -> list[int]:
    """The pids of this process's live children (a grading pytest, a mutant batch)."""
    me, found = str(os.getpid()), []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z":
            found.append(int(entry.parent.name))
    return found


def _on_interrupt():
    """Ctrl-C: a terminal sends SIGINT to this process and to the pytest it runs (same
    process group). While such a child runs, let it stop its ranks and exit, and say nothing
    more than one line afterwards; otherwise stop at once (KeyboardInterrupt)."""
    import signal
    import threading
    interrupted = threading.Event()

    def handler(signum, frame):
        if interrupted.is_set() or not Path("/proc/self").exists() or not _children():
            raise KeyboardInterrupt
        interrupted.set()
        sys.stdout.flush()
        _silence(sys.stdout)   # no partial score table: the run did not finish

    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGINT, handler)
    return interrupted, previous


if __name__ == "__main__":
    sys.exit(main())
