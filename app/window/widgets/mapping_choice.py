"""The Convert panel's model mapping: which one (none, a built-in, a rules file…), the model's
config.json, and the preview of its plan -- computed on a worker from the open checkpoint whenever
one of them changes (the GUI thread never reads the checkpoint), shown in a table
(:class:`PlanDialog`) with what the mapping refuses highlighted and the one-line reason above.

Converting and verifying are core's (:func:`~dcpstudio.core.ops.mappings.map_convert` and
:func:`~dcpstudio.core.ops.mappings.map_verify`, as the CLI calls them): :class:`MappingRequest`
only builds the job functions the panel runs through its usual flow (progress, Cancel, outcome)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QComboBox,
    QDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPushButton,
    QTableView,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from dcpstudio.core import ConversionResult, DCPStudioError, DiffReport
from dcpstudio.core.ops.mappings import Plan, list_mappings, map_convert, map_verify, plan_for
from dcpstudio.core.ops.report import diff_text

from ..context import Context
from ..plan_model import PlanModel, plan_rows
from ..workers import JobFunction

__all__ = ["FILE", "NONE", "MappedVerification", "MappingChoice", "MappingRequest", "PlanDialog", "Preview"]

NONE = "No mapping"
FILE = "A rules file…"


@dataclass(frozen=True)
class MappedVerification:
    """What the panel's Verify shows after a mapped conversion (as a :class:`Verification`)."""

    report: DiffReport
    summary: str

    @property
    def equal(self) -> bool:
        return self.report.equal

    def text(self) -> str:
        return self.summary


@dataclass(frozen=True)
class MappingRequest:
    """A mapping (a built-in's name or a rules file), the config.json, and whether unmatched
    entries pass through: what a mapped conversion and its verification are called with."""

    spec: str
    config: Path
    allow_unmapped: bool = False

    def convert_work(self, source: Any, dst: Any, target: str, overwrite: bool, max_shard_size: object) -> JobFunction:
        def work(progress: Any, cancel: Any) -> ConversionResult:
            with warnings.catch_warnings():  # notes come back in the result and are shown in the report
                warnings.simplefilter("ignore", UserWarning)
                done = map_convert(
                    source, dst, self.spec, self.config, to=target, allow_unmapped=self.allow_unmapped,
                    overwrite=overwrite, max_shard_size=max_shard_size, progress=progress, cancel=cancel,
                )  # fmt: skip
            assert done.result is not None
            via = f"{done.plan.target} names via {done.plan.mapping.name}"
            copied = f"; copied {', '.join(done.assets)}" if done.assets else ""
            return replace(done.result, notes=(via + copied, *done.plan.notes(), *done.result.notes))

        return work

    def rank_options(self, base: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
        """``run_convert``'s options for this mapped conversion on ranks."""
        mapped = dict(mapping=self.spec, config=self.config, allow_unmapped=self.allow_unmapped)
        return dict(base, **mapped, max_shard_size=options.get("max_shard_size"))

    def verify_work(self, a: Any, b: Any) -> JobFunction:
        def work(progress: Any, cancel: Any) -> MappedVerification:
            plan, report = map_verify(
                a, b, self.spec, self.config, allow_unmapped=self.allow_unmapped, progress=progress, cancel=cancel
            )
            first, *rest = diff_text(report).split("\n")
            through = f"A is the source through {plan.mapping.name} ({plan.target} names): {len(plan.outputs)} entries"
            return MappedVerification(report, "\n".join([first, through, *plan.notes(), *rest]))

        return work


@dataclass(frozen=True)
class Preview:
    """A plan of ``request`` over ``source``; ``refusal``: why the mapping refuses it (then
    ``plan``, when there is one, is the plan passing unmatched entries through, to show them)."""

    source: Any
    request: MappingRequest
    plan: Plan | None
    refusal: str | None = None

    def summary(self) -> str:
        if self.refusal is not None:
            return f"Refused: {self.refusal}"
        assert self.plan is not None
        p = self.plan
        side = p.mapping.target_side("inverse" if p.direction == "forward" else "forward")
        return "\n".join([f"{p.mapping.name}: {side} → {p.target} names, {len(p.outputs)} entries", *p.notes()])


def _plan(source: Any, request: MappingRequest) -> Preview:
    try:
        return Preview(source, request, plan_for(source, request.spec, request.config,
                                                 allow_unmapped=request.allow_unmapped))  # fmt: skip
    except DCPStudioError as e:
        refusal = str(e)
    try:
        shown: Plan | None = plan_for(source, request.spec, request.config, allow_unmapped=True)
    except DCPStudioError:
        shown = None
    return Preview(source, request, shown, refusal)


def set_state(widget: QWidget, state: str) -> None:
    """Set the ``state`` property ``style.qss`` colours by (a refusal is seen before it is read)."""
    widget.setProperty("state", state)
    widget.style().unpolish(widget)
    widget.style().polish(widget)


class PlanDialog(QDialog):
    """The preview: the summary (or the refusal, in red), the table, and "Pass unmatched through"."""

    def __init__(self, allow: QCheckBox, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Mapping preview")
        self.resize(900, 460)
        self.summary = QLabel()
        self.summary.setObjectName("planSummary")
        self.summary.setWordWrap(True)
        self.summary.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.model = PlanModel(self)
        self.table = QTableView()
        self.table.setModel(self.model)
        self.table.setTextElideMode(Qt.TextElideMode.ElideMiddle)  # both ends of a long name stay
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.verticalHeader().hide()
        header = self.table.horizontalHeader()
        for column, width in enumerate((240, 150, 280, 90)):
            header.resizeSection(column, width)
        header.setStretchLastSection(True)
        header.setSectionResizeMode(QHeaderView.ResizeMode.Interactive)
        close = QPushButton("Close")
        close.clicked.connect(self.close)
        bottom = QHBoxLayout()
        bottom.addWidget(allow)
        bottom.addStretch(1)
        bottom.addWidget(close)
        lay = QVBoxLayout(self)
        lay.addWidget(self.summary)
        lay.addWidget(self.table, 1)
        lay.addLayout(bottom)

    def show_preview(self, preview: Preview) -> None:
        self.summary.setText(preview.summary())
        set_state(self.summary, "error" if preview.refusal else "")
        self.model.set_rows(plan_rows(preview.plan, preview.refusal is not None) if preview.plan else [])


class MappingChoice(QObject):
    """The widgets the panel lays out (``choice``; ``row``: the config field, its "…" and
    "Preview…"), the last :class:`Preview`, and ``changed(active)`` when a mapping is chosen or
    left. ``planned(Preview)`` follows each preview."""

    changed = Signal(bool)
    planned = Signal(object)

    def __init__(self, ctx: Context, parent: QWidget) -> None:
        super().__init__(parent)
        self.ctx = ctx
        self.preview: Preview | None = None
        self.choice = QComboBox()
        self.choice.addItem(NONE, None)
        for name, description in list_mappings():
            self.choice.addItem(name, name)
            self.choice.setItemData(self.choice.count() - 1, description, Qt.ItemDataRole.ToolTipRole)
        self.choice.addItem(FILE, FILE)
        self.choice.setToolTip("Write the checkpoint as another model definition's names (torchtitan ↔ Hugging Face)")
        self.choice.activated.connect(self._chosen)
        self._index = 0
        self.config = QLineEdit()
        self.config.setPlaceholderText("the model's Hugging Face config.json")
        self.config.editingFinished.connect(lambda: self.refresh(show=True))
        browse = QToolButton()
        browse.setText("…")
        browse.setToolTip("Choose the model's config.json (heads, kv heads, layers, experts)")
        browse.clicked.connect(self._browse)
        self.preview_button = QPushButton("Preview…")
        self.preview_button.setToolTip("The mapping's plan for the open checkpoint: each entry and what it becomes")
        self.preview_button.clicked.connect(lambda: self.refresh(show=True))
        self.allow = QCheckBox("Pass unmatched entries through unchanged")
        self.allow.toggled.connect(lambda _: self.refresh())
        self.row = QWidget()
        lay = QHBoxLayout(self.row)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.config, 1)
        lay.addWidget(browse)
        lay.addWidget(self.preview_button)
        self._parent = parent
        self._dialog: PlanDialog | None = None
        self.changed.connect(self._enable)
        self._enable(False)

    @property
    def dialog(self) -> PlanDialog:
        """The preview, made when first shown (the window starts without it)."""
        if self._dialog is None:
            self._dialog = PlanDialog(self.allow, self._parent)
        return self._dialog

    def spec(self) -> str | None:
        data = self.choice.currentData()
        return None if data in (None, FILE) else str(data)

    def request(self) -> MappingRequest | None:
        """The chosen mapping, or None; a mapping without a config is refused (``ValueError``)."""
        spec = self.spec()
        if spec is None:
            return None
        config = self.config.text().strip()
        if not config:
            raise ValueError("a mapping needs the model's config.json: choose it in the Config field")
        return MappingRequest(spec, Path(config).expanduser(), self.allow.isChecked())

    def set_mapping(self, spec: str | None) -> None:
        """Choose ``spec`` (a built-in's name, a rules file; None: no mapping)."""
        index = self.choice.findData(spec)
        if index < 0:
            self.choice.insertItem(self.choice.count() - 1, Path(spec or "").name, spec)
            self.choice.setItemData(self.choice.count() - 2, spec, Qt.ItemDataRole.ToolTipRole)
            index = self.choice.count() - 2
        self.choice.setCurrentIndex(index)
        self._chosen(index)

    def refusal_for(self, source: Any, request: MappingRequest) -> str | None:
        """Why the last preview refused ``request`` over ``source``, if it did."""
        p = self.preview
        return p.refusal if p is not None and p.request == request and p.source == source else None

    def refresh(self, show: bool = False) -> None:
        """Plan the open checkpoint with the current choice, on a worker; ``show`` opens the
        preview when it is ready (it is updated anyway while open)."""
        self.preview = None
        ckpt = self.ctx.checkpoint()
        try:
            request = self.request()
        except ValueError:
            request = None
        if request is None or ckpt is None:
            self.ctx.board.cancel("mapping")
            return
        source = ckpt.path
        job = self.ctx.start("mapping", lambda _p, _c: _plan(source, request), lambda p: self._planned(p, show))
        job.errored.connect(lambda e: self._planned(Preview(source, request, None, str(e)), show))

    def _planned(self, preview: Preview, show: bool) -> None:
        self.preview = preview
        set_state(self.preview_button, "error" if preview.refusal else "")
        if show or (self._dialog is not None and self._dialog.isVisible()):
            self.dialog.show_preview(preview)
            self.dialog.show()
            self.dialog.raise_()
        self.planned.emit(preview)

    def _chosen(self, index: int) -> None:
        if self.choice.itemData(index) == FILE:
            path = self.ctx.open_path("Choose a mapping's rules (.toml)", False)
            if path is None:
                self.choice.setCurrentIndex(self._index)
                return
            self.set_mapping(str(path))
            return
        self._index = index
        self.changed.emit(self.spec() is not None)
        self.refresh(show=True)

    def _browse(self) -> None:
        path = self.ctx.open_path("Choose the model's config.json", False)
        if path is not None:
            self.config.setText(str(path))
            self.refresh(show=True)

    def _enable(self, active: bool) -> None:
        self.row.setEnabled(active)
        if active and not self.config.text():
            self.config.setFocus()
        if not active and self._dialog is not None:
            self._dialog.close()
