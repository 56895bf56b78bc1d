"""The Gradescope bundle, end to end: ``labkit autograder 00`` is unpacked into a simulated
``/autograder`` layout and ``run_autograder`` grades four submissions: the reference (full
marks), the stubs (zero), one whose all-gather hangs and one whose reduce-scatter exits its
rank. The last two lose exactly the tasks that use the broken function (a task scores only
when all of its tests pass), within the time limit per launch, and every run writes
``results/results.json``. The bundle carries the hidden tests a workspace lacks.
"""

import json
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from tests.conftest import needs_solutions

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 4  # seconds per graded launch in this bundle: a hang costs that, once per test

pytestmark = needs_solutions  # the bundle is built from the reference solutions


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundle") / "autograder.zip"
    proc = subprocess.run([sys.executable, "-m", "labkit.course.cli", "autograder", "00", "-o", str(out),
                           "--timeout", str(LIMIT)], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_the_bundle_has_what_gradescope_expects_and_no_solutions(bundle):
    with zipfile.ZipFile(bundle) as z:
        names = set(z.namelist())
        assert {"setup.sh", "run_autograder", "autograder.json", "labkit/collectives.py",
                "tests/grading/test_collectives.py", ".labkit-workspace",
                "tests/grading/hidden/test_collectives.py"} <= names
        assert not any(n.startswith("tests/mutants/") for n in names), "the mutants quote the solutions"
        assert z.getinfo("run_autograder").external_attr >> 16 & 0o111, "run_autograder must be executable"
        config = json.loads(z.read("autograder.json"))
        assert {k: config[k] for k in ("chapters", "timeout")} == {"chapters": ["collectives"], "timeout": LIMIT}
        assert sum(t["points"] for t in config["tests"]) == MAX_SCORE, config["tests"]
        exercises = [n for n in names if re.fullmatch(r"labkit/\w+\.py", n) and b"NotImplementedError(" in z.read(n)]
        assert "labkit/collectives.py" in exercises
        for name in exercises:
            assert b"# BEGIN SOLUTION" not in z.read(name), f"{name} carries a reference solution"


def reference_source() -> str:
    return (ROOT / "labkit" / "collectives.py").read_text()


def submissions() -> dict[str, tuple[str, str]]:
    """name -> (contents of collectives.py, where in the submission it goes)."""
    reference = reference_source()
    hang = reference.replace(
        "    chunks = output.view(n, -1)  # a view",
        "    import time; time.sleep(3600)  # hangs, and not in communication: only the timeout sees it\n"
        "    chunks = output.view(n, -1)  # a view")
    # A rank that exits mid-task (os.kill and os._exit break the policy: tests/test_cheats.py).
    kill = reference.replace(
        "    chunks = input.reshape(n, -1)\n",
        "    chunks = input.reshape(n, -1)\n    raise SystemExit(9)\n")
    assert hang != reference and kill != reference
    return {"reference": (reference, "labkit/collectives.py"), "stub": (None, "collectives.py"),
            "hang": (hang, "labkit/collectives.py"), "kill": (kill, "my files/collectives.py")}


# (score, tasks that must score nothing): chapter 00 carries 11 points, one per test at world
# sizes 2-4 and on subgroups, the hidden one included; world size 1 is a diagnostic. The
# all-reduce has its own reduce-scatter pass (in place, on a view of its chunks), so a
# reduce-scatter that exits costs only its own 3 points: 11 - 3 = 8.
MAX_SCORE = 11
EXPECTED = {"reference": (11, set()), "stub": (0, {"reduce_scatter", "all_gather", "all_reduce"}),
            "hang": (3, {"all_gather", "all_reduce"}), "kill": (8, {"reduce_scatter"})}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_run_autograder_scores_a_submission(bundle, tmp_path, name):
    root = tmp_path / "autograder"
    with zipfile.ZipFile(bundle) as z:
        z.extractall(root / "source")
    contents, where = submissions()[name]
    if contents is None:  # the stub as released
        contents = (root / "source" / "labkit" / "collectives.py").read_text()
    target = root / "submission" / where
    target.parent.mkdir(parents=True)
    target.write_text(contents)
    env = dict(os.environ, AUTOGRADER_ROOT=str(root), AUTOGRADER_PYTHON=sys.executable)
    env.pop("PYTHONPATH", None)
    start = time.monotonic()
    proc = subprocess.run(["bash", str(root / "source" / "run_autograder")], env=env,
                          capture_output=True, text=True, timeout=600)
    elapsed = time.monotonic() - start
    results_file = root / "results" / "results.json"
    assert results_file.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(results_file.read_text())
    assert results["extra_data"] == {"flagged": []}, "an honest submission is never flagged"
    score, failing = EXPECTED[name]
    assert (results["score"], results["max_score"]) == (score, MAX_SCORE), results.get("output")
    failed = {re.search(r"collectives\.(\w+)", t["name"])[1] for t in results["tests"]
              if t["score"] < t["max_score"]}
    assert failed == failing, [t["name"] for t in results["tests"] if t["score"] < t["max_score"]]
    hidden = [t for t in results["tests"] if "hidden" in t["name"]]
    assert len(hidden) == 1 and hidden[0]["visibility"] == "after_published", hidden
    if name == "hang":  # four hung tests (the hidden one too), each cut at the limit; the rest skip
        # Cut at the limit: a hang that escaped it sleeps an hour. 4 x LIMIT plus start-up is
        # about 40 s on a quiet machine and 83 s has been seen on a loaded one.
        assert elapsed < 300, f"{elapsed:.0f} s: a hung test was not cut at its {LIMIT}-s limit"
        hung = [t for t in results["tests"] if "no result within" in t["output"]]
        assert len(hung) == 4, [t["output"][:200] for t in results["tests"]]
        assert any("skipped: hung at world size 1" in t["output"] for t in results["tests"])
    if name == "kill":
        assert any("raised SystemExit: 9" in t["output"] for t in results["tests"]), results


# ----------------------------------------------------------------------------- setup.sh

PYENV = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"


def _pyenv_python(minor: int) -> Path | None:
    found = sorted(PYENV.glob(f"3.{minor}.*/bin/python3.{minor}"))
    return found[-1] if found else None


@pytest.mark.parametrize("minor, chosen, installs", [(10, "python3.11", True), (11, "python3", False),
                                                     (12, "python3", False)])
def test_setup_sh_uses_python_3_11_or_newer(tmp_path, minor, chosen, installs):
    """setup.sh on an image whose python3 is 3.10 (Gradescope's Ubuntu 22.04) installs the
    distribution's python3.11 and uses it; on 3.11 or newer it keeps python3. A stand-in
    python3 from pyenv and a stand-in apt-get (which 'installs' python3.11) on PATH."""
    from labkit.course.autograder import SETUP_SH
    old, new = _pyenv_python(minor), _pyenv_python(11)
    if old is None or new is None:
        pytest.skip(f"needs pyenv's Python 3.{minor} and 3.11 (stand-ins for the image's python3)")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(old)
    log = tmp_path / "apt.log"
    (bin_dir / "apt-get").write_text(f"""#!/bin/bash
echo "$@" >> {log}
if [[ "$*" == *"install"*"python3.11"* ]]; then /bin/ln -sf {new} {bin_dir}/python3.11; fi
""")
    (bin_dir / "apt-get").chmod(0o755)
    script = tmp_path / "setup.sh"
    script.write_text(SETUP_SH)
    (tmp_path / "source").mkdir()
    # PATH is the stand-ins alone: the script uses only bash built-ins, python3 and apt-get
    env = {"PATH": str(bin_dir), "AUTOGRADER_ROOT": str(tmp_path), "LABKIT_SETUP_CHECK": "1"}
    proc = subprocess.run(["/bin/bash", str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    used = proc.stdout.strip().split()
    assert used[0] == "python:" and Path(used[1]).name == chosen and used[2].startswith("3.1") \
        and int(used[2].split(".")[1]) >= 11, proc.stdout
    assert log.exists() == installs, log.read_text() if log.exists() else "apt-get not called"
    if installs:
        assert "install -y python3.11 python3.11-venv" in log.read_text()


def test_submitted_files_are_found_by_their_path_below_labkit(tmp_path):
    """A chapter package's files count at their path (``compress/topk.py``, with or without
    ``labkit/`` above), or loose by a name no other exercise file has; ``__init__.py`` only
    in its folder. A one-file chapter counts by its name, wherever it is."""
    from labkit.course.autograder import exercise_files
    package = ROOT / "labkit"
    upload = tmp_path / "upload"
    for rel in ("labkit/compress/powersgd.py", "my/compress/topk.py", "fp16.py", "__init__.py",
                "deep/pp.py", "labkit/dp.py", "dp.py", "notes/readme.py"):
        (upload / rel).parent.mkdir(parents=True, exist_ok=True)
        (upload / rel).write_text("# " + rel)
    found = {key: path.relative_to(upload).as_posix() for key, path in exercise_files(upload, package).items()}
    assert found == {"compress/powersgd.py": "labkit/compress/powersgd.py", "compress/topk.py": "my/compress/topk.py",
                     "compress/fp16.py": "fp16.py", "pp.py": "deep/pp.py", "dp.py": "labkit/dp.py"}
