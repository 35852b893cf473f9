"""Whether one checkpoint is whole, without a reference to compare it with.

:func:`check` asks every entry in turn what the readers would refuse when it is read
(:func:`~...checkpoints.stored.check_entry`: its files exist and lie inside the checkpoint, its
records parse, its zstd frames decode, its chunks tile it) and collects each refusal as a
:class:`Finding` instead of stopping at the first. A DCP's data files are also checked to hold
nothing but their items: a gap or a tail no entry names is what a partial or a concatenated write
leaves. ``values=True`` reads every tensor once more (:func:`~..explore.stats.tensor_stats`,
bounded memory) for NaN and Inf counts and all-zero tensors. :func:`check_path` opens the
checkpoint itself, so a refusal at open (a safetensors shard missing) is a finding too, shard by
shard.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...checkpoints.dcp.checkpoint import DCPCheckpoint
from ...checkpoints.model import relative
from ...checkpoints.opening import Checkpoint, open_checkpoint
from ...checkpoints.stored import check_entry, data_file_size, listed_chunks, stored_ranges
from ...errors import CancelledError, DCPStudioError, LimitError
from ...formats.detect import detect_format
from ...formats.safetensors import read_safetensors_header, safetensors_files
from ...io.remote.locations import as_location
from ...progress import CancelToken, ProgressCallback, Reporter
from ...units import plural
from .counts import release_buffers, value_counts

__all__ = ["CheckReport", "Finding", "ValueCounts", "check", "check_path"]


@dataclass(frozen=True)
class Finding:
    """One thing wrong: the file it is in (relative to the checkpoint; empty when it is the
    checkpoint as a whole), the entry it concerns (empty when none) and what is wrong, one line."""

    file: str
    entry: str
    what: str

    def line(self) -> str:
        where = ": ".join(p for p in (self.file, repr(self.entry) if self.entry else "") if p)
        return f"{where}: {self.what}" if where else self.what


@dataclass(frozen=True)
class ValueCounts:
    """What ``--values`` counts in one tensor."""

    fqn: str
    count: int
    nan: int
    inf: int
    zeros: int

    @property
    def all_zero(self) -> bool:
        return self.count > 0 and self.zeros == self.count

    def json(self) -> dict[str, Any]:
        return {"name": self.fqn, "count": self.count, "nan": self.nan, "inf": self.inf, "zeros": self.zeros,
                "all_zero": self.all_zero}  # fmt: skip


@dataclass
class CheckReport:
    """Findings of one check; ``whole`` when there are none. ``values``: per-tensor counts (with
    ``--values``); an all-zero tensor is listed there and in the summary, not as a finding (a
    freshly initialised bias is all zeros)."""

    path: str
    format: str
    entries: int = 0
    files: int = 0
    findings: list[Finding] = field(default_factory=list)
    values: list[ValueCounts] | None = None

    @property
    def whole(self) -> bool:
        return not self.findings

    def all_zero(self) -> list[str]:
        return [v.fqn for v in self.values or () if v.all_zero]

    def summary(self) -> str:
        what = f"{self.path} ({self.format}, {plural(self.entries, 'entry')}, {plural(self.files, 'file')})"
        zeros = self.all_zero()
        tail = f"; {plural(len(zeros), 'all-zero tensor')}" if zeros else ""
        if self.whole:
            checked = " and values" if self.values is not None else ""
            return f"whole: {what}: every file and record{checked} checked{tail}"
        return f"damaged: {what}: {plural(len(self.findings), 'finding')}{tail}"

    def text(self) -> str:
        return "\n".join([self.summary(), *(f"  {f.line()}" for f in self.findings)])

    def json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "whole": self.whole,
            "entries": self.entries,
            "files": self.files,
            "findings": [{"file": f.file, "entry": f.entry, "what": f.what} for f in self.findings],
            "values": None if self.values is None else [v.json() for v in self.values],
        }


def _what(e: BaseException, *names: str) -> str:
    """The refusal's message without what the finding already says (the file's path)."""
    text = str(e).split("\n")[0]
    for name in names:
        if name and text.startswith(name):
            text = text[len(name) :].lstrip(" :")
    return text


def _file_of(ckpt: Checkpoint, fqn: str) -> str:
    try:
        files = {c.file for c in ckpt.chunks(fqn) if c.file}
    except Exception:  # a refused chunk table: the files it lists, as listed
        files = {c[2] for c in listed_chunks(ckpt, fqn)} if isinstance(ckpt, DCPCheckpoint) else set()
    return ", ".join(sorted(files))


def _repeated(ckpt: Checkpoint, fqn: str) -> str:
    """What a chunk table that lists one region more than once means, or empty: a tensor saved
    by several ranks without deduplication (torch's planner keeps one rank's copy of a
    replicated tensor), whose copies torch's ``dcp.load`` does not compare -- it reads the one
    record the ``.metadata`` keeps for that region."""
    if not isinstance(ckpt, DCPCheckpoint):
        return ""
    seen: dict[tuple[Any, Any], list[str]] = {}
    for offsets, sizes, file, offset, _ in listed_chunks(ckpt, fqn):
        seen.setdefault((offsets, sizes), []).append(f"{file}@{offset}")
    twice = {box: where for box, where in seen.items() if len(where) > 1}
    if not twice:
        return ""
    (offsets, sizes), where = next(iter(twice.items()))
    more = f" (and {len(twice) - 1} more regions)" if len(twice) > 1 else ""
    return (
        f"the region at {list(offsets)} of size {list(sizes)} is listed {len(where)} times{more}: a tensor "
        f"saved by several ranks without deduplication; dcp.load reads only the copy at {sorted(set(where))[-1]}, "
        "any other rank's copy is left unread (a diverged replica goes unnoticed)"
    )


def _check_layout(ckpt: DCPCheckpoint, report: CheckReport) -> None:
    """A DCP data file holds its items one after another: no gap, no overlap, no tail."""
    ranges = stored_ranges(ckpt)
    report.files = len(ranges)
    for name, items in sorted(ranges.items()):
        try:
            size = data_file_size(ckpt, name)
        except LimitError:
            raise
        except DCPStudioError:
            continue  # named by every entry stored in it
        at = 0
        for (offset, length), fqn in sorted(items.items()):
            if offset > at:
                stray = _stray_copy(ckpt, name, at, offset)
                report.findings.append(Finding(name, stray[0], f"bytes {at}-{offset} are named by no entry{stray[1]}"))
            elif offset < at:
                report.findings.append(Finding(name, fqn, f"bytes {offset}-{at} are also another item's"))
            at = max(at, offset + length)
        if size > at:
            report.findings.append(Finding(name, "", f"an unexplained tail: bytes {at}-{size} are named by no entry"))


def _stray_copy(ckpt: DCPCheckpoint, name: str, start: int, end: int) -> tuple[str, str]:
    """Whether unnamed bytes are a tensor chunk's archive holding a region some entry lists more
    than once (another rank's copy, which dcp.load never reads): that entry, and whether its
    values equal the copy read; else ``("", "")``."""
    from ...formats.dcp.files import open_chunk

    f = ckpt._files.get(name)
    label = f"{ckpt.path / name}"
    try:
        stray = open_chunk(f, start, end - start, label)
        raw = stray.raw_offset()
    except Exception:
        return "", ""
    t = stray.tensor
    if raw is None or raw + t.nbytes > end:
        return "", ""
    for fqn, entry in ckpt.entries.items():
        if entry.kind != "tensor" or entry.dtype is not t.dtype:
            continue
        listed = listed_chunks(ckpt, fqn)
        boxes = [(o, s) for o, s, *_ in listed]
        for o, s, file, offset, length in listed:
            if boxes.count((o, s)) < 2 or tuple(s) != tuple(t.shape):
                continue
            try:
                kept = open_chunk(ckpt._files.get(file), offset, length, f"{ckpt.path / file}", fqn)
                kept_raw = kept.raw_offset()
                same = kept_raw is not None and _same_range(f, raw, ckpt._files.get(file), kept_raw, t.nbytes)
            except Exception:
                return fqn, f": another copy of {fqn!r} at {list(o)}"
            how = "the same values as" if same else "different values from"
            return fqn, f": another copy of {fqn!r} at {list(o)}, with {how} the copy dcp.load reads ({file})"
    return "", ""


def _same_range(fa: Any, a: int, fb: Any, b: int, n: int) -> bool:
    from ...io.raw import read_exact

    step = 16 << 20
    for at in range(0, n, step):
        k = min(step, n - at)
        x, y = bytearray(k), bytearray(k)
        read_exact(fa, a + at, memoryview(x), "stray copy")
        read_exact(fb, b + at, memoryview(y), "kept copy")
        if x != y:
            return False
    return True


def check(
    ckpt: Checkpoint,
    *,
    values: bool = False,
    progress: ProgressCallback | None = None,
    cancel: CancelToken | None = None,
) -> CheckReport:
    """Check an open checkpoint entry by entry (see the module's docstring)."""
    report = CheckReport(str(ckpt.path), ckpt.format, len(ckpt.entries))
    total = ckpt.tensor_bytes if values else 0
    reporter = Reporter(progress, cancel, total_bytes=total, total_items=len(ckpt.entries))
    counts: list[ValueCounts] = []
    for fqn, entry in ckpt.entries.items():
        reporter.check()
        try:
            check_entry(ckpt, fqn)
            if values and entry.kind == "tensor":
                c = _counts(ckpt, fqn, cancel)
                counts.append(c)
                bad = [f"{n} {what}" for n, what in ((c.nan, "NaN"), (c.inf, "Inf")) if n]
                if bad:
                    report.findings.append(Finding(_file_of(ckpt, fqn), fqn, " and ".join(bad) + " values"))
        except (CancelledError, LimitError):
            raise
        except (DCPStudioError, ValueError, OSError) as e:
            file = _file_of(ckpt, fqn)
            at = str(ckpt.path / file) if file else str(ckpt.path)
            what = _what(e, f"{at} ({fqn!r})", at, f"{ckpt.path} ({fqn!r})", str(ckpt.path))
            repeated = _repeated(ckpt, fqn) if "overlap" in what else ""
            report.findings.append(Finding(file, fqn, f"{what}; {repeated}" if repeated else what))
        reporter.advance(entry.nbytes if values and entry.kind == "tensor" else 0, current=fqn)
    release_buffers()
    if isinstance(ckpt, DCPCheckpoint):
        _check_layout(ckpt, report)
    else:
        report.files = len({c.file for fqn in ckpt.entries for c in _chunks(ckpt, fqn) if c.file})
    report.values = counts if values else None
    return report


def _counts(ckpt: Checkpoint, fqn: str, cancel: CancelToken | None) -> ValueCounts:
    """Counted from the bytes in place without torch when it can be, else through torch's stats."""
    fast = value_counts(ckpt, fqn, cancel=cancel)
    if fast is not None:
        return ValueCounts(fqn, fast.count, fast.nan, fast.inf, fast.zeros)
    from ..explore.stats import tensor_stats  # here: torch's path, for what the bytes in place cannot answer

    s = tensor_stats(ckpt, fqn, bins=0, cancel=cancel)
    return ValueCounts(fqn, s.count, s.nan, s.posinf + s.neginf, s.zeros)


def _chunks(ckpt: Checkpoint, fqn: str) -> list[Any]:
    try:
        return ckpt.chunks(fqn) if ckpt.entries[fqn].kind == "tensor" else []
    except Exception:
        return []


def _safetensors_shards(path: Any, report: CheckReport) -> None:
    """Each shard of a safetensors checkpoint read alone, so every bad one is named (opening stops
    at the first), with the tensors the index maps to it."""
    try:
        files, info = safetensors_files(path)
    except DCPStudioError as e:
        report.findings.append(Finding("", "", _what(e, str(path))))
        return
    report.files = len(files)
    owners: dict[str, list[str]] = {}
    for name, file in (info.get("weight_map") or {}).items():
        owners.setdefault(str(file), []).append(str(name))
    for f in files:
        name = relative(f, path)
        tensors = owners.get(name, [])
        entry = tensors[0] + (f" (and {len(tensors) - 1} more)" if len(tensors) > 1 else "") if tensors else ""
        if not f.is_file():
            report.findings.append(Finding(name, entry, "listed in the index but missing"))
            continue
        try:
            read_safetensors_header(f)
        except DCPStudioError as e:
            report.findings.append(Finding(name, entry, _what(e, str(f))))


def check_path(
    path: str | os.PathLike[str],
    *,
    values: bool = False,
    trust_pickle: bool = False,
    progress: ProgressCallback | None = None,
    cancel: CancelToken | None = None,
) -> CheckReport:
    """Open ``path`` and :func:`check` it; what opening refuses is a finding (the location's
    format is detected once; an unknown format is refused as every command refuses it). A local
    checkpoint's manifest is checked on a thread of its own meanwhile (its files re-hashed: SHA-256
    releases the GIL), so the hashing and the entries' checks -- with ``values``, a read of every
    tensor -- take the two cores."""
    p = as_location(path)
    fmt = detect_format(p)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcpstudio-manifest")
    try:
        pending = pool.submit(_manifest_check, p) if isinstance(p, Path) else None
        report = _check_path(p, fmt, values=values, trust_pickle=trust_pickle, progress=progress, cancel=cancel)
        found = pending.result() if pending is not None else []
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)  # a cancelled check does not wait for the hashing
        raise
    pool.shutdown()
    named = {f.file for f in report.findings}
    report.findings.extend(f for f in found if not f.file or f.file not in named)
    return report


def _manifest_check(p: Path) -> list[Finding]:
    """What the checkpoint's manifest finds (none without one; an unreadable one is a finding)."""
    from .manifests import manifest_findings, read_manifest

    try:
        manifest = read_manifest(p)
    except DCPStudioError as e:
        return [Finding("", "", _what(e))]
    if manifest is None:
        return []
    return [Finding(f, "", what) for f, what in manifest_findings(p, manifest)]


def _check_path(
    p: Any, fmt: Any, *, values: bool, trust_pickle: bool, progress: ProgressCallback | None, cancel: CancelToken | None
) -> CheckReport:
    if fmt == "safetensors":
        report = CheckReport(str(p), fmt)
        _safetensors_shards(p, report)
        if not report.whole:
            return report
    try:
        ckpt = open_checkpoint(p, trust_pickle=trust_pickle, fmt=fmt)
    except (CancelledError, LimitError):
        raise
    except DCPStudioError as e:
        return CheckReport(str(p), fmt, findings=[Finding("", "", _what(e))])
    with ckpt:
        return check(ckpt, values=values, progress=progress, cancel=cancel)
