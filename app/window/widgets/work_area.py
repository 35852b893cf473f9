"""The window's right column: the views (Details · Values · Compare) over the Convert/Load area,
which folds away so the views get its height, and two strips that never widen the window.

The area's state is remembered between runs; folding it gives its height to the views and
unfolding gives back the height it had. While the Run view is shown the area folds by itself (a
run's plots and lists want the height; converting is about one checkpoint) and unfolds when another
view is, unless it was unfolded there or folded by hand meanwhile; the remembered state is only the
user's. The column's minimum does not depend on the page shown or the tensor explored, so its
splitters never move by themselves.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QAction, QKeySequence, QWheelEvent
from PySide6.QtWidgets import (
    QFrame,
    QLabel,
    QLayout,
    QScrollArea,
    QSizePolicy,
    QSpinBox,
    QSplitter,
    QTabWidget,
    QToolButton,
    QWidget,
)

from ..settings import Settings

__all__ = ["TOGGLE_SHORTCUT", "SideScroll", "WorkArea"]

TOGGLE_SHORTCUT = "Ctrl+J"  # as an editor's "toggle panel"


class SideScroll(QScrollArea):
    """Holds a row of controls whose count varies (one index box per free dimension of the tensor
    explored): beyond its width it scrolls sideways (the wheel over it, or Tab to a box) instead of
    raising the window's minimum. Its height and minimum are the same for every tensor."""

    def __init__(self, row: QLayout, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        inner = QWidget()
        row.setContentsMargins(0, 0, 0, 0)
        inner.setLayout(row)
        self.setWidget(inner)
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)  # a bar would cover the boxes
        spin = QSpinBox()
        spin.setRange(0, 9999)
        self.setFixedHeight(spin.sizeHint().height())
        self.setMinimumWidth(QLabel("dim 0").sizeHint().width() + spin.sizeHint().width() + 12)  # one box in view
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def wheelEvent(self, event: QWheelEvent) -> None:
        bar = self.horizontalScrollBar()
        bar.setValue(bar.value() - (event.angleDelta().y() or event.angleDelta().x()) // 4)
        event.accept()


class WorkArea(QSplitter):
    """``views`` over ``actions`` (:attr:`area`); :attr:`toggle` (checked: the area shown) folds it away."""

    def __init__(self, views: QTabWidget, actions: QTabWidget, settings: Settings) -> None:
        super().__init__(Qt.Orientation.Vertical)
        self.settings = settings
        self.views, self.area = views, actions
        self.addWidget(views)
        self.addWidget(actions)
        self.setChildrenCollapsible(False)  # dragged small, a pane stops at its minimum: never crushed to 0
        self.setStretchFactor(0, 1)  # a taller window gives its height to the views
        self.setStretchFactor(1, 0)
        # the area as small as its pages allow (a tab widget's hint is its tallest page's, with room
        # to spare): the views get the rest, the area grows only when dragged
        self.setSizes([600, actions.minimumSizeHint().height()])
        self.toggle = QAction("Convert && Load Area", self)
        self.toggle.setCheckable(True)
        self.toggle.setShortcut(QKeySequence(TOGGLE_SHORTCUT))
        self.toggle.setStatusTip("Show or hide the Convert and Load on ranks area; the views take its height")
        self.toggle.setToolTip(f"Show or hide the Convert and Load area ({TOGGLE_SHORTCUT})")
        self.toggle.setIconText("Convert/Load")  # the corner button's text
        self.toggle.setChecked(settings.actions_shown())
        self.toggle.toggled.connect(self._set_shown)
        self.button = QToolButton()
        self.button.setDefaultAction(self.toggle)
        self.button.setAutoRaise(True)
        views.setCornerWidget(self.button, Qt.Corner.TopRightCorner)
        self._height = actions.minimumSizeHint().height()
        self._folded_for_page = False  # folded by :meth:`fold_for_page`, to unfold on leaving the page
        self._by_hand = True  # a toggle not made by fold_for_page: remembered, and ends the above
        self._on_page = False  # the view shown wants the height
        self._kept_on_page = False  # unfolded by hand there: not folded for it again
        actions.setVisible(self.toggle.isChecked())

    def _set_shown(self, shown: bool) -> None:
        if self._by_hand:
            self._folded_for_page = False
            self._kept_on_page = shown and self._on_page
        if shown == self.area.isVisibleTo(self):
            return
        if not shown:
            self._height = self.sizes()[1] or self._height
        total = sum(self.sizes())
        self.area.setVisible(shown)
        if shown and total > self._height:
            self.setSizes([total - self._height - self.handleWidth(), self._height])
        if self._by_hand:
            self.settings.set_actions_shown(shown)

    def fold_for_page(self, wants_height: bool) -> None:
        """The view shown changed: fold the area for one that ``wants_height`` (the Run view) -- unless
        it was unfolded by hand there -- and unfold it again for another if it was folded for that."""
        self._on_page = wants_height
        fold = wants_height and self.toggle.isChecked() and not self._kept_on_page
        unfold = not wants_height and self._folded_for_page
        if not (fold or unfold):
            return
        self._by_hand = False
        try:
            self.toggle.setChecked(unfold)
        finally:
            self._by_hand = True
        self._folded_for_page = fold

    def show_actions(self) -> None:
        """Unfold the area (a conversion or a load started: its progress and outcome are there)."""
        self.toggle.setChecked(True)
