"""The main window: file browser | metadata tree | details, conversion controls, one message bar.

Every long operation (open, preview and stats, convert, verify) runs as a :class:`Job`; the GUI
thread only builds widgets from results. Dialogs go through :meth:`choose_destination` and
:meth:`confirm`, so tests (and scripts) can answer them.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtGui import QAction, QCloseEvent, QDragEnterEvent, QDropEvent, QKeySequence
from PySide6.QtWidgets import (
    QFileDialog,
    QLabel,
    QMainWindow,
    QMessageBox,
    QSplitter,
    QTabWidget,
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
from dcpstudio.core.model import printable
from dcpstudio.core.report import diff_text, human_bytes

from .jobs import JobBoard
from .notify import Notifier
from .settings import Settings
from .tree_model import CheckpointTreeModel
from .widgets.convert_panel import ConvertPanel, dropped_paths
from .widgets.details import DetailsPanel, preview_values
from .widgets.file_browser import FileBrowser
from .widgets.load_panel import LoadPanel
from .widgets.message_bar import MessageBar
from .widgets.tree_pane import TreePane
from .workers import Job

__all__ = ["MainWindow"]

_SUFFIX = {"dcp": "_dcp", "torch": ".pt", "safetensors": ".safetensors"}


class MainWindow(QMainWindow):
    def __init__(self, settings: Settings | None = None) -> None:
        super().__init__()
        self.setWindowTitle("DCP Studio")
        self.setAcceptDrops(True)
        self.settings = settings or Settings()
        self.ckpt: Checkpoint | None = None
        self.board = JobBoard(self, self._job_failed)
        self.jobs = self.board.jobs
        self.last_result: ConversionResult | None = None
        self.last_diff: DiffReport | None = None

        self.message_bar = MessageBar()
        self.notifier = Notifier(self.message_bar)
        self.browser = FileBrowser(self.settings.last_dir())
        self.browser.activated.connect(lambda index: self.open_path(self.browser.path_at(index)))
        self.tree_pane = TreePane()
        self.tree_pane.selection_changed.connect(self._selection_changed)
        self.filter_box, self.tree, self.proxy = self.tree_pane.filter_box, self.tree_pane.view, self.tree_pane.proxy
        self.details = DetailsPanel()
        self.panel = ConvertPanel()
        self.panel.convert_requested.connect(self.convert)
        self.panel.cancel_requested.connect(lambda: self.board.cancel("convert"))
        self.panel.verify_requested.connect(self.verify)
        self.panel.open_result_requested.connect(self._open_result)

        right = QSplitter(Qt.Orientation.Vertical)
        right.addWidget(self.details)
        self.load_panel = LoadPanel()
        self.load_panel.load_requested.connect(self.load_on_ranks)
        self.load_panel.cancel_requested.connect(lambda: self.board.cancel("load"))
        self.actions_tabs = QTabWidget()
        self.actions_tabs.addTab(self.panel, "Convert")
        self.actions_tabs.addTab(self.load_panel, "Load on ranks")
        right.addWidget(self.actions_tabs)
        right.setStretchFactor(0, 3)
        right.setStretchFactor(1, 1)
        split = QSplitter(Qt.Orientation.Horizontal)
        split.addWidget(self.browser)
        split.addWidget(self.tree_pane)
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
    @property
    def model(self) -> CheckpointTreeModel | None:
        return self.tree_pane.model

    def _start(self, kind: str, fn: Any, on_result: Any, on_done: Any = None) -> Job:
        """One job per kind: a new one cancels the old (see :class:`~.jobs.JobBoard`)."""
        return self.board.start(kind, fn, on_result, on_done, functools.partial(self._job_progress, kind))

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
        self.board.cancel("preview")  # it reads the checkpoint about to be closed
        old, self.ckpt = self.ckpt, ckpt
        if old is not None:
            old.close()
        self.tree_pane.show_checkpoint(ckpt)
        self.details.show_summary(ckpt)
        self.settings.add_recent(ckpt.path)
        self.setWindowTitle(f"DCP Studio — {printable(ckpt.path.name)}")
        self.message_bar.hide()

    # -- selection ---------------------------------------------------------------------------------
    def selected_node(self) -> Node | None:
        return self.tree_pane.selected_node()

    def select(self, fqn: str) -> bool:
        """Select the node whose path is ``fqn`` (expanding its parents); True when found."""
        return self.tree_pane.select(fqn)

    def _selection_changed(self) -> None:
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
            values = preview_values(ckpt, fqn)
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
        self.board.stop_all()
        self.settings.set_geometry(self.saveGeometry())
        self.settings.sync()
        if self.ckpt is not None:
            self.ckpt.close()
        super().closeEvent(event)
