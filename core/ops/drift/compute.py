"""``drift(run)``: every tensor's series over the run's steps, its modules' series, the values table
(with a Hugging Face Trainer step's trainer_state.json scalars, :mod:`.trainer_state`) and the
anomalies, reading each checkpoint once.

Each step's checkpoints are opened once and passed down. Steps whose sums are cached (under the
identities of the checkpoints they depend on, :mod:`.cache`) are not read at all; the others are
streamed tensor by tensor (:mod:`.stream`, a thread per core), reading the cached steps they compare
with only as far as needed.
"""

from __future__ import annotations

import contextlib
from typing import Any

from ...checkpoints.base import Checkpoint
from ...checkpoints.model import Entry, dtype_name, expanded
from ...checkpoints.opening import open_checkpoint
from ...errors import DCPStudioError
from ...progress import CancelToken, ProgressCallback, Reporter
from .anomalies import Finding, find_anomalies
from .cache import load_step, step_identity, store_step
from .metrics import StepSums
from .report import Anomaly, DriftReport, group_series, tensor_series
from .run import Run
from .stream import BLOCK_ELEMENTS, Source, stream_run
from .trainer_state import trainer_values

__all__ = ["drift"]

_VALUE_BYTES = 1 << 16  # a non-tensor value larger than this is not a table cell


def _scalar(value: Any) -> Any:
    if isinstance(value, bool | int | str) and not (isinstance(value, str) and len(value) > 200):
        return value
    if isinstance(value, float):
        return value
    return None


def _entries(parts: list[tuple[str, Checkpoint]]) -> dict[str, tuple[Checkpoint, Entry]]:
    out: dict[str, tuple[Checkpoint, Entry]] = {}
    for prefix, ckpt in parts:
        for fqn, entry in ckpt.entries.items():
            out[prefix + fqn] = (ckpt, entry)
    return out


def _values(entries: dict[str, tuple[Checkpoint, Entry]]) -> dict[str, Any]:
    """A step's plain values (numbers, flags, short strings) by name; larger or nested ones are left out."""
    out: dict[str, Any] = {}
    for name, (ckpt, entry) in entries.items():
        if entry.kind == "tensor" or (entry.byte_size and entry.byte_size > _VALUE_BYTES):
            continue
        try:
            value = _scalar(ckpt.read_object(entry.fqn, limit=_VALUE_BYTES))
        except DCPStudioError:
            continue
        if value is not None:
            out[name] = value
    return out


def _chunk(ckpt: Checkpoint, entry: Entry, at: int | None) -> str | None:
    """The stored piece holding element ``at`` (flat) of a tensor: its chunk and file."""
    if at is None or entry.shape is None:
        return None
    index, rest = [], at
    for n in reversed(entry.shape):
        rest, k = divmod(rest, max(n, 1))
        index.append(k)
    index.reverse()
    try:
        chunks = ckpt.chunks(entry.fqn)
    except (DCPStudioError, NotImplementedError):
        return None
    for k, c in enumerate(chunks):
        if all(o <= x < o + n for x, o, n in zip(index, c.offsets, c.sizes, strict=False)):
            where = f", file {c.file}" if c.file else ""
            many = (
                f"chunk {k + 1} of {len(chunks)} (offsets {list(c.offsets)}){where}"
                if len(chunks) > 1
                else (f"file {c.file}" if c.file else "")
            )
            return f"element {index}: {many}" if many else f"element {index}"
    return f"element {index}"


def _firsts(opened: list[dict[str, tuple[Checkpoint, Entry]]]) -> list[list[int]]:
    """For each step, the steps its tensors' cosines to the first are taken against: for each tensor
    the first step holding it in the shape it has here (step 0 for a run whose layout never changes)."""
    first_of: dict[tuple[str, tuple[int, ...]], int] = {}
    out: list[list[int]] = []
    for i, es in enumerate(opened):
        here = set()
        for name, (_, e) in es.items():
            if e.kind == "tensor":
                here.add(first_of.setdefault((name, tuple(e.shape or ())), i))
        out.append(sorted(here))
    return out


def _groups(series_sums: dict[str, list[StepSums | None]]) -> dict[str, dict[str, list[Any]]]:
    members: dict[str, list[list[StepSums | None]]] = {}
    for name, ss in series_sums.items():
        parts = name.split(".")
        for k in range(1, len(parts)):
            members.setdefault(".".join(parts[:k]), []).append(ss)
    return {g: group_series(m) for g, m in sorted(members.items()) if len(m) > 1}


def drift(
    run: Run,
    *,
    trust_pickle: bool = False,
    cache: bool = True,
    progress: ProgressCallback | None = None,
    cancel: CancelToken | None = None,
    block_elements: int = BLOCK_ELEMENTS,
) -> DriftReport:
    """How every tensor of ``run`` moved over its steps (see :class:`DriftReport`). ``cache``: use and
    fill the per-step cache. Reads every byte of every checkpoint not cached exactly once; memory is
    about four blocks of ``block_elements`` values per thread plus what the checkpoints' structures take."""
    n = len(run.steps)
    with contextlib.ExitStack() as stack:
        opened: list[dict[str, tuple[Checkpoint, Entry]]] = []
        for step in run.steps:
            parts = []
            for prefix, location, fmt in step.parts:
                ckpt = stack.enter_context(open_checkpoint(location, trust_pickle=trust_pickle, fmt=fmt))
                parts.append((prefix, ckpt))
            opened.append(_entries(parts))
        idents = [step_identity(s) for s in run.steps] if cache else [None] * n
        firsts = _firsts(opened)

        def depends(i: int) -> list[str | None]:
            """The identities of what step ``i``'s sums are computed from: itself, the two steps
            before it, and every step that is the first of a tensor's shape (``cos_first``)."""
            return [
                idents[i],
                idents[i - 1] if i > 0 else "",
                idents[i - 2] if i > 1 else "",
                *(idents[j] for j in firsts[i]),
            ]

        cached: dict[int, tuple[dict[str, StepSums], dict[str, Any]]] = {}
        if cache:
            for i, step in enumerate(run.steps):
                record = load_step(step, depends(i))
                if record is not None:
                    cached[i] = record
        needed = {i for i in range(n) if i not in cached}
        names = list(dict.fromkeys(name for es in opened for name, (_, e) in es.items() if e.kind == "tensor"))
        presence = {
            name: {
                i: Source(es[name][0], es[name][1].fqn, es[name][1])
                for i, es in enumerate(opened)
                if name in es and es[name][1].kind == "tensor" and not expanded(es[name][1])
            }
            for name in names
        }
        total = sum(src.entry.nbytes for p in presence.values() for i, src in p.items() if i in needed)
        reporter = Reporter(progress, cancel, total_bytes=total, total_items=len(names))
        sums: dict[str, list[StepSums | None]] = {name: [None] * n for name in names}
        for i, (got, _) in cached.items():
            for name, kept in got.items():
                if name in sums:
                    sums[name][i] = kept
        for name, computed in stream_run(names, presence, needed, reporter, block_elements=block_elements):
            for i, fresh in computed.items():
                sums[name][i] = fresh
            reporter.advance(0, current=name)
        values_rows = [cached[i][1] if i in cached else _values(opened[i]) for i in range(n)]
        if cache:
            for i in needed:
                store_step(
                    run.steps[i], depends(i), {nm: s for nm in names if (s := sums[nm][i]) is not None}, values_rows[i]
                )
        for name in names:
            for i, one in enumerate(sums[name]):
                if one is not None and one.value is not None:
                    values_rows[i].setdefault(name, one.value)  # a one-element tensor: its value
        notes = []
        for i, step in enumerate(run.steps):  # read each time (a few KiB): a file's note is never lost to the cache
            reporter.check()
            found, note = trainer_values(step)
            values_rows[i].update(found)
            notes += [note] if note else []
        layouts = [{name: (e.kind, dtype_name(e.dtype) or "", e.shape) for name, (_, e) in es.items()} for es in opened]
        findings = find_anomalies([s.step for s in run.steps], sums, layouts)
        anomalies = [_anomaly(run, f, opened) for f in findings]
    value_names = list(dict.fromkeys(name for row in values_rows for name in row))
    return DriftReport(
        location=str(run.location),
        convention=run.convention,
        steps=[s.step for s in run.steps],
        series={name: tensor_series(name, ss) for name, ss in sums.items()},
        groups=_groups(sums),
        values={name: [row.get(name) for row in values_rows] for name in value_names},
        anomalies=anomalies,
        skipped=list(run.skipped),
        notes=notes,
        cached_steps=len(cached),
        read_bytes=reporter.done_bytes,
    )


def _anomaly(run: Run, f: Finding, opened: list[dict[str, tuple[Checkpoint, Entry]]]) -> Anomaly:
    chunk = None
    if f.at is not None and f.entry in opened[f.i]:
        ckpt, entry = opened[f.i][f.entry]
        chunk = _chunk(ckpt, entry, f.at)
    step = run.steps[f.i].step
    detail = f.detail if chunk is None else f"{f.detail}; at {chunk}"
    return Anomaly(step, f.entry, f.kind, detail, chunk)
