"""Changing what a filter proxy accepts, on every supported Qt: 6.10 added
``beginFilterChange`` / ``endFilterChange`` and deprecated ``invalidateFilter``."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QSortFilterProxyModel

__all__ = ["change_filter"]


def change_filter(proxy: QSortFilterProxyModel, change: Callable[[], None]) -> None:
    """Run ``change`` (which alters what ``proxy.filterAcceptsRow`` answers) and refilter."""
    if hasattr(proxy, "beginFilterChange"):
        proxy.beginFilterChange()
        change()
        proxy.endFilterChange()
    else:
        change()
        proxy.invalidateFilter()
