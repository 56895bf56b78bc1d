"""The grader's own rules: forbidden built-ins are found however they are spelled, the
reference modules use none, and the mutants file format is checked before anything runs."""

from pathlib import Path

import pytest

from labkit.course import mutants, rules, workspace
from labkit.course.chapters import exercise_files

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("source, found", [
    ("import torch.distributed as dist\ndist.all_reduce(t)\n", "torch.distributed.all_reduce"),
    ("from torch.distributed import all_reduce as ar\nar(t)\n", "torch.distributed.all_reduce"),
    ("import torch\ntorch.distributed.all_gather_into_tensor(o, i)\n", "torch.distributed.all_gather_into_tensor"),
    ("import torch.distributed as dist\ngetattr(dist, 'reduce_scatter_single')(o, i)\n",
     "torch.distributed.reduce_scatter_single"),
    ("import importlib\nimportlib.import_module('torch.distributed._functional_collectives')\n",
     "torch.distributed._functional_collectives"),
])
def test_a_forbidden_name_is_found_however_it_is_spelled(source, found):
    uses = rules.forbidden_uses("collectives", source)
    assert any(use.endswith(found) for use in uses), uses
    with pytest.raises(AssertionError, match=r"collectives.all_reduce: labkit/collectives.py uses PyTorch's own"):
        rules.check("collectives.all_reduce", source)


def test_allowed_names_and_docstrings_pass():
    source = ('"""Like torch.distributed.all_reduce, built from send/recv."""\n'
              "import torch.distributed as dist\ndist.isend(t, 1)\ndist.batch_isend_irecv([])\n")
    assert rules.forbidden_uses("collectives", source) == []
    assert rules.forbidden_uses("ddp", "import torch.distributed as dist\ndist.all_reduce(t)\n") == []
    assert rules.forbidden_uses("pp", "from torch.distributed.pipelining import Schedule1F1B\n")


@pytest.mark.parametrize("module", sorted(rules.FORBIDDEN))
def test_the_reference_uses_no_forbidden_name(module):
    paths = exercise_files(ROOT / "labkit", module)
    if not any(workspace.find_regions(path) for path in paths):
        pytest.skip("a learner workspace: the module is the learner's")
    assert [use for path in paths for use in rules.forbidden_uses(module, path.read_text())] == []


def test_every_chapter_module_has_a_rule():
    from labkit.course.grading import CHAPTERS
    assert set(CHAPTERS.values()) == set(rules.FORBIDDEN)


def test_a_mutant_must_match_its_module_exactly_once(tmp_path):
    (tmp_path / "labkit").mkdir()
    (tmp_path / "labkit" / "demo.py").write_text("x = 1\ny = 1\n")
    ok = mutants.Mutant("demo.task", "two", "why", find="x = 1", replace="x = 2")
    assert ok.source(tmp_path) == "x = 2\ny = 1\n" and ok.id == "demo.task/two"
    for find, count in (("z = 1", 0), ("= 1", 2)):
        with pytest.raises(ValueError, match=f"occurs {count} times"):
            mutants.Mutant("demo.task", "bad", "why", find=find, replace="").source(tmp_path)
    with pytest.raises(SyntaxError):
        mutants.Mutant("demo.task", "broken", "why", find="x = 1", replace="x = (").source(tmp_path)



def test_a_chapter_packages_mutant_must_match_one_of_its_files_once(tmp_path):
    """In a chapter package the find text must occur once across all its files: the mutant's
    file is the one holding it, and the package travels whole with that file mutated."""
    package = tmp_path / "labkit" / "demo"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from labkit.demo.a import f\nfrom labkit.demo.b import g\n")
    (package / "a.py").write_text("def f():\n    n = 1\n    return n\n")
    (package / "b.py").write_text("def g():\n    n = 1\n    return -n\n")
    ok = mutants.Mutant("demo.task", "neg", "why", find="return -n", replace="return n")
    assert ok.locate(tmp_path) == package / "b.py" and ok.source(tmp_path).endswith("return n\n")
    assert ok.sources(tmp_path)["demo.b"] == ok.source(tmp_path) and set(ok.sources(tmp_path)) == {"demo", "demo.a", "demo.b"}
    with pytest.raises(ValueError, match="occurs 2 times in labkit/demo/"):
        mutants.Mutant("demo.task", "both", "why", find="n = 1", replace="n = 2").locate(tmp_path)


def test_a_stale_mutant_is_never_counted_as_killed():
    """A mutant whose find text is gone errors in every test's set-up; that error mutates
    nothing, so the plugin must not count it as a kill (it then shows as a survivor)."""
    from types import SimpleNamespace
    from labkit.course import grading
    mutant = mutants.Mutant("demo.task", "gone", "why", find="x = 1", replace="x = 2")
    item = SimpleNamespace(nodeid="tests/grading/test_demo.py::test_it")
    for error, killed in ((mutants.StaleMutant("its 'find' text occurs 0 times"), False),
                          (AssertionError("wrong answer"), True)):
        config = SimpleNamespace(_labkit_fates={})
        report = SimpleNamespace(failed=True, when="setup", duration=0.0, longrepr=str(error), sections=[])
        grading._mutant_fate(config, mutant, item, report, SimpleNamespace(excinfo=SimpleNamespace(value=error)))
        assert config._labkit_fates[mutant.id]["killed"] is killed, error
