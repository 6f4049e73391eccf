"""Order statistics shared by the benchmark drivers (no torch import: the HTTP clients use it)."""

from __future__ import annotations

import math


def percentile(values, q: float, empty=None):
    """The q-th percentile by linear interpolation between closest ranks (numpy.percentile's
    default), so reports match what a reader computes with numpy; `empty` for no values."""
    s = sorted(values)
    if not s:
        return empty
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
