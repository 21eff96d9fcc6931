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


STANDARD_PERCENTILES = (50.0, 90.0, 99.0)


def summarize(
    values: list[float], percentiles: tuple[float, ...] = STANDARD_PERCENTILES
) -> dict[str, float]:
    """mean and each percentile (`p50_ms` is the median) of seconds, in milliseconds; NaN
    when empty."""
    ms = [v * 1000.0 for v in values]
    summary = {"mean_ms": sum(ms) / len(ms) if ms else float("nan")}
    for q in sorted(set(STANDARD_PERCENTILES) | set(percentiles)):
        summary[percentile_key(q)] = percentile(ms, q)
    return summary


def percentile_key(q: float) -> str:
    return f"p{q:g}_ms"
