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
