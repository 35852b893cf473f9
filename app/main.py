"""Start the window: ``dcpstudio`` (optionally with paths to open) and ``dcpstudio --demo``."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["run"]


def run(paths: Sequence[str] = (), *, demo: bool = False) -> int:
    from PySide6.QtWidgets import QApplication

    from .main_window import MainWindow

    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("DCP Studio")
    app.setOrganizationName("DCPStudio")
    style = Path(__file__).with_name("style.qss")
    if style.is_file():
        app.setStyleSheet(style.read_text())  # type: ignore[attr-defined]
    window = MainWindow()
    window.notifier.install_hooks()
    if demo:
        from dcpstudio.core.demo import write_demo

        pt, dcp_dir = write_demo()
        window.settings.add_recent(pt)
        window.browser.set_root(str(dcp_dir.parent))
        window.open_path(dcp_dir)
    elif paths:
        window.open_path(Path(paths[0]))
    window.show()
    return int(app.exec())
