"""Numbers as people read them: the one number style every pane, table, message and the CLI use.

Two kinds of number, one rule each:

- a *magnitude* (a tensor's elements, a group's parameters, bytes) is exact below its first unit,
  then one decimal and a unit: ``913``, ``3.2 K``, ``65.5 K``, ``2.3 M``, ``7.2 B``; ``913 B``,
  ``1.2 KiB``, ``65.5 MiB`` (:func:`human_count`, :func:`human_bytes`). The same number never
  reads "3,200" in one pane and "3.2 K" in the next, nor "2.29 M" beside "2.3 M".
- a *count a user checks* (entries, matches, mismatched or non-finite values, ranks) is exact, in
  thousands: ``1,374,862`` (:func:`exact_count`), on the terminal as in the window.
"""

from __future__ import annotations

import re

__all__ = ["exact_count", "human_bytes", "human_count", "parse_size", "plural"]


def _one_decimal(n: float, base: int, units: tuple[str, ...]) -> str:
    if abs(n) < base:
        return f"{n:.0f}" + (f" {units[0]}" if units[0] else "")
    for unit in units[1:]:
        n /= base
        if abs(n) < base - 0.05 or unit == units[-1]:  # 999.96 K reads "1.0 M", not "1000.0 K"
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def human_bytes(n: float) -> str:
    """``913 B``, ``1.2 KiB``, ``65.5 MiB``, ``1.0 GiB`` (powers of 1024)."""
    return _one_decimal(n, 1024, ("B", "KiB", "MiB", "GiB", "TiB"))


def human_count(n: float) -> str:
    """``913``, ``3.2 K``, ``65.5 K``, ``2.3 M``, ``7.2 B``, ``1.5 T`` (powers of 1000)."""
    return _one_decimal(n, 1000, ("", "K", "M", "B", "T"))


def exact_count(n: int) -> str:
    """``1,374,862``: a count shown to the unit."""
    return f"{n:,}"


def plural(n: int, word: str) -> str:
    """``1 tensor``, ``2 tensors``, ``1,024 other values``, ``3 entries``."""
    if n == 1:
        return f"1 {word}"
    return f"{exact_count(n)} {word[:-1]}ies" if word.endswith("y") else f"{exact_count(n)} {word}s"


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"5GiB"`` -> 5 * 2**30 (the units Hugging Face uses)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"invalid size {text!r}; use e.g. 500MB, 5GB or 2GiB")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    scale = (1024 if binary else 1000) ** "_KMGT".index(unit or "_")
    size = int(number * scale)
    if size <= 0:
        raise ValueError(f"invalid size {text!r}: must be positive")
    return size
