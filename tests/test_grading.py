"""Solution regions, stubs, the task registry and the score/Gradescope formats."""

import re
from pathlib import Path

import pytest

from labkit.course import grading, workspace
from labkit.course.chapters import exercise_files

ROOT = Path(__file__).resolve().parent.parent

EXERCISE = '''\
def add(a, b):
    """Return a + b."""
    # BEGIN SOLUTION demo.add: use the + operator
    total = a + b
    return total
    # END SOLUTION


class Thing:
    def method(self):
        if True:
            # BEGIN SOLUTION demo.method: return 42
            return 42
            # END SOLUTION
'''


def test_solution_regions_become_stubs_at_their_indentation(tmp_path):
    path = tmp_path / "demo.py"
    path.write_text(EXERCISE)
    regions = workspace.find_regions(path)
    assert [(r.task, r.hint, r.begin, r.end) for r in regions] == [
        ("demo.add", "use the + operator", 2, 5), ("demo.method", "return 42", 11, 13)]
    stub = workspace.stub_source(path)
    assert "BEGIN SOLUTION" not in stub and "total = a + b" not in stub
    assert "    raise NotImplementedError('demo.add: use the + operator')\n" in stub
    assert "            raise NotImplementedError('demo.method: return 42')\n" in stub
    namespace = {}
    exec(compile(stub, "demo.py", "exec"), namespace)
    with pytest.raises(NotImplementedError, match="demo.add: use the"):
        namespace["add"](1, 2)


@pytest.mark.parametrize("source, words", [
    ("# BEGIN SOLUTION a.b: hint\n", "never closed"),
    ("# END SOLUTION\n", "without BEGIN"),
    ("# BEGIN SOLUTION a.b: x\n# BEGIN SOLUTION a.c: y\n# END SOLUTION\n", "inside the region"),
    ("# BEGIN SOLUTION a.b\n# END SOLUTION\n", "has no hint"),
    ("# BEGIN SOLUTION Not-A-Task hint\n# END SOLUTION\n", "malformed marker"),
])
def test_malformed_regions_are_refused(tmp_path, source, words):
    path = tmp_path / "bad.py"
    path.write_text(source)
    with pytest.raises(ValueError, match=words):
        workspace.find_regions(path)


def test_every_task_has_graded_tests_and_every_graded_test_a_known_task():
    known = grading.known_tasks(ROOT)  # in a workspace: the list the stubs were made from
    assert known, "no solution regions found in labkit/"
    graded = set()
    for path in (ROOT / "tests" / "grading").glob("test_*.py"):
        graded |= set(re.findall(r'@task\("([^"]+)"', path.read_text()))
    assert graded - known == set(), f"tests grade unknown tasks: {graded - known}"
    assert known - graded == set(), f"tasks without graded tests: {known - graded}"


def test_grading_files_resolve_chapter_numbers_and_names():
    by_number = grading.grading_files(["00"], ROOT)
    assert by_number == grading.grading_files(["collectives"], ROOT)
    hidden = ROOT / "tests" / "grading" / "hidden" / "test_collectives.py"  # not in a workspace
    assert by_number == [ROOT / "tests" / "grading" / "test_collectives.py"] + [hidden] * hidden.exists()
    with pytest.raises(ValueError, match="no graded chapter 'nope'"):
        grading.grading_files(["nope"], ROOT)



@pytest.mark.parametrize("name, module", [
    ("12", "recompute"), ("recompute", "recompute"), ("memory", "recompute"), ("12_memory", "recompute"),
    ("labs/12_memory.py", "recompute"), ("hybrid", "mesh"), ("08", "mesh"), ("8", "mesh"), ("comm", "compress"),
    ("11_comm", "compress"), ("elastic", "elastic"), ("fault tolerance", "elastic"), ("Data-Parallelism", "dp"),
    ("tensor_parallelism", "tp"), ("00", "collectives"), ("0", "collectives"),
])
def test_chapters_answer_to_their_number_module_title_and_lab_name(name, module):
    assert grading.resolve_selection([name], ROOT) == ([module], [])
    assert grading.grading_files([name], ROOT)[0] == ROOT / "tests" / "grading" / f"test_{module}.py"


def test_every_readme_chapter_title_and_lab_name_is_accepted():
    readme = (ROOT / "README.md").read_text()
    titles = re.findall(r"^\| (\d\d) \| \[([^\]]+)\]\(chapters/", readme, re.M)
    assert len(titles) == len(grading.CHAPTERS), titles
    for number, title in titles:
        assert grading.resolve_selection([title], ROOT)[0] == [grading.CHAPTERS[number]], title
    for lab in (ROOT / "labs").glob("[0-9][0-9]_*.py"):
        assert grading.resolve_selection([lab.stem], ROOT)[0] == [grading.CHAPTERS[lab.name[:2]]], lab.stem


@pytest.mark.parametrize("name, suggestion", [("moe.capcity", "did you mean moe.capacity?"),
                                              ("memry", "did you mean memory?"), ("13_memory", "")])
def test_an_unknown_name_is_refused_with_a_did_you_mean(name, suggestion):
    with pytest.raises(ValueError, match=re.escape(f"no ") + ".*" + re.escape(suggestion)) as error:
        grading.resolve_selection(["00", name], ROOT)
    assert str(error.value).count("\n") == 0 and len(str(error.value)) < 400, str(error.value)


def run_cli(*args, cwd=ROOT):
    import subprocess, sys, os
    return subprocess.run([sys.executable, "-m", "labkit.course.cli", *args], cwd=cwd, capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)


@pytest.mark.parametrize("args, says", [
    (["grade", "moe.capcity"], "did you mean moe.capacity?"),
    (["grade", "00", "--json", "/nonexistent/dir/r.json"], "the folder /nonexistent/dir does not exist"),
    (["grade", "00", "--json", "{file}/x.json"], "{file} is a file, not a folder"),
    (["coverage", "collectives.reduce_scater"], "did you mean collectives.reduce_scatter"),
    (["coverage", "colectives"], "did you mean collectives?"),
    (["mutate", "collectives.reduce_scater"], "did you mean collectives.reduce_scatter"),
    (["mutate", "colectives", "--list"], "did you mean collectives?"),
], ids=["typo", "json-folder", "json-under-a-file", "coverage-task-typo", "coverage-chapter-typo",
        "mutate-task-typo", "mutate-chapter-typo"])
def test_labkit_refuses_bad_input_at_once_with_exit_2(args, says, tmp_path):
    from labkit.course.workspace import is_student_workspace
    if args[0] in ("coverage", "mutate") and is_student_workspace():
        pytest.skip("coverage and mutate refuse a learner workspace before reading names (tests/test_workspace.py)")
    # A typo is never a green "1 of 1 tasks at 100 %" or "0 killed of 0" (issue 43 item 3).
    file = tmp_path / "a-file"
    file.write_text("")
    args, says = [a.format(file=file) for a in args], says.format(file=file)
    proc = run_cli(*args)
    assert proc.returncode == 2 and says in proc.stderr, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr            # one sentence
    assert "Traceback" not in proc.stderr and "tests:" not in proc.stdout, proc.stdout   # nothing ran
    assert "100 %" not in proc.stdout and "killed" not in proc.stdout, proc.stdout


def test_labkit_tasks_into_a_closed_pipe_says_nothing(tmp_path):
    # `labkit tasks | head`: the reader leaves early; a closed pipe is no traceback.
    import os, subprocess, sys
    read, write = os.pipe()
    os.close(read)   # every write now fails with EPIPE, as once `head` has what it wanted
    proc = subprocess.run([sys.executable, "-m", "labkit.course.cli", "tasks"], cwd=ROOT, stdout=write,
                          stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    os.close(write)
    assert proc.stderr == "" and proc.returncode == 1, proc.stderr


def test_labkit_tasks_lists_the_named_chapters_and_tasks_only(capsys):
    from labkit.course import cli
    assert cli.main(["--root", str(ROOT), "tasks", "memory", "moe.router"]) == 0
    listed = {line.split()[1] for line in capsys.readouterr().out.splitlines() if line[:2].isdigit()}
    wanted = {t for t in grading.known_tasks(ROOT) if t.startswith("recompute.")} | {"moe.router"}
    assert listed == wanted, listed ^ wanted
    proc = run_cli("tasks", "memry")
    assert proc.returncode == 2 and "did you mean memory?" in proc.stderr and "Traceback" not in proc.stderr, \
        proc.stdout + proc.stderr


def test_the_score_table_is_printed_even_when_results_json_cannot_be_written(tmp_path, monkeypatch, capsys):
    from labkit.course import cli
    folder = tmp_path / "out"
    folder.mkdir()

    def grade_then_lose_the_folder(*args, **kwargs):   # the folder goes away while grading
        folder.rmdir()
        return [dict(name="t::a[2]", task="collectives.all_reduce", points=1.0, world_size=2,
                     outcome="passed", output="")], ""
    monkeypatch.setattr(grading, "run_tests", grade_then_lose_the_folder)
    status = cli.main(["--root", str(ROOT), "grade", "collectives.all_reduce", "--json", str(folder / "r.json")])
    out, err = capsys.readouterr()
    assert status == 2 and "could not write" in err, out + err
    assert "collectives.all_reduce" in out and "1/1" in out and "total" in out, out


RECORDS = [
    dict(name="t::a[1]", task="x.one", points=0.0, world_size=1, outcome="passed", output=""),
    dict(name="t::a[2]", task="x.one", points=1.0, world_size=2, outcome="failed", output="x.one: rank 1 off by 2"),
    dict(name="t::b", task="x.two", points=3.0, outcome="passed", output=""),
    dict(name="t::c", task="x.two", points=0.5, outcome="skipped", output="skipped: no GPU"),
    dict(name="t::d[1]", task="x.three", points=0.0, world_size=1, outcome="passed", output=""),
    dict(name="t::d[2]", task="x.three", points=2.0, world_size=2, outcome="passed", output=""),
    dict(name="h::e", task="x.three", points=1.0, hidden=True, outcome="passed", output=""),
]


def test_a_task_scores_only_when_every_test_passes():
    scores = grading.score_by_task(RECORDS)
    assert sorted((s.task, s.passed, s.total, s.score, s.max_score) for s in scores) == [
        ("x.one", 1, 2, 0.0, 1.0), ("x.three", 3, 3, 3.0, 3.0), ("x.two", 1, 2, 0.0, 3.5)]
    table = grading.format_table(scores)
    assert "x.one" in table and "1/2" in table and "3/7.5" in table.splitlines()[-1]


def test_gradescope_results_have_the_required_fields():
    results = grading.gradescope_results(RECORDS)
    assert (results["score"], results["max_score"]) == (3.0, 7.5)
    assert [t["score"] for t in results["tests"]] == [0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 1.0]
    for test, record in zip(results["tests"], RECORDS):
        assert set(test) == {"name", "score", "max_score", "output", "visibility"}
        assert test["name"].startswith(record["task"]) and test["max_score"] == record["points"]
        assert test["visibility"] == ("after_published" if record.get("hidden") else "visible")
    assert results["tests"][1]["output"] == "FAILED x.one · a[2]\n  rank 1 off by 2"
    assert results["tests"][2]["output"].startswith("passed; but x.two earns its points only when all")
    assert results["tests"][0]["output"].endswith("(world size 1: a diagnostic, no points of its own)")
    assert results["tests"][6]["output"] == "passed"


def test_a_failure_caused_by_another_tasks_stub_names_it_first():
    records = [dict(name="t::f[2]", task="elastic.save", points=1.0, outcome="failed",
                    output="elastic.save: failed at world size 2: rank 0 raised NotImplementedError: "
                           "fsdp.shard: take rows", details="", frame="labkit/fsdp.py:80 in shard_tensor"),
               dict(name="t::g[2]", task="x.one", points=1.0, outcome="failed", output="x.one: off by one")]
    report = grading.failure_report(records).splitlines()
    assert report[0] == ("NEEDS fsdp.shard: elastic.save uses your fsdp.shard (labkit/fsdp.py:80 in shard_tensor), "
                         "still a stub: implement fsdp.shard first"), report


def test_long_failure_output_is_truncated():
    record = dict(RECORDS[1], output="x" * (grading.OUTPUT_LIMIT + 100))
    output = grading.gradescope_results([record])["tests"][0]["output"]
    assert len(output) < grading.OUTPUT_LIMIT + 50 and output.endswith("(truncated)")


def test_a_traceback_quoted_in_a_message_prints_as_lines():
    quoted = ("Regex pattern did not match.\n Actual message: 'rank 1 raised X\\n\\n--- remote traceback ---\\n"
              "Traceback (most recent call last):\\n  File \"/w/labkit/fsdp.py\", line 3, in shard\\n    raise X(\\'a\\')'")
    text = grading.unescape_tracebacks(quoted)
    assert "Traceback (most recent call last):\n  File" in text and "\\n" not in text and "X('a')" in text
    assert grading.learner_frame(text).startswith("labkit/fsdp.py:3 in shard\n")
    assert grading.unescape_tracebacks("a literal \\n with no traceback") == "a literal \\n with no traceback"


def test_what_a_lab_uses_is_read_from_its_imports_and_calls(tmp_path):
    # A lab's tasks follow its references through labkit: a module-level import, an import
    # inside a function, a call through a module alias, a class used whole; not what it never names.
    from labkit.course import catalog
    (tmp_path / "labkit").mkdir()
    (tmp_path / "labkit" / "__init__.py").write_text("")
    (tmp_path / "labkit" / "one.py").write_text(
        "from labkit.two import helper\n\n"
        "def used():\n    # BEGIN SOLUTION one.used: hint\n    return helper()\n    # END SOLUTION\n\n"
        "def unused():\n    # BEGIN SOLUTION one.unused: hint\n    pass\n    # END SOLUTION\n")
    (tmp_path / "labkit" / "two.py").write_text(
        "def helper():\n    from labkit import three\n    return three.Thing()\n\n"
        "def other():\n    # BEGIN SOLUTION two.other: hint\n    pass\n    # END SOLUTION\n")
    (tmp_path / "labkit" / "three.py").write_text(
        "class Thing:\n    def go(self):\n        # BEGIN SOLUTION three.go: hint\n        pass\n        # END SOLUTION\n")
    lab = tmp_path / "lab.py"
    lab.write_text("import labkit.one as first\n\ndef main():\n    return first.used()\n")
    assert set(catalog.lab_uses(tmp_path, lab)) == {"one.used", "three.go"}


def test_labkit_tasks_and_the_lab_header_say_which_other_chapters_a_lab_runs():
    # Chapter 14's lab runs chapter 11's hierarchical all-reduce (on the emulated nodes): a
    # chapter-14 learner must read that before meeting "not implemented yet: compress.hierarchical".
    from labkit.course import catalog, labscript
    assert "compress.hierarchical" in catalog.earlier_tasks(ROOT, "14")
    assert "fsdp.shard" in catalog.earlier_tasks(ROOT, "09")          # lab 09 trains under your FSDP
    assert catalog.earlier_tasks(ROOT, "00") == []
    assert "compress.hierarchical (11)" in labscript.uses_line("14")
    proc = run_cli("tasks", "14")
    assert proc.returncode == 0 and "lab 14 also runs these tasks of other chapters:" in proc.stdout \
        and "compress.hierarchical (11)" in proc.stdout, proc.stdout + proc.stderr


def test_every_not_implemented_line_says_where_the_stub_is(tmp_path):
    # Chapter 14's tests call perf's functions in the test process: no rank, no traceback
    # frame, and before this the line said only "NOT IMPLEMENTED perf.flops: 3 test(s)".
    from labkit.course import catalog, cli, workspace
    ws = tmp_path / "ws"
    for path in exercise_files(ROOT / "labkit", "perf"):   # the chapter package's files, stubbed
        (ws / path.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
        (ws / path.relative_to(ROOT)).write_text(workspace.stub_source(path))
    (ws / workspace.MARKER_FILE).write_text("perf.flops\thint\n")
    where = next(t.where for t in catalog.tasks(ws) if t.task == "perf.flops")
    assert where.startswith("labkit/perf/flops.py:"), where
    record = dict(task="perf.flops", name="tests/grading/test_perf.py::test_flops", outcome="failed",
                  output="perf.flops: NotImplementedError: perf.flops: hint", details="", frame="")
    report = cli.with_stub_places(grading.failure_report([record]), ws)
    assert report == f"NOT IMPLEMENTED perf.flops: 1 test(s) · {where}", report
    with_frame = dict(record, frame="labkit/perf/flops.py:1 in flops_per_token")
    assert cli.with_stub_places(grading.failure_report([with_frame]), ws).endswith("· labkit/perf/flops.py:1 in flops_per_token")


def test_results_json_says_each_failure_once():
    """A failed test's output in results.json: the message once, then the traceback lines
    that add something (not the message again as the traceback's last line)."""
    from labkit.course.grading import gradescope_results
    message = "dp.sampler: failed at world size 2: rank 1 raised ContractError: contract broken by labkit.dp.shard_indices"
    details = ('Traceback (most recent call last):\n  File "labkit/dp.py", line 66, in shard_indices\n'
               "    torch.manual_seed(seed + epoch)\n"
               "labkit.runtime.contracts.ContractError: contract broken by labkit.dp.shard_indices\n"
               f"E   labkit.course.grading.GradedFailure: {message}")
    record = dict(name="tests/grading/test_dp.py::test_sampler[2]", task="dp.sampler", points=1.0, world_size=2,
                  hidden=False, outcome="failed", output=message, details=details, frame="")
    output = gradescope_results([record])["tests"][0]["output"]
    assert output.count("contract broken by labkit.dp.shard_indices") == 1, output
    assert 'line 66, in shard_indices' in output and "torch.manual_seed(seed + epoch)" in output
