"""How the benchmarks print a figure measured over several runs: the median,
then the lowest and the highest run in parentheses."""

from __future__ import annotations

import statistics


def spread(values: list[float], digits: int = 2, width: int = 7, *, scale: float = 1.0, unit: str = "") -> str:
    """``"median (lowest-highest)"`` of ``values`` times ``scale``, the median
    right-aligned in ``width`` characters and followed by ``unit``."""
    lo, mid, hi = min(values) * scale, statistics.median(values) * scale, max(values) * scale
    return f"{mid:{width}.{digits}f}{unit} ({lo:.{digits}f}-{hi:.{digits}f})"
