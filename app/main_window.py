"""The main window: file browser | metadata tree | details, conversion controls, one message bar.

Every long operation (open, preview and stats, convert, verify) runs as a :class:`Job`; the GUI
thread only builds widgets from results. Dialogs go through :meth:`choose_destination` and
:meth:`confirm`, so tests (and scripts) can answer them.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from PySide6.QtCore import QItemSelection, QModelIndex, Qt
from PySide6.QtGui import QAction, QCloseEvent, QDragEnterEvent, QDropEvent, QKeySequence
from PySide6.QtWidgets import (
    QFileDialog,
    QHeaderView,
    QLabel,
    QLineEdit,
    QMainWindow,
    QMessageBox,
    QSplitter,
    QTabWidget,
    QTreeView,
    QVBoxLayout,
    QWidget,
)

from dcpstudio.core import (
    Checkpoint,
    ConversionResult,
    DiffReport,
    Node,
    UnsafePickleError,
    convert,
    diff,
    open_checkpoint,
    tensor_stats,
)
from dcpstudio.core.load import run_load
from dcpstudio.core.report import diff_text, human_bytes

from .notify import Notifier
from .settings import Settings
from .tree_model import NODE_ROLE, CheckpointTreeModel, NameFilterProxy
from .widgets.convert_panel import ConvertPanel, dropped_paths
from .widgets.details import DetailsPanel
from .widgets.file_browser import FileBrowser
from .widgets.load_panel import LoadPanel
from .widgets.message_bar import MessageBar
from .workers import Job

__all__ = ["MainWindow"]

_SUFFIX = {"dcp": "_dcp", "torch": ".pt", "safetensors": ".safetensors"}
_PREVIEW = 12


def _preview_values(ckpt: Checkpoint, fqn: str) -> Any:
    entry = ckpt.entries[fqn]
    if entry.kind != "tensor":
        return ckpt.read_value(fqn)
    shape = entry.shape or ()
    region = [slice(0, _PREVIEW if i < 2 else 1) for i in range(len(shape))]
    t = ckpt.read_tensor(fqn, region)
    if t.dtype.is_floating_point and t.dtype.itemsize < 4:  # bf16, fp16 and fp8 print as float32
        t = t.float()
    if t.dim() > 2:
        t = t.reshape(t.shape[0], t.shape[1])
    return t.tolist()


class MainWindow(QMainWindow):
    def __init__(self, settings: Settings | None = None) -> None:
        super().__init__()
        self.setWindowTitle("DCP Studio")
        self.setAcceptDrops(True)
        self.settings = settings or Settings()
        self.ckpt: Checkpoint | None = None
        self.jobs: dict[str, Job] = {}
        self._retired: set[Job] = set()  # cancelled jobs whose threads have not ended yet
        self.last_result: ConversionResult | None = None
        self.last_diff: DiffReport | None = None

        self.message_bar = MessageBar()
        self.notifier = Notifier(self.message_bar)
        self.browser = FileBrowser(self.settings.last_dir())
        self.browser.activated.connect(lambda index: self.open_path(self.browser.path_at(index)))
        self.filter_box = QLineEdit()
        self.filter_box.setPlaceholderText("Filter names…")
        self.filter_box.setClearButtonEnabled(True)
        self.filter_box.textChanged.connect(self._apply_filter)
        self.tree = QTreeView()
        self.tree.setSortingEnabled(True)
        self.tree.setUniformRowHeights(True)
        self.tree.setIndentation(14)
        self.tree.header().setSectionResizeMode(0, QHeaderView.ResizeMode.Interactive)
        self.tree.setColumnWidth(0, 280)
        self.proxy = NameFilterProxy(self)
        self.model: CheckpointTreeModel | None = None
        self.details = DetailsPanel()
        self.panel = ConvertPanel()
        self.panel.convert_requested.connect(self.convert)
        self.panel.cancel_requested.connect(lambda: self._cancel("convert"))
        self.panel.verify_requested.connect(self.verify)
        self.panel.open_result_requested.connect(self._open_result)

        middle = QWidget()
        mlay = QVBoxLayout(middle)
        mlay.setContentsMargins(0, 0, 0, 0)
        mlay.addWidget(self.filter_box)
        mlay.addWidget(self.tree)
        right = QSplitter(Qt.Orientation.Vertical)
        right.addWidget(self.details)
        self.load_panel = LoadPanel()
        self.load_panel.load_requested.connect(self.load_on_ranks)
        self.load_panel.cancel_requested.connect(lambda: self._cancel("load"))
        self.actions_tabs = QTabWidget()
        self.actions_tabs.addTab(self.panel, "Convert")
        self.actions_tabs.addTab(self.load_panel, "Load on ranks")
        right.addWidget(self.actions_tabs)
        right.setStretchFactor(0, 3)
        right.setStretchFactor(1, 1)
        split = QSplitter(Qt.Orientation.Horizontal)
        split.addWidget(self.browser)
        split.addWidget(middle)
        split.addWidget(right)
        split.setSizes([260, 520, 520])
        central = QWidget()
        clay = QVBoxLayout(central)
        clay.addWidget(self.message_bar)
        clay.addWidget(split, 1)
        self.setCentralWidget(central)
        self._build_menu()
        self.torch_status = QLabel()
        self.statusBar().addPermanentWidget(self.torch_status)
        self.details.show_summary(None)
        geometry = self.settings.geometry()
        if geometry is not None:
            self.restoreGeometry(geometry)
        else:
            self.resize(1400, 860)

    # -- menus ------------------------------------------------------------------------------------
    def _build_menu(self) -> None:
        menu = self.menuBar().addMenu("&File")
        open_file = QAction("Open &File…", self, shortcut=QKeySequence(QKeySequence.StandardKey.Open))
        open_file.triggered.connect(self._ask_open_file)
        open_dir = QAction("Open &Directory…", self)
        open_dir.triggered.connect(self._ask_open_dir)
        menu.addAction(open_file)
        menu.addAction(open_dir)
        self.recent_menu = menu.addMenu("Open &Recent")
        self.recent_menu.aboutToShow.connect(self._fill_recent)
        menu.addSeparator()
        quit_action = QAction("&Quit", self, shortcut=QKeySequence(QKeySequence.StandardKey.Quit))
        quit_action.triggered.connect(self.close)
        menu.addAction(quit_action)

    def _fill_recent(self) -> None:
        self.recent_menu.clear()
        for path in self.settings.recent():
            action = self.recent_menu.addAction(path)
            action.triggered.connect(lambda _=False, p=path: self.open_path(Path(p)))

    def _ask_open_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open checkpoint", self.settings.last_dir())
        if path:
            self.open_path(Path(path))

    def _ask_open_dir(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Open DCP or safetensors directory", self.settings.last_dir())
        if path:
            self.open_path(Path(path))

    # -- dialogs (overridable) ----------------------------------------------------------------------
    def choose_destination(self, target: str, src: Path) -> Path | None:
        suggestion = str(src.parent / (src.name.split(".")[0] + _SUFFIX[target]))
        path, _ = QFileDialog.getSaveFileName(self, f"Convert {src.name} to {target}", suggestion)
        return Path(path) if path else None

    def confirm(self, text: str) -> bool:
        answer = QMessageBox.question(self, "DCP Studio", text)
        return answer == QMessageBox.StandardButton.Yes

    # -- jobs --------------------------------------------------------------------------------------
    def _start(self, kind: str, fn: Any, on_result: Any, on_done: Any = None) -> Job:
        """One job per kind: a new one cancels the old, which is kept alive until its thread ends."""
        old = self.jobs.get(kind)
        if old is not None and old.running:
            old.cancel()
            self._retired.add(old)
            old.finished.connect(lambda o=old: self._retired.discard(o))
        job = Job(fn, kind, self)
        job.result.connect(on_result)
        job.errored.connect(lambda e, k=kind, j=job: self._job_failed(k, e, j))
        if on_done is not None:
            job.finished.connect(on_done)
        job.progress.connect(lambda p, k=kind: self._job_progress(k, p))
        self.jobs[kind] = job
        return job.start()

    def _cancel(self, kind: str) -> None:
        job = self.jobs.get(kind)
        if job is not None and job.running:
            job.cancel()

    def _job_progress(self, kind: str, p: Any) -> None:
        if kind in ("convert", "verify"):
            self.panel.set_progress(p.fraction, p.current)
        elif kind == "load":
            self.load_panel.rank_progress(p)

    def _job_failed(self, kind: str, exc: BaseException, job: Job) -> None:
        if job.token.cancelled:
            return  # a cancelled job's failure (e.g. its checkpoint was closed) is not news
        actions = []
        if isinstance(exc, UnsafePickleError) and kind == "open" and self._pending_open is not None:
            path = self._pending_open
            actions = [("Open trusting this file", lambda: self.open_path(path, trust_pickle=True))]
        self.notifier.error(exc, actions)

    # -- start-up ----------------------------------------------------------------------------------
    def load_torch_in_background(self) -> Job:
        """Import PyTorch and its DCP package (seconds of CPU) on a worker thread while the window is
        already in use: browsing, opening any checkpoint and converting need none of it. Previews,
        statistics, verify and multi-rank load import it when they run; a worker that gets there
        first waits for this import, never the GUI thread."""
        self.torch_status.setText("Loading PyTorch…")

        def work(progress: Any, cancel: Any) -> str:
            import torch
            import torch.distributed.checkpoint

            import dcpstudio.core.formats.dcp_storage  # noqa: F401

            return str(torch.__version__)

        def done(version: str) -> None:
            self.torch_status.setText("")
            self.torch_status.setToolTip(f"PyTorch {version}")

        job = self._start("torch", work, done)
        job.errored.connect(lambda e: self.torch_status.setText("PyTorch failed to load"))
        return job

    def open_demo(self) -> Job:
        """Write the demo checkpoints (a worker job), then open the DCP one."""
        self.statusBar().showMessage("Writing the demo checkpoints…")

        def work(progress: Any, cancel: Any) -> tuple[Path, Path]:
            from dcpstudio.core.demo import write_demo

            return write_demo()

        def done(paths: tuple[Path, Path]) -> None:
            pt, dcp_dir = paths
            self.settings.add_recent(pt)
            self.browser.set_root(str(dcp_dir.parent))
            self.open_path(dcp_dir)

        return self._start("demo", work, done)

    # -- opening -----------------------------------------------------------------------------------
    _pending_open: Path | None = None

    def open_path(self, path: Path, *, trust_pickle: bool = False) -> None:
        path = Path(path)
        self._pending_open = path
        self.statusBar().showMessage(f"Opening {path}…")

        def work(progress: Any, cancel: Any) -> Checkpoint:
            ckpt = open_checkpoint(path, trust_pickle=trust_pickle)
            ckpt.tree  # noqa: B018 - builds the tree and the storage index off the GUI thread
            return ckpt

        self._start("open", work, self._opened, lambda: self.statusBar().clearMessage())

    def _opened(self, ckpt: Checkpoint) -> None:
        self._cancel("preview")  # it reads the checkpoint about to be closed
        old, self.ckpt = self.ckpt, ckpt
        if old is not None:
            old.close()
        counts: dict[str, int] = {}

        def chunk_count(fqn: str) -> int | None:
            if fqn not in counts:
                try:
                    counts[fqn] = len(ckpt.chunks(fqn))
                except Exception:
                    return None
            return counts[fqn]

        self.model = CheckpointTreeModel(ckpt.tree, chunk_count, self)
        self.proxy.setSourceModel(self.model)
        self.tree.setModel(self.proxy)
        self.tree.sortByColumn(-1, Qt.SortOrder.AscendingOrder)  # file order until a header is clicked
        self.tree.setColumnWidth(0, 300)
        self.tree.selectionModel().selectionChanged.connect(self._selection_changed)
        self._apply_filter(self.filter_box.text())
        self.details.show_summary(ckpt)
        self.settings.add_recent(ckpt.path)
        self.setWindowTitle(f"DCP Studio — {ckpt.path.name}")
        self.message_bar.hide()

    def _apply_filter(self, text: str) -> None:
        self.proxy.set_pattern(text, self.ckpt.tree if self.ckpt is not None else None)
        if text:
            self.tree.expandToDepth(2)

    # -- selection ---------------------------------------------------------------------------------
    def selected_node(self) -> Node | None:
        indexes = self.tree.selectionModel().selectedRows() if self.tree.selectionModel() else []
        return indexes[0].data(NODE_ROLE) if indexes else None

    def _selection_changed(self, selected: QItemSelection, deselected: QItemSelection) -> None:
        node = self.selected_node()
        ckpt = self.ckpt
        if ckpt is None or node is None:
            self.details.show_summary(ckpt)
            return
        entry = node.entry
        chunks = ckpt.chunks(entry.fqn) if entry is not None and entry.kind == "tensor" else []
        self.details.show_node(ckpt, node, chunks)
        if entry is None:
            return
        fqn = entry.fqn

        def work(progress: Any, cancel: Any) -> tuple[str, Any, Any, Any]:
            values = _preview_values(ckpt, fqn)
            stats = (
                tensor_stats(ckpt, fqn, bins=40, progress=progress, cancel=cancel) if entry.kind == "tensor" else None
            )
            resolved = ckpt.resolve_chunks(fqn) if entry.kind == "tensor" else []
            return fqn, values, stats, resolved

        self._start("preview", work, self._previewed)

    def _previewed(self, result: tuple[str, Any, Any, Any]) -> None:
        fqn, values, stats, chunks = result
        self.details.show_preview(fqn, values, stats)
        if chunks and self.details.current == fqn and self.ckpt is not None:
            node = self.selected_node()
            if node is not None:
                self.details.show_node(self.ckpt, node, chunks)
                self.details.show_preview(fqn, values, stats)

    def select(self, fqn: str) -> bool:
        """Select the node whose path is ``fqn`` (expanding its parents); True when found."""
        if self.model is None:
            return False
        parent = QModelIndex()
        parts = fqn.split(".")
        found = QModelIndex()
        for depth in range(len(parts)):
            path = ".".join(parts[: depth + 1])
            while self.model.canFetchMore(parent):
                self.model.fetchMore(parent)
            found = QModelIndex()
            for row in range(self.model.rowCount(parent)):
                idx = self.model.index(row, 0, parent)
                if self.model.node(idx).path == path:
                    found = idx
                    break
            if not found.isValid():
                return False
            parent = found
        view_index = self.proxy.mapFromSource(found)
        self.tree.setCurrentIndex(view_index)
        self.tree.scrollTo(view_index)
        return True

    # -- converting --------------------------------------------------------------------------------
    def convert(self, target: str, src: Path | None = None, dst: Path | None = None) -> Job | None:
        source = Path(src) if src is not None else (self.ckpt.path if self.ckpt is not None else None)
        if source is None:
            self.notifier.info("Open a checkpoint first, or drop one on a conversion button.")
            return None
        dst = dst or self.choose_destination(target, source)
        if dst is None:
            return None
        overwrite = False
        if dst.exists():
            if not self.confirm(f"{dst} exists. Replace it?"):
                return None
            overwrite = True
        options = self.panel.options(target)
        self.panel.set_busy(True, f"Converting {source.name} → {dst.name}")

        def work(progress: Any, cancel: Any) -> ConversionResult:
            with warnings.catch_warnings():  # notes come back in the result and are shown in the panel
                warnings.simplefilter("ignore", UserWarning)
                return convert(source, dst, to=target, progress=progress, cancel=cancel, overwrite=overwrite, **options)

        job = self._start("convert", work, self._converted, lambda: self.panel.set_busy(False))
        job.cancelled.connect(lambda: self.panel.set_result("Cancelled; nothing was written."))
        job.errored.connect(lambda e: self.panel.set_result(f"Failed: {e}"))
        return job

    def _converted(self, result: ConversionResult) -> None:
        self.last_result = result
        self.panel.set_result(
            f"Wrote {result.dst.name} ({result.target}): {result.tensors} tensors, {human_bytes(result.tensor_bytes)}."
            + "".join(f"\n{note}" for note in result.notes),
            can_open=True,
        )
        self.notifier.info(f"Converted to {result.dst}", [("Open result", self._open_result)])

    def _open_result(self) -> None:
        if self.last_result is not None:
            target = self.last_result.dst
            self.open_path(
                target / "model.safetensors.index.json"
                if (target / "model.safetensors.index.json").exists()
                else target
            )

    def verify(self) -> Job | None:
        if self.last_result is None:
            return None
        a, b = self.last_result.src, self.last_result.dst
        self.panel.set_busy(True, f"Verifying {a.name} against {b.name}")

        def work(progress: Any, cancel: Any) -> DiffReport:
            with open_checkpoint(a) as x, open_checkpoint(b) as y:
                return diff(x, y, progress=progress, cancel=cancel)

        def done(report: DiffReport) -> None:
            self.last_diff = report
            self.panel.set_result(diff_text(report), can_open=True)

        return self._start("verify", work, done, lambda: self.panel.set_busy(False))

    # -- multi-rank load ---------------------------------------------------------------------------
    def load_on_ranks(self) -> Job | None:
        if self.ckpt is None:
            self.notifier.info("Open a checkpoint first.")
            return None
        path = self.ckpt.path
        ranks = self.load_panel.ranks.value()
        layout = self.load_panel.layout_box.currentText()
        mesh = self.load_panel.mesh.text().strip() or None
        self.load_panel.start(ranks)

        def work(progress: Any, cancel: Any) -> list[Any]:
            return run_load(path, ranks=ranks, layout=layout, mesh=mesh, on_progress=progress, cancel=cancel)

        job = self._start("load", work, self.load_panel.show_reports, lambda: self.load_panel.set_busy(False))
        job.cancelled.connect(lambda: self.load_panel.status.setText("Cancelled; the ranks were stopped."))
        job.errored.connect(lambda e: self.load_panel.status.setText(f"Failed: {e}"))
        return job

    # -- drag and drop -----------------------------------------------------------------------------
    def dragEnterEvent(self, event: QDragEnterEvent) -> None:
        if dropped_paths(event):
            event.acceptProposedAction()

    def dropEvent(self, event: QDropEvent) -> None:
        paths = dropped_paths(event)
        if paths:
            event.acceptProposedAction()
            self.open_path(paths[0])

    # -- closing -----------------------------------------------------------------------------------
    def closeEvent(self, event: QCloseEvent) -> None:
        jobs = [*self.jobs.values(), *self._retired]
        for job in jobs:
            if job.running:
                job.cancel()
        for job in jobs:
            job.wait(30_000)
        self.settings.set_geometry(self.saveGeometry())
        self.settings.sync()
        if self.ckpt is not None:
            self.ckpt.close()
        super().closeEvent(event)
