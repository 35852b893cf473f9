"""Selecting checkpoint entries by name."""

from __future__ import annotations

import re

__all__ = ["NameFilter"]


class NameFilter:
    """``include`` / ``exclude`` regular expressions, searched in fully-qualified names.

    A name is kept when it matches ``include`` (or ``include`` is None) and does not match
    ``exclude``. Patterns use :func:`re.search`: anchor them (``^model\\.``) to match a prefix.
    """

    def __init__(self, include: str | None = None, exclude: str | None = None) -> None:
        try:
            self._include = re.compile(include) if include else None
            self._exclude = re.compile(exclude) if exclude else None
        except re.error as e:
            raise ValueError(f"invalid name pattern: {e}") from e

    def __call__(self, fqn: str) -> bool:
        if self._include is not None and not self._include.search(fqn):
            return False
        return not (self._exclude is not None and self._exclude.search(fqn))
