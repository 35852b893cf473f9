"""Colours for how much each entry changed at a step (the tree's shading in the Run view).

Changes between steps span orders of magnitude and cluster around what the learning rate makes
them, so a fixed scale would paint every tensor the same: the scale runs, in log space, from the
step's smallest change (pale yellow) to its largest (red). An unchanged entry (0: frozen) is blue
-grey and a non-finite change dark red, whatever the others did.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping

from PySide6.QtGui import QColor

__all__ = ["FROZEN", "NONFINITE", "Scale", "heat_scale"]

FROZEN = QColor(148, 163, 184, 120)
NONFINITE = QColor(153, 27, 27, 200)
_STOPS = ((0.0, (254, 249, 195)), (0.5, (251, 146, 60)), (1.0, (220, 38, 38)))
_ALPHA = 150


def _blend(t: float) -> QColor:
    for (t0, c0), (t1, c1) in itertools.pairwise(_STOPS):
        if t <= t1:
            f = 0.0 if t1 == t0 else (t - t0) / (t1 - t0)
            r, g, b = (round(x + (y - x) * f) for x, y in zip(c0, c1, strict=True))
            return QColor(r, g, b, _ALPHA)
    return QColor(*_STOPS[-1][1], _ALPHA)


class Scale:
    """The colour scale of one step's changes: smallest positive ``lo`` to largest ``hi``."""

    def __init__(self, lo: float, hi: float) -> None:
        self.lo, self.hi = lo, hi

    def colour(self, value: float) -> QColor:
        if not math.isfinite(value):
            return NONFINITE
        if value <= 0:
            return FROZEN
        if self.hi <= self.lo:
            return _blend(1.0)
        t = (math.log10(value) - math.log10(self.lo)) / (math.log10(self.hi) - math.log10(self.lo))
        return _blend(min(1.0, max(0.0, t)))

    def legend(self) -> str:
        return f"pale: {self.lo:.3g} (the least) … red: {self.hi:.3g} (the most); blue-grey: unchanged"


def heat_scale(values: Mapping[str, float | None]) -> Scale | None:
    """The scale of ``values`` (None: none is finite and positive)."""
    positive = [v for v in values.values() if v is not None and math.isfinite(v) and v > 0]
    return Scale(min(positive), max(positive)) if positive else None
