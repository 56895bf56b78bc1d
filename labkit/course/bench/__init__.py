"""``labkit bench``: each course implementation against the PyTorch built-in, in one run.

The runner (``runner.py``: ``BenchRow``, ``@row``, ``run``, ``format_table``) and one file of
rows per chapter (``chNN_<module>.py``), each imported here so that its rows register in
chapter order.
"""

from labkit.course.bench import (  # noqa: F401 - importing a chapter registers its rows
    ch00_collectives,
    ch01_dp,
    ch02_ddp,
    ch03_zero,
    ch04_fsdp,
    ch05_tp,
    ch06_pp,
    ch07_sp,
    ch08_mesh,
    ch10_moe,
    ch11_compress,
    ch12_recompute,
    ch13_rpc,
    ch14_perf,
)
from labkit.course.bench.runner import (
    ROWS,
    BenchRow,
    format_table,
    race_training_steps,
    rank_batch,
    row,
    run,
)
from labkit.timing import interleaved_medians

__all__ = ["ROWS", "BenchRow", "format_table", "interleaved_medians", "race_training_steps", "rank_batch",
           "row", "run"]
