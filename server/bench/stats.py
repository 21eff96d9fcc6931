"""Latency summaries: mean, median and tail percentiles in milliseconds."""

from __future__ import annotations

import math


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), without numpy."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(values: list[float]) -> dict[str, float]:
    """mean / p50 (the median) / p90 / p99 of seconds, in milliseconds; NaN when empty."""
    ms = [v * 1000.0 for v in values]
    return {
        "mean_ms": sum(ms) / len(ms) if ms else float("nan"),
        "p50_ms": percentile(ms, 50),
        "p90_ms": percentile(ms, 90),
        "p99_ms": percentile(ms, 99),
    }
