"""The open and save dialogs, which take a checkpoint folder as they take a file.

A DCP checkpoint is a folder (``.metadata`` beside its ``.distcp`` files), and so is a sharded
safetensors or torch.save checkpoint with its index. A plain file dialog enters such a folder when
it is chosen, and a save dialog turns its button to "Open": neither an existing folder checkpoint
to replace nor one to open could be picked there. These dialogs treat a checkpoint folder as a
leaf: choosing it (selected or typed, then Open/Save or Enter, or double-clicked) returns it. They
are Qt's own widget dialogs, since a platform dialog cannot be taught that. Replacing what exists
is still the caller's question (the save dialog never asks, so it is never asked twice).
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QFileDialog, QLineEdit, QWidget

__all__ = ["MARKERS", "CheckpointFileDialog", "ask_open", "ask_save", "is_checkpoint_folder"]

# what marks a folder as a checkpoint, found by a stat each (no listing of the folder on the GUI thread)
MARKERS = (".metadata", "model.safetensors.index.json", "pytorch_model.bin.index.json")


def is_checkpoint_folder(path: Path) -> bool:
    try:
        return path.is_dir() and any((path / name).is_file() for name in MARKERS)
    except OSError:
        return False


class CheckpointFileDialog(QFileDialog):
    """``chosen`` is the path picked once :meth:`exec` returns Accepted."""

    def __init__(self, parent: QWidget | None, title: str, start: str, *, save: bool, filters: str = "") -> None:
        super().__init__(parent, title, start, filters)
        self.setOption(QFileDialog.Option.DontUseNativeDialog, True)
        self.chosen: Path | None = None
        if save:
            self.setAcceptMode(QFileDialog.AcceptMode.AcceptSave)
            self.setFileMode(QFileDialog.FileMode.AnyFile)
            self.setOption(QFileDialog.Option.DontConfirmOverwrite, True)
        else:
            self.setFileMode(QFileDialog.FileMode.ExistingFile)
        self._label = "Save" if save else "Open"
        self.directoryEntered.connect(self._entered)  # a double-click on a folder enters it: a checkpoint is chosen
        box = self.findChild(QDialogButtonBox, "buttonBox")
        which = QDialogButtonBox.StandardButton.Save if save else QDialogButtonBox.StandardButton.Open
        self._button = box.button(which) if box is not None else None
        queued = Qt.ConnectionType.QueuedConnection  # after the dialog's own update, which says "Open"
        self.currentChanged.connect(self._relabel, queued)
        self._edit = self.findChild(QLineEdit, "fileNameEdit")
        if self._edit is not None:
            self._edit.textChanged.connect(self._relabel, queued)

    def _folder(self) -> Path | None:
        """The checkpoint folder typed or selected, if that is what is chosen (the selection may
        also hold the folder shown, which is not a choice)."""
        here = Path(self.directory().absolutePath())
        typed = self._edit.text().strip() if self._edit is not None else ""
        candidates = [here / Path(typed).expanduser()] if typed else []
        candidates += [Path(f) for f in self.selectedFiles() if Path(f) != here]
        return next((c for c in candidates if is_checkpoint_folder(c)), None)

    def _relabel(self, *_: object) -> None:
        if self._button is not None and self._folder() is not None:
            self._button.setText(f"&{self._label}")
            self._button.setEnabled(True)

    def _entered(self, directory: str) -> None:
        if self.isVisible() and is_checkpoint_folder(Path(directory)):
            self.chosen = Path(directory)
            QDialog.accept(self)

    def accept(self) -> None:
        folder = self._folder()
        if folder is not None:
            self.chosen = folder
            QDialog.accept(self)
            return
        super().accept()  # a file, or a plain folder to enter
        if self.result() == QDialog.DialogCode.Accepted and self.selectedFiles():
            self.chosen = Path(self.selectedFiles()[0])


def _run(dialog: CheckpointFileDialog) -> Path | None:
    try:
        return dialog.chosen if dialog.exec() == QDialog.DialogCode.Accepted else None
    finally:
        dialog.deleteLater()


def ask_open(parent: QWidget | None, title: str, start: str) -> Path | None:
    """A checkpoint to open: a file, or a checkpoint folder."""
    return _run(CheckpointFileDialog(parent, title, start, save=False))


def ask_save(parent: QWidget | None, title: str, suggestion: Path, filters: str = "") -> Path | None:
    """Where to write: a new name, an existing file or an existing checkpoint folder (to replace,
    if the caller's question is answered yes). A suggestion with a suffix keeps it on a typed name
    without one (``out`` becomes ``out.pt`` for a torch.save target)."""
    dialog = CheckpointFileDialog(parent, title, str(suggestion.parent), save=True, filters=filters)
    dialog.selectFile(suggestion.name)
    if suggestion.suffix and not filters:
        dialog.setDefaultSuffix(suggestion.suffix.lstrip("."))
    return _run(dialog)
