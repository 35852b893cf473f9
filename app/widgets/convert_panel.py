"""Conversion controls: one button per target (each also a drop target), options, progress,
Cancel, and the outcome with "Open result" / "Verify"."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtGui import QDragEnterEvent, QDropEvent
from PySide6.QtWidgets import (
    QComboBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

__all__ = ["TARGETS", "ConvertPanel", "DropButton", "dropped_paths"]

TARGETS = {"dcp": "→ DCP", "torch": "→ torch.save", "safetensors": "→ safetensors"}


def dropped_paths(event: QDropEvent | QDragEnterEvent) -> list[Path]:
    mime = event.mimeData()
    return [Path(u.toLocalFile()) for u in mime.urls() if u.isLocalFile()] if mime.hasUrls() else []


class DropButton(QPushButton):
    """A button that also takes a dropped file or directory (``dropped(path)``)."""

    dropped = Signal(object)

    def __init__(self, text: str, parent: QWidget | None = None) -> None:
        super().__init__(text, parent)
        self.setAcceptDrops(True)

    def dragEnterEvent(self, event: QDragEnterEvent) -> None:
        if dropped_paths(event):
            event.acceptProposedAction()

    def dropEvent(self, event: QDropEvent) -> None:
        paths = dropped_paths(event)
        if paths:
            event.acceptProposedAction()
            self.dropped.emit(paths[0])


class ConvertPanel(QGroupBox):
    convert_requested = Signal(str, object)  # target, source path (None: the open checkpoint)
    cancel_requested = Signal()
    verify_requested = Signal()
    open_result_requested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Convert", parent)
        self.buttons: dict[str, DropButton] = {}
        row = QHBoxLayout()
        for target, title in TARGETS.items():
            b = DropButton(title)
            b.setToolTip(f"Convert the open checkpoint {title[2:]} (or drop a checkpoint here)")
            b.clicked.connect(lambda _=False, t=target: self.convert_requested.emit(t, None))
            b.dropped.connect(lambda path, t=target: self.convert_requested.emit(t, path))
            self.buttons[target] = b
            row.addWidget(b)
        self.include = QLineEdit()
        self.include.setPlaceholderText("regex, e.g. ^model\\.")
        self.exclude = QLineEdit()
        self.exclude.setPlaceholderText("regex, e.g. ^optim\\.")
        self.shard_size = QLineEdit()
        self.shard_size.setPlaceholderText("safetensors shard size, e.g. 5GB (empty: one file)")
        self.dtype = QComboBox()
        self.dtype.addItems(["keep dtypes", "bf16", "fp16", "fp32"])
        form = QFormLayout()
        form.addRow("Include", self.include)
        form.addRow("Exclude", self.exclude)
        form.addRow("Shards", self.shard_size)
        form.addRow("Cast floats", self.dtype)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setTextVisible(True)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(self.cancel_requested)
        self.status = QLabel()
        self.status.setWordWrap(True)
        self.open_button = QPushButton("Open result")
        self.open_button.clicked.connect(self.open_result_requested)
        self.verify_button = QPushButton("Verify")
        self.verify_button.setToolTip("Compare the source and the result, value by value")
        self.verify_button.clicked.connect(self.verify_requested)
        bottom = QHBoxLayout()
        bottom.addWidget(self.progress, 1)
        bottom.addWidget(self.cancel_button)
        outcome = QHBoxLayout()
        outcome.addWidget(self.status, 1)
        outcome.addWidget(self.open_button)
        outcome.addWidget(self.verify_button)
        lay = QVBoxLayout(self)
        lay.addLayout(row)
        lay.addLayout(form)
        lay.addLayout(bottom)
        lay.addLayout(outcome)
        self.set_busy(False)
        self.set_result(None)

    def options(self, target: str) -> dict[str, object]:
        opts: dict[str, object] = {
            "include": self.include.text() or None,
            "exclude": self.exclude.text() or None,
        }
        if target == "safetensors":
            opts["max_shard_size"] = self.shard_size.text().strip() or None
            opts["dtype"] = None if self.dtype.currentIndex() == 0 else self.dtype.currentText()
        return opts

    def set_busy(self, busy: bool, text: str = "") -> None:
        for b in self.buttons.values():
            b.setEnabled(not busy)
        self.cancel_button.setEnabled(busy)
        self.progress.setVisible(busy)
        self.cancel_button.setVisible(busy)
        if busy:
            self.progress.setValue(0)
            self.status.setText(text)
            self.open_button.setVisible(False)
            self.verify_button.setVisible(False)

    def set_progress(self, fraction: float, text: str) -> None:
        self.progress.setValue(int(fraction * 1000))
        self.progress.setFormat(f"{fraction * 100:.0f}%  {text[-48:]}")

    def set_result(self, text: str | None, can_open: bool = False) -> None:
        self.status.setText(text or "")
        self.open_button.setVisible(can_open)
        self.verify_button.setVisible(can_open)
