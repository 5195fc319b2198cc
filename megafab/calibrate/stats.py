"""What every measurement of this machine shares: the median of timed repeats, and a (weighted)
least-squares line through the points."""

from __future__ import annotations

import statistics
import time


def timed(fn, repeats: int = 5) -> float:
    """fn's median seconds over `repeats` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def line(xs: list[float], ys: list[float], weights: list[float] | None = None) -> tuple[float, float]:
    """(intercept, slope) of the (weighted) least-squares line y = intercept + slope x."""
    w = weights or [1.0] * len(xs)
    total = sum(w)
    mx, my = sum(wi * x for wi, x in zip(w, xs)) / total, sum(wi * y for wi, y in zip(w, ys)) / total
    slope = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys)) / max(
        sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs)), 1e-30)
    return my - slope * mx, slope
