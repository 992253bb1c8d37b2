"""How the benchmarks print a figure measured over several runs: the median,
then the lowest and the highest run in parentheses."""

from __future__ import annotations

import math
import statistics


def spread(values: list[float], digits: int = 2, width: int = 7, *, scale: float = 1.0, unit: str = "") -> str:
    """``"median (lowest-highest)"`` of ``values`` times ``scale``, the median
    right-aligned in ``width`` characters and followed by ``unit``."""
    lo, mid, hi = min(values) * scale, statistics.median(values) * scale, max(values) * scale
    return f"{mid:{width}.{digits}f}{unit} ({lo:.{digits}f}-{hi:.{digits}f})"


def ratio_line(ratio: float, what: str, target: float) -> str:
    """A ratio and its target, ``"   ratio 0.95x  <what>  target >= 0.9x  PASS"``
    (or ``FAIL``): every ratio that has a target is printed so, on a line of
    its own that starts with ``ratio``, for the GPU check's report to gather.
    The ratio is printed rounded down to hundredths, so that a ratio just short
    of its target never reads as the target itself beside ``FAIL`` (0.797
    prints 0.79, not 0.80)."""
    shown = math.floor(ratio * 100 + 1e-9) / 100
    return f"   ratio {shown:5.2f}x  {what}  target >= {target:g}x  {'PASS' if ratio >= target else 'FAIL'}"
