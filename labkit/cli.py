"""The ``labkit`` command: grade, bench, tasks, workspace."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from labkit import grading, workspace


def cmd_grade(args) -> int:
    root = workspace.course_root()
    files = grading.grading_files(args.chapters, root)
    records = grading.run_tests(files, root, extra_args=["-k", args.k] if args.k else [])
    scores = grading.score_by_task(records)
    print()
    print(grading.format_table(scores))
    if args.json:
        Path(args.json).write_text(json.dumps(grading.gradescope_results(records), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if all(s.score == s.max_score for s in scores) else 1


def cmd_bench(args) -> int:
    from labkit import bench
    options = {k: v for k, v in (("repeats", args.repeats), ("world_size", args.world_size)) if v}
    print(bench.format_table(bench.run(args.rows, **options)))
    return 0


def cmd_tasks(args) -> int:
    root = workspace.course_root()
    regions = workspace.all_regions(root / "labkit")
    if not regions:  # a learner workspace: the regions are stubs now; list from the marker
        for task in sorted(grading.known_tasks(root)):
            print(task)
        return 0
    for region in regions:
        where = f"{region.path.relative_to(root)}:{region.begin + 1}"
        print(f"{region.task:<28} {where:<30} {region.hint}")
    return 0


def cmd_workspace(args) -> int:
    regions = workspace.make_workspace(Path(args.dest), force=args.force)
    tasks = sorted({r.task for r in regions})
    print(f"learner workspace written to {args.dest}: {len(regions)} solution regions "
          f"stubbed across {len(tasks)} tasks")
    print(f"next: cd {args.dest} && pip install -e . && labkit grade")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="labkit", description="Parallelism Labs tools")
    sub = parser.add_subparsers(dest="command", required=True)

    grade = sub.add_parser("grade", help="run the graded tests and print points per task")
    grade.add_argument("chapters", nargs="*", help="chapter numbers or names (default: all)")
    grade.add_argument("--json", metavar="PATH", help="also write Gradescope's results.json here")
    grade.add_argument("-k", metavar="EXPR", help="only tests matching this pytest -k expression")
    grade.set_defaults(run=cmd_grade)

    bench = sub.add_parser("bench", help="time course implementations against PyTorch built-ins")
    bench.add_argument("rows", nargs="*", help="rows to run (default: all)")
    bench.add_argument("--repeats", type=int, help="timed repetitions per side")
    bench.add_argument("--world-size", type=int, help="ranks")
    bench.set_defaults(run=cmd_bench)

    tasks = sub.add_parser("tasks", help="list the exercises: task id, file and line, hint")
    tasks.set_defaults(run=cmd_tasks)

    ws = sub.add_parser("workspace", help="write a learner workspace with every solution stubbed")
    ws.add_argument("dest", help="directory to create")
    ws.add_argument("--force", action="store_true", help="replace dest if it exists")
    ws.set_defaults(run=cmd_workspace)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileExistsError, RuntimeError) as error:
        print(f"labkit {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
