"""perf.roofline: an operation's time is the larger of its FLOPs at the achieved FLOP/s and its
bytes at the memory bandwidth (Williams, Waterman & Patterson 2009; the overview:
``labkit/perf/__init__.py``).
"""

from __future__ import annotations

from labkit.hardware import Hardware

def op_time(flops: float, nbytes: float, hw: Hardware, achieved: bool = True) -> float:
    """The roofline: max(flops / FLOP/s, nbytes / bandwidth) seconds, with the hardware's
    achieved figures (each one that is None falls back to its peak), or its peaks when
    ``achieved`` is False."""
    # BEGIN SOLUTION perf.roofline: pick achieved or peak FLOP/s and bandwidth (None -> peak); the larger of the two times
    rate = hw.achieved_flops if achieved and hw.achieved_flops else hw.peak_flops
    bandwidth = hw.achieved_bandwidth if achieved and hw.achieved_bandwidth else hw.memory_bandwidth
    return max(flops / rate, nbytes / bandwidth)
    # END SOLUTION


def matmul_time(m: int, n: int, k: int, hw: Hardware, element_bytes: int = 2, achieved: bool = True) -> float:
    """[m, k] @ [k, n]: 2mnk FLOPs; reads both inputs and writes the output once,
    (mk + kn + mn) x element_bytes bytes; timed by ``op_time``."""
    # BEGIN SOLUTION perf.roofline: 2mnk FLOPs, (mk + kn + mn) x element_bytes bytes, op_time
    return op_time(2 * m * n * k, (m * k + k * n + m * n) * element_bytes, hw, achieved)
    # END SOLUTION


def arithmetic_intensity(flops: float, nbytes: float) -> float:
    """FLOPs per byte moved."""
    # BEGIN SOLUTION perf.roofline: flops / bytes
    return flops / nbytes
    # END SOLUTION


def ridge_point(hw: Hardware, achieved: bool = True) -> float:
    """The intensity (FLOPs/byte) above which an op is compute-bound: FLOP/s / bandwidth."""
    # BEGIN SOLUTION perf.roofline: FLOP/s / bandwidth, achieved or peak as in op_time
    rate = hw.achieved_flops if achieved and hw.achieved_flops else hw.peak_flops
    bandwidth = hw.achieved_bandwidth if achieved and hw.achieved_bandwidth else hw.memory_bandwidth
    return rate / bandwidth
    # END SOLUTION
