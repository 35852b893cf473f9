"""Checkpoint models and diff reports as JSON (a documented schema) and as readable text.

JSON schema of ``dcpstudio inspect --json`` (``schema: 1``)::

    {"schema": 1, "format": "dcp" | "torch" | "safetensors", "path": str,
     "totals": {"entries": int, "tensors": int, "tensor_bytes": int,
                "by_dtype": {dtype: {"count": int, "nbytes": int}},
                "by_prefix": {prefix: {"count": int, "nbytes": int}}},
     "entries": [{"fqn": str, "kind": "tensor" | "bytes" | "object",
                  "dtype": str | null, "shape": [int] | null, "numel": int, "nbytes": int,
                  "storage": str | null, "shared_with": [str],
                  "chunks": [{"offsets": [int], "sizes": [int], "file": str | null,
                              "offset": int | null, "length": int | null,
                              "data_offset": int | null}]}]}

``by_dtype`` counts non-tensor entries under ``"value"``, whatever the format.
``fqn`` is the flattened DCP key (``model.emb.weight``); ``file`` is relative to the checkpoint
path (its directory, for single-file checkpoints); ``offset``/``length`` is the byte range that
stores the chunk (for DCP: the chunk's archive; otherwise the raw bytes) and ``data_offset``
where the raw row-major element bytes begin (for DCP only with ``--chunks``, which parses each
chunk's archive).

JSON schema of ``dcpstudio verify --json`` (``schema: 1``; :func:`diff_json`)::

    {"schema": 1, "a": str, "b": str, "equal": bool, "compared": int,
     "only_a": [str], "only_b": [str],
     "kind": [{"fqn": str, "a": str, "b": str}], "dtype": [{"fqn": str, "a": str, "b": str}],
     "shape": [{"fqn": str, "a": [int], "b": [int]}],
     "values": [{"fqn": str, "mismatched": int, "count": int, "nonfinite": int,
                 "max_abs": float, "max_rel": float}],
     "objects": [str]}

``values`` lists the tensors with elements outside the tolerance; the numbers are defined in
:mod:`dcpstudio.core.ops.compare.diff`: ``nonfinite`` (added later, still schema 1) counts the mismatched pairs
with NaN or an infinity on a side, which make ``max_abs`` infinite; ``max_rel`` is over the pairs
where B is not 0, and infinite when B is 0 where A is beyond ``atol``. Infinities are written as
Python's :mod:`json` writes them (``Infinity``).
"""

from __future__ import annotations

import math
from typing import Any

from ..checkpoints.model import Chunk, Entry, Node, dtype_name, printable, short_repr
from ..checkpoints.opening import Checkpoint
from ..errors import DCPStudioError, UnsafePickleError
from ..io.remote.locations import RemotePath
from ..pickles.subclass import UnreadableRef
from ..units import exact_count, human_bytes, human_count, plural
from .compare.diff import DiffReport, EntryComparison, ValueMismatch

__all__ = [
    "LIST_LIMIT",
    "STATUS_TEXT",
    "checkpoint_json",
    "checkpoint_text",
    "compare_csv",
    "compare_json",
    "compare_summary",
    "compare_text",
    "diff_json",
    "diff_summary",
    "diff_text",
    "exact_count",
    "human_bytes",
    "human_count",
    "metric",
    "plural",
    "value_text",
]


def _chunk_json(c: Chunk) -> dict[str, Any]:
    return {
        "offsets": list(c.offsets),
        "sizes": list(c.sizes),
        "file": c.file,
        "offset": c.offset,
        "length": c.length,
        "data_offset": c.data_offset,
    }


def checkpoint_json(ckpt: Checkpoint, *, resolve_chunks: bool = False) -> dict[str, Any]:
    entries = []
    for fqn, e in ckpt.entries.items():
        chunks = ckpt.resolve_chunks(fqn) if resolve_chunks else ckpt.chunks(fqn)
        entries.append(
            {
                "fqn": fqn,
                "kind": e.kind,
                "dtype": dtype_name(e.dtype),
                "shape": list(e.shape) if e.shape is not None else None,
                "numel": e.numel,
                "nbytes": e.nbytes,
                "storage": e.storage,
                "shared_with": list(e.shared_with),
                "chunks": [_chunk_json(c) for c in chunks],
            }
        )
    return {
        "schema": 1,
        "format": ckpt.format,
        "path": str(ckpt.path),
        "totals": {
            "entries": len(ckpt.entries),
            "tensors": sum(1 for e in ckpt.entries.values() if e.kind == "tensor"),
            "tensor_bytes": ckpt.tensor_bytes,
            "by_dtype": {k: {"count": t.count, "nbytes": t.nbytes} for k, t in ckpt.totals_by_dtype().items()},
            "by_prefix": {k: {"count": t.count, "nbytes": t.nbytes} for k, t in ckpt.totals_by_prefix().items()},
        },
        "entries": entries,
    }


SHOWN_VALUE_LIMIT = 64 << 10
"""The largest stored non-tensor value a listing reads to show it (a DCP byte item: a small
torch.save archive, restricted-unpickled); larger ones are described by their size."""
_SHOWN_VALUES_BUDGET = 16 << 20  # all of a listing's reads of values together...
_SHOWN_VALUES_READS = {"local": 4096, "remote": 64}  # ...and how many reads (a remote one is a request)


def value_text(ckpt: Checkpoint, e: Entry, budget: list[int] | None = None) -> str:
    """A non-tensor entry as every format shows it: ``= 1234`` when its value can be read safely
    and cheaply (held already, or a small item read with the restricted unpickler), else
    ``(value, 913 B)`` and why it is not shown. ``budget`` (bytes and reads left, shared by a
    listing's calls) bounds the reads."""
    if e.kind == "object":
        return f"= {short_repr(e.value, 160 if isinstance(e.value, UnreadableRef) else 60)}"
    if e.byte_size > SHOWN_VALUE_LIMIT or (budget is not None and (budget[0] < e.byte_size or budget[1] < 1)):
        return f"(value, {human_bytes(e.nbytes)})"
    if budget is not None:
        budget[0] -= e.byte_size
        budget[1] -= 1
    try:
        value = ckpt.read_object(e.fqn, limit=SHOWN_VALUE_LIMIT)
    except DCPStudioError as error:
        reason = "needs --trust-pickle" if isinstance(error, UnsafePickleError) else "unreadable"
        return f"(value, {human_bytes(e.nbytes)}, not shown: {reason})"
    return f"= {short_repr(value, 60)}"


def _describe(ckpt: Checkpoint, node: Node, budget: list[int]) -> str:
    e = node.entry
    if e is None:
        return ""
    if e.kind == "tensor":
        text = f"{dtype_name(e.dtype)} {list(e.shape or ())} {human_bytes(e.nbytes)}"
        if e.shard_of is not None:
            text += f" (a shard, at {list(e.shard_of[0])} of a larger tensor; its other shards are elsewhere)"
        if e.shared_with:
            text += f" (shares storage with {', '.join(e.shared_with)})"
        return text
    return value_text(ckpt, e, budget)


def checkpoint_text(ckpt: Checkpoint, *, chunks: bool = False) -> str:
    tensors = sum(1 for e in ckpt.entries.values() if e.kind == "tensor")
    lines = [
        f"{ckpt.path} ({ckpt.format}): {plural(tensors, 'tensor')}, "
        f"{plural(len(ckpt.entries) - tensors, 'other value')}, {human_bytes(ckpt.tensor_bytes)}",
        *(f"note: {printable(n)}" for n in ckpt.info.get("notes", ())),
    ]
    remote = isinstance(ckpt.path, RemotePath)
    budget = [_SHOWN_VALUES_BUDGET, _SHOWN_VALUES_READS["remote" if remote else "local"]]

    def walk(node: Node, depth: int) -> None:
        for child in node.children.values():
            desc = _describe(ckpt, child, budget)
            suffix = "" if child.entry is not None and not child.children else "/"
            pad = "  " * depth
            lines.append(f"{pad}{printable(child.name)}{suffix}  {desc}".rstrip())
            if chunks and child.entry is not None:
                for c in ckpt.resolve_chunks(child.entry.fqn):
                    where = f"{printable(str(c.file))} @ {c.offset} +{c.length}"
                    if c.data_offset is not None and c.data_offset != c.offset:
                        where += f" (data @ {c.data_offset})"
                    lines.append(f"{pad}    chunk offsets={list(c.offsets)} sizes={list(c.sizes)} {where}")
            walk(child, depth + 1)

    walk(ckpt.tree, 1)
    for title, totals in (("dtype", ckpt.totals_by_dtype()), ("prefix", ckpt.totals_by_prefix())):
        lines.append(f"totals by {title}:")
        lines += [
            f"  {printable(k):<16} {exact_count(t.count):>9} {human_bytes(t.nbytes):>12}" for k, t in totals.items()
        ]
    return "\n".join(lines)


def diff_json(report: DiffReport) -> dict[str, Any]:
    return {
        "schema": 1,
        "a": report.a,
        "b": report.b,
        "equal": report.equal,
        "compared": report.compared,
        "only_a": report.only_a,
        "only_b": report.only_b,
        "kind": [{"fqn": f, "a": x, "b": y} for f, x, y in report.kind],
        "dtype": [{"fqn": f, "a": x, "b": y} for f, x, y in report.dtype],
        "shape": [{"fqn": f, "a": x, "b": y} for f, x, y in report.shape],
        "values": [
            {
                "fqn": v.fqn,
                "mismatched": v.mismatched,
                "count": v.count,
                "nonfinite": v.nonfinite,
                "max_abs": v.max_abs,
                "max_rel": v.max_rel,
                "rel_l2": v.rel_l2,
                "first_index": list(v.first_index) if v.first_index is not None else None,
                "partial": v.partial,
            }
            for v in report.values
        ],
        "objects": report.objects,
    }


def _value_line(v: ValueMismatch) -> str:
    """Four significant digits (``0``, ``0.001``, ``2.5e-07``), and why a maximum is infinite."""
    most = f"inf ({exact_count(v.nonfinite)} NaN/Inf against a different value)" if v.nonfinite else f"{v.max_abs:.4g}"
    rel = "inf (B is 0 where A is not)" if v.max_rel == math.inf else f"{v.max_rel:.4g}"
    first = f", first at {list(v.first_index)}" if v.first_index is not None else ""
    counted = f"{exact_count(v.mismatched)}/{exact_count(v.count)} elements"
    if v.partial:
        return (
            f"  values differ: {printable(v.fqn)}{first}: {counted} read up to the first "
            f"differing block, max abs {most}, max rel {rel} (--quick: the rest not read)"
        )
    l2 = f", rel L2 {v.rel_l2:.4g}" if v.rel_l2 is not None else ""
    l2 += " over the finite pairs" if l2 and v.nonfinite else ""
    return f"  values differ: {printable(v.fqn)}{first}: {counted}, max abs {most}, max rel {rel}{l2}"


LIST_LIMIT = 20
"""Lines per kind of difference that ``diff_text`` prints before "… and N more"."""


def _groups(names: list[str]) -> str:
    """Where a list of names lies, by first component: ``" (model.*)"``, ``" (model.* 78, optim.* 2)"``."""
    if not names:
        return ""
    counts: dict[str, int] = {}
    for n in names:
        head, dot, _ = n.partition(".")
        key = f"{head}.*" if dot else head
        counts[key] = counts.get(key, 0) + 1
    if len(counts) == 1:
        return f" ({printable(next(iter(counts)))})"
    top = sorted(counts.items(), key=lambda kv: -kv[1])
    text = ", ".join(f"{printable(k)} {exact_count(v)}" for k, v in top[:3])
    return f" ({text}{', …' if len(top) > 3 else ''})"


def diff_summary(report: DiffReport) -> str:
    """One line of counts: ``equal: 310, different: 2, only in A: 80 (model.*), only in B: 0``
    (an entry that differs in several ways counts once)."""
    differing = {f for f, *_ in report.kind + report.dtype + report.shape} | set(report.objects)
    differing |= {v.fqn for v in report.values}
    return (
        f"equal: {exact_count(report.compared - len(differing))}, different: {exact_count(len(differing))}, "
        f"only in A: {exact_count(len(report.only_a))}{_groups(report.only_a)}, "
        f"only in B: {exact_count(len(report.only_b))}{_groups(report.only_b)}"
    )


def _capped(lines: list[str], limit: int | None) -> list[str]:
    if limit is None or len(lines) <= limit:
        return lines
    return [*lines[:limit], f"  … and {exact_count(len(lines) - limit)} more (--all lists them)"]


def diff_text(report: DiffReport, limit: int | None = None) -> str:
    """The summary first, then each difference: at most ``limit`` lines of each kind (None: all,
    for a scrolling box; ``verify`` on a terminal passes :data:`LIST_LIMIT`)."""
    if report.equal:
        return f"equal: {exact_count(report.compared)} entries compared"
    lines = [f"A and B differ; {diff_summary(report)}"]
    for part in (
        [f"  kind differs: {printable(f)}: {x} vs {y}" for f, x, y in report.kind],
        [f"  dtype differs: {printable(f)}: {x} vs {y}" for f, x, y in report.dtype],
        [f"  shape differs: {printable(f)}: {x} vs {y}" for f, x, y in report.shape],
        [_value_line(v) for v in report.values],
        [f"  value differs: {printable(f)}" for f in report.objects],
        [f"  only in A: {printable(f)}" for f in report.only_a],
        [f"  only in B: {printable(f)}" for f in report.only_b],
    ):
        lines += _capped(part, limit)
    return "\n".join(lines)


STATUS_TEXT = {
    "equal": "equal",
    "different": "different",
    "only_a": "only in A",
    "only_b": "only in B",
    "kind": "kind differs",
    "dtype": "dtype differs",
    "shape": "shape differs",
}
"""What a compare row's status is called, in the window's table and on the terminal."""
COMPARE_FIELDS = ("fqn", "status", "max_abs", "rel_l2", "cosine", "mismatched", "count", "dtype_a", "dtype_b")


def metric(v: float | None, digits: int = 4) -> str:
    """A compare metric as the compare table shows it: ``digits`` significant digits, "—" where
    it does not apply."""
    if v is None:
        return "—"
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:.{digits}g}"


def compare_summary(rows: list[EntryComparison]) -> str:
    """:func:`diff_summary`'s line for :func:`~.compare.diff.compare`'s rows."""
    only_a = [r.fqn for r in rows if r.status == "only_a"]
    only_b = [r.fqn for r in rows if r.status == "only_b"]
    equal = sum(r.status == "equal" for r in rows)
    return (
        f"equal: {exact_count(equal)}, different: {exact_count(len(rows) - equal - len(only_a) - len(only_b))}, "
        f"only in A: {exact_count(len(only_a))}{_groups(only_a)}, "
        f"only in B: {exact_count(len(only_b))}{_groups(only_b)}"
    )


def compare_text(rows: list[EntryComparison], *, differences_only: bool = False) -> str:
    """The compare view's table: entry, status, max |Δ|, relative L2 ‖a-b‖/‖a‖, cosine; the
    summary line last (over every row, shown or not)."""
    shown = [r for r in rows if not (differences_only and r.status == "equal")]
    width = min(max([len(printable(r.fqn)) for r in shown] + [5]), 80)
    lines = [f"{'entry':<{width}}  {'status':<13} {'max |Δ|':>10} {'rel L2':>10} {'cosine':>10}"]
    lines += [
        f"{printable(r.fqn):<{width}}  {STATUS_TEXT.get(r.status, r.status):<13} "
        f"{metric(r.max_abs):>10} {metric(r.rel_l2):>10} {metric(r.cosine, 6):>10}"
        for r in shown
    ]
    lines.append(compare_summary(rows))
    return "\n".join(lines)


def _row_json(r: EntryComparison) -> dict[str, Any]:
    out = {k: list(v) if isinstance(v, tuple) else v for k, v in vars(r).items()}
    out["status_text"] = STATUS_TEXT.get(r.status, r.status)
    return out


def compare_json(a: str, b: str, rows: list[EntryComparison], rtol: float, atol: float, equal: bool) -> dict[str, Any]:
    """``dcpstudio compare --json``: ``{"schema": 1, "a", "b", "rtol", "atol", "equal": bool,
    "entries": [every field of :class:`~.compare.diff.EntryComparison`, tuples as lists, plus
    "status_text"]}``; metrics not applicable are null, infinities ``Infinity``."""
    return {
        "schema": 1,
        "a": a,
        "b": b,
        "rtol": rtol,
        "atol": atol,
        "equal": equal,
        "entries": [_row_json(r) for r in rows],
    }


def compare_csv(rows: list[EntryComparison]) -> str:
    """The rows as CSV (:data:`COMPARE_FIELDS` plus the shapes), metrics at full precision, empty
    where they do not apply."""
    import csv
    import io

    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([*COMPARE_FIELDS, "shape_a", "shape_b"])
    for r in rows:
        cells = [printable(r.fqn), *(getattr(r, k) for k in COMPARE_FIELDS[1:])]
        shapes = [str(list(s)) if s is not None else "" for s in (r.shape_a, r.shape_b)]
        writer.writerow([*("" if c is None else repr(c) if isinstance(c, float) else c for c in cells), *shapes])
    return out.getvalue().rstrip("\n")
