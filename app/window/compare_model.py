"""The rows of a comparison as a table model: one per entry, appended as the worker finishes them,
sortable by any column (numbers sort as numbers), coloured by status; a proxy can show only the
entries that differ."""

from __future__ import annotations

import math
from typing import Any

from PySide6.QtCore import QAbstractTableModel, QModelIndex, QObject, QPersistentModelIndex, QSortFilterProxyModel, Qt
from PySide6.QtGui import QBrush, QColor

from dcpstudio.core.checkpoints.model import printable
from dcpstudio.core.ops.report import STATUS_TEXT, metric

from .proxies import change_filter

__all__ = ["COMPARE_COLUMNS", "HIDDEN_AT_FIRST", "ROW_ROLE", "STATUS_TEXT", "CompareModel", "CompareProxy"]

COMPARE_COLUMNS = (
    "Name",
    "Status",
    "Max |Δ|",
    "Rel. L2",
    "Cosine",
    "Mismatch",
    "Dtype A / B",
    "Shape A / B",
)
HIDDEN_AT_FIRST = (6, 7)  # the status says when they differ; the row's tooltip and the header menu show them
_COLOURS = {
    "equal": None,
    "different": QColor(254, 202, 202, 140),
    "only_a": QColor(191, 219, 254, 140),
    "only_b": QColor(221, 214, 254, 140),
}
ROW_ROLE = Qt.ItemDataRole.UserRole + 1
SORT_ROLE = Qt.ItemDataRole.UserRole + 2
AnyIndex = QModelIndex | QPersistentModelIndex


def _pair(a: Any, b: Any) -> str:
    fa = "—" if a is None else str(list(a) if isinstance(a, tuple) else a)
    fb = "—" if b is None else str(list(b) if isinstance(b, tuple) else b)
    return fa if fa == fb else f"{fa} / {fb}"


class CompareModel(QAbstractTableModel):
    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.rows: list[Any] = []

    def clear(self) -> None:
        self.beginResetModel()
        self.rows = []
        self.endResetModel()

    def append(self, row: Any) -> None:
        n = len(self.rows)
        self.beginInsertRows(QModelIndex(), n, n)
        self.rows.append(row)
        self.endInsertRows()

    def rowCount(self, parent: AnyIndex = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self.rows)

    def columnCount(self, parent: AnyIndex = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(COMPARE_COLUMNS)

    def headerData(self, section: int, orientation: Qt.Orientation, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if orientation != Qt.Orientation.Horizontal:
            return None
        if role == Qt.ItemDataRole.DisplayRole:
            return COMPARE_COLUMNS[section]
        if role == Qt.ItemDataRole.ToolTipRole:
            return {
                2: "Max abs diff: the largest |a − b| over the elements",
                3: "Relative L2 change: ‖a − b‖ / ‖a‖ over the whole tensor",
                4: "⟨a, b⟩ / (‖a‖ ‖b‖): 1 when the tensors point the same way",
                5: "Share of elements outside the tolerance |a − b| ≤ atol + rtol·|b|",
            }.get(section)
        return None

    def cell(self, r: Any, col: int) -> Any:
        if col == 0:
            return printable(r.fqn)
        if col == 1:
            return STATUS_TEXT.get(r.status, r.status)
        if col == 2:
            return metric(r.max_abs)
        if col == 3:
            return metric(r.rel_l2)
        if col == 4:
            return metric(r.cosine, 6)
        if col == 5:
            return f"{100 * r.mismatched / r.count:.3g} %" if r.count else "—"
        if col == 6:
            return _pair(r.dtype_a, r.dtype_b)
        return _pair(r.shape_a, r.shape_b)

    def sort_key(self, r: Any, col: int) -> Any:
        if col in (2, 3, 4):
            v = (r.max_abs, r.rel_l2, r.cosine)[col - 2]
            return -math.inf if v is None else (math.inf if math.isnan(v) else v)
        if col == 5:
            return r.mismatched
        return str(self.cell(r, col))

    def data(self, index: AnyIndex, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid():
            return None
        r = self.rows[index.row()]
        if role == Qt.ItemDataRole.DisplayRole:
            return self.cell(r, index.column())
        if role == SORT_ROLE:
            return self.sort_key(r, index.column())
        if role == ROW_ROLE:
            return r
        if role == Qt.ItemDataRole.BackgroundRole:
            colour = _COLOURS.get(r.status, QColor(253, 230, 138, 140))
            return QBrush(colour) if colour is not None else None
        if role == Qt.ItemDataRole.ToolTipRole:
            return (
                f"{printable(r.fqn)}\n{STATUS_TEXT.get(r.status, r.status)}; dtype {_pair(r.dtype_a, r.dtype_b)}, "
                f"shape {_pair(r.shape_a, r.shape_b)}"
                + (f"; {r.mismatched:,} of {r.count:,} elements outside the tolerance" if r.count else "")
                + (f", the first at {list(r.first_index)}" if r.first_index is not None else "")
            )
        if role == Qt.ItemDataRole.TextAlignmentRole and index.column() in (2, 3, 4, 5):
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        return None


class CompareProxy(QSortFilterProxyModel):
    """Sorts numerically; with :attr:`differences_only` hides equal entries."""

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.differences_only = False
        self.setSortRole(SORT_ROLE)
        self.setDynamicSortFilter(True)

    def set_differences_only(self, on: bool) -> None:
        def change() -> None:
            self.differences_only = on

        change_filter(self, change)

    def filterAcceptsRow(self, source_row: int, source_parent: AnyIndex) -> bool:
        if not self.differences_only:
            return True
        model = self.sourceModel()
        row = model.index(source_row, 0, source_parent).data(ROW_ROLE)
        return row is not None and row.status != "equal"
