"""The main window: it wires the panes together and owns what they share.

File browser | metadata tree | (Details · Values · Compare · Run, once a run is open) over
(Convert · Load on ranks), and one message strip in the status bar. Every long operation runs as a
:class:`Job` started by the pane that needs it, through the :class:`~.context.Context` lent to it;
the GUI thread only builds widgets from results. Dialogs go through :meth:`choose_destination`,
:meth:`save_path`, :meth:`ask_path` and :meth:`confirm`, so tests (and scripts) can answer them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtGui import (
    QAction,
    QCloseEvent,
    QDragEnterEvent,
    QDragMoveEvent,
    QDropEvent,
    QGuiApplication,
)
from PySide6.QtWidgets import QFileDialog, QLabel, QMainWindow, QMenu, QMessageBox, QSplitter, QTabWidget

from dcpstudio.core import Checkpoint, Node, UnsafePickleError, open_checkpoint, stop_index_children
from dcpstudio.core.checkpoints.model import printable

from . import startup
from .context import Context
from .jobs import JobBoard
from .locations import Location, accept_copy, dropped_locations, is_remote, location, name_of, shown
from .menus import build_menus, entry_menu, show_in_file_manager
from .notify import Notifier
from .run_session import RunSession
from .settings import Settings
from .tree_filter import TreeIndex
from .widgets.compare_view import CompareView
from .widgets.convert_panel import ConvertPanel, suggest_destination
from .widgets.details import DetailsPanel
from .widgets.file_browser import FileBrowser
from .widgets.file_dialogs import ask_open, ask_save
from .widgets.load_panel import LoadPanel
from .widgets.message_bar import MessageBar
from .widgets.open_url import OpenUrlDialog
from .widgets.remote_status import RemoteStatus
from .widgets.tree_pane import TreePane
from .widgets.value_explorer import ValueExplorer
from .widgets.work_area import WorkArea
from .workers import Job

__all__ = ["MainWindow"]

_CANCELLABLE: tuple[str, ...] = ("convert", "verify", "load", "check", "compare", "drift")
_CANCELLABLE += ("explore-summary", "explore-export", "explore-copy")


class MainWindow(QMainWindow):
    recent_menu: QMenu
    menu_actions: dict[str, QAction] = {}

    def __init__(self, settings: Settings | None = None) -> None:
        super().__init__()
        self.setWindowTitle("DCP Studio")
        self.setAcceptDrops(True)
        self.settings = settings or Settings()
        self.ckpt: Checkpoint | None = None
        self.board = JobBoard(self, self._job_failed, on_change=self._jobs_changed)
        self.jobs = self.board.jobs
        self.message_bar = MessageBar()
        self.notifier = Notifier(self.message_bar)
        self.ctx = Context(
            self.board,
            self.notifier,
            self.settings,
            lambda: self.ckpt,
            lambda title, suggestion, filters: self.save_path(title, suggestion, filters),
            lambda title, directory: self.ask_path(title, directory),
            lambda text: self.confirm(text),
        )
        self.browser = FileBrowser(self.settings.last_dir())
        self.browser.activated.connect(self.open_path)
        self.tree_pane = TreePane(self.settings)
        self.tree_pane.selection_changed.connect(self._selection_changed)
        self.tree_pane.context_requested.connect(lambda node, pos: entry_menu(self, node).exec(pos))
        self.tree_pane.copy_requested.connect(self._copy_node)
        self.filter_box, self.tree = self.tree_pane.filter_box, self.tree_pane.view
        self.details = DetailsPanel(self.ctx)
        self.details.explore_requested.connect(self.explore)
        self.explorer = ValueExplorer(self.ctx)
        self.compare_view = CompareView(self.ctx)
        self.compare_view.explore_requested.connect(self.explore)
        self.views = QTabWidget()
        self.views.addTab(self.details, "Details")
        self.views.addTab(self.explorer, "Values")
        self.views.addTab(self.compare_view, "Compare")
        self.panel = ConvertPanel(self.ctx)
        self.panel.choose_destination = lambda target, src: self.choose_destination(target, src)
        self.panel.open_requested.connect(self.open_path)
        self.load_panel = LoadPanel(self.ctx)
        self.actions_tabs = QTabWidget()
        self.actions_tabs.addTab(self.panel, "Convert")
        self.actions_tabs.addTab(self.load_panel, "Load on ranks")

        self.runs = RunSession(self)  # its Run view (pyqtgraph) is made with the first run shown
        self.views.currentChanged.connect(lambda _: self._follow_selection())
        self.right = WorkArea(self.views, self.actions_tabs, self.settings)
        self.views.currentChanged.connect(lambda _: self.right.fold_for_page(self._run_view_shown()))
        split = QSplitter(Qt.Orientation.Horizontal)
        split.setChildrenCollapsible(False)
        for pane in (self.browser, self.tree_pane, self.right):
            split.addWidget(pane)
        split.setSizes([210, 530, 660])
        self.setCentralWidget(split)
        self.activity = QLabel()
        self.torch_status = QLabel()
        status = self.statusBar()
        status.setSizeGripEnabled(True)
        status.addWidget(self.message_bar, 1)
        self.remote_status = RemoteStatus()
        status.addPermanentWidget(self.remote_status)
        status.addPermanentWidget(self.activity)
        status.addPermanentWidget(self.torch_status)
        self.menu_actions = build_menus(self)
        self.setTabOrder(self.browser.view, self.tree_pane.filter_box)
        self.setTabOrder(self.tree_pane.view, self.views)
        self.setTabOrder(self.views, self.panel.buttons["dcp"])
        self.details.show_summary(None)
        geometry = self.settings.geometry()
        if geometry is not None:
            self.restoreGeometry(geometry)
        else:
            self.resize(1400, 860)
        self._fit_screen()

    def _run_view_shown(self) -> bool:
        return self.runs.view is not None and self.views.currentWidget() is self.runs.view

    def _fit_screen(self) -> None:
        """Never larger than the screen (a saved size from another monitor, or an older version)."""
        screen = self.screen().availableGeometry() if self.screen() is not None else None
        if screen is not None and screen.isValid():
            self.resize(min(self.width(), screen.width()), min(self.height(), screen.height()))

    # -- dialogs (overridable) ----------------------------------------------------------------------
    def choose_destination(self, target: str, src: Location) -> Path | None:
        suggestion = suggest_destination(target, src, self.settings.last_dir())
        return self.save_path(f"Convert {name_of(src)}", suggestion, "")

    def save_path(self, title: str, suggestion: Path, filters: str) -> Path | None:
        """Ask where to write (the caller asks before replacing: the dialog does not)."""
        return ask_save(self, title, suggestion, filters)

    def ask_path(self, title: str, directory: bool) -> Path | None:
        """A file or a checkpoint folder to open (``directory``: any folder)."""
        if not directory:
            return ask_open(self, title, self.settings.last_dir())
        path = QFileDialog.getExistingDirectory(self, title, self.settings.last_dir())
        return Path(path) if path else None

    def ask_url(self, title: str = "Open URL", label: str = "Checkpoint URL") -> str | None:
        dialog = OpenUrlDialog(self.settings.recent_urls(), self, title=title, label=label)
        return dialog.url() if dialog.exec() == OpenUrlDialog.DialogCode.Accepted else None

    def convert_to_url(self, target: str) -> None:
        """Convert the open checkpoint to ``target`` in a remote store (uploaded as it is written)."""
        url = self.ask_url(f"Convert to {target} at a URL", "Destination URL (written only when complete)")
        if url:
            self.panel.convert(target, dst=url)

    def confirm(self, text: str) -> bool:
        answer = QMessageBox.question(self, "DCP Studio", text)
        return answer == QMessageBox.StandardButton.Yes

    # -- menu actions -----------------------------------------------------------------------------
    def ask_open_file(self) -> None:
        path = self.ask_path("Open checkpoint", False)
        if path is not None:
            self.open_path(path)

    def ask_open_dir(self) -> None:
        path = self.ask_path("Open DCP or safetensors directory", True)
        if path is not None:
            self.open_path(path)

    def ask_open_url(self) -> None:
        url = self.ask_url()
        if url:
            self.open_path(url)

    def show_view(self, index: int) -> None:
        self.views.setCurrentIndex(index)
        first = {1: self.explorer.table, 2: self.compare_view.b_path}.get(index, self.views.currentWidget())
        first.setFocus(Qt.FocusReason.ShortcutFocusReason)

    def show_load(self) -> None:
        self.right.show_actions()
        self.actions_tabs.setCurrentWidget(self.load_panel)
        self.load_panel.ranks.setFocus()

    def focus_filter(self) -> None:
        self.filter_box.setFocus(Qt.FocusReason.ShortcutFocusReason)
        self.filter_box.selectAll()

    def filter_to(self, path: str) -> None:
        self.tree_pane.regex_button.setChecked(False)
        self.filter_box.setText(path)
        self.tree_pane.apply_filter()

    def copy_text(self, text: str) -> None:
        QGuiApplication.clipboard().setText(text)
        self.notifier.info(f"Copied {printable(text)}")

    def _copy_node(self, node: Node | None) -> None:
        if node is not None:
            self.copy_text(node.path)

    def copy_name(self) -> None:
        node = self.selected_node()
        if node is not None:
            self.copy_text(node.path)

    def copy_shape(self) -> None:
        node = self.selected_node()
        if node is not None and node.entry is not None and node.entry.shape is not None:
            self.copy_text(str(list(node.entry.shape)))

    def explore(self, fqn: str) -> None:
        if self.ckpt is not None and fqn in self.ckpt.entries and self.ckpt.entries[fqn].kind == "tensor":
            self.explorer.show_tensor(self.ckpt, fqn)
            self._exploring = True  # what is explored now, not what the tree selects
            self.views.setCurrentWidget(self.explorer)
            self._exploring = False
            self.explorer.table.setFocus(Qt.FocusReason.OtherFocusReason)  # arrows page through the values

    def explore_selected(self) -> None:
        node = self.selected_node()
        if node is None or node.entry is None or node.entry.kind != "tensor":
            self.notifier.info("Select a tensor in the tree first.")
            return
        self.explore(node.entry.fqn)

    def export(self, fqn: str) -> Job | None:
        self.explore(fqn)
        return self.explorer.export()

    def export_selected(self) -> Job | None:
        node = self.selected_node()
        if node is None or node.entry is None or node.entry.kind != "tensor":
            self.notifier.info("Select a tensor in the tree first.")
            return None
        return self.export(node.entry.fqn)

    def compare_with(self) -> None:
        self.views.setCurrentWidget(self.compare_view)
        self.compare_view.choose_b(False)

    def show_in_file_manager(self, node: Node) -> None:
        if self.ckpt is not None:
            show_in_file_manager(self.ckpt, node, self.notifier)

    def cancel_work(self) -> None:
        for kind in _CANCELLABLE:
            self.board.cancel(kind)

    # -- jobs --------------------------------------------------------------------------------------
    def _jobs_changed(self) -> None:
        running = [k for k in _CANCELLABLE if k in self.jobs and self.jobs[k].running]
        if "cancel" in self.menu_actions:
            self.menu_actions["cancel"].setEnabled(bool(running))
        if {"convert", "verify", "load"} & set(running):
            self.right.show_actions()  # where its progress and outcome are shown
        busy = "open" in self.jobs and self.jobs["open"].running
        self.activity.setText(
            f"Opening {printable(name_of(self._pending_open))}…" if busy and self._pending_open else ""
        )

    def _job_failed(self, kind: str, exc: BaseException, job: Job) -> None:
        if job.token.cancelled:
            return  # a cancelled job's failure (e.g. its checkpoint was closed) is not news
        actions: list[tuple[str, Callable[[], None]]] = []
        if isinstance(exc, UnsafePickleError):
            path = self._pending_open if kind == "open" else (self.ckpt.path if self.ckpt is not None else None)
            if path is not None:
                title = "Open trusting this file" if kind == "open" else "Reopen trusting this file"
                actions = [(title, functools.partial(self.open_path, path, trust_pickle=True))]
        if kind == "index" and self.ckpt is not None:  # shown from its head, refused as a whole: closed
            self._replace(None)
            self.tree_pane.clear()
            self.details.show_summary(None)
        self.notifier.error(exc, actions)

    # -- start-up ----------------------------------------------------------------------------------
    def load_torch_in_background(self) -> Job:
        return startup.load_torch_in_background(self.board, self.torch_status)

    def open_demo(self) -> Job:
        return startup.open_demo(self.board, self.activity, self.settings, self.browser, self.open_path)

    # -- opening -----------------------------------------------------------------------------------
    _pending_open: Location | None = None

    def open_path(self, path: object, *, trust_pickle: bool = False, as_run: bool = False) -> None:
        """Open a local path, or a URL (a string or a RemotePath): read on a worker, which is the
        only place that may wait for the network. A local folder of checkpoints by step (or, with
        ``as_run``, refused unless it is one) opens as a run: its latest step in the tree."""
        path = location(path)
        self._pending_open = path
        detect = self.runs.detector(path, as_run)  # the run at ``path`` or None, asked on the worker

        def work(progress: Any, cancel: Any) -> tuple[Checkpoint, TreeIndex, Any]:
            run = detect()
            target = run.steps[-1].parts[0][1] if run is not None else path
            ckpt = open_checkpoint(target, trust_pickle=trust_pickle)  # a large DCP's index: in a child, meanwhile
            return ckpt, TreeIndex(ckpt.early_tree(), ckpt.chunk_count), run  # built off the GUI thread

        self.board.start("open", work, lambda result: self._opened(*result))
        self._jobs_changed()

    def _replace(self, ckpt: Checkpoint | None) -> None:
        """Close the checkpoint shown (``ckpt`` takes its place) and what reads it."""
        for kind in ("preview", "compare-values", "index", "check"):
            self.board.cancel(kind)  # they read the checkpoint about to be closed
        self.explorer.clear()
        self.compare_view.checkpoint_changed(ckpt)
        self.load_panel.checkpoint_changed()
        old, self.ckpt = self.ckpt, ckpt
        if old is not None:
            old.close()

    def _opened(self, ckpt: Checkpoint, index: TreeIndex | None = None, run: Any = None) -> None:
        self._replace(ckpt)
        self.tree_pane.show_checkpoint(ckpt, index)
        self.details.follow_index(ckpt, self.selected_node)  # shown from a large DCP's head: the rest, now
        tree = self.tree_pane.model.tree if self.tree_pane.model else None
        self.details.show_summary(ckpt, tree.by_kind if tree else None, tree.root if tree else None)
        self.views.setCurrentWidget(self.details)
        self.panel.keep_for(ckpt.path)
        if is_remote(ckpt.path):  # the file browser shows local folders; the status bar says where
            url = location(ckpt.path)
            self.settings.add_recent_url(str(url))
            self.remote_status.show_for(shown(url))
        else:
            self.runs.add_recent(ckpt.path)  # not each step of the run shown
            self.browser.reveal(ckpt.path, expand=ckpt.path.is_dir())
            self.remote_status.show_for(None)
        self.setWindowTitle(f"DCP Studio — {printable(name_of(ckpt.path))}")
        self.message_bar.clear()
        if run is not None:
            self.runs.show(run)
        self.runs.opened(ckpt)

    # -- selection ---------------------------------------------------------------------------------
    def selected_node(self) -> Node | None:
        return self.tree_pane.selected_node()

    def select(self, fqn: str, *, scroll: bool = True) -> bool:
        """Select the node whose path is ``fqn`` (expanding its parents); True when found."""
        return self.tree_pane.select(fqn, scroll=scroll)

    def _selection_changed(self) -> None:
        self.details.show_selection(self.ckpt, self.selected_node())
        self._follow_selection()
        self.runs.selection_changed(self.selected_node())

    _exploring = False

    def _follow_selection(self) -> None:
        """While Values is shown, it shows the tensor selected in the tree."""
        entry = getattr(self.selected_node(), "entry", None)
        shown = not self._exploring and self.ckpt is not None and self.views.currentWidget() is self.explorer
        if shown and entry is not None and entry.kind == "tensor" and entry.fqn != self.explorer.fqn:
            self.explorer.show_tensor(self.ckpt, entry.fqn)

    # -- drag and drop: always a copy; the dropped file or URL is opened ------------------------------
    def dragEnterEvent(self, event: QDragEnterEvent) -> None:
        accept_copy(event)

    def dragMoveEvent(self, event: QDragMoveEvent) -> None:
        accept_copy(event)

    def dropEvent(self, event: QDropEvent) -> None:
        if accept_copy(event):
            self.open_path(dropped_locations(event)[0])

    # -- closing -----------------------------------------------------------------------------------
    def closeEvent(self, event: QCloseEvent) -> None:
        stop_index_children()  # a large .metadata being parsed for the open job: stop, do not wait
        self.board.stop_all()
        self.settings.set_geometry(self.saveGeometry())
        self.settings.sync()
        self.explorer.clear()
        self.compare_view.close_b()
        if self.ckpt is not None:
            self.ckpt.close()
        super().closeEvent(event)
