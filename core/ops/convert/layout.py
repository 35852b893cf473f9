"""A conversion's output laid out before a byte of tensor data is written, and split by bytes.

:func:`~.convert.convert` plans an output and hands it to its :class:`~.output.Writers`; a
:class:`Recorder` keeps that call instead. :func:`lay_out` then runs the very writer the
single-process conversion runs, with every tensor's bytes left as a :class:`~...io.raw.Hole`: the
files it makes hold the headers, pickles, ZIP directories, ``.metadata`` and index exactly as the
single-process output does, and each hole records where its bytes go. Tensor bytes are only
skipped (sparse files), so laying out costs the headers. Every rank of a distributed conversion lays
the output out the same way and gets the same holes (:meth:`Layout.digest` checks it);
:func:`split_by_bytes` gives each rank a contiguous run of the holes' bytes -- a tensor larger than a
share is cut at element boundaries -- and :func:`~.pieces.write_pieces` writes a rank's runs with
positioned writes, computing them from the source range by range (a cast reads exactly the source
elements it needs). A ZIP record needs the CRC-32 of its whole: each piece's CRC is returned, and
:func:`combine_crcs` joins them; laid out again with them, the headers are final (:func:`overlay`).
A manifest is laid out the same way: the writer's read-back is a :class:`~.replay.Replay`, which
records what it would read (:attr:`Layout.tensors`, :attr:`Layout.spans`) and, given the digests
the ranks computed from the output, returns them as its records.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from ...errors import CorruptCheckpointError
from ...io.crc import crc32_combine
from ...io.direct import pwrite_all
from ...io.raw import Hole
from ...pickles.refs import TensorRef
from .output import Target, Writers, write_dcp_output, write_safetensors_output, write_torch_save_output
from .replay import Replay

__all__ = [
    "Layout",
    "Piece",
    "Recorder",
    "combine_crcs",
    "hole_ranges",
    "lay_out",
    "outside",
    "overlay",
    "split_by_bytes",
]

GRAIN = 16 << 20  # a large tensor is cut at multiples of this within it (and blocks are this large)
_WRITERS: dict[str, Callable[..., None]] = {
    "torch": write_torch_save_output,
    "dcp": write_dcp_output,
    "safetensors": write_safetensors_output,
}


@dataclass
class Recorder:
    """:class:`~.output.Writers` that write nothing: the call convert() makes is kept."""

    kind: Target | None = None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def writers(self) -> Writers:
        return Writers(
            torch_save=partial(self._record, "torch"),
            dcp=partial(self._record, "dcp"),
            safetensors=partial(self._record, "safetensors"),
        )

    def _record(self, kind: Target, *args: Any, **kwargs: Any) -> None:
        self.kind, self.args, self.kwargs = kind, args, kwargs

    @property
    def dst(self) -> Path:
        return Path(self.args[0])

    @property
    def overwrite(self) -> bool:
        return bool(self.args[1])


@dataclass(frozen=True)
class Layout:
    """An output's files (relative names, ``""`` for a single-file output; their sizes) and its
    holes in the order the writer met them: ``(file, offset, nbytes, element size)``, with the
    tensor each one holds. ``crc``: its records need CRC-32s (ZIP: torch.save, DCP)."""

    single: bool
    files: dict[str, int]
    holes: list[tuple[str, int, int, int]]
    sources: list[TensorRef]
    crc: bool
    tensors: list[tuple[str, int, int, str]] = field(default_factory=list)  # the manifest's: (file, at, n, dtype)
    spans: list[tuple[str, int, int]] = field(default_factory=list)  # the manifest's hashed (file, start, end)

    def digest(self, sizes: bool = True) -> str:
        """What the ranks compare; without ``sizes``, what a manifest's length cannot change."""
        files = sorted(self.files.items()) if sizes else sorted(self.files)
        text = json.dumps([self.single, files, self.holes, self.crc, self.tensors, self.spans])
        return hashlib.sha256(text.encode()).hexdigest()

    @property
    def total(self) -> int:
        return sum(h[2] for h in self.holes)


def lay_out(recorder: Recorder, at: Path, crcs: Sequence[int] | None = None, replay: Replay | None = None) -> Layout:
    """Run the recorded writer at the new path ``at`` with every tensor left as a hole (CRC-32s
    from ``crcs``, in hole order, when given; 0 until then) and ``replay`` reading the output back
    for its manifest (its digests when given; placeholders of the same length until then). ``at``
    should end in the destination's name: a single file's manifest names it."""
    assert recorder.kind is not None, "convert() made no output"
    holes: list[Hole] = []
    sources: list[TensorRef] = []

    def hook(t: TensorRef) -> Hole:
        hole = Hole(t.nbytes, crcs[len(holes)] if crcs is not None else None)
        holes.append(hole)
        sources.append(t)
        return hole

    replay = replay if replay is not None else Replay()
    _WRITERS[recorder.kind](*recorder.args, **recorder.kwargs, payload=hook, at=at, reader=replay.reader)
    single = at.is_file()

    def rel(name: str) -> str:
        return "" if single else Path(name).relative_to(at).as_posix()

    files = (
        {"": at.stat().st_size}
        if single
        else {p.relative_to(at).as_posix(): p.stat().st_size for p in sorted(at.rglob("*")) if p.is_file()}
    )
    placed = []
    for hole, t in zip(holes, sources, strict=True):
        ((name, offset),) = hole.placed
        files[rel(name)] = max(files[rel(name)], offset + hole.nbytes)  # a hole at a file's end leaves it short
        placed.append((rel(name), offset, hole.nbytes, max(1, t.dtype.itemsize)))
    return Layout(
        single,
        files,
        placed,
        sources,
        crc=recorder.kind != "safetensors",
        tensors=[(rel(name), a, n, d) for name, a, n, d in replay.tensors],
        spans=[(rel(name), a, b) for name, a, b in replay.spans],
    )


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, end)`` of hole ``hole``."""

    hole: int
    start: int
    end: int


def split_by_bytes(layout: Layout, world: int) -> list[list[Piece]]:
    """Each rank's pieces: the holes' bytes, concatenated in order, cut into ``world`` runs of
    about equal size. A cut inside a tensor falls on an element boundary -- on a multiple of
    :data:`GRAIN` bytes into it when the tensor is large -- so a share is within a grain of the mean."""
    sizes = [h[2] for h in layout.holes]
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    total = starts[-1]
    cuts = [0]
    i = 0
    for k in range(1, world):
        b = total * k // world
        while i < len(sizes) and starts[i + 1] <= b:
            i += 1
        if i == len(sizes):
            cuts.append(total)
            continue
        n, unit = sizes[i], layout.holes[i][3]
        align = GRAIN if n >= 4 * GRAIN else unit
        within = min(n, (b - starts[i] + align // 2) // align * align)
        cuts.append(max(cuts[-1], starts[i] + within))
    cuts.append(total)
    shares: list[list[Piece]] = []
    for r in range(world):
        lo, hi = cuts[r], cuts[r + 1]
        pieces = []
        for h, n in enumerate(sizes):
            a, b = max(lo, starts[h]), min(hi, starts[h] + n)
            if a < b:
                pieces.append(Piece(h, a - starts[h], b - starts[h]))
        shares.append(pieces)
    return shares


def combine_crcs(layout: Layout, pieces: Sequence[tuple[int, int, int]]) -> list[int]:
    """Each hole's CRC-32 from its pieces' (from every rank: ``(hole, start, crc)``)."""
    by_hole: dict[int, list[tuple[int, int]]] = {}
    for hole, start, crc in pieces:
        by_hole.setdefault(hole, []).append((start, crc))
    crcs = []
    for h, (_, _, n, _) in enumerate(layout.holes):
        parts = sorted(by_hole.get(h, []))
        whole = 0
        for k, (start, crc) in enumerate(parts):
            end = parts[k + 1][0] if k + 1 < len(parts) else n
            whole = crc32_combine(whole, crc, end - start) if k else crc
        if not parts and n:
            raise ValueError(f"no rank wrote tensor {h}")
        crcs.append(whole)
    return crcs


def create_files(layout: Layout, root: Path) -> None:
    """The output's files at ``root`` (a file, or a folder of them), each at its final size."""
    if not layout.single:
        root.mkdir()
    for name, size in layout.files.items():
        path = root / name if name else root
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "xb") as f:
            f.truncate(size)


def hole_ranges(layout: Layout) -> dict[str, list[tuple[int, int]]]:
    """Per file, the byte ranges ``(start, end)`` of its holes (the tensor bytes the ranks write)."""
    gaps: dict[str, list[tuple[int, int]]] = {}
    for name, offset, n, _ in layout.holes:
        gaps.setdefault(name, []).append((offset, offset + n))
    return gaps


def outside(ranges: Sequence[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The ranges of ``[0, size)`` that none of ``ranges`` (in any order, overlapping or not) covers."""
    keep, pos = [], 0
    for a, b in sorted(ranges):
        if a > pos:
            keep.append((pos, a))
        pos = max(pos, b)
    if pos < size:
        keep.append((pos, size))
    return keep


def overlay(layout: Layout, laid: Path, root: Path, kept: Sequence[tuple[str, int, int]] = ()) -> None:
    """Copy what the writer wrote at ``laid`` (everything but the holes and the ``kept`` spans
    ``(file, start, end)``: headers, pickles, directories, whole files such as ``.metadata`` --
    last) into the output at ``root``, and flush every file."""
    gaps = hole_ranges(layout)
    for name, start, end in kept:  # already hashed for the manifest: a second layout's random ids stay out
        gaps.setdefault(name, []).append((start, end))
    names = sorted(
        layout.files, key=lambda n: (n.rsplit("/", 1)[-1] in (".metadata", "model.safetensors.index.json"), n)
    )
    for name in names:
        size = layout.files[name]
        keep = outside(gaps.get(name, []), size)
        src = os.open(laid / name if name else laid, os.O_RDONLY)
        dst = os.open(root / name if name else root, os.O_WRONLY | os.O_CREAT, 0o666)  # a manifest may be new
        try:
            if os.fstat(dst).st_size != size:  # a manifest's length is known last
                os.ftruncate(dst, size)
            for a, b in keep:
                data = os.pread(src, b - a, a)
                if len(data) != b - a:
                    raise CorruptCheckpointError(f"{laid / name}: laid out short")
                pwrite_all(dst, memoryview(data), a)
            os.fsync(dst)
        finally:
            os.close(src)
            os.close(dst)
