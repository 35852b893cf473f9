"""A conversion's output laid out before a byte of tensor data is written, and split by bytes.

:func:`~.convert.convert` plans an output and hands it to its :class:`~.output.Writers`; a
:class:`Recorder` keeps that call instead. :func:`lay_out` then runs the very writer the
single-process conversion runs, with every tensor's bytes left as a :class:`~...io.raw.Hole`: the
files it makes hold the headers, pickles, ZIP directories, ``.metadata`` and index exactly as the
single-process output does, and each hole records where its bytes go. Tensor bytes are only
skipped (sparse files), so laying out costs the headers. Every rank of a distributed conversion lays
the output out the same way and gets the same holes (:meth:`Layout.digest` checks it);
:func:`split_by_bytes` gives each rank a contiguous run of the holes' bytes -- a tensor larger than a
share is cut at element boundaries -- and :func:`write_pieces` writes a rank's runs with positioned
writes, computing them from the source range by range (a cast reads exactly the source elements it
needs). A ZIP record needs the CRC-32 of its whole: each piece's CRC is returned, and
:func:`combine_crcs` joins them; laid out again with them, the headers are final (:func:`overlay`).
A manifest is laid out the same way: the writer's read-back is a :class:`~.replay.Replay`, which
records what it would read (:attr:`Layout.tensors`, :attr:`Layout.spans`) and, given the digests
the ranks computed from the output, returns them as its records.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from ...errors import CorruptCheckpointError
from ...io.crc import crc32_combine
from ...io.direct import Block, DirectWriter
from ...io.pipeline import prefetch
from ...io.raw import FileRange, Hole, pread_into
from ...pickles.refs import TensorRef
from ...pickles.tensor_io import materialize, to_bytes
from .output import Target, Writers, write_dcp_output, write_safetensors_output, write_torch_save_output
from .computed import CastReader, castable, direct_writer
from .replay import Replay
from .transform import _Cast

__all__ = [
    "Layout",
    "Piece",
    "Recorder",
    "combine_crcs",
    "lay_out",
    "overlay",
    "split_by_bytes",
    "write_pieces",
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


class _Source:
    """A tensor's row-major bytes by range: in place in a file (a :class:`FileRange`), a cast of
    exactly the source elements the range needs, or -- for what is computed whole (a view that
    is not contiguous, a mapping's output, chunks to assemble) -- computed once and sliced."""

    def __init__(self) -> None:
        self._whole: tuple[int, Any, memoryview] | None = None  # (id, its owner kept alive, its bytes)

    def bytes(self, t: TensorRef, start: int, end: int) -> FileRange | memoryview:
        ref = t.storage
        if ref is None or ref.archive is None:
            raise CorruptCheckpointError("a tensor saved without data (meta device) has no values")
        if t.is_contiguous():
            s, e = t.byte_offset + start, t.byte_offset + end
            where = ref.archive.storage_range(ref)
            if where is not None:
                return FileRange(where.fd, where.offset + s, e - s, None, where.base)
            archive = ref.archive
            if isinstance(archive, _Cast):
                return self._cast(archive, t, s, e)
            return self._computed(ref, lambda: archive.storage_bytes(ref))[s:e]
        return self._computed(t, lambda: to_bytes(materialize(t)))[start:end]

    def _cast(self, cast: _Cast, t: TensorRef, s: int, e: int) -> memoryview:
        import torch

        src, out = cast.source, t.dtype.itemsize
        inner = src.dtype.itemsize
        data = self.bytes(src, s // out * inner, e // out * inner)
        if isinstance(data, FileRange):
            data = _read(data)
        if not data.nbytes:
            return memoryview(b"")
        values = torch.frombuffer(data, dtype=src.dtype.torch)
        return to_bytes(values.to(cast.to.torch))

    def _computed(self, key: Any, compute: Callable[[], memoryview]) -> memoryview:
        if self._whole is None or self._whole[0] != id(key):
            self._whole = None
            self._whole = (id(key), key, memoryview(compute()).cast("B"))
        return self._whole[2]


def _read(r: FileRange) -> memoryview:
    buf = bytearray(r.nbytes)
    view = memoryview(buf)
    if pread_into(r.fd, view, r.start()) < r.nbytes:
        raise CorruptCheckpointError("a source file ends early (truncated?)")
    return view


def _pwrite(fd: int, data: memoryview, offset: int) -> None:
    while data.nbytes:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _kernel_copy(r: FileRange, fd: int, offset: int) -> bool:
    """Copy ``r`` to ``offset`` of ``fd`` inside the kernel; False where that is not possible."""
    if not isinstance(r.fd, int) or not hasattr(os, "copy_file_range"):
        return False
    src, left = r.start(), r.nbytes
    while left:
        try:
            n = os.copy_file_range(r.fd, fd, left, src, offset)
        except OSError as e:
            if e.errno in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF) and src == r.start():
                return False
            raise
        if n == 0:
            raise CorruptCheckpointError("a source file ends early (truncated?)")
        src, offset, left = src + n, offset + n, left - n
    return True


def write_pieces(
    layout: Layout,
    pieces: Sequence[Piece],
    root: Path,
    advance: Callable[[int], None],
    check: Callable[[], None] = lambda: None,
) -> list[tuple[int, int, int]]:
    """Write ``pieces`` into the pre-sized files under ``root`` (positioned writes; bytes in place
    copied in the kernel when no CRC is needed), each file flushed to stable storage; returns
    ``(hole, start, crc)`` per piece (crc 0 when the layout needs none). ``advance(n)`` after each
    block; ``check()`` may raise to stop."""
    source = _Source()
    casts = CastReader()
    fds: dict[str, int] = {}
    direct: dict[str, DirectWriter] = {}
    out: list[tuple[int, int, int]] = []
    for p in pieces:  # opened here: the blocks are made on another thread
        name = layout.holes[p.hole][0]
        if name not in fds:
            path = root / name if name else root
            fds[name] = os.open(path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
            if any(castable(layout.sources[q.hole]) and layout.holes[q.hole][0] == name for q in pieces):
                direct[name] = direct_writer(path, fds[name])

    def blocks() -> Iterator[tuple[Piece, int, int]]:
        for p in pieces:
            for s in range(p.start, p.end, GRAIN):
                yield p, s, min(p.end, s + GRAIN)

    def produce(block: tuple[Piece, int, int]) -> FileRange | memoryview | Block:
        check()
        p, s, e = block
        t = layout.sources[p.hole]
        name, offset = layout.holes[p.hole][0], layout.holes[p.hole][1]
        if name in direct and castable(t):  # computed into the block that is written
            made = direct[name].block(offset + s, e - s)
            casts.fill(t, s, e, made.view)
            return made
        data = source.bytes(t, s, e)
        if isinstance(data, FileRange) and (layout.crc or not isinstance(data.fd, int)):
            data = _read(data)
        return data

    try:
        crc = 0
        for (p, s, e), data in prefetch(produce, blocks()):
            name, offset = layout.holes[p.hole][0], layout.holes[p.hole][1]
            fd = fds[name]
            if isinstance(data, FileRange) and not _kernel_copy(data, fd, offset + s):
                data = _read(data)
            if isinstance(data, Block):
                if data.nbytes != e - s:
                    raise CorruptCheckpointError(f"tensor {p.hole}: {data.nbytes} bytes computed, {e - s} expected")
                if layout.crc:
                    crc = zlib.crc32(data.view, crc if s > p.start else 0)
                direct[name].write(data)
            elif not isinstance(data, FileRange):
                if data.nbytes != e - s:
                    raise CorruptCheckpointError(f"tensor {p.hole}: {data.nbytes} bytes computed, {e - s} expected")
                if layout.crc:
                    crc = zlib.crc32(data, crc if s > p.start else 0)
                _pwrite(fd, data, offset + s)
            if e == p.end:
                out.append((p.hole, p.start, crc if layout.crc else 0))
                crc = 0
            advance(e - s)
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for w in direct.values():
            w.close()
        for fd in fds.values():
            os.close(fd)
    return out


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


def overlay(layout: Layout, laid: Path, root: Path, kept: Sequence[tuple[str, int, int]] = ()) -> None:
    """Copy what the writer wrote at ``laid`` (everything but the holes and the ``kept`` spans
    ``(file, start, end)``: headers, pickles, directories, whole files such as ``.metadata`` --
    last) into the output at ``root``, and flush every file."""
    gaps: dict[str, list[tuple[int, int]]] = {}
    for name, offset, n, _ in layout.holes:
        gaps.setdefault(name, []).append((offset, offset + n))
    for name, start, end in kept:  # already hashed for the manifest: a second layout's random ids stay out
        gaps.setdefault(name, []).append((start, end))
    names = sorted(
        layout.files, key=lambda n: (n.rsplit("/", 1)[-1] in (".metadata", "model.safetensors.index.json"), n)
    )
    for name in names:
        size = layout.files[name]
        keep, pos = [], 0
        for a, b in sorted(gaps.get(name, [])):
            if a > pos:
                keep.append((pos, a))
            pos = max(pos, b)
        if pos < size:
            keep.append((pos, size))
        src = os.open(laid / name if name else laid, os.O_RDONLY)
        dst = os.open(root / name if name else root, os.O_WRONLY | os.O_CREAT, 0o666)  # a manifest may be new
        try:
            if os.fstat(dst).st_size != size:  # a manifest's length is known last
                os.ftruncate(dst, size)
            for a, b in keep:
                data = os.pread(src, b - a, a)
                if len(data) != b - a:
                    raise CorruptCheckpointError(f"{laid / name}: laid out short")
                _pwrite(dst, memoryview(data), a)
            os.fsync(dst)
        finally:
            os.close(src)
            os.close(dst)
