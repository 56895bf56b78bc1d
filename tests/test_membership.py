"""Elastic membership on real torchrun agents (chapter 09; ``labs/cluster/membership.py``):
one of two agents is killed with its worker, the survivor resumes at world size 1 from the
newest checkpoint, resharded; a new agent joins and the job grows back to two ranks. The
loss at every step equals one process training on the same global batches, within
``labkit.check``'s float64 tolerance: the global batch and its mean do not depend on the
world size, only the order of a few additions does (about 1e-15 relative)."""

import importlib.util
from pathlib import Path

from tests.conftest import needs_solutions

ROOT = Path(__file__).resolve().parent.parent
pytestmark = needs_solutions


def membership():
    spec = importlib.util.spec_from_file_location("membership", ROOT / "labs" / "cluster" / "membership.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_node_leaves_and_rejoins_and_the_loss_curve_is_unchanged(tmp_path):
    demo = membership()
    result = demo.run(tmp_path)
    logs = "\n\n".join(f"--- agent {n}\n{o[-3000:]}" for n, o in result["outputs"].items())
    assert result["error"] is None and len(result["story"]) == 3, f"{result['error']}\n{logs}"
    assert result["exit_codes"] == [0, 0], logs
    assert result["curve_ok"] and result["params_ok"], logs
    assert result["sizes"][-1] == 2, result["sizes"]   # the newest checkpoint: the regrown job's
    assert demo.verdict(result)
