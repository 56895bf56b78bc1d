"""Wall-clock stamps for promptness bars. A rank writes one just before the event a test times
(a raise, a blocking call, a lost RPC); the test measures from the latest stamp to the report.
Timing from the launch instead would count how long a loaded machine takes to start the ranks,
which is not what any of these bars is about."""

import os
import time


def stamp(folder, name: str) -> None:
    """Write the wall clock into ``folder/name`` (ranks call this: plain files, no pickling)."""
    with open(os.path.join(folder, name), "w") as f:
        f.write(repr(time.time()))


def stamps(folder) -> list[float]:
    """Every stamp in ``folder``; files left empty (a pid file of a rank that never stamped) are skipped."""
    return [float(text) for name in os.listdir(folder) if (text := open(os.path.join(folder, name)).read())]


def seconds_since_last(folder, expected: int | None = None, ended: float | None = None) -> float:
    """Seconds from the latest stamp in ``folder`` to ``ended`` (default now); with ``expected``,
    every one of that many ranks must have stamped."""
    found = stamps(folder)
    assert found, "no rank reached its stamp"
    assert expected is None or len(found) == expected, f"only {len(found)} of {expected} ranks reached their stamp"
    return (time.time() if ended is None else ended) - max(found)
