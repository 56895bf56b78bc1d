"""labkit coverage (labkit/course/coverage.py): a branch that no test takes is reported, an
exclusion needs its reason, ranks record under the task of their launch, and the CI check
looks only at the tasks whose every graded test ran."""

import importlib.util
import json
import os
from pathlib import Path

import pytest

import labkit
from labkit.course import coverage
from tests.conftest import needs_solutions

ROOT = Path(__file__).resolve().parent.parent

FAKE = '''\
def pick(x, strict=False):
    # BEGIN SOLUTION fake.pick: return x; refuse a negative one when strict
    if strict and x < 0:
        raise ValueError("negative")
    return x
    # END SOLUTION
'''


def fake_tree(tmp_path, source=FAKE, exclusions=""):
    root = tmp_path / "course"
    (root / "labkit").mkdir(parents=True)
    (root / "labkit" / "fake.py").write_text(source)
    (root / "tests").mkdir()
    (root / coverage.EXCLUSIONS).write_text(exclusions)
    return root


def run_fake(root, folder, monkeypatch, *calls):
    """Record ``pick(*args)`` for each call under the context fake.pick, in this process."""
    monkeypatch.setenv(coverage.DIR_ENV, str(folder))
    monkeypatch.setenv(coverage.FILES_ENV, "")  # start() sets it: restored after the test
    spec = importlib.util.spec_from_file_location("labkit_fake_under_test", root / "labkit" / "fake.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cov = coverage.start("fake.pick", root)
    for args in calls:
        try:
            module.pick(*args)
        except ValueError:
            pass
    coverage.save(cov)
    return coverage.measure(folder, root, ["fake.pick"])


def test_an_untaken_branch_is_reported_with_its_line(tmp_path, monkeypatch):
    root = fake_tree(tmp_path)
    [result], errors = run_fake(root, tmp_path, monkeypatch, (1,), (2, True))
    assert not errors
    assert (result.lines_run, result.lines, result.branches_taken, result.branches) == (2, 3, 1, 2)
    assert not result.complete
    assert [(g.path, g.line, g.text) for g in result.gaps] == [
        ("labkit/fake.py", 3, "if strict and x < 0:"), ("labkit/fake.py", 4, 'raise ValueError("negative")')]
    report = coverage.format_report([result])
    assert "labkit/fake.py:4: raise ValueError" in report and "not run" in report and "0 of 1 tasks" in report


def test_every_line_and_branch_run_is_complete(tmp_path, monkeypatch):
    root = fake_tree(tmp_path)
    [result], _ = run_fake(root, tmp_path, monkeypatch, (1,), (-1, True))
    assert result.complete and (result.lines, result.branches) == (3, 2) and not result.gaps


def test_lines_run_under_another_context_do_not_count(tmp_path, monkeypatch):
    root = fake_tree(tmp_path)
    monkeypatch.setenv(coverage.DIR_ENV, str(tmp_path))
    monkeypatch.setenv(coverage.FILES_ENV, "")
    spec = importlib.util.spec_from_file_location("labkit_fake_other", root / "labkit" / "fake.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cov = coverage.start("fake.other", root)
    module.pick(1)
    coverage.save(cov)
    [result], _ = coverage.measure(tmp_path, root, ["fake.pick"])
    assert result.lines_run == 0 and result.lines == 3


@pytest.mark.parametrize("how", ["file", "pragma"])
def test_an_excluded_line_with_its_reason_passes(tmp_path, monkeypatch, how):
    if how == "file":
        root = fake_tree(tmp_path, exclusions='# comment\nfake.pick | raise ValueError("negative") | tested in test_x\n')
    else:
        root = fake_tree(tmp_path, FAKE.replace('("negative")', '("negative")  # coverage: tested in test_x'))
    [result], errors = run_fake(root, tmp_path, monkeypatch, (1,), (2, True))
    assert not errors
    assert result.complete and result.excluded == 1
    assert (result.lines_run, result.lines, result.branches_taken, result.branches) == (2, 2, 1, 1)


@pytest.mark.parametrize("exclusions, source, error", [
    ('fake.pick | raise ValueError("negative") |\n', FAKE, "expected '<task> | <the line's text> | <reason>'"),
    ('fake.pick | raise ValueError("negative")\n', FAKE, "expected '<task> | <the line's text> | <reason>'"),
    ("fake.pick | return y | moved\n", FAKE, "no line 'return y' in the solution regions of fake.pick"),
    ("", FAKE.replace('("negative")', '("negative")  # coverage:  '), "'# coverage:' without a reason"),
])
def test_an_exclusion_without_a_reason_or_a_line_is_an_error(tmp_path, exclusions, source, error):
    _, errors = coverage.exclusions(fake_tree(tmp_path, source, exclusions))
    assert len(errors) == 1 and error in errors[0], errors


@needs_solutions
def test_the_ranks_of_a_launch_record_under_its_task(tmp_path, monkeypatch):
    """A launch while TASK_ENV names a task: its ranks' lines count for that task only."""
    import torch

    from labkit import collectives
    monkeypatch.setenv(coverage.DIR_ENV, str(tmp_path))
    monkeypatch.setenv(coverage.TASK_ENV, "collectives.all_reduce")
    monkeypatch.setenv(coverage.FILES_ENV, os.pathsep.join(coverage.measured_files(ROOT)))

    def ranks():
        t = torch.ones(4)
        collectives.ring_all_reduce(t)
        return t.sum().item()

    assert labkit.launch(ranks, 2, timeout=60) == [8.0, 8.0]
    results, _ = coverage.measure(tmp_path, ROOT, ["collectives.all_reduce", "collectives.all_gather"])
    assert results[0].lines_run > 0 and results[1].lines_run == 0
    assert len(list(tmp_path.glob("cov.*"))) == 2  # one data file per rank


def test_the_ci_check_measures_only_the_tasks_whose_tests_all_ran(tmp_path, monkeypatch):
    root = fake_tree(tmp_path)
    run_fake(root, tmp_path, monkeypatch, (1,), (2, True))
    graded = dict(collected={"fake.pick": ["t.py::a", "t.py::b"], "fake.other": ["t.py::c"]})
    (tmp_path / "tests.1.json").write_text(json.dumps(dict(graded, outcomes={"t.py::a": ["passed"]})))
    results, _, _ = coverage.check(str(tmp_path), root)
    assert results == []  # t.py::b did not run: a partial run checks nothing of fake.pick
    (tmp_path / "tests.2.json").write_text(json.dumps(dict(graded, outcomes={"t.py::b": ["skipped"]})))
    results, _, text = coverage.check(str(tmp_path), root)
    assert [r.task for r in results] == ["fake.pick"] and "labkit/fake.py:4" in text
