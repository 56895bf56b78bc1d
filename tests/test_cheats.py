"""Cheating submissions through the autograder bundle, and the judge's runtime layers on their own.

Every cheat in tests/cheats (one trick each: the launcher's finished file written by a rank, a
pickled error file, a detached process rewriting the report, the tests' helpers patched at
import, built-ins reached around the rules, given code that solves a task, the plugin's records
patched through gc, a chapter-14 module reaching chapter 00) is graded by ``run_autograder``
exactly as Gradescope would: it scores 0 and results.json lists its trick's lines under
``extra_data.flagged``. The policy stops them before anything runs (a run costs a few seconds);
the tests after that show the layers behind the policy hold on their own: a forged result file
is refused and flagged, a pickled error file is never loaded, a detached grandchild does not
outlive its launch, and the judge's process refuses to import a submitted module.
"""

import ast
import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from labkit.course.chapters import exercise_files, relative_path
from tests.conftest import needs_solutions

ROOT = Path(__file__).resolve().parent.parent
CHEATS = sorted((ROOT / "tests" / "cheats").glob("*.py"))
MAX_SCORE = 11  # chapter 00, as in test_autograder


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundle") / "autograder.zip"
    proc = subprocess.run([sys.executable, "-m", "labkit.course.cli", "autograder", "00", "-o", str(out),
                           "--timeout", "4"], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def run_autograder(bundle: Path, root: Path, files: dict[str, str]) -> dict:
    with zipfile.ZipFile(bundle) as z:
        z.extractall(root / "source")
    for where, text in files.items():
        target = root / "submission" / where
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    env = dict(os.environ, AUTOGRADER_ROOT=str(root), AUTOGRADER_PYTHON=sys.executable)
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(["bash", str(root / "source" / "run_autograder")], env=env, capture_output=True,
                          text=True, timeout=600)
    results = root / "results" / "results.json"
    assert results.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(results.read_text())


@needs_solutions
@pytest.mark.parametrize("cheat", CHEATS, ids=[c.stem for c in CHEATS])
def test_a_cheat_scores_zero_and_is_flagged(bundle, tmp_path, cheat):
    module = cheat.stem.split("_")[0]
    where = submitted_as(module, cheat.read_text())
    files = {where: cheat.read_text()}
    if module != "collectives":  # another chapter's module beside the released stub of chapter 00
        files["labkit/collectives.py"] = zipfile.ZipFile(bundle).read("labkit/collectives.py").decode()
    results = run_autograder(bundle, tmp_path / "autograder", files)
    assert (results["score"], results["max_score"]) == (0, MAX_SCORE), results["output"][:2000]
    flagged = results["extra_data"]["flagged"]
    expected = ast.literal_eval(cheat.read_text().split("EXPECT = ", 1)[1].split("\n", 1)[0])
    lines = {int(f.split(":")[2]) for f in flagged if f.startswith(f"policy: {where}:")}
    assert lines == set(expected), flagged
    assert f"{where}:{expected[0]}" in results["output"], "the student reads why"


def submitted_as(module: str, source: str) -> str:
    """Where a cheat goes in the submission: ``labkit/<module>.py``, or in a chapter package the
    file that defines the first function the cheat defines (``labkit/perf/flops.py``)."""
    files = exercise_files(ROOT / "labkit", module)
    first = next(n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef))
    home = files[0] if len(files) == 1 else next(f for f in files if f"\ndef {first}(" in f.read_text())
    return relative_path(ROOT / "labkit", home)


# ----------------------------------------------------------------------------- behind the policy


def judge_script(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    """Run ``body`` (which launches) in a fresh process under the judge (LABKIT_JUDGE=1)."""
    script = tmp_path / "judge_script.py"
    script.write_text(textwrap.dedent(body))
    env = dict(os.environ, LABKIT_JUDGE="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)


RANK_CODE = '''
import os, sys, time, pickle
import torch
from labkit.launch import launch, WorkerError
from labkit.runtime import sandbox
sandbox.adopt_orphans()

def rundir():
    return os.path.dirname(os.readlink("/proc/self/fd/1"))

def forge_result():
    torch.save({"nonce": "guess", "value": None}, os.path.join(rundir(), "result_0.pt"))
    time.sleep(60)

class Exploit:
    def __reduce__(self):
        return (open, (sys.argv[1], "w"))

def plant_error_pickle():
    with open(os.path.join(rundir(), "error_0.pkl"), "wb") as f:
        pickle.dump(Exploit(), f)
    with open(os.path.join(rundir(), "error_0.json"), "w") as f:
        f.write("not json")
    os._exit(1)
'''


def test_a_forged_result_file_is_refused_and_flagged(tmp_path):
    proc = judge_script(tmp_path, RANK_CODE + '''
try:
    launch(forge_result, 1, timeout=30)
    print("ACCEPTED")
except sandbox.Tampered as error:
    print("REFUSED", error)
''')
    assert "REFUSED" in proc.stdout and sandbox_flag() in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_a_pickled_error_file_is_never_loaded(tmp_path):
    marker = tmp_path / "pwned"
    proc = judge_script(tmp_path, RANK_CODE + f'''
sys.argv[1:] = [{str(marker)!r}]
try:
    launch(plant_error_pickle, 1, timeout=30)
except WorkerError as error:
    print("FAILED", error.exc_type, error.message)
''')
    assert "FAILED Tampered" in proc.stdout and sandbox_flag() in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert not marker.exists(), "the grader unpickled a file the rank wrote"


def test_a_detached_grandchild_does_not_outlive_its_launch(tmp_path):
    proc = judge_script(tmp_path, RANK_CODE + '''
def grandchild():
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            with open("grandchild.pid", "w") as f:
                f.write(str(os.getpid()))
            time.sleep(120)
        os._exit(0)
    while not os.path.exists("grandchild.pid"):
        time.sleep(0.05)
launch(grandchild, 1, timeout=30)
pid = int(open("grandchild.pid").read())
time.sleep(0.2)
alive = os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
print("ALIVE" if alive else "GONE", pid)
''')
    assert "GONE" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_the_judges_process_never_imports_a_submitted_module(tmp_path):
    """In the pytest process of ``labkit grade --judge``, importing an exercise module raises
    SubmissionImport; the test is run again in a child, which may import it."""
    test_file = tmp_path / "test_inprocess.py"
    test_file.write_text(textwrap.dedent('''
        import sys
        from labkit.course.grading import task

        @task("perf.flops", points=1)
        def test_calls_perf_in_process():
            from labkit.perf import flops_per_token  # refused here; fine in the child
            assert "LABKIT_RANK" in __import__("os").environ, "ran in the judge's own process"
            assert callable(flops_per_token)
    '''))
    env = dict(os.environ, LABKIT_JUDGE="1", PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}")
    proc = subprocess.run([sys.executable, "-m", "pytest", str(test_file), "-p", "labkit.course.judge",
                           "-p", "no:cacheprovider", "-p", "no:xdist", "-q", f"--rootdir={ROOT}",
                           "-o", "addopts="], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]


def sandbox_flag() -> str:
    from labkit.runtime import sandbox
    return sandbox.FLAG


# ----------------------------------------------------------------------------- as root

def readable_python(tmp_path: Path) -> Path | None:
    """A Python the unprivileged user can run: the system's python3.X (this one's version)
    in a venv that sees this environment's packages (ours may live under /root)."""
    system = Path(f"/usr/bin/python3.{sys.version_info[1]}")
    if os.geteuid() != 0 or not system.exists():
        return None
    venv = tmp_path / "venv"
    subprocess.run([str(system), "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    site = next(p for p in sys.path if p.endswith("site-packages"))
    (venv / "lib" / f"python3.{sys.version_info[1]}" / "site-packages" / "course.pth").write_text(site + "\n")
    return venv / "bin" / "python"


def test_as_root_the_ranks_run_as_another_user_and_leave_nothing(tmp_path):
    python = readable_python(tmp_path)
    if python is None:
        pytest.skip("needs root and a system Python of this version (the isolation Gradescope gets)")
    from labkit.course import judge
    from labkit.runtime import sandbox
    judge.isolation(tmp_path)  # creates the user; lets it read tmp_path
    os.chmod(tmp_path, 0o755)
    import pwd
    entry = pwd.getpwnam(judge.STUDENT_USER)
    if sandbox.unreadable_by(entry.pw_uid, entry.pw_gid, [str(ROOT)]):
        pytest.skip(f"{ROOT} is not readable by another user (a workspace under pytest's 0700 tmp); "
                    "test_an_unreadable_course_is_refused_before_any_rank_starts covers that case")
    secret = tmp_path / "root-only"
    secret.mkdir(mode=0o700)
    script = tmp_path / "judge_script.py"
    script.write_text(textwrap.dedent(f'''
        import os, time
        from labkit.launch import launch, WorkerError
        from labkit.runtime import sandbox
        sandbox.adopt_orphans()

        def rank():
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    time.sleep(120)
                os._exit(0)
            try:
                open({str(secret / "report.json")!r}, "w")
                wrote = True
            except PermissionError:
                wrote = False
            return os.getuid(), wrote

        print("RANKS", launch(rank, 2, timeout=60))
        uid = sandbox.student()[0]
        print("LEFT", sandbox.processes_of(uid))
    '''))
    env = dict(os.environ, LABKIT_JUDGE="1", LABKIT_JUDGE_USER=judge.STUDENT_USER, PYTHONPATH=str(ROOT))
    proc = subprocess.run([str(python), str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    import pwd
    uid = pwd.getpwnam(judge.STUDENT_USER).pw_uid
    assert f"RANKS [({uid}, False), ({uid}, False)]" in proc.stdout, proc.stdout
    assert "LEFT []" in proc.stdout, proc.stdout
    assert not (secret / "report.json").exists()


def test_an_unreadable_course_is_refused_before_any_rank_starts(tmp_path, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("needs root (the ranks drop to another user only then)")
    from labkit.course import judge
    from labkit.launch import launch
    from labkit.runtime import sandbox
    judge.isolation(tmp_path)
    hidden = tmp_path / "private"
    (hidden / "labkit").mkdir(parents=True)
    hidden.chmod(0o700)
    monkeypatch.setenv("LABKIT_JUDGE", "1")
    monkeypatch.setenv("LABKIT_JUDGE_USER", judge.STUDENT_USER)
    monkeypatch.setattr(sandbox, "__file__", str(hidden / "labkit" / "runtime" / "sandbox.py"))
    with pytest.raises(PermissionError, match=f"{judge.STUDENT_USER}.*cannot read {hidden / 'labkit'}"):
        launch(os.getpid, 2, timeout=30)


@needs_solutions
def test_as_root_the_reference_still_scores_full(bundle, tmp_path):
    python = readable_python(tmp_path)
    if python is None:
        pytest.skip("needs root and a system Python of this version (the isolation Gradescope gets)")
    root = tmp_path / "autograder"
    with zipfile.ZipFile(bundle) as z:
        z.extractall(root / "source")
    (root / "submission").mkdir()
    (root / "submission" / "collectives.py").write_text((ROOT / "labkit" / "collectives.py").read_text())
    env = dict(os.environ, AUTOGRADER_ROOT=str(root), AUTOGRADER_PYTHON=str(python))
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(["bash", str(root / "source" / "run_autograder")], env=env, capture_output=True,
                          text=True, timeout=900)
    results = json.loads((root / "results" / "results.json").read_text())
    assert (results["score"], results["max_score"]) == (MAX_SCORE, MAX_SCORE), results["output"] + proc.stderr[-2000:]
    assert results["extra_data"]["flagged"] == []
