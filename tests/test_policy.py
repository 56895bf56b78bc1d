"""The submission policy (``labkit.course.policy``): every reference module passes it, every
cheating submission in tests/cheats breaks it at the lines of its trick, and the ways around
an allow-list that a student finds first (a computed name, an alias, a module reached through
another, a patched class, a frame) are each refused with the line named."""

import ast
from pathlib import Path

import pytest

from labkit.course import policy
from labkit.course.chapters import CHAPTERS

ROOT = Path(__file__).resolve().parent.parent
CHEATS = sorted((ROOT / "tests" / "cheats").glob("*.py"))


def sources() -> dict[str, str]:
    return policy.all_sources(ROOT / "labkit")


@pytest.mark.parametrize("module", list(CHAPTERS.values()))
def test_every_reference_module_passes_the_policy(module):
    files = [name for name in sources() if name.split(".")[0] == module]
    assert files, module
    found = [v for name in files for v in policy.violations(name, sources()[name], sources=sources())]
    assert found == [], [str(v) for v in found]


@pytest.mark.parametrize("cheat", CHEATS, ids=[c.stem for c in CHEATS])
def test_every_cheat_breaks_the_policy_at_its_trick(cheat):
    source = cheat.read_text()
    module = cheat.stem.split("_")[0]
    expected = ast.literal_eval(source.split("EXPECT = ", 1)[1].split("\n", 1)[0])
    found = policy.violations(module, source)
    assert expected and sorted({v.line for v in found}) == expected, [str(v) for v in found]
    with pytest.raises(AssertionError, match=rf"labkit/{module}.py:{expected[0]}: "):
        policy.check(module, source)


HEAD = "import torch\nimport torch.distributed as dist\nimport torch.nn as nn\n"


@pytest.mark.parametrize("line, why", [
    ("getattr(dist, 'all_' + 'reduce')(t)", "computed attribute name"),
    ("f = getattr; f(dist, 'x')", "getattr with a computed"),
    ("d = dist\nd.all_reduce(t)", "as a value"),
    ("g = torch.distributed\ng.all_reduce(t)", "as a value"),
    ("dist.distributed_c10d.all_reduce(t)", "distributed_c10d"),
    ("torch._C._distributed_c10d", "torch._C"),
    ("torch.ops.c10d.allreduce_", "torch.ops.c10d"),
    ("dist.all_reduce = lambda *a, **k: None", "monkeypatching"),
    ("nn.Linear.forward = lambda self, x: x", "monkeypatching"),
    ("type(t).add = None", "type(...)"),
    ("setattr(torch, 'x', 1)", "changes code"),
    ("t.__class__.__subclasses__()", "__class__"),
    ("dist.__dict__['all_reduce'](t)", "__dict__"),
    ("(lambda: 0).__globals__", "__globals__"),
    ("__builtins__['eval']('1')", "__builtins__"),
    ("eval('1')", "eval"),
    ("exec('x = 1')", "exec"),
    ("__import__('os')", "__import__"),
    ("import importlib", "importlib"),
    ("import sys", "sys"),
    ("import gc", "gc"),
    ("import inspect", "inspect"),
    ("import ctypes", "ctypes"),
    ("import subprocess", "subprocess"),
    ("import signal", "signal"),
    ("import atexit", "atexit"),
    ("import os", "os"),
    ("from torch.distributed import *", "import \\*"),
    ("open('/tmp/x', 'w')", "opens a file"),
    ("torch.save(t, 'x')", "torch.save"),
    ("import labkit.comm", "labkit.comm"),
    ("from labkit.course import grading", "labkit.course"),
    ("from labkit.runtime import worker", "labkit.runtime"),
    ("import torch.multiprocessing", "torch.multiprocessing"),
    ("try:\n    pass\nexcept Exception as e:\n    e.__traceback__.tb_frame.f_back", "__traceback__"),
    ("def g():\n    yield\ng().gi_frame.f_back", "gi_frame"),
    ("class T(torch.Tensor):\n    def __torch_function__(self, *a):\n        pass", "__torch_function__"),
    ("class X:\n    def __eq__(self, o):\n        return True", "__eq__"),
    ("globals()['dist']", "globals"),
    ("vars(dist)", "vars"),
    ("import labkit.models\nlabkit.models.torch.distributed.all_gather_into_tensor(o, i)", "PyTorch's own"),
    ("import torch.nn.parallel.distributed as d\nd.dist.all_reduce(t)", "PyTorch's own|torch.nn.parallel"),
])
def test_ways_around_the_allow_list_are_refused(line, why):
    found = policy.violations("collectives", HEAD + line + "\n")
    assert found, f"{line!r} passed the policy"
    assert any(__import__("re").search(why, v.what) for v in found), [str(v) for v in found]
    assert all(v.file == "labkit/collectives.py" and v.line >= 1 for v in found)


@pytest.mark.parametrize("line", [
    "dist.send(t, 1)",
    "getattr(t, 'grad')",
    "NAME = '_unit'\ndef f(m):\n    return getattr(m, NAME)",
    "def f(m):\n    for k in ('a', 'b'):\n        setattr(m, k, 1)",
    "def f(input):\n    return input",          # a parameter that shadows a builtin
    "def f(dist):\n    return dist",            # a parameter that shadows an import
    "class A:\n    def __init__(self):\n        super().__init__()\n    def __repr__(self):\n        return type(self).__name__",
    "def f(m):\n    c = m.__new__(type(m))\n    c.__dict__ = m.__dict__.copy()\n    return vars(c)",
    "torch.autograd.Variable._execution_engine.queue_callback(print)",
    "torch.ops.aten.mm(t, t)",
])
def test_what_an_honest_module_writes_passes(line):
    found = policy.violations("collectives", HEAD + line + "\n")
    assert found == [], [str(v) for v in found]


def test_a_name_the_policy_allows_only_in_some_chapters():
    assert policy.violations("elastic", "import os\nos.replace('a', 'b')\nopen('x')\n") == []
    assert policy.violations("elastic", "import os\nos.fork()\n")
    assert policy.violations("compress", "import numpy\nnumpy.zeros(3)\n") == []
    assert policy.violations("collectives", "import numpy\n")
    assert policy.violations("sp", "from labkit.tp import ParallelMLP\n") == []
    assert policy.violations("tp", "from labkit.sp import ring_attention\n"), "a later chapter's module"


def test_a_chapter_packages_files_are_checked_through_one_another():
    """A file of a chapter package reaches its siblings, never around the policy: a forbidden
    name re-exported by one file is refused where another uses it, a sibling's private name
    is refused, and each violation names its own file."""
    honest = sources()
    forbidden = "from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as hidden\n"
    via_sibling = dict(honest, **{"compress.topk": honest["compress.topk"] + "\nfrom labkit.compress.fp16 import hidden\nhidden.fp16_compress_hook\n",
                                  "compress.fp16": honest["compress.fp16"] + "\n" + forbidden})
    found = policy.check_tree("compress", {k: v for k, v in via_sibling.items() if k.startswith("compress")},
                              ROOT / "labkit")
    files = {v.file for v in found}
    assert "labkit/compress/fp16.py" in files and "labkit/compress/topk.py" in files, [str(v) for v in found]
    assert any("PyTorch's own" in v.what for v in found if v.file == "labkit/compress/topk.py"), [str(v) for v in found]
    private = policy.violations("compress.topk", "from labkit.compress.powersgd import _helper\n", sources=honest)
    assert private and "private" in private[0].what and private[0].file == "labkit/compress/topk.py"
    assert policy.violations("compress.topk", "from labkit.compress import fp16\nx = fp16\n", sources=honest), \
        "a sibling file held as a value"
    assert policy.violations("compress.topk", "from labkit.compress.powersgd import powersgd_hook\n",
                             sources=honest) == []
