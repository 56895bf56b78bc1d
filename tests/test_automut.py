"""The mutation generator of ``labkit mutate`` (labkit.course.automut), on a tiny module:
each operator makes the edit it should, only inside solution regions, every mutant compiles,
and ids do not move when unrelated lines do. (Grading the mutants is the tool's job, not CI's.)"""

import json
from dataclasses import asdict

from pathlib import Path

import pytest

from labkit.course import automut
from tests.conftest import needs_solutions

SOURCE = '''import torch
import torch.distributed as dist


def before(x):
    return x + 1   # outside every region: never mutated


def f(x, group=None, flag=True):
    """A docstring."""
    # BEGIN SOLUTION demo.f: the hint
    y = x.detach().clone()
    if flag:
        y = y + 1
    else:
        y = y * 2
    work = dist.all_reduce(y, group=group, async_op=True)
    z = torch.maximum(y, x)
    work.wait()
    n = dist.get_world_size(group)
    return torch.cat([y, z[-1:]], dim=0) if n < 2 else y
    # END SOLUTION


def g(x):
    # BEGIN SOLUTION demo.g: another
    return x.sum(dim=x.dim() - 1)
    # END SOLUTION
'''


def edits(source=SOURCE):
    return {(m.task, m.op, m.old, m.new) for m in automut.generate(source, "demo")}


def test_each_operator_makes_its_edit():
    found = edits()
    expected = {
        ("demo.f", "delete", "y = x.detach().clone()", "pass"),
        ("demo.f", "drop_call", "x.detach()", "x"),
        ("demo.f", "drop_call", "x.detach().clone()", "x.detach()"),
        ("demo.f", "if_true", "flag", "True"),
        ("demo.f", "if_false", "flag", "False"),
        ("demo.f", "if_body", "if flag: y = y + 1 else: y = y * 2", "if flag: pass else: y = y * 2"),
        ("demo.f", "else", "if flag: y = y + 1 else: y = y * 2", "if flag: y = y + 1"),
        ("demo.f", "arith", "y + 1", "y - 1"),
        ("demo.f", "arith", "y * 2", "y / 2"),
        ("demo.f", "int", "1", "0"),
        ("demo.f", "int", "2", "3"),
        ("demo.f", "group", "group", "None"),
        ("demo.f", "bool", "True", "False"),
        ("demo.f", "swap", "torch.maximum(y, x)", "torch.maximum(x, y)"),
        ("demo.f", "wait", "work.wait()", "pass"),
        ("demo.f", "move_wait", "z = torch.maximum(y, x) work.wait()", "work.wait() z = torch.maximum(y, x)"),
        ("demo.f", "int", "-1", "-2"),
        ("demo.f", "int", "-1", "0"),
        ("demo.f", "dim", "0", "1"),
        ("demo.f", "cmp", "n < 2", "n <= 2"),
        ("demo.f", "ifexp", "torch.cat([y, z[-1:]], dim=0) if n < 2 else y", "y"),
        ("demo.f", "return", "return torch.cat([y, z[-1:]], dim=0) if n < 2 else y", "return None"),
        ("demo.g", "dim", "x.dim() - 1", "x.dim() - 1 + 1"),
        ("demo.g", "arith", "x.dim() - 1", "x.dim() + 1"),
    }
    assert expected <= found, sorted(expected - found)
    groups = [m.line for m in automut.generate(SOURCE, "demo") if m.op == "group"]
    assert groups == [17, 20], groups   # the keyword and the positional group
    assert not any(e[1] == "delete" and e[2].startswith('"""') for e in found), "a docstring was deleted"


def test_mutants_compile_stay_in_their_region_and_apply():
    lines = SOURCE.splitlines(keepends=True)
    head, tail = "".join(lines[:10]), "".join(lines[22:])   # up to BEGIN of f; from END of f
    found = automut.generate(SOURCE, "demo")
    assert len(found) > 30
    for m in found:
        assert SOURCE.count(m.find) == 1, m.id
        mutated = SOURCE.replace(m.find, m.replace)
        compile(mutated, m.id, "exec")
        assert mutated != SOURCE
        assert mutated.startswith(head), f"{m.id} edits code before its region"
        if m.task == "demo.f":
            assert mutated.endswith(tail), f"{m.id} edits code after its region"
    assert len({m.id for m in found}) == len(found), "ids must be unique"
    assert {m.task for m in found} == {"demo.f", "demo.g"}
    assert automut.generate(SOURCE, "demo", tasks={"demo.g"}) == [m for m in found if m.task == "demo.g"]


def test_ids_survive_unrelated_lines_moving():
    moved = SOURCE.replace("def before(x):\n", "def before(x):\n    x = x * 3\n    x = x - 2\n")
    moved = moved.replace('    """A docstring."""\n', '    """A docstring."""\n    x = x\n')
    ids = {m.id: (m.line, m.description) for m in automut.generate(SOURCE, "demo")}
    moved_ids = {m.id: (m.line, m.description) for m in automut.generate(moved, "demo")}
    assert set(ids) == set(moved_ids)
    some = next(iter(ids))
    assert moved_ids[some][0] == ids[some][0] + 3   # same mutant, three lines further down
    edited = SOURCE.replace("y = y * 2", "y = y * 4")
    assert set(ids) != {m.id for m in automut.generate(edited, "demo")}   # an edited line: new ids


def test_mutants_file_round_trip(tmp_path):
    found = automut.generate(SOURCE, "demo")
    path = tmp_path / "mutants.json"
    path.write_text(json.dumps([asdict(m.mutant()) for m in found]))
    loaded = automut.load_file(str(path))
    assert [f"{m.task}/{m.name}" for m in loaded] == [m.id for m in found]
    assert loaded[0].why == found[0].description


def test_equivalent_entries_need_a_reason(tmp_path):
    (tmp_path / "tests" / "mutants").mkdir(parents=True)
    path = tmp_path / "tests" / "mutants" / "demo.py"
    path.write_text('MUTANTS = []\nEQUIVALENT = {"demo.f/bool/0123abcd": "async_op only changes when we wait"}\n')
    assert automut.equivalents(tmp_path, "demo") == {"demo.f/bool/0123abcd": "async_op only changes when we wait"}
    path.write_text('MUTANTS = []\nEQUIVALENT = {"demo.f/bool/0123abcd": " "}\n')
    with pytest.raises(ValueError, match="need a reason"):
        automut.equivalents(tmp_path, "demo")
    assert automut.equivalents(tmp_path, "nothing") == {}


@needs_solutions
def test_collect_picks_mutants_by_id():
    root = Path(__file__).resolve().parent.parent
    router = automut.collect(root, ["moe.router"])["moe.router"]
    picked = automut.collect(root, [], ids=[router[0].id])
    assert picked == {"moe.router": [router[0]]}
    with pytest.raises(ValueError, match="no such automatic mutant"):
        automut.collect(root, [], ids=["moe.router/int/00000000"])
