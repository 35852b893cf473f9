"""A table over a 2-D slice of a tensor that reads only what is on screen.

The table is cut into tiles of :data:`TILE_ROWS` × :data:`TILE_COLS` cells. A cell whose tile is not
loaded yet shows "…" and asks :class:`TileLoader` for it; one worker job drains the requests (the
most recent first, so scrolling far away is served before the rows scrolled past) and hands each
tile back as it is read. Only the bytes of requested tiles are read; a bounded cache keeps the
recent ones.
"""

from __future__ import annotations

import csv
import io
import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QAbstractTableModel, QModelIndex, QObject, QPersistentModelIndex, Qt

from dcpstudio.core import Checkpoint
from dcpstudio.core.ops.explore.slices import SliceSpec, display_cells, read_window

__all__ = ["TILE_COLS", "TILE_ROWS", "TileLoader", "ValueTableModel", "csv_text", "format_value", "selection_csv"]

TILE_ROWS, TILE_COLS = 64, 16
_CACHE_TILES = 512
_QUEUE = 48  # requests beyond this are dropped, oldest first: they scrolled out of view
AnyIndex = QModelIndex | QPersistentModelIndex
Tile = list[list[str]]


def _csv_field(v: Any) -> Any:
    if isinstance(v, tuple):  # a packed element's values (float4_e2m1fn_x2), one field as its cell shows them
        return " | ".join(str(_csv_field(x)) for x in v)
    return repr(v) if isinstance(v, float) else v


def csv_text(rows: list[list[Any]]) -> str:
    """Values as CSV, full precision (Python's shortest round-trip repr for floats), one field per
    cell: a packed element's values in one field, ``lo | hi``."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for row in rows:
        writer.writerow([_csv_field(v) for v in row])
    return out.getvalue()


def selection_csv(
    ckpt: Checkpoint, fqn: str, spec: SliceSpec, boxes: list[tuple[int, int, int, int]], cancel: Any
) -> str:
    """The values of ``boxes`` (row0, row1, col0, col1) of ``spec`` as CSV, one block each (on a worker)."""
    parts = []
    for r0, r1, c0, c1 in sorted(boxes):
        cancel.check()
        parts.append(csv_text(display_cells(read_window(ckpt, fqn, spec, r0, r1, c0, c1))))
    return "\n".join(parts)


def format_value(v: Any) -> str:
    """A cell's text: floats to 6 significant digits, complex as a+bj, a packed element's values
    (a tuple from :func:`~dcpstudio.core.ops.explore.slices.display_cells`) as ``lo | hi``, the rest as Python
    prints them."""
    if isinstance(v, tuple):
        return " | ".join(format_value(x) for x in v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.6g}"
    if isinstance(v, complex):
        return f"{v.real:.4g}{v.imag:+.4g}j"
    return str(v)


def tile_texts(ckpt: Checkpoint, fqn: str, spec: SliceSpec, tr: int, tc: int) -> Tile:
    """Read tile ``(tr, tc)`` of the slice and format it (on a worker)."""
    r0, c0 = tr * TILE_ROWS, tc * TILE_COLS
    t = read_window(ckpt, fqn, spec, r0, r0 + TILE_ROWS, c0, c0 + TILE_COLS)
    return [[format_value(v) for v in row] for row in display_cells(t)]


class TileLoader:
    """Queues tile requests and runs one worker job at a time that reads them, newest first.

    ``start_job(fn, on_tile, on_done)`` is lent by the owner (it starts a job on the window's job
    board); ``fn(progress, cancel)`` reports each tile through ``progress`` as ``(key, tile)`` or
    ``(key, error)``.
    """

    def __init__(self, read: Callable[[int, int], Tile], start_job: Callable[..., Any]) -> None:
        self._read = read
        self._start_job = start_job
        self._lock = threading.Lock()
        self._queue: OrderedDict[tuple[int, int], None] = OrderedDict()
        self._running = False
        self.on_tile: Callable[[tuple[int, int], Tile | BaseException], None] = lambda key, tile: None
        self.closed = False

    def request(self, key: tuple[int, int]) -> None:
        if self.closed:
            return
        with self._lock:
            self._queue.pop(key, None)
            self._queue[key] = None
            while len(self._queue) > _QUEUE:
                self._queue.popitem(last=False)
            if self._running:
                return
            self._running = True
        self._start_job(self._work, self._delivered, self._finished)

    def _next(self) -> tuple[int, int] | None:
        with self._lock:
            if not self._queue:
                self._running = False
                return None
            key, _ = self._queue.popitem(last=True)
            return key

    def _work(self, progress: Any, cancel: Any) -> None:
        while not cancel.cancelled:
            key = self._next()
            if key is None:
                return
            try:
                tile: Tile | BaseException = self._read(*key)
            except Exception as e:  # shown in the cells of this tile, and once in the message bar
                tile = e
            progress((key, tile))
        with self._lock:
            self._running = False

    def _delivered(self, item: Any) -> None:
        if isinstance(item, tuple) and len(item) == 2 and not self.closed:
            self.on_tile(*item)

    def _finished(self) -> None:
        with self._lock:
            again = bool(self._queue) and not self._running and not self.closed
            if again:
                self._running = True
        if again:
            self._start_job(self._work, self._delivered, self._finished)

    def close(self) -> None:
        self.closed = True
        with self._lock:
            self._queue.clear()


class ValueTableModel(QAbstractTableModel):
    """The cells of ``spec`` for tensor ``fqn``; headers are indices in the tensor's dimensions.
    ``failed(error)`` is called once when a tile cannot be read. ``note`` (what a cell of a packed
    dtype holds, :func:`~dcpstudio.core.ops.explore.slices.cell_note`) is the tooltip of cells and headers."""

    def __init__(self, spec: SliceSpec, loader: TileLoader, parent: QObject | None = None, note: str = "") -> None:
        super().__init__(parent)
        self.spec = spec
        self.note = note
        self.loader = loader
        self.tiles: OrderedDict[tuple[int, int], Tile | BaseException] = OrderedDict()
        self.requested: set[tuple[int, int]] = set()
        self.failed: Callable[[BaseException], None] = lambda e: None
        self._reported = False
        loader.on_tile = self._tile_loaded

    def rowCount(self, parent: AnyIndex = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else self.spec.n_rows

    def columnCount(self, parent: AnyIndex = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else self.spec.n_cols

    def headerData(self, section: int, orientation: Qt.Orientation, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if role == Qt.ItemDataRole.DisplayRole:
            return str(section)
        if role == Qt.ItemDataRole.ToolTipRole:
            dim = self.spec.rows if orientation == Qt.Orientation.Vertical else self.spec.cols
            tip = f"index {section} of dimension {dim}" if dim is not None else ""
            return "\n".join(t for t in (tip, self.note) if t) or None
        return None

    def data(self, index: AnyIndex, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid():
            return None
        if role == Qt.ItemDataRole.TextAlignmentRole:
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        if role not in (Qt.ItemDataRole.DisplayRole, Qt.ItemDataRole.ToolTipRole):
            return None
        r, c = index.row(), index.column()
        key = (r // TILE_ROWS, c // TILE_COLS)
        tile = self.tiles.get(key)
        if tile is None:
            if key not in self.requested:
                self.requested.add(key)
                self.loader.request(key)
            return "…" if role == Qt.ItemDataRole.DisplayRole else None
        if isinstance(tile, BaseException):
            return "⚠" if role == Qt.ItemDataRole.DisplayRole else str(tile)
        if role == Qt.ItemDataRole.ToolTipRole:
            return self.note or None
        row = tile[r - key[0] * TILE_ROWS] if r - key[0] * TILE_ROWS < len(tile) else []
        return row[c - key[1] * TILE_COLS] if c - key[1] * TILE_COLS < len(row) else ""

    def loaded(self, r: int, c: int) -> bool:
        tile = self.tiles.get((r // TILE_ROWS, c // TILE_COLS))
        return tile is not None and not isinstance(tile, BaseException)

    def _tile_loaded(self, key: tuple[int, int], tile: Tile | BaseException) -> None:
        self.requested.discard(key)
        self.tiles[key] = tile
        self.tiles.move_to_end(key)
        while len(self.tiles) > _CACHE_TILES:
            self.tiles.popitem(last=False)
        if isinstance(tile, BaseException) and not self._reported:
            self._reported = True
            self.failed(tile)
        r0, c0 = key[0] * TILE_ROWS, key[1] * TILE_COLS
        r1 = min(self.spec.n_rows, r0 + TILE_ROWS) - 1
        c1 = min(self.spec.n_cols, c0 + TILE_COLS) - 1
        if r1 >= r0 and c1 >= c0:
            self.dataChanged.emit(self.index(r0, c0), self.index(r1, c1), [Qt.ItemDataRole.DisplayRole])
