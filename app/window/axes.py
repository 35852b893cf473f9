"""Where a painted axis puts its ticks and what they read (no Qt).

Ticks sit at round values, a step of 1, 2 or 5 times a power of ten ("nice numbers"): a value
axis from -4.344 to 2.234 reads -4, -2, 0, 2, never the range's ends cut into fifths. A count axis
has distinct whole numbers only, so a small histogram never reads "1 / 0 / 0".
"""

from __future__ import annotations

import math

__all__ = ["count_ticks", "tick_text", "value_ticks"]


def _steps(span: float) -> list[float]:
    """Candidate steps for a span, smallest first: 1, 2, 5 times powers of ten around it."""
    k = math.floor(math.log10(span)) - 3
    return [m * 10.0**e for e in range(k, k + 6) for m in (1, 2, 5)]


def value_ticks(lo: float, hi: float, most: int = 5) -> tuple[list[float], float]:
    """The densest round ticks inside ``[lo, hi]``, at most ``most`` of them, and their step."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return ([lo] if math.isfinite(lo) else []), 0.0
    most = max(1, most)
    for step in _steps(hi - lo):
        first, last = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
        if last - first + 1 <= most:
            return [k * step + 0.0 for k in range(first, last + 1)], step
    return [lo], 0.0


def tick_text(value: float, step: float) -> str:
    """A tick's label with as many decimals as its step needs: ``-4``, ``0.25``, ``1e-06``."""
    if value == 0:
        return "0"
    if step <= 0 or abs(value) >= 1e6 or step < 1e-4:
        return f"{value:.3g}"
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    return f"{value:.{decimals}f}"


def count_ticks(top: int, most: int = 3) -> list[int]:
    """Round, distinct counts from 0 up to ``top`` for a count axis: a step of 1, 2 or 5 times a power
    of ten, at most ``most`` + 1 ticks -- never "1 / 0 / 0" for a small histogram."""
    if top <= 0:
        return [0]
    scale = 1
    while True:
        for step in (scale, 2 * scale, 5 * scale):
            if top // step <= most:
                return list(range(0, top + 1, step))
        scale *= 10
