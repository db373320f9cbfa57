"""Timing helpers shared by the benchmark scripts (run as ``python bench/<name>.py``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(action: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` calls: robust to the odd slow run on a shared machine."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
