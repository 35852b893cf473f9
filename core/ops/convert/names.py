"""Selecting checkpoint entries by name."""

from __future__ import annotations

import re
from collections.abc import Iterable

from ...errors import EmptySelectionError

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

    def check(self, names: Iterable[str], allow_empty: bool = False) -> list[str]:
        """Refuse a selection that keeps no entry (unless ``allow_empty``), naming the pattern that
        emptied it and a few real names; return a warning for each pattern that matches no name
        while the selection keeps some (a pattern that does nothing is a mistake to point out)."""
        names = list(names)
        inc, exc = self._include, self._exclude
        included = [n for n in names if inc is None or inc.search(n)]
        kept = [n for n in included if exc is None or not exc.search(n)]
        if not kept and names and not allow_empty:
            if inc is not None and not included:
                raise EmptySelectionError(
                    f"--include {inc.pattern!r} matches no entry; names look like {_examples(names)}"
                    " (--allow-empty writes an empty checkpoint)"
                )
            what = f"every entry --include {inc.pattern!r} keeps" if inc is not None else "every entry"
            assert exc is not None
            raise EmptySelectionError(
                f"--exclude {exc.pattern!r} drops {what}; nothing would be written (--allow-empty writes it anyway)"
            )
        warnings = []
        if exc is not None and kept and not any(exc.search(n) for n in names):
            warnings.append(f"--exclude {exc.pattern!r} matches no entry; nothing was excluded")
        return warnings


def _examples(names: list[str], count: int = 3) -> str:
    """A few names spread over the checkpoint, so a user sees its naming scheme."""
    step = max(1, len(names) // count)
    picked = names[::step][:count]
    return ", ".join(picked) + (", …" if len(names) > len(picked) else "")
