"""Seeded draws of graded configurations (issue 39, item 2), shared by chapters 00-03's tests.

A launch costs seconds, so hypothesis's one-example-per-call shape does not fit a test that
runs on N ranks: the test process draws K configurations from a seed instead, passes them to
ONE launch per world size, and every failure message names the seed. Each CI run takes a new
seed; ``LABKIT_SEED=S`` replays a run, ``LABKIT_LONG=1`` draws ``long`` configurations instead
of ``ci`` (a developer's machine).
"""

from __future__ import annotations

import os
import random

LONG = os.environ.get("LABKIT_LONG") == "1"


def seed() -> int:
    """``LABKIT_SEED`` if set, else a fresh one (drawn once per test process)."""
    global _seed
    if _seed is None:
        _seed = int(os.environ.get("LABKIT_SEED") or random.SystemRandom().randrange(2 ** 31))
    return _seed


_seed: int | None = None


def budget(ci: int, long: int) -> int:
    return long if LONG else ci


def rng(salt: str) -> random.Random:
    """A generator for one test: the run's seed and the test's own salt (a string)."""
    return random.Random(f"{seed()}:{salt}")


def replay(salt: str = "") -> str:
    """What a failure message appends so that the run can be replayed."""
    return f"[drawn configuration: LABKIT_SEED={seed()} replays it{'; ' + salt if salt else ''}]"
