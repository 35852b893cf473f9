"""How a distributed upload cuts the output into S3 parts and builds each part's bytes (see
:mod:`.upload`): the same plan on every rank, split between the ranks by bytes at part granularity.

Every part but the last of an object is at least :data:`MIN_PART` bytes (S3's minimum), so the cut
between two ranks falls on a part boundary: parts are made small enough for each rank to get about
:data:`PARTS_PER_RANK` of them (at most :data:`MAX_PART`, unless an object needs larger ones to stay
within :data:`MAX_PARTS`). A part's bytes are the layout's bytes outside the holes (headers, pickles,
ZIP directories) with the tensor ranges it holds computed from the source; a range may cut an
element (parts are cut by bytes), so it is computed on element boundaries and sliced. The parts
holding bytes that depend on the CRC-32s of the tensors (a ZIP record's local header, its directory)
are found by laying the output out with a distinct CRC per tensor and comparing (:func:`crc_fields`):
each field found, and the tensor whose CRC-32 it holds, so a rank that computed all of a tensor
fills its fields in itself (:func:`patch`) and uploads the part at once.
"""

from __future__ import annotations

import bisect
import os
import shutil
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import DCPStudioError
from ..io.raw import FileRange
from ..ops.convert.layout import GRAIN, Layout, Recorder, hole_ranges, lay_out, outside
from ..ops.convert.pieces import _read, _Source
from ..ops.convert.replay import Replay

__all__ = [
    "MAX_PART",
    "MAX_PARTS",
    "MIN_PART",
    "PARTS_PER_RANK",
    "Fields",
    "Part",
    "PartBuilder",
    "Segments",
    "crc_fields",
    "laid_out",
    "patch",
    "plan_parts",
    "segments_of",
    "uploaded",
]

MIN_PART = 5 << 20  # S3: every part of a multipart upload but the last is at least this large
MAX_PART = 64 << 20  # parts are at most this large (memory: about three per rank) ...
MAX_PARTS = 10_000  # ... unless an object needs larger ones to stay within S3's count of parts
PARTS_PER_RANK = 16  # parts small enough for each rank to get about this many: shares within 1/16 of the mean
Segments = dict[str, list[tuple[int, bytes]]]  # per file: (offset, bytes) outside the holes, in order


@dataclass(frozen=True)
class Part:
    """Bytes ``[start, end)`` of the output file ``file``: part ``number`` (from 1) of its upload,
    built and uploaded by ``rank``."""

    file: str
    number: int
    start: int
    end: int
    rank: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def _part_size(layout: Layout, files: list[str], world: int) -> int:
    total = sum(layout.files[f] for f in files)
    size = min(MAX_PART, max(MIN_PART, -(-total // (world * PARTS_PER_RANK))))
    largest = max((layout.files[f] for f in files), default=0)
    size = max(size, -(-largest // MAX_PARTS))
    return -(-size // (1 << 20)) << 20  # whole MiB


def plan_parts(layout: Layout, world: int) -> list[Part]:
    """Every uploaded object's parts, the same on every rank: the files holding tensor bytes, each
    cut into parts of one size (the last shorter), and the parts, in order over the files, split
    between the ranks in contiguous runs of about equal bytes (each part to the rank whose share
    holds its middle byte)."""
    files = uploaded(layout)
    size = _part_size(layout, files, world)
    cuts = [
        (f, k + 1, a, min(layout.files[f], a + size))
        for f in files
        for k, a in enumerate(range(0, layout.files[f], size))
    ]
    total = sum(b - a for _, _, a, b in cuts)
    parts, before = [], 0
    for f, number, a, b in cuts:
        middle = before + (b - a) // 2
        parts.append(Part(f, number, a, b, min(world - 1, middle * world // max(1, total))))
        before += b - a
    return parts


def uploaded(layout: Layout) -> list[str]:
    """The files uploaded in parts: those holding tensor bytes (the others are small, written whole)."""
    return sorted({h[0] for h in layout.holes if h[2]} & {f for f, n in layout.files.items() if n})


def segments_of(layout: Layout, root: Path) -> Segments:
    """What the writer wrote at ``root`` outside the holes: per file, ``(offset, bytes)`` in order."""
    gaps = hole_ranges(layout)
    out: Segments = {}
    for name, size in layout.files.items():
        keep = outside(gaps.get(name, []), size)
        with open(root / name if name else root, "rb") as f:
            out[name] = [(a, os.pread(f.fileno(), b - a, a)) for a, b in keep]
        if any(len(data) != b - a for (a, b), (_, data) in zip(keep, out[name], strict=True)):
            raise DCPStudioError(f"internal error: {name or 'the output'} laid out short")
    return out


def laid_out(
    recorder: Recorder, scratch: str | None, crcs: list[int] | None = None, replay: Replay | None = None
) -> tuple[Layout, Segments]:
    """The output laid out in a folder under ``scratch`` (removed at once) and the bytes it holds
    outside the holes; ``crcs``, ``replay``: as for :func:`~..ops.convert.layout.lay_out`."""
    folder = Path(tempfile.mkdtemp(prefix="dcpstudio-layout-", dir=scratch))
    try:
        at = folder / recorder.args[0].name  # the name: a torch.save archive holds it
        layout = lay_out(recorder, at, crcs, replay)
        return layout, segments_of(layout, at)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _probe(h: int) -> int:
    """The CRC-32 hole ``h`` is laid out with to find its fields: no byte zero (each one changes
    from the first layout's 0), and ``h`` read back from it (:func:`_probed`)."""
    value = 0
    for k in range(4):
        value |= (h % 255 + 1) << (8 * k)
        h //= 255
    return value


def _probed(field: bytes) -> int | None:
    """The hole whose probe a 4-byte CRC field holds (little-endian, as ZIP stores it), if any."""
    if len(field) != 4 or 0 in field:
        return None
    return sum((b - 1) * 255**k for k, b in enumerate(field))


Fields = dict[int, list[tuple[int, int | None]]]
"""Per part (its index): the CRC-32 fields in it -- ``(offset in its file, hole)``; ``None``: bytes
that change with the CRCs but are not a field the parts can fill in themselves."""


def crc_fields(layout: Layout, parts: list[Part], first: Segments, recorder: Recorder, scratch: str | None) -> Fields:
    """The CRC-32 fields in each part (parts without any are left out): the output laid out again
    with a distinct CRC per hole, and the bytes outside the holes compared with the first layout's
    (a field that straddles two parts is in both)."""
    if not layout.crc:
        return {}
    if len(layout.holes) >= 255**4:
        raise DCPStudioError(f"{len(layout.holes)} tensors: more than a distributed upload can tell apart")
    import numpy as np

    _, probe = laid_out(recorder, scratch, [_probe(h) for h in range(len(layout.holes))])
    starts: dict[str, list[int]] = {}
    indices: dict[str, list[int]] = {}
    for i, p in enumerate(parts):
        starts.setdefault(p.file, []).append(p.start)
        indices.setdefault(p.file, []).append(i)
    out: Fields = {}
    for name, segs in first.items():
        if name not in starts:
            continue
        for (a, one), (_, two) in zip(segs, probe[name], strict=True):
            if one == two:
                continue
            changed = np.flatnonzero(np.frombuffer(one, np.uint8) != np.frombuffer(two, np.uint8))
            runs = np.split(changed, np.flatnonzero(np.diff(changed) != 1) + 1)
            for run in runs:
                at, n = int(run[0]), len(run)
                fields: list[tuple[int, int | None]] = []
                for k in range(0, n - n % 4, 4):
                    h = _probed(two[at + k : at + k + 4])
                    known = h is not None and h < len(layout.holes) and one[at + k : at + k + 4] == bytes(4)
                    fields.append((a + at + k, h if known else None))
                if n % 4:
                    fields.append((a + at + n - n % 4, None))
                for offset, h in fields:
                    lo = np.searchsorted(starts[name], offset, side="right") - 1
                    hi = np.searchsorted(starts[name], offset + 3, side="right") - 1
                    for k in range(int(lo), int(hi) + 1):
                        out.setdefault(indices[name][k], []).append((offset, h))
    return out


def patch(part: Part, data: bytearray, fields: list[tuple[int, int | None]], crcs: dict[int, int]) -> None:
    """Write the CRC-32s ``crcs`` (by hole) into the part's bytes ``data``, at its ``fields``."""
    for offset, h in fields:
        assert h is not None
        value = crcs[h].to_bytes(4, "little")
        for k in range(4):
            if part.start <= offset + k < part.end:
                data[offset + k - part.start] = value[k]


class PartBuilder:
    """A part's bytes: the layout's outside the holes, the tensors' ranges computed from the source."""

    def __init__(self, layout: Layout, segments: Segments) -> None:
        self.layout = layout
        self.segments = segments
        self.source = _Source()
        self.holes: dict[str, list[tuple[int, int, int]]] = {}  # file -> (offset, end, hole) in order
        for h, (name, offset, n, _) in enumerate(layout.holes):
            if n:
                self.holes.setdefault(name, []).append((offset, offset + n, h))
        for spans in self.holes.values():
            spans.sort()
        self._hole_starts = {name: [s[0] for s in spans] for name, spans in self.holes.items()}
        self._starts: dict[tuple[int, str], list[int]] = {}  # (id of the segments, file) -> their offsets

    def overlay(self, part: Part, view: memoryview, segments: Segments) -> None:
        """Copy ``segments``' bytes that lie in ``part`` into its bytes ``view``."""
        segs = segments.get(part.file, [])
        if (id(segments), part.file) not in self._starts:
            self._starts[id(segments), part.file] = [a for a, _ in segs]
        k = max(0, bisect.bisect_right(self._starts[id(segments), part.file], part.start) - 1)
        for a, data in segs[k:]:
            if a >= part.end:
                break
            lo, hi = max(a, part.start), min(a + len(data), part.end)
            if lo < hi:
                view[lo - part.start : hi - part.start] = data[lo - a : hi - a]

    def build(self, part: Part, check: Callable[[], None]) -> tuple[bytearray, list[tuple[int, int, int]]]:
        """The part's bytes, and ``(hole, start, crc)`` for each tensor range in it."""
        buf = bytearray(part.nbytes)
        view = memoryview(buf)
        self.overlay(part, view, self.segments)
        crcs = []
        spans = self.holes.get(part.file, [])
        k = max(0, bisect.bisect_right(self._hole_starts.get(part.file, []), part.start) - 1)
        for offset, end, h in spans[k:]:
            if offset >= part.end:
                break
            lo, hi = max(offset, part.start), min(end, part.end)
            if lo >= hi:
                continue
            crc = 0
            for s in range(lo - offset, hi - offset, GRAIN):
                check()
                e = min(hi - offset, s + GRAIN)
                data = self._range(h, s, e)
                view[offset + s - part.start : offset + e - part.start] = data
                if self.layout.crc:
                    crc = zlib.crc32(data, crc)
            crcs.append((h, lo - offset, crc))
        return buf, crcs

    def _range(self, h: int, s: int, e: int) -> memoryview:
        """Bytes ``[s, e)`` of tensor ``h`` (computed on element boundaries: a part may cut an element)."""
        t, unit = self.layout.sources[h], self.layout.holes[h][3]
        a, b = s // unit * unit, min(self.layout.holes[h][2], -(-e // unit) * unit)
        data = self.source.bytes(t, a, b)
        if isinstance(data, FileRange):
            data = _read(data)
        if data.nbytes != b - a:
            raise DCPStudioError(f"tensor {h}: {data.nbytes} bytes computed, {b - a} expected")
        return data[s - a : e - a]
