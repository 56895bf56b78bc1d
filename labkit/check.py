"""Numerical checks shared by labs and grading tests, with the tolerances written down.

Parallel code sums in a different order than the single-process reference, so floats
differ in the last bits; integers must match exactly. The bounds below are per dtype:
|actual - expected| <= atol + rtol * |expected|, elementwise.
"""

from __future__ import annotations

import torch

# dtype -> (rtol, atol). float32: ~100 ulps of relative slack covers reordered sums of a
# few ranks over several optimizer steps; the low-precision types get ~8 ulps of theirs.
TOLERANCES = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.float16: (8e-3, 1e-5),
    torch.bfloat16: (6e-2, 1e-5),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for a dtype; (0, 0) for integers and bools: they must be exact."""
    return TOLERANCES.get(dtype, (0.0, 0.0))


def mismatch(actual: torch.Tensor, expected: torch.Tensor, rtol=None, atol=None) -> str | None:
    """None if ``actual`` matches ``expected`` within tolerance, else what is wrong and how far."""
    if not isinstance(actual, torch.Tensor):
        return f"expected a tensor, got {type(actual).__name__}"
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype}, expected {expected.dtype}"
    default_rtol, default_atol = tolerance(expected.dtype)
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    diff = (a - e).abs()
    bad = ~(diff <= atol + rtol * e.abs())  # NaN counts as bad
    if not bad.any():
        return None
    where = tuple(int(i) for i in torch.nonzero(bad)[0]) if diff.dim() else ()
    worst = diff.nan_to_num(float("inf")).max().item()
    return (f"{int(bad.sum())} of {bad.numel()} elements differ; first at index {where}: "
            f"got {a[where].item():.8g}, expected {e[where].item():.8g}; "
            f"max |diff| {worst:.3g} (rtol={rtol:g}, atol={atol:g})")


def assert_close(actual, expected, what: str, rtol=None, atol=None) -> None:
    """Raise AssertionError saying ``what`` (task, rank, step, tensor) and how far off."""
    problem = mismatch(actual, expected, rtol, atol)
    if problem:
        raise AssertionError(f"{what}: {problem}")


# ----------------------------------------------------------------------------- stubs in labs


def not_implemented(error: BaseException) -> str | None:
    """"not implemented yet: <task> (hint: <the stub's hint>)" if ``error`` comes from an
    exercise stub (raised here or on a rank of a launch), else None."""
    from labkit.launch import WorkerError
    if isinstance(error, NotImplementedError):
        message = str(error)
    elif isinstance(error, WorkerError) and error.exc_type == "NotImplementedError":
        message = error.message
    else:
        return None
    task, _, hint = message.partition(":")
    return f"not implemented yet: {task}" + (f" (hint: {hint.strip()})" if hint.strip() else "")


def attempt(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), None)``, or ``(None, "not implemented yet: <task>")`` while
    the code it runs hits a stub, so that a lab section can say so and the notebook go on::

        sweep, missing = attempt(labkit.launch, sweep_on_rank, 2)
        print(missing or table(sweep))
    """
    try:
        return fn(*args, **kwargs), None
    except Exception as error:  # noqa: BLE001 - re-raised unless it is a stub's
        missing = not_implemented(error)
        if missing is None:
            raise
        return None, missing


# ----------------------------------------------------------------------------- verdicts


VERDICT = "[verdict]"  # tests/test_notebooks.py reads these lines in the saved notebooks


def verdict(claim: str, holds: bool, evidence: str = "") -> bool:
    """Print a machine-checkable line for a conclusion a notebook draws from its own numbers:
    ``[verdict] ok: <claim> (<evidence>)`` or ``[verdict] FAILED: <claim> (<evidence>)``.

    The prose around it may then rely on the claim: the test suite fails if a saved notebook
    holds a FAILED verdict, so text and numbers cannot silently disagree. Returns ``holds``.
    """
    status = "ok" if holds else "FAILED"
    print(f"{VERDICT} {status}: {claim}" + (f" ({evidence})" if evidence else ""))
    return holds
