"""Whether two checkpoints are bitwise the same, answered without torch when they are.

A conversion's output usually equals its source bit for bit, and a ``verify`` that says so needs
no arithmetic: the same names, kinds, dtypes and shapes, every tensor's canonical bytes equal
(read in place: :func:`~...checkpoints.canonical.canonical_source`, compared with numpy) and every
value equal. :func:`bitwise_equal` answers True only then, and None as soon as anything differs
or needs torch to be read (a compressed chunk, a value holding tensors): the caller then runs the
full comparison (:func:`~.diff.diff`), which says what differs and by how much -- so the answer
never differs from the full comparison's, it only comes sooner.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from typing import Any

from ...checkpoints.base import Checkpoint
from ...checkpoints.canonical import RawBuffers, canonical_source
from ...checkpoints.model import dtype_name
from ...io.blocks import blocks
from ...io.pipeline import prefetch
from ...pickles.tree import map_tensors
from ...progress import Reporter
from .values import objects_equal

__all__ = ["bitwise_equal"]

_BUFFERS = RawBuffers(keep=8)


class _HoldsTensor(Exception):
    pass


def _no_tensors(value: Any) -> Any:
    def refuse(t: Any) -> Any:
        raise _HoldsTensor

    return map_tensors(value, refuse)


def _next(pairs: Iterator[tuple[Any, Any]], _: int) -> tuple[Any, Any]:
    return next(pairs)


def _same_bytes(x: Any, y: Any) -> bool:
    import numpy as np

    if x.nbytes != y.nbytes:
        return False
    kind = np.uint64 if x.nbytes % 8 == 0 else np.uint8
    return bool(np.array_equal(x.view(kind), y.view(kind)))


def bitwise_equal(a: Checkpoint, b: Checkpoint, *, budget: int, reporter: Reporter) -> bool | None:
    """True when ``a`` and ``b`` hold the same entries bit for bit; None otherwise (different, or
    not to be told without torch)."""
    try:
        return _bitwise_equal(a, b, budget, reporter)
    finally:
        _BUFFERS.clear()


def _bitwise_equal(a: Checkpoint, b: Checkpoint, budget: int, reporter: Reporter) -> bool | None:
    if sys.byteorder != "little" or set(a.entries) != set(b.entries):
        return None
    a.tree, b.tree  # noqa: B018 - the whole structure checked first, as the full comparison does
    for fqn, ea in a.entries.items():
        eb = b.entries[fqn]
        if (ea.kind == "tensor") != (eb.kind == "tensor"):
            return None
        if ea.kind != "tensor":
            try:
                if not objects_equal(_no_tensors(a.read_object(fqn)), _no_tensors(b.read_object(fqn))):
                    return None
            except _HoldsTensor:
                return None
            continue
        if dtype_name(ea.dtype) != dtype_name(eb.dtype) or tuple(ea.shape or ()) != tuple(eb.shape or ()):
            return None
        sa, sb = canonical_source(a, fqn), canonical_source(b, fqn)
        if sa is None or sb is None:
            return None
        pairs = zip(sa.blocks(budget, _BUFFERS), sb.blocks(budget, _BUFFERS), strict=True)
        count = sum(1 for _ in blocks(sa.shape, sa.itemsize, budget))
        for _, (x, y) in prefetch(functools.partial(_next, pairs), range(count)):  # the next pair read meanwhile
            reporter.check()
            same = _same_bytes(x, y)
            reporter.advance(x.nbytes + y.nbytes, items=0, current=fqn)
            _BUFFERS.give(x)
            _BUFFERS.give(y)
            if not same:
                return None
        reporter.advance(0, current=fqn)
    return True
