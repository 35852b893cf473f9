"""Compare two checkpoints of any formats, streaming: what differs, by how much, and where.

Entries are matched by their flattened fully-qualified names. Tensors are compared block by
block (bounded memory); NaNs in the same places count as equal, so a conversion that preserves
bits compares equal at ``rtol = atol = 0``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ._blocks import blocks
from ._refs import is_tensor
from .inspect import Checkpoint
from .model import dtype_name, refuse_expanded
from .progress import CancelToken, ProgressCallback, Reporter

__all__ = ["DiffReport", "ValueMismatch", "diff"]


@dataclass(frozen=True)
class ValueMismatch:
    fqn: str
    mismatched: int  # elements outside the tolerance
    count: int
    max_abs: float
    max_rel: float


@dataclass
class DiffReport:
    a: str
    b: str
    compared: int = 0
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    kind: list[tuple[str, str, str]] = field(default_factory=list)
    dtype: list[tuple[str, str, str]] = field(default_factory=list)
    shape: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
    values: list[ValueMismatch] = field(default_factory=list)
    objects: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return not (self.only_a or self.only_b or self.kind or self.dtype or self.shape or self.values or self.objects)


def _objects_equal(x: Any, y: Any) -> bool:
    if is_tensor(x) or is_tensor(y):
        import torch

        return (
            isinstance(x, torch.Tensor)
            and isinstance(y, torch.Tensor)
            and x.dtype == y.dtype
            and x.shape == y.shape
            and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        )
    if isinstance(x, dict) and isinstance(y, dict):
        ys = {str(k): w for k, w in y.items()}
        return {str(k) for k in x} == set(ys) and all(_objects_equal(v, ys[str(k)]) for k, v in x.items())
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(_objects_equal(v, w) for v, w in zip(x, y, strict=True))
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True  # the same value, stored twice (NaN != NaN)
    try:
        return bool(x == y)
    except Exception:
        return False


def _compare_tensor(
    a: Checkpoint, b: Checkpoint, fqn: str, rtol: float, atol: float, budget: int, reporter: Reporter
) -> ValueMismatch | None:
    import torch

    ea, eb = a.entries[fqn], b.entries[fqn]
    itemsize = max(ea.dtype.itemsize if ea.dtype else 1, eb.dtype.itemsize if eb.dtype else 1)
    mismatched = count = 0
    max_abs = max_rel = 0.0
    exact = rtol == 0 and atol == 0 and ea.dtype == eb.dtype
    for offsets, sizes in blocks(ea.shape or (), itemsize, budget):
        reporter.check()
        region = [slice(o, o + s) for o, s in zip(offsets, sizes, strict=True)]
        x = a.read_tensor(fqn, region).reshape(-1)
        y = b.read_tensor(fqn, region).reshape(-1)
        count += x.numel()
        if exact and torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            reporter.advance(2 * x.numel() * itemsize, items=0, current=fqn)
            continue
        xd, yd = (
            x.to(torch.complex128 if x.is_complex() else torch.float64),
            y.to(torch.complex128 if y.is_complex() else torch.float64),
        )
        both_nan = torch.isnan(xd) & torch.isnan(yd)
        close = torch.isclose(xd, yd, rtol=rtol, atol=atol, equal_nan=True) | both_nan
        bad = int((~close).sum())
        if bad:
            mismatched += bad
            diff = (xd - yd).abs()
            diff = torch.where(both_nan, torch.zeros_like(diff), diff)
            finite = torch.isfinite(diff)
            if bool((~finite).any()):
                max_abs = math.inf
            if bool(finite.any()):
                max_abs = max(max_abs, float(diff[finite].max()))
                rel = diff[finite] / yd.abs()[finite].clamp_min(torch.finfo(torch.float64).tiny)
                max_rel = max(max_rel, float(rel.max()))
        reporter.advance(2 * x.numel() * itemsize, items=0, current=fqn)
    if mismatched:
        return ValueMismatch(fqn, mismatched, count, max_abs, max_rel)
    return None


def diff(
    a: Checkpoint,
    b: Checkpoint,
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
    budget: int = 32 << 20,
    progress: ProgressCallback | None = None,
    cancel: CancelToken | None = None,
) -> DiffReport:
    """Compare ``a`` with ``b``; tensors within ``|a - b| <= atol + rtol * |b|`` are equal."""
    a.tree, b.tree  # noqa: B018 - the whole structure, checked (a DCP's storage index too), before any value
    report = DiffReport(str(a.path), str(b.path))
    report.only_a = [k for k in a.entries if k not in b.entries]
    report.only_b = [k for k in b.entries if k not in a.entries]
    common = [k for k in a.entries if k in b.entries]
    total = sum(a.entries[k].nbytes + b.entries[k].nbytes for k in common if a.entries[k].kind == "tensor")
    reporter = Reporter(progress, cancel, total_bytes=total, total_items=len(common))
    for fqn in common:
        reporter.check()
        ea, eb = a.entries[fqn], b.entries[fqn]
        report.compared += 1
        a_tensor, b_tensor = ea.kind == "tensor", eb.kind == "tensor"
        if a_tensor != b_tensor:
            report.kind.append((fqn, ea.kind, eb.kind))
            continue
        if not a_tensor:
            if not _objects_equal(a.read_value(fqn), b.read_value(fqn)):
                report.objects.append(fqn)
            reporter.advance(0, current=fqn)
            continue
        if ea.dtype != eb.dtype:
            report.dtype.append((fqn, dtype_name(ea.dtype) or "", dtype_name(eb.dtype) or ""))
        if ea.shape != eb.shape:
            report.shape.append((fqn, list(ea.shape or ()), list(eb.shape or ())))
            continue
        refuse_expanded(ea, str(a.path), "compare")
        refuse_expanded(eb, str(b.path), "compare")
        found = _compare_tensor(a, b, fqn, rtol, atol, budget, reporter)
        if found is not None:
            report.values.append(found)
        reporter.advance(0, current=fqn)
    return report
