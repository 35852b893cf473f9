"""The Convert panel's "Ranks" choice: 1 converts in the window's process, as always; N > 1 runs the
same conversion on N local ranks (:func:`dcpstudio.core.ranks.convert.run_convert`: the tensor bytes
split between them by size, the output the same byte for byte), as a Job, with a bar per rank. The
bars are made when a distributed conversion starts and cleared when another starts."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from PySide6.QtWidgets import QBoxLayout, QHBoxLayout, QProgressBar, QSpinBox, QWidget

from dcpstudio.core import ConversionResult
from dcpstudio.core.ops.report import human_bytes, plural

from ..locations import is_remote

__all__ = ["RanksChoice", "rank_bars"]


def rank_bars(row: QBoxLayout, old: list[QProgressBar], ranks: int) -> list[QProgressBar]:
    """``old``'s bars taken out of ``row``, and a bar for each of ``ranks`` ranks put in (a convert
    or a load on ranks: each rank's share done)."""
    for bar in old:
        row.removeWidget(bar)
        bar.deleteLater()
    bars = []
    for r in range(ranks):
        bar = QProgressBar()
        bar.setRange(0, 100)
        bar.setFormat(f"rank {r}: %p%")
        row.addWidget(bar)
        bars.append(bar)
    return bars


class RanksChoice:
    """``spin``: how many ranks (1 .. the machine's cores); ``bars``: a row of per-rank progress bars."""

    def __init__(self, parent: QWidget) -> None:
        self.spin = QSpinBox(parent)
        self.spin.setRange(1, max(1, os.cpu_count() or 1))
        self.spin.setValue(1)
        self.spin.setToolTip(
            "Convert on this many local ranks, the tensor bytes split between them by size; the output is what one "
            "process writes, byte for byte, its manifest too where it writes one (1: in this process)"
        )
        self.bars = QWidget(parent)
        self._row = QHBoxLayout(self.bars)
        self._row.setContentsMargins(0, 0, 0, 0)
        self._bars: list[QProgressBar] = []

    @property
    def count(self) -> int:
        return int(self.spin.value())

    def refusal(self, source: Any) -> str | None:
        """Why these ranks cannot convert ``source`` (None: they can)."""
        if self.count > 1 and is_remote(source) and str(source).lower().startswith("memory://"):
            return f"{source} lives in this process's memory: ranks are separate processes and cannot read it."
        return None

    def work(self, source: Any, dst: Any, options: dict[str, Any]) -> Any:
        """The Job function: ``options`` as for ``run_convert`` (``convert``'s, or a mapping's)."""
        ranks = self.count
        self.reset(ranks)

        def work(progress: Any, cancel: Any) -> ConversionResult:
            import warnings

            from dcpstudio.core.ranks.convert import run_convert

            with warnings.catch_warnings():  # notes come back in the result and are shown in the report
                warnings.simplefilter("ignore", UserWarning)
                result, shares = run_convert(source, dst, ranks=ranks, on_progress=progress, cancel=cancel, **options)
            each = ", ".join(f"rank {s.rank} {human_bytes(s.nbytes)} in {s.seconds:.2f} s" for s in shares)
            said = f"on {plural(ranks, 'rank')}: {each}"
            return replace(result, notes=(said, *result.notes))

        return work

    def reset(self, ranks: int = 0) -> None:
        """A bar for each of ``ranks`` ranks (none: the conversion runs here)."""
        self._bars = rank_bars(self._row, self._bars, ranks)

    def show(self, p: Any) -> float | None:
        """A rank's progress drawn on its bar; the mean over the ranks (None: not a rank's progress)."""
        rank = getattr(p, "rank", None)
        if rank is None or not 0 <= rank < len(self._bars):
            return None
        self._bars[rank].setValue(int(p.fraction * 100))
        return sum(b.value() for b in self._bars) / (100 * len(self._bars))
