"""File › Open URL…: an editable list of the URLs opened lately (most recent first), a line with
the forms accepted, and OK once the text is a URL of a remote store."""

from __future__ import annotations

from PySide6.QtWidgets import QComboBox, QDialog, QDialogButtonBox, QLabel, QPushButton, QVBoxLayout, QWidget

from dcpstudio.core.io.remote.locations import is_url

__all__ = ["FORMS", "OpenUrlDialog"]

FORMS = ("s3://bucket/prefix", "gs://bucket/prefix", "az://container/prefix", "https://host/path", "hf://org/repo/file")


class OpenUrlDialog(QDialog):
    def __init__(
        self,
        recent: list[str],
        parent: QWidget | None = None,
        *,
        title: str = "Open URL",
        label: str = "Checkpoint URL",
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle(title)
        self.combo = QComboBox()
        self.combo.setEditable(True)
        self.combo.setInsertPolicy(QComboBox.InsertPolicy.NoInsert)
        self.combo.setMinimumContentsLength(56)
        self.combo.addItems(recent)
        self.combo.setToolTip("A DCP folder, a torch.save file or a safetensors checkpoint in a remote store")
        line = self.combo.lineEdit()
        assert line is not None
        line.setPlaceholderText(FORMS[0])
        self.hint = QLabel(
            "A DCP folder, torch.save file or safetensors checkpoint at "
            + ", ".join(FORMS)
            + ". Credentials come from the environment, as for the store's own tools."
        )
        self.hint.setWordWrap(True)
        self.hint.setObjectName("hint")
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        self.buttons.accepted.connect(self.accept)
        self.buttons.rejected.connect(self.reject)
        lay = QVBoxLayout(self)
        lay.addWidget(QLabel(label))
        lay.addWidget(self.combo)
        lay.addWidget(self.hint)
        lay.addWidget(self.buttons)
        self.combo.editTextChanged.connect(self._check)
        if recent:
            self.combo.setCurrentIndex(0)
            line.selectAll()
        self._check()

    @property
    def ok_button(self) -> QPushButton:
        button = self.buttons.button(QDialogButtonBox.StandardButton.Ok)
        assert button is not None
        return button

    def url(self) -> str:
        return self.combo.currentText().strip()

    def _check(self) -> None:
        self.ok_button.setEnabled(is_url(self.url()))

    def accept(self) -> None:
        if is_url(self.url()):  # Enter in the box accepts too: never with a bad text
            super().accept()
