"""A Gradescope autograder made from the course: ``labkit autograder [chapters] -o autograder.zip``.

The zip holds what Gradescope asks for at its top level, ``setup.sh`` (builds the image once)
and ``run_autograder`` (runs per submission), next to the *student release* of the course
(every solution stubbed, as ``labkit workspace`` makes it) and ``autograder.json`` (which
chapters, the time limit per graded launch). Gradescope unpacks it in ``/autograder/source``
and puts the student's files in ``/autograder/submission``. For each submission we

1. copy the release to a scratch tree and drop in the submitted exercise modules
   (``collectives.py``, ``ddp.py``, ... found anywhere in the submission; nothing else:
   a submission cannot replace the grading code);
2. read every submitted module against the policy (``labkit.course.policy``) before anything
   runs: a module that breaks it earns none of its tasks' points, and each breach is listed;
3. grade the chosen chapters there as ``labkit grade --judge`` does (``labkit.course.judge``):
   the process that records the score imports no submitted module, results cross as plain
   data, and, as root (Gradescope), the ranks run as the unprivileged ``labkit-student`` and
   every process of that user is killed before the report is read;
4. write ``/autograder/results/results.json`` whatever happens: a hung or crashing
   submission still gets its score, and a broken grading run gets a score of 0 that says why.
   ``extra_data.flagged`` lists, for the instructor, every policy breach and every result or
   error file the launcher did not write (the same lines lead ``output``).

``AUTOGRADER_ROOT`` (default ``/autograder``) and ``AUTOGRADER_PYTHON`` let a test run the
same script in a simulated layout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
import zipfile
from pathlib import Path

from labkit.course import catalog, grading, judge, workspace
from labkit.course.chapters import exercise_files as exercise_files_of
from labkit.course.chapters import file_label
from labkit.runtime import sandbox

CONFIG = "autograder.json"
RELEASE_PARTS = ["labkit", "tests", "pyproject.toml", "README.md", workspace.MARKER_FILE]

SETUP_SH = """#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder image. The course needs
# Python >= 3.11 (its pins have no wheels for 3.10, Ubuntu 22.04's python3): when the image's
# python3 is older, install the distribution's python3.11 and use that.
# LABKIT_SETUP_CHECK=1: only say which Python would be used (tests/test_autograder.py).
set -euo pipefail
cd "${AUTOGRADER_ROOT:-/autograder}/source"
PY=python3
if ! command -v python3 >/dev/null || ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    PY=python3.11
    apt-get update && apt-get install -y python3.11 python3.11-venv
elif ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
    apt-get update && apt-get install -y "python3.$(python3 -c 'import sys; print(sys.version_info[1])')-venv"
fi
"$PY" -c 'import sys; assert sys.version_info >= (3, 11), sys.version'
if [ "${LABKIT_SETUP_CHECK:-}" = 1 ]; then
    echo "python: $(command -v "$PY") $("$PY" -c 'import platform; print(platform.python_version())')"
    exit 0
fi
"$PY" -m venv /autograder/venv
# The CPU build of torch: the default one on Linux pulls several GB of CUDA libraries.
/autograder/venv/bin/pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
/autograder/venv/bin/pip install -e /autograder/source
"""

RUN_AUTOGRADER = """#!/usr/bin/env bash
# Gradescope runs this for every submission. It always writes results/results.json.
AG="${AUTOGRADER_ROOT:-/autograder}"
PY="${AUTOGRADER_PYTHON:-$AG/venv/bin/python}"
cd "$AG/source"
exec "$PY" -m labkit.course.autograder run --source "$AG/source" \\
    --submission "$AG/submission" --results "$AG/results/results.json"
"""


# ----------------------------------------------------------------------------- building


def make_bundle(output: Path, root: Path, chapters: list[str], timeout: float = 60) -> Path:
    """Write the autograder zip for ``chapters`` (all if empty) of the course at ``root``."""
    if workspace.is_student_workspace(root):
        raise ValueError("build the autograder from the course with the reference solutions, "
                         "not from a learner workspace")
    files = grading.grading_files(chapters, root)  # fails early on an unknown chapter
    output = Path(output).resolve()
    with tempfile.TemporaryDirectory(prefix="labkit-autograder-") as tmp:
        release = Path(tmp) / "release"
        workspace.make_workspace(release, root=root)
        catalog.write_uses(root, release)   # the labs' uses of other chapters, as a learner workspace has them
        hidden = root / "tests" / "grading" / grading.HIDDEN_DIR  # graded, never in a student release
        if hidden.is_dir():
            shutil.copytree(hidden, release / "tests" / "grading" / grading.HIDDEN_DIR,
                            ignore=shutil.ignore_patterns("__pycache__"))
        output.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(output, "w", zipfile.ZIP_DEFLATED) as bundle:
            for name, text in (("setup.sh", SETUP_SH), ("run_autograder", RUN_AUTOGRADER)):
                info = zipfile.ZipInfo(name)
                info.external_attr = 0o755 << 16  # executable once unpacked
                bundle.writestr(info, text)
            chapters = list(dict.fromkeys(f.stem.removeprefix("test_") for f in files))  # hidden files too
            config = dict(chapters=chapters, timeout=timeout, tests=_graded_tests(release, chapters))
            bundle.writestr(CONFIG, json.dumps(config, indent=1) + "\n")
            for part in RELEASE_PARTS:
                path = release / part
                for file in sorted(path.rglob("*") if path.is_dir() else [path]):
                    if file.is_file() and "__pycache__" not in file.parts:
                        bundle.write(file, file.relative_to(release).as_posix())
    return output


def _graded_tests(release: Path, chapters: list[str]) -> list[dict]:
    """The bundle's graded tests (name, task, points), collected once in the release (nothing runs)."""
    listing = release / "graded-tests.json"
    env = dict(os.environ, PYTHONPATH=str(release), **{judge.COLLECT_ENV: str(listing)})
    files = grading.grading_files(chapters, release)
    subprocess.run([sys.executable, "-m", "pytest", *map(str, files), "-p", "no:cacheprovider", "-o", "addopts=",
                    f"--rootdir={release}", "-p", "labkit.course.judge", "-q", "-p", "no:xdist"],
                   cwd=release, env=env, capture_output=True, check=False)
    if not listing.exists():
        raise RuntimeError("could not list the bundle's graded tests")
    tests = json.loads(listing.read_text())
    listing.unlink()
    return tests


# ----------------------------------------------------------------------------- running


def exercise_files(submission: Path, package: Path) -> dict[str, Path]:
    """Submitted exercise files by their path below ``labkit/`` in the release ``package``:
    ``pp.py``, or ``compress/topk.py`` for a file of a chapter package. A file counts where its
    path ends with that one (``labkit/`` itself may be missing); a loose file of a chapter
    package counts by its name alone when no other exercise file has that name. The deepest
    match wins, then the one in a ``labkit`` folder."""
    wanted = [f.relative_to(package) for m in grading.CHAPTERS.values() for f in exercise_files_of(package, m)]
    names = [w.name for w in wanted]
    loose = {w.name: w for w in wanted if len(w.parts) > 1 and names.count(w.name) == 1 and w.name != "__init__.py"}
    found: dict[str, tuple] = {}
    for path in submission.rglob("*.py"):
        parts = path.relative_to(submission).parts
        for rel in wanted:
            exact = tuple(parts[-len(rel.parts):]) == rel.parts
            if exact or loose.get(path.name) == rel:
                rank = (exact, len(rel.parts) if exact else 0, "labkit" in parts[:-1], -len(parts))
                key = rel.as_posix()
                if key not in found or rank > found[key][0]:
                    found[key] = (rank, path)
    return {key: path for key, (_, path) in sorted(found.items())}


def grade_submission(source: Path, submission: Path, results: Path) -> dict:
    """Grade one submission against the release in ``source``; write and return results."""
    config = json.loads((source / CONFIG).read_text())
    with tempfile.TemporaryDirectory(prefix="labkit-submission-") as tmp:
        tree = Path(tmp) / "course"
        shutil.copytree(source, tree, ignore=shutil.ignore_patterns("__pycache__"))
        submitted = exercise_files(submission, tree / "labkit")
        labels = {m: file_label(tree / "labkit", m) for m in grading.CHAPTERS.values()}
        if not submitted:
            return _write(results, dict(score=0.0, output=(
                "No exercise files found in the submission: upload your labkit/*.py "
                f"({', '.join(labels[m] for m in config['chapters'])}).")))
        for name, path in submitted.items():
            shutil.copy(path, tree / "labkit" / name)
        broken = judge.check_submission(tree / "labkit", list(dict.fromkeys(n.split("/")[0].removesuffix(".py")
                                                                          for n in submitted)))
        flagged = [f"policy: {v}" for vs in broken.values() for v in vs]
        env = dict(os.environ, **{grading.TIMEOUT_ENV: str(config["timeout"])})
        isolated = judge.isolation(Path(tmp))  # as root: the ranks run as another user
        env.update(isolated)
        os.environ.update(isolated, **({judge.JUDGE_ENV: "1"} if isolated else {}))  # run_tests kills that user's processes
        records = judge.policy_records(config.get("tests", []), broken)  # scored without running
        done = {r["task"].split(".")[0] for r in records}
        left = [m for m in config["chapters"] if m not in done]
        if left:
            records += grading.run_tests(grading.grading_files(left, tree), tree, progress=False, env=env,
                                         judge=True)[0]
    out = grading.gradescope_results(records)
    flagged += [f"runtime: {t['name']}: " + next(line for line in t["output"].splitlines() if sandbox.FLAG in line)
                for t in out["tests"] if sandbox.FLAG in t["output"]]
    out["output"] = (f"Graded {', '.join(sorted(submitted))} on chapters {', '.join(config['chapters'])}: "
                     f"{out['score']:g}/{out['max_score']:g}.")
    if broken:
        out["output"] = (f"Not graded: {', '.join(labels[m] for m in broken)} "
                         f"{'break' if len(broken) > 1 else 'breaks'} the policy for exercise modules "
                         "(labkit/course/policy.py says what an exercise may use), so none of their tasks "
                         "earn points:\n" + "\n".join(f"  {v}" for vs in broken.values() for v in vs)
                         + "\n\n" + out["output"])
    out["extra_data"] = dict(flagged=flagged)
    return _write(results, out)


def _write(results: Path, content: dict) -> dict:
    results.parent.mkdir(parents=True, exist_ok=True)
    tmp = results.with_suffix(".tmp")
    tmp.write_text(json.dumps(content, indent=2) + "\n")
    os.replace(tmp, results)
    return content


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit.course.autograder")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="grade one submission (what run_autograder calls)")
    run.add_argument("--source", type=Path, required=True)
    run.add_argument("--submission", type=Path, required=True)
    run.add_argument("--results", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        results = grade_submission(args.source, args.submission, args.results)
    except Exception:  # noqa: BLE001 - the student must always get a results.json
        _write(args.results, dict(score=0.0, output="The autograder failed; tell your instructor.\n\n"
                                  + traceback.format_exc()[-3000:]))
        raise
    print(f"score {results['score']:g}" + (f"/{results['max_score']:g}" if "max_score" in results else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
