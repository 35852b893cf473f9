"""The window's menus and keyboard shortcuts, the entry context menu, Help › Read Me and About.

Every action a pane offers is reachable from a menu with a shortcut, so the window can be used
with the keyboard only; the same actions appear in the tree's context menu.
"""

from __future__ import annotations

import html
import platform
import re
import sys
from collections.abc import Callable
from importlib import metadata
from typing import Any

from PySide6.QtCore import QSettings, Qt, QUrl
from PySide6.QtGui import QAction, QDesktopServices, QKeySequence, QTextCursor
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QMenu, QMessageBox, QTextBrowser, QVBoxLayout, QWidget

from .locations import is_remote, shown
from .widgets.check_view import check_open
from .widgets.convert_panel import TARGETS
from .widgets.message_log import MessageLog

__all__ = [
    *("about_html", "build_menus", "entry_menu", "fill_recent", "readme_text", "show_about"),
    *("show_in_file_manager", "show_readme"),
]


def _action(parent: QWidget, text: str, slot: Callable[[], Any], shortcut: Any = None, tip: str = "") -> QAction:
    action = QAction(text, parent)
    if shortcut is not None:
        action.setShortcut(QKeySequence(shortcut))
    if tip:
        action.setStatusTip(tip)
    action.triggered.connect(lambda _=False: slot())
    return action


def build_menus(w: Any) -> dict[str, QAction]:
    """Fill the menu bar of ``w`` (the main window: typed loosely, it imports this module) and
    return the actions by name (tests and the window use them)."""
    bar = w.menuBar()
    acts: dict[str, QAction] = {}

    def add(menu: QMenu, name: str, *args: Any, **kwargs: Any) -> QAction:
        action = acts[name] = _action(w, *args, **kwargs)
        menu.addAction(action)
        return action

    file = bar.addMenu("&File")
    add(file, "open", "Open &File…", w.ask_open_file, QKeySequence.StandardKey.Open)
    add(file, "open_dir", "Open &Directory…", w.ask_open_dir, "Ctrl+Shift+O")
    add(
        file,
        "open_url",
        "Open &URL…",
        w.ask_open_url,
        "Ctrl+L",
        "Open a checkpoint in S3, GCS, Azure, over HTTP or on the Hub",
    )
    add(
        file,
        "open_run",
        "Open as R&un…",
        w.runs.ask_open,
        "Ctrl+Shift+U",
        "A folder of one training run's checkpoints by step: how every tensor moved, and the anomalies",
    )
    w.recent_menu = file.addMenu("Open &Recent")
    w.recent_menu.aboutToShow.connect(lambda: fill_recent(w))
    file.addSeparator()
    add(file, "compare", "&Compare With…", w.compare_with, "Ctrl+D", "Compare the open checkpoint with another")
    add(
        file, "export", "&Export Tensor…", w.export_selected, "Ctrl+Shift+E", "Write the selected tensor to .npy or .pt"
    )
    file.addSeparator()
    add(file, "quit", "&Quit", w.close, QKeySequence.StandardKey.Quit)

    edit = bar.addMenu("&Edit")
    add(edit, "find", "&Find…", w.focus_filter, QKeySequence.StandardKey.Find)
    add(edit, "copy_name", "Copy Full &Name", w.copy_name, "Ctrl+Shift+C")
    add(edit, "copy_shape", "Copy &Shape", w.copy_shape, "Ctrl+Alt+C")

    view = bar.addMenu("&View")
    for n, (name, title) in enumerate((("details", "&Details"), ("values", "&Values"), ("compare_tab", "C&ompare")), 1):
        add(view, f"tab_{name}", title, lambda i=n - 1: w.show_view(i), f"Alt+{n}")
    add(view, "tab_run", "&Run", w.runs.show_view, "Alt+4", "The run open: its steps, plots and anomalies")
    add(view, "explore", "&Explore Values", w.explore_selected, "Ctrl+E", "Page through the selected tensor")
    add(
        view,
        "messages",
        "&Messages",
        lambda: MessageLog.show_for(w.message_bar, w),
        "Ctrl+Shift+M",
        "Every message of this session, in full",
    )
    view.addSeparator()
    acts["actions_area"] = w.right.toggle
    view.addAction(w.right.toggle)
    columns = view.addMenu("Tree &Columns")

    def fill_columns() -> None:
        columns.clear()
        for a in w.tree_pane.column_menu().actions():
            columns.addAction(a)

    columns.aboutToShow.connect(fill_columns)

    convert = bar.addMenu("&Convert")
    for n, (target, title) in enumerate(TARGETS.items(), 1):
        add(convert, f"to_{target}", f"To {title[2:]}…", lambda t=target: w.panel.convert(t), f"Ctrl+{n}")
    to_url = convert.addMenu("To a &URL")
    for target, title in TARGETS.items():
        add(to_url, f"url_{target}", f"{title[2:]}…", lambda t=target: w.convert_to_url(t))
    convert.addSeparator()
    add(
        convert,
        "verify",
        "&Verify Result",
        w.panel.verify,
        "Ctrl+Shift+V",
        "Compare the last conversion's source and result",
    )
    add(convert, "open_result", "Open &Result", w.panel.open_result, "Ctrl+Shift+R")
    add(convert, "load", "&Load on Ranks…", w.show_load, "Ctrl+Shift+L")
    add(
        convert,
        "check",
        "C&heck Checkpoint",
        lambda: check_open(w),
        "Ctrl+K",
        "Is the open checkpoint whole: files, records, zstd frames, chunk tables",
    )
    convert.addSeparator()
    cancel = add(convert, "cancel", "Ca&ncel", w.cancel_work, Qt.Key.Key_Escape, "Stop the running operation")
    cancel.setEnabled(False)

    help_menu = bar.addMenu("&Help")
    add(help_menu, "readme", "&Read Me", lambda: show_readme(w), QKeySequence.StandardKey.HelpContents)
    add(help_menu, "about", "&About DCP Studio", lambda: show_about(w))
    return acts


def fill_recent(w: Any) -> None:
    """File › Open Recent of ``w``: recent files and folders, then recent URLs."""
    from pathlib import Path

    from dcpstudio.core.checkpoints.model import printable

    w.recent_menu.clear()
    urls = w.settings.recent_urls()
    for path in w.settings.recent():
        action = w.recent_menu.addAction(printable(path))
        action.triggered.connect(lambda _=False, p=path: w.open_path(Path(p)))
    if urls and not w.recent_menu.isEmpty():
        w.recent_menu.addSeparator()
    for url in urls:
        action = w.recent_menu.addAction(printable(url))
        action.triggered.connect(lambda _=False, u=url: w.open_path(u))


def entry_menu(w: Any, node: Any) -> QMenu:
    """The context menu of a tree row."""
    menu = QMenu(w)
    entry = node.entry
    menu.addAction(_action(menu, "Copy full name", lambda: w.copy_text(node.path)))
    if entry is not None and entry.shape is not None:
        menu.addAction(_action(menu, "Copy shape", lambda: w.copy_text(str(list(entry.shape)))))
    if entry is not None and entry.kind == "tensor":
        menu.addSeparator()
        menu.addAction(_action(menu, "Explore values", lambda: w.explore(entry.fqn)))
        menu.addAction(_action(menu, "Export tensor…", lambda: w.export(entry.fqn)))
    menu.addSeparator()
    menu.addAction(
        _action(
            menu, "Filter to this group" if entry is None else "Filter to this name", lambda: w.filter_to(node.path)
        )
    )
    reveal = _action(menu, "Show in file manager", lambda: w.show_in_file_manager(node))
    if w.ckpt is not None and is_remote(w.ckpt.path):
        reveal.setText("Show in file manager (not for a checkpoint in a remote store)")
        reveal.setEnabled(False)
    menu.addAction(reveal)
    return menu


def show_in_file_manager(ckpt: Any, node: Any, notifier: Any) -> None:
    """Open the folder holding the entry's data (the checkpoint's folder for a group)."""
    if is_remote(ckpt.path):
        notifier.info(f"{shown(ckpt.path)} is in a remote store: no file manager shows it.")
        return
    folder = ckpt.path if ckpt.path.is_dir() else ckpt.path.parent
    if node.entry is not None and node.entry.kind == "tensor" and ckpt.index_ready():
        files = [c.file for c in ckpt.chunks(node.entry.fqn) if c.file]
        if files:
            folder = (folder / files[0]).parent
    if not QDesktopServices.openUrl(QUrl.fromLocalFile(str(folder))):  # no launcher here (xdg-open missing)
        notifier.error(OSError(f"No file manager could be started to show {folder}; open it by hand."))


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def about_html() -> str:
    import PySide6

    import dcpstudio
    import dcpstudio.core as core

    rows = [
        ("DCP Studio", _version("dcpstudio")),
        ("PyTorch", getattr(sys.modules.get("torch"), "__version__", None) or _version("torch")),  # may be loading
        ("Python", platform.python_version()),
        ("Qt / PySide6", PySide6.__version__),
        ("Installed in", str(dcpstudio.__file__).rsplit("/", 1)[0]),
        ("Core", str(core.__file__).rsplit("/", 1)[0]),
        ("Settings", QSettings().fileName()),
    ]
    body = "".join(f"<tr><td><b>{html.escape(k)}</b></td><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return (
        "<h3>DCP Studio</h3><p>Convert, inspect and load PyTorch checkpoints: DCP directories, torch.save files "
        f"and safetensors.</p><table cellspacing='4'>{body}</table>"
        "<p>Help › Read Me (F1) shows the manual.</p>"
    )


def show_about(parent: QWidget) -> None:
    box = QMessageBox(parent)
    box.setWindowTitle("About DCP Studio")
    box.setTextFormat(Qt.TextFormat.RichText)
    box.setText(about_html())
    box.exec()


def readme_text() -> str:
    """The README, from the installed package's metadata (it is the project's long description)."""
    try:
        text = metadata.metadata("dcpstudio").get_payload()  # type: ignore[attr-defined]
    except metadata.PackageNotFoundError:
        text = ""
    return str(text or "") or "The README is not available in this installation."


def show_readme(parent: QWidget) -> QDialog:
    dialog = QDialog(parent)
    dialog.setWindowTitle("DCP Studio — Read Me")
    view = QTextBrowser()
    view.setOpenExternalLinks(True)
    # the README's pictures are not installed with the package: their captions instead of broken images
    view.setMarkdown(re.sub(r"!\[([^\]]*)\]\([^)]*\)", r"*(picture: \1)*", readme_text()))
    block = view.document().begin()
    while block.isValid():  # code blocks wrap at the width too: no sideways scrolling to read a command
        fmt = block.blockFormat()
        if fmt.nonBreakableLines():
            fmt.setNonBreakableLines(False)
            QTextCursor(block).setBlockFormat(fmt)
        block = block.next()
    buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
    buttons.rejected.connect(dialog.reject)
    lay = QVBoxLayout(dialog)
    lay.addWidget(view)
    lay.addWidget(buttons)
    dialog.resize(820, 640)
    dialog.show()
    return dialog
