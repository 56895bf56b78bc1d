"""The notebooks as saved: no error output, no verdict that contradicts its prose, and
widgets whose controls start on their own step grid.

A notebook states conclusions about its own measurements. Where a conclusion depends on a
number, the cell prints a machine-checkable line with ``labkit.check.verdict`` ("[verdict]
ok: ..." or "[verdict] FAILED: ..."), and the text may rely on it. This test reads every
saved notebook: a FAILED verdict means the text now claims something its numbers deny.
(nbval re-runs the cells and compares outputs; this test reads what a reader sees.)
"""

import ast
import json
import math
from pathlib import Path

import pytest

from labkit.check import VERDICT

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p.relative_to(ROOT).as_posix() for folder in ("chapters", "labs") for p in (ROOT / folder).glob("*.ipynb"))


def outputs(path: str):
    cells = json.loads((ROOT / path).read_text())["cells"]
    for index, cell in enumerate(cells):
        for output in cell.get("outputs", []):
            yield index, cell, output


def text_of(output) -> str:
    text = output.get("text", "")
    if not text and "data" in output:
        text = output["data"].get("text/plain", "")
    return "".join(text) if isinstance(text, list) else text


@pytest.mark.parametrize("path", NOTEBOOKS)
def test_no_saved_error_and_no_failed_verdict(path):
    for index, cell, output in outputs(path):
        assert output.get("output_type") != "error", f"{path}: cell {index} holds an error: {output.get('ename')}: {output.get('evalue')}"
        for line in text_of(output).splitlines():
            assert not line.startswith(f"{VERDICT} FAILED"), f"{path}: cell {index}: {line}"


def constant(node):
    """The value of a literal or an arithmetic expression of literals (2**24, 1 / 8), else None."""
    try:
        return eval(compile(ast.Expression(node), "<slider>", "eval"), {"__builtins__": {}}, {})
    except Exception:  # noqa: BLE001 - a name or a call: not a constant
        return None


def sliders(source: str):
    """(class name, {keyword: value}) of every ipywidgets slider built in ``source``."""
    try:
        tree = ast.parse(source)
    except SyntaxError:  # IPython magics
        tree = ast.parse("\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name.endswith("Slider"):
                yield name, {k.arg: constant(k.value) for k in node.keywords if k.arg}


def on_grid(name: str, args: dict) -> bool:
    value = args.get("value")
    if name == "SelectionSlider" or value is None:
        return value is None or value in (args.get("options") or [value])
    low, step = args.get("min", 0), args.get("step", 1)
    if "Log" in name:
        value = math.log(value, args.get("base", 10))
    k = (value - low) / step
    return abs(k - round(k)) < 1e-9


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if "Slider(" in (ROOT / p).read_text()])
def test_sliders_start_on_their_step_grid(path):
    """A slider whose value is off its grid snaps it on first render and fires a callback:
    the widget then shows something else than the text next to it says (5 becomes 5.01)."""
    for cell in json.loads((ROOT / path).read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        for name, args in sliders("".join(cell["source"])):
            assert on_grid(name, args), f"{path}: {name}({args}): the value is not on the slider's grid"
