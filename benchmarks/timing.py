"""One timing helper for every benchmark: medians of wall-clock repeats.

Benchmarks report ratios measured in one run, so each of them times its
cases the same way: one warm-up call, then the median of ``repeats`` calls
(or, for very short calls, the best mean over rounds of ``number`` calls).
"""

from __future__ import annotations

import statistics
import time
import timeit
from collections.abc import Callable

__all__ = ["best_us", "median_s"]


def median_s(fn: Callable[[], object], repeats: int = 7, warmup: int = 1) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeats`` calls after
    ``warmup`` untimed calls. ``fn`` must block until its work is done
    (``mx.eval``, ``jax.block_until_ready``)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def best_us(fn: Callable[[], object], number: int, repeat: int = 5) -> float:
    """Microseconds per call: the best of ``repeat`` rounds of ``number``
    back-to-back calls (for calls far shorter than the timer's noise)."""
    fn()
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6
