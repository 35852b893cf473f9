"""The status bar's remote indicator: where the open checkpoint lives (☁ s3://bucket/ckpt) and what
this process has fetched so far from remote stores, refreshed twice a second. Hidden while the
open checkpoint is local. It reads core's counters only: never the network."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QHBoxLayout, QLabel, QWidget

from dcpstudio.core.io.remote.locations import FetchStats, fetch_stats
from dcpstudio.core.ops.report import human_bytes

__all__ = ["RemoteStatus"]

_WIDEST = 360  # px for the URL: a long one is elided in the middle, the message strip keeps its room


class RemoteStatus(QWidget):
    def __init__(
        self, stats: Callable[[], FetchStats] = fetch_stats, interval_ms: int = 500, parent: QWidget | None = None
    ) -> None:
        super().__init__(parent)
        self._stats = stats
        self.url = ""
        self.where = QLabel()
        self.where.setObjectName("remoteWhere")
        self.where.setTextFormat(Qt.TextFormat.PlainText)
        self.fetched = QLabel()
        self.fetched.setTextFormat(Qt.TextFormat.PlainText)
        self.fetched.setToolTip("Bytes and range requests fetched from remote stores since DCP Studio started")
        lay = QHBoxLayout(self)
        lay.setContentsMargins(0, 0, 6, 0)
        lay.addWidget(self.where)
        lay.addWidget(self.fetched)
        self.timer = QTimer(self)
        self.timer.setInterval(interval_ms)
        self.timer.timeout.connect(self.refresh)
        self.setVisible(False)

    def show_for(self, url: str | None) -> None:
        """Show ``url`` (as shown: no credentials) and start counting; ``None`` hides it all."""
        self.url = url or ""
        if url is None:
            self.timer.stop()
            self.setVisible(False)
            return
        text = f"☁ {url}"
        self.where.setText(self.where.fontMetrics().elidedText(text, Qt.TextElideMode.ElideMiddle, _WIDEST))
        self.where.setToolTip(f"The open checkpoint is read from {url}")
        self.refresh()
        self.timer.start()
        self.setVisible(True)

    def refresh(self) -> None:
        s = self._stats()
        self.fetched.setText(
            f"fetched {human_bytes(s.bytes)} in {s.requests:,} request{'s' if s.requests != 1 else ''}"
        )
