"""The compare view's lower half: the first values of the selected entry in A and in B, side by side,
the first element outside the tolerance marked. :func:`side_values` runs on a worker (it reads)."""

from __future__ import annotations

from PySide6.QtGui import QColor
from PySide6.QtWidgets import QTableWidget, QTableWidgetItem

from dcpstudio.core import Checkpoint
from dcpstudio.core.checkpoints.model import short_repr
from dcpstudio.core.ops.explore.slices import SliceSpec, cell_note, display_cells, read_window

from ..value_model import format_value

__all__ = ["fill_side", "side_cell", "side_values", "values_table"]

_SIDE = (24, 12)  # rows, columns shown of each value


def side_values(ckpt: Checkpoint | None, fqn: str) -> tuple[list[list[str]], str]:
    """The first values of ``fqn`` in ``ckpt`` as text cells, and a caption (on a worker)."""
    if ckpt is None or fqn not in ckpt.entries:
        return [], "not in this checkpoint"
    entry = ckpt.entries[fqn]
    if entry.kind != "tensor":
        return [[short_repr(ckpt.read_value(fqn), 300)]], "value"
    spec = SliceSpec.default(tuple(entry.shape or ()))
    t = read_window(ckpt, fqn, spec, 0, _SIDE[0], 0, _SIDE[1])
    rows = min(spec.n_rows, _SIDE[0])
    cols = min(spec.n_cols, _SIDE[1])
    caption = f"{spec.label()} rows 0–{rows - 1}, columns 0–{cols - 1}" if entry.shape else "scalar"
    note = cell_note(entry.dtype)
    return [[format_value(v) for v in row] for row in display_cells(t)], caption + (f"; {note}" if note else "")


def side_cell(ndim: int, first: tuple[int, ...] | None) -> tuple[int, int] | None:
    """The (row, column) of the side panes where the element at ``first`` shows (they show the
    first two dimensions at index 0 of the others, numbered from 0 like the Values tab), or None
    when it lies outside the values shown."""
    if first is None or len(first) != ndim or any(first[2:]):
        return None
    row, col = (first[0] if ndim else 0), (first[1] if ndim > 1 else 0)
    return (row, col) if row < _SIDE[0] and col < _SIDE[1] else None


def values_table() -> QTableWidget:
    t = QTableWidget(0, 0)
    t.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
    t.setTabKeyNavigation(False)
    t.horizontalHeader().setDefaultSectionSize(78)
    t.verticalHeader().setDefaultSectionSize(22)
    return t


def fill_side(
    table: QTableWidget, cells: list[list[str]], mark: tuple[int, int] | None, first: tuple[int, ...] | None
) -> None:
    """Show ``cells`` in ``table``, numbered from 0; ``mark``: the cell of element ``first`` (the first
    outside the tolerance), highlighted and scrolled to."""
    table.setRowCount(len(cells))
    table.setColumnCount(max((len(r) for r in cells), default=0))
    table.setVerticalHeaderLabels([str(i) for i in range(table.rowCount())])
    table.setHorizontalHeaderLabels([str(j) for j in range(table.columnCount())])
    for i, cells_row in enumerate(cells):
        for j, text in enumerate(cells_row):
            table.setItem(i, j, QTableWidgetItem(text))
    item = table.item(*mark) if mark is not None else None
    if item is not None:
        item.setBackground(QColor("#fde68a"))
        item.setToolTip(f"The first element outside the tolerance, at {list(first or ())}")
        table.scrollToItem(item)
