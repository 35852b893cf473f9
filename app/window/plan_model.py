"""The rows of a mapping's plan for the preview table: one per destination entry (its sources,
the operations, its name, shape and dtype), and one per entry the config implies that the source
lacks. A row no rule made -- a source entry refused or passed through unchanged, an absent entry --
carries its reason: it is listed first, highlighted, and the reason is its tooltip. A thin adapter over
:class:`~dcpstudio.core.ops.mappings.Plan`: the plan is core's, nothing is decided here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QAbstractTableModel, QModelIndex, QPersistentModelIndex, Qt
from PySide6.QtGui import QBrush, QColor

from dcpstudio.core.ops.mappings import Plan

__all__ = ["COLUMNS", "PlanModel", "PlanRow", "plan_rows"]

COLUMNS = ("Source", "Operation", "Destination", "Shape", "Dtype")
_PROBLEM = QBrush(QColor("#fee2e2"))  # the outcome box's error colour (style.qss)
_PROBLEM_TEXT = QBrush(QColor("#7f1d1d"))  # dark on light whatever the palette: readable in a dark theme too


@dataclass(frozen=True)
class PlanRow:
    cells: tuple[str, str, str, str, str]
    problem: str = ""


def plan_rows(plan: Plan, refused: bool) -> list[PlanRow]:
    """The plan's rows, those no rule made first. ``refused``: the plan was made passing unmatched
    entries through only to show them; the mapping itself refuses them."""
    unmatched = set(plan.unmatched)
    rows, problems = [], []
    for o in plan.outputs:
        src = o.sources[0] if len(o.sources) == 1 else f"{o.sources[0]} (+{len(o.sources) - 1})"
        shape, dtype = str(list(o.shape)), o.dtype.name if o.dtype else ""
        if o.rule is None and o.name in unmatched:
            if refused:
                why = f"matches no rule of {plan.mapping.name} (Pass unmatched through writes it as it is)"
                problems.append(PlanRow((src, "no rule", "", shape, dtype), why))
            else:
                why = "matches no rule: written as it is"
                problems.append(PlanRow((src, "passed through", o.name, shape, dtype), why))
            continue
        ops = " ".join(op.text() for op in o.ops) or ("as is" if o.name == o.sources[0] else "rename")
        rows.append(PlanRow((src, ops, o.name, shape, dtype)))
    for name in plan.missing:
        why = "the config implies this entry; the source lacks it"
        problems.append(PlanRow(("(absent)", "missing", name, "", ""), why))
    return problems + rows


class PlanModel(QAbstractTableModel):
    """:func:`plan_rows` as a table, replaced whole (:meth:`set_rows`)."""

    def __init__(self, parent: Any = None) -> None:
        super().__init__(parent)
        self.rows: list[PlanRow] = []

    def set_rows(self, rows: list[PlanRow]) -> None:
        self.beginResetModel()
        self.rows = rows
        self.endResetModel()

    def rowCount(self, parent: QModelIndex | QPersistentModelIndex = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self.rows)

    def columnCount(self, parent: QModelIndex | QPersistentModelIndex = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(COLUMNS)

    def data(self, index: QModelIndex | QPersistentModelIndex, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid():
            return None
        row = self.rows[index.row()]
        if role == Qt.ItemDataRole.DisplayRole:
            return row.cells[index.column()]
        if role == Qt.ItemDataRole.ToolTipRole:
            text = row.cells[index.column()]
            return f"{text}\n{row.problem}" if row.problem else text or None
        if role == Qt.ItemDataRole.BackgroundRole and row.problem:
            return _PROBLEM
        if role == Qt.ItemDataRole.ForegroundRole and row.problem:
            return _PROBLEM_TEXT
        return None

    def headerData(self, section: int, orientation: Qt.Orientation, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole:
            return COLUMNS[section]
        return None
