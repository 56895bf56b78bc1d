"""labkit bench: the rows run and report medians, ratios and traced bytes."""

import labkit
from labkit.course import bench
from labkit.launch import WorkerError
from tests.conftest import needs_solutions


@needs_solutions
def test_ring_row_reports_times_ratio_and_bytes_against_the_formula():
    (row,) = bench.run(["ring_all_reduce"], repeats=3, world_size=2)
    assert row.ours_s > 0 and row.builtin_s > 0 and row.ratio == row.ours_s / row.builtin_s
    size = int(16 * 2 ** 20) // 4 * 4
    assert row.formula_bytes == 2 * (2 - 1) / 2 * size
    assert row.traced_bytes == row.formula_bytes  # 16 MB divides evenly: no padding
    table = bench.format_table([row])
    assert "ring all-reduce vs dist.all_reduce" in table and f"{row.ratio:.2f}" in table


def two_ranks_time_two_things():
    import time
    return bench.interleaved_medians({"fast": lambda x: None, "slow": lambda x: time.sleep(0.02)},
                                     lambda: None, repeats=3, warmup=1)


def test_interleaved_medians_time_each_candidate_on_every_rank():
    results = labkit.launch(two_ranks_time_two_things, 2)
    assert results[0] == results[1], "every rank must report the same (slowest-rank) medians"
    assert results[0]["slow"] >= 0.02 > results[0]["fast"]


def test_a_stubbed_row_says_not_implemented(monkeypatch):
    def stub_row(**options):
        raise WorkerError(0, "NotImplementedError", "collectives.all_reduce: pad to a multiple of N", "")
    monkeypatch.setitem(bench.ROWS, "stub", stub_row)
    assert bench.run(["stub"]) == ["stub: not implemented yet (collectives.all_reduce: pad to a multiple of N)"]


def test_rows_that_cannot_take_the_world_size_are_skipped_with_a_reason_and_the_rest_run(monkeypatch):
    from labkit.course.bench import runner
    ran = []

    def fine(**options):
        ran.append(options["world_size"])
        return bench.BenchRow("fine", 1.0, 2.0)

    def broken(**options):
        raise WorkerError(1, "RuntimeError", "boom\nmore", "")
    monkeypatch.setitem(bench.ROWS, "halves", fine)
    monkeypatch.setitem(runner.SIZES, "halves", (runner.divides(8), "its 8 heads split evenly"))
    monkeypatch.setitem(bench.ROWS, "fine", fine)
    monkeypatch.setitem(bench.ROWS, "broken", broken)
    out = bench.run(["halves", "broken", "fine"], world_size=3)
    assert out[0] == "halves: skipped at 3 ranks: its 8 heads split evenly; it runs on 1, 2, 4, 8", out
    assert out[1] == "broken: FAILED on rank 1: RuntimeError: boom", out
    assert isinstance(out[2], bench.BenchRow) and ran == [3], out   # the row after them still ran
    assert runner.size_problem("tp", 3) and runner.size_problem("tp", 4) is None   # the real rows declare theirs


def test_an_unknown_row_is_refused_before_any_runs_with_a_did_you_mean():
    import pytest
    with pytest.raises(ValueError, match="no benchmark row 'tpp'; did you mean tp?"):
        bench.run(["ring_all_reduce", "tpp"])


def test_the_table_stays_in_line_with_long_labels_and_explains_every_extra_figure():
    import ast
    from pathlib import Path
    from labkit.course.bench import runner
    rows = [bench.BenchRow("short", 0.001, 0.002, 10, 10, extra=dict(balanced_formula=5)),
            bench.BenchRow("a much longer label " * 5, 0.001, 0.002)]
    lines = bench.format_table(rows).splitlines()
    header, first, second = lines[0], lines[2], lines[4]
    assert len(first) == len(second) == len(header), "\n".join(lines)   # every column ends where its title does
    assert any(line.strip().startswith("balanced_formula") and "evenly" in line for line in lines), lines
    # Every extra figure a row reports has its meaning written down.
    keys = set()
    for path in Path(runner.__file__).parent.glob("ch*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            value = None
            if isinstance(node, ast.keyword) and node.arg == "extra":
                value = node.value
            elif isinstance(node, (ast.Assign, ast.AugAssign)) and "extra" in ast.unparse(node).split("=")[0]:
                value = node.value
            if isinstance(value, ast.Dict):
                keys |= {k.value for k in value.keys if isinstance(k, ast.Constant)}
            elif isinstance(value, ast.Call) and ast.unparse(value.func) == "dict":
                keys |= {k.arg for k in value.keywords}
    assert len(keys) > 20 and keys <= set(runner.EXTRA_MEANINGS), sorted(keys - set(runner.EXTRA_MEANINGS))


@needs_solutions
def test_the_flops_row_counts_what_flop_counter_mode_counts():
    (result,) = bench.run(["perf_flops"], repeats=3)
    assert isinstance(result, bench.BenchRow), result
    assert result.extra["formula_flops"] == result.extra["counted_flops"] > 0, result.extra
