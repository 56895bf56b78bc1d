"""Software stacks and their calibration (given; the overview: ``labkit/perf/__init__.py``).

A GPU's datasheet peak is not what a training run gets: the achieved fraction belongs to the
SOFTWARE STACK (its kernels, fusions, overlap, clocks under its power cap) on one GPU
generation, not to the GPU. A Stack holds that fraction; ``calibrate`` fits it from ONE run
(a published row, or a step you timed yourself) by solving step_time(...) = the measured step
for the matmul efficiency; the stack then predicts the other runs of the same stack
(``step_time(..., stack=stack)`` or ``stack.on(cluster)``). Element-wise work is not in the
fraction: step_time prices it at HBM bandwidth (``elementwise_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from labkit.hardware import Cluster, Hardware
from labkit.perf.flops import Model
from labkit.perf.step import Layout, step_time

@dataclass(frozen=True)
class Stack:
    """One software stack on one GPU: ``matmul`` is the achieved fraction of the GPU's dense
    peak FLOP/s in its matmuls (and attention), ``memory`` the achieved fraction of its HBM
    bandwidth for element-wise work (1.0: the datasheet's; the calibration fits ``matmul``
    only), ``source`` what it was calibrated on. ``saturated``: the fit hit 100 % of the peak
    and still did not reach the measured speed (the model's other terms are too large)."""
    name: str
    gpu: Hardware
    matmul: float
    memory: float = 1.0
    source: str = ""
    saturated: bool = False

    def hardware(self) -> Hardware:
        """The GPU with this stack's achieved FLOP/s and bandwidth."""
        return replace(self.gpu, achieved_flops=self.matmul * self.gpu.peak_flops,
                       achieved_bandwidth=self.memory * self.gpu.memory_bandwidth)

    def on(self, cluster: Cluster) -> Cluster:
        """``cluster`` with its GPU running this stack."""
        return replace(cluster, gpu=self.hardware())


def calibrate(model: Model, layout: Layout, cluster: Cluster, global_batch: int, *,
              tokens_per_second: float | None = None, step_seconds: float | None = None,
              name: str = "", source: str = "", memory: float = 1.0) -> Stack:
    """The Stack that makes ``step_time(model, layout, cluster, global_batch)`` take the measured
    step: give ``step_seconds`` or ``tokens_per_second`` (the whole job's: global_batch x seq /
    step). Solves for the matmul efficiency by bisection in (0, 1] (the step time falls as the
    efficiency rises); ``memory``: the fraction of HBM bandwidth, held fixed. A run the model
    cannot reach even at the peak gives matmul = 1 and saturated = True."""
    if (tokens_per_second is None) == (step_seconds is None):
        raise ValueError("calibrate: give exactly one of tokens_per_second and step_seconds")
    target = step_seconds if step_seconds is not None else global_batch * model.seq / tokens_per_second
    if not target > 0:
        raise ValueError(f"calibrate: the measured step must be positive, got {target!r} s")

    def stack(fraction: float) -> Stack:
        return Stack(name or f"calibrated on {model.name or 'a run'}", cluster.gpu, fraction, memory,
                     source or f"{model.name} {layout} on {cluster.name or cluster.gpu.name}: {target:.4g} s/step")

    def seconds(fraction: float) -> float:
        return step_time(model, layout, cluster, global_batch, stack=stack(fraction)).total

    if seconds(1.0) > target:
        return replace(stack(1.0), saturated=True)
    lo, hi = 1e-4, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if seconds(mid) > target:
            lo = mid
        else:
            hi = mid
    return stack((lo + hi) / 2)
