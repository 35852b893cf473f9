"""A distributed conversion into S3: one multipart upload per output object, its parts uploaded by
the ranks that hold them, the same bytes as one process uploads.

An object store takes no positioned writes, but S3 takes the parts of one multipart upload from
any number of writers: every part but the last of at least :data:`MIN_PART` bytes, numbered, put
together in number order when the upload is completed. So every rank lays the output out (as for a
shared filesystem: :func:`~..ops.convert.layout.lay_out`), and all cut each object the same way
into parts (:func:`plan_parts`); the parts, in order over all objects, are split between the ranks
by bytes at part granularity. Rank 0 starts one multipart upload per object that holds tensor
bytes and hands every rank the upload ids; each rank builds its parts -- the layout's headers,
pickles and directories with its tensor ranges computed from the source -- and uploads them.

A ZIP record (torch.save, DCP) holds the CRC-32 of its bytes in its local header and in the
directory, known only once every rank has computed its ranges: a part that holds such a field
(found by laying the output out a second time with other CRCs and comparing) is kept in a spill
file of the rank's temporary folder (unlinked at once: a rank killed leaves nothing there) until
the ranks have exchanged their CRCs; then every rank lays the output out with the final CRCs,
patches its kept parts and uploads them. A safetensors header depends on the layout only: its
parts go up at once. The random save ids (``.data/serialization_id``, DCP's ``save_id``) are drawn
once by rank 0 and shared (``$DCPSTUDIO_SAVE_ID``'s derivation), so every rank's layout has the same
bytes.

Rank 0 completes the uploads once every rank's parts are in -- last, as the single-process writer
closes its uploads -- then writes the objects without tensor bytes, ``.metadata`` or the index
last (a folder that replaces another goes through a temporary prefix, as one process writes it:
:func:`~..io.atomic.atomic_output`). A failure anywhere aborts every upload (every rank aborts them
all, so a rank 0 that dies is covered by its peers) and removes what was published: nothing is left,
no object and no pending upload. Other stores (GCS, Azure, HTTP, the Hub) take no parts from many
writers here: a destination there is refused, naming the limitation. A DCP's manifest needs each
data file's SHA-256 over bytes no rank holds whole: it is refused too (``--no-manifest``).
"""

from __future__ import annotations

import bisect
import contextlib
import os
import secrets
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import DCPStudioError
from ..io.atomic import atomic_output
from ..io.files import SAVE_ID_VARIABLE, create_file, sync_file
from ..io.pipeline import prefetch
from ..io.raw import FileRange
from ..io.remote.calls import on_loop, retried
from ..io.remote.fs import backend
from ..io.remote.locations import RemotePath, as_location
from ..ops.convert.layout import GRAIN, Layout, Recorder, _read, _Source, combine_crcs, lay_out
from ..progress import CancelToken, Progress, ProgressCallback

__all__ = ["MIN_PART", "Part", "check_upload", "plan_parts", "refuse_store", "upload_on_ranks"]

MIN_PART = 5 << 20  # S3: every part of a multipart upload but the last is at least this large
MAX_PART = 64 << 20  # parts are at most this large (memory: about three per rank) ...
MAX_PARTS = 10_000  # ... unless an object needs larger ones to stay within S3's count of parts
PARTS_PER_RANK = 8  # parts small enough for each rank to get about this many: the balance
_CRC_PROBE = 0xFFFFFFFF  # the CRC-32 the second layout is given: every byte of a CRC field changes
_LAST = (".metadata", "model.safetensors.index.json")  # published last


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


def refuse_store(dst: Any) -> None:
    """A remote destination other than S3 is refused before anything starts, naming why."""
    where = as_location(dst)
    if not isinstance(where, RemotePath):
        return
    kind = backend(where.url)
    if kind != "s3":
        raise DCPStudioError(
            f"{where}: a distributed conversion uploads each object as one multipart upload whose parts the ranks "
            f"send, which only S3 takes here ({kind} stores take no parts of one object from many writers); write to "
            "s3:// or a shared filesystem, or convert on one rank"
        )


def check_upload(recorder: Recorder) -> Recorder:
    """The recorded output as it is uploaded: without a manifest (one process uploads none for a
    torch.save or safetensors file: it would need a second pass), and a DCP one refused."""
    if recorder.kind == "dcp":
        if recorder.kwargs.get("manifest", True):
            raise DCPStudioError(
                f"{recorder.args[0]}: a DCP checkpoint uploaded by many ranks cannot carry its manifest (each data "
                "file's SHA-256 needs bytes no one rank holds); pass --no-manifest (`hash --manifest` adds one later), "
                "or convert on one rank"
            )
        return recorder
    if recorder.kind == "torch" and len(recorder.args) > 7:  # positional: (dst, overwrite, obj, ..., manifest)
        return replace(recorder, args=(*recorder.args[:7], False, *recorder.args[8:]))
    return replace(recorder, kwargs={**recorder.kwargs, "manifest": False})


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
    files = _uploaded(layout)
    size = _part_size(layout, files, world)
    cuts = [(f, k + 1, a, min(layout.files[f], a + size)) for f in files for k, a in enumerate(range(0, layout.files[f], size))]
    total = sum(b - a for _, _, a, b in cuts)
    parts, before = [], 0
    for f, number, a, b in cuts:
        middle = before + (b - a) // 2
        parts.append(Part(f, number, a, b, min(world - 1, middle * world // max(1, total))))
        before += b - a
    return parts


def _uploaded(layout: Layout) -> list[str]:
    """The files uploaded in parts: those holding tensor bytes (the others are small, written whole)."""
    return sorted({h[0] for h in layout.holes if h[2]} & {f for f, n in layout.files.items() if n})


def _segments(layout: Layout, root: Path) -> dict[str, list[tuple[int, bytes]]]:
    """What the writer wrote at ``root`` outside the holes: per file, ``(offset, bytes)`` in order."""
    gaps: dict[str, list[tuple[int, int]]] = {}
    for name, offset, n, _ in layout.holes:
        gaps.setdefault(name, []).append((offset, offset + n))
    out: dict[str, list[tuple[int, bytes]]] = {}
    for name, size in layout.files.items():
        keep, pos = [], 0
        for a, b in sorted(gaps.get(name, [])):
            if a > pos:
                keep.append((pos, a))
            pos = max(pos, b)
        if pos < size:
            keep.append((pos, size))
        with open(root / name if name else root, "rb") as f:
            out[name] = [(a, os.pread(f.fileno(), b - a, a)) for a, b in keep]
        if any(len(data) != b - a for (a, b), (_, data) in zip(keep, out[name], strict=True)):
            raise DCPStudioError(f"internal error: {name or 'the output'} laid out short")
    return out


def _laid_out(recorder: Recorder, crcs: list[int] | None) -> tuple[Layout, dict[str, list[tuple[int, bytes]]]]:
    """The output laid out in a scratch folder (removed at once) and the bytes it holds outside the holes."""
    from .convert import _SCRATCH

    scratch = Path(tempfile.mkdtemp(prefix="dcpstudio-layout-", dir=_SCRATCH))
    try:
        at = scratch / recorder.args[0].name  # the name: a torch.save archive holds it
        layout = lay_out(recorder, at, crcs)
        return layout, _segments(layout, at)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _late(layout: Layout, parts: list[Part], first: dict[str, list[tuple[int, bytes]]], recorder: Recorder) -> set[int]:
    """The parts (indices) holding bytes that change with the CRC-32s: laid out again with other
    CRCs, the bytes outside the holes compared."""
    if not layout.crc:
        return set()
    import numpy as np

    _, probe = _laid_out(recorder, [_CRC_PROBE] * len(layout.holes))
    starts: dict[str, list[int]] = {}
    indices: dict[str, list[int]] = {}
    for i, p in enumerate(parts):
        starts.setdefault(p.file, []).append(p.start)
        indices.setdefault(p.file, []).append(i)
    late: set[int] = set()
    for name, segs in first.items():
        if name not in starts:
            continue
        for (a, one), (_, two) in zip(segs, probe[name], strict=True):
            if one == two:
                continue
            changed = np.flatnonzero(np.frombuffer(one, np.uint8) != np.frombuffer(two, np.uint8)) + a
            for k in np.unique(np.searchsorted(starts[name], changed, side="right") - 1):
                late.add(indices[name][int(k)])
    return late


class _Builder:
    """A part's bytes: the layout's outside the holes, the tensors' ranges computed from the source."""

    def __init__(self, layout: Layout, segments: dict[str, list[tuple[int, bytes]]]) -> None:
        self.layout = layout
        self.segments = segments
        self.source = _Source()
        self.holes: dict[str, list[tuple[int, int, int]]] = {}  # file -> (offset, end, hole) in order
        for h, (name, offset, n, _) in enumerate(layout.holes):
            if n:
                self.holes.setdefault(name, []).append((offset, offset + n, h))
        for spans in self.holes.values():
            spans.sort()

    def overlay(self, part: Part, view: memoryview, segments: dict[str, list[tuple[int, bytes]]]) -> None:
        segs = segments.get(part.file, [])
        k = max(0, bisect.bisect_right([a for a, _ in segs], part.start) - 1)
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
        k = max(0, bisect.bisect_right([s[0] for s in spans], part.start) - 1)
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


class _Store:
    """The S3 calls of a multipart upload, each retried and bounded as every remote call is."""

    def __init__(self, where: RemotePath) -> None:
        self.where = where
        self.fs = where.fs

    def _call(self, doing: str, method: str, **kwargs: Any) -> Any:
        fs = self.fs
        extra = getattr(fs, "s3_additional_kwargs", {}) or {}  # what one process's uploads carry (SSE, ACL)
        return retried(self.where.url, doing, lambda clock: on_loop(fs.loop, fs._call_s3(method, extra, **kwargs), clock))

    def key(self, name: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(self.object(name).path)
        return bucket, key

    def object(self, name: str) -> RemotePath:
        return self.where / name if name else self.where

    def start(self, name: str) -> str:
        bucket, key = self.key(name)
        return str(self._call("write", "create_multipart_upload", Bucket=bucket, Key=key)["UploadId"])

    def put(self, name: str, upload: str, number: int, body: bytes | bytearray) -> str:
        bucket, key = self.key(name)
        out = self._call("write", "upload_part", Bucket=bucket, Key=key, UploadId=upload, PartNumber=number, Body=body)
        return str(out["ETag"])

    def complete(self, name: str, upload: str, etags: list[tuple[int, str]]) -> None:
        bucket, key = self.key(name)
        parts = [{"PartNumber": n, "ETag": e} for n, e in sorted(etags)]
        self._call(
            "write", "complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts}
        )
        self.object(name).forget()

    def abort(self, uploads: dict[str, str]) -> None:
        """Abort the uploads (quietly: another rank may have aborted them already)."""
        for name, upload in uploads.items():
            bucket, key = self.key(name)
            with contextlib.suppress(Exception):
                self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload)


@contextlib.contextmanager
def _seeded(seed: str) -> Iterator[None]:
    """The save ids drawn from ``seed`` while laying out: the same bytes on every rank."""
    before = os.environ.get(SAVE_ID_VARIABLE)
    os.environ[SAVE_ID_VARIABLE] = seed
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(SAVE_ID_VARIABLE, None)
        else:
            os.environ[SAVE_ID_VARIABLE] = before


def upload_on_ranks(
    recorder: Recorder, progress: ProgressCallback | None, cancel: CancelToken | None, started: float
) -> tuple[int, int, float]:
    """This rank's part of uploading the recorded output (every rank calls it): its bytes, its
    parts, and the seconds since ``started``."""
    import torch.distributed as dist

    from .convert import KILL_VARIABLE, _agree, _message

    rank = dist.get_rank()
    seed = _agree(None, os.environ.get(SAVE_ID_VARIABLE) or secrets.token_hex(16))[0]
    with _seeded(seed), ExitStack() as stack:
        error = digest = None
        try:
            recorder = check_upload(recorder)
            layout, segments = _laid_out(recorder, None)
            parts = plan_parts(layout, dist.get_world_size())
            late = _late(layout, parts, segments, recorder)
            digest = layout.digest()
        except Exception as e:
            error = _message(e)
        if len(set(_agree(error, digest))) != 1:
            raise DCPStudioError("the ranks planned different outputs: do they all see the same source and options?")
        mine = [i for i, p in enumerate(parts) if p.rank == rank]

        error, uploads, where = None, {}, None
        store: _Store | None = None
        if rank == 0:
            try:
                where = stack.enter_context(atomic_output(recorder.args[0], overwrite=recorder.overwrite))
                store = _Store(where)
                for name in _uploaded(layout):
                    uploads[name] = store.start(name)
            except Exception as e:
                error = _message(e)
                if store is not None:
                    store.abort(uploads)
        url, uploads = _agree(error, (where.url if where is not None else None, uploads))[0]
        store = store or _Store(RemotePath(url))
        try:
            share = _upload(layout, segments, parts, mine, late, recorder, store, uploads, progress, cancel, kill=KILL_VARIABLE)
            if rank == 0:
                stack.close()  # a folder replacing another is copied into place from its temporary prefix
        except BaseException:
            store.abort(uploads)  # every rank: a rank 0 that died aborts nothing
            raise
    return share, len(mine), time.monotonic() - started


def _upload(
    layout: Layout,
    segments: dict[str, list[tuple[int, bytes]]],
    parts: list[Part],
    mine: list[int],
    late: set[int],
    recorder: Recorder,
    store: _Store,
    uploads: dict[str, str],
    progress: ProgressCallback | None,
    cancel: CancelToken | None,
    kill: str,
) -> int:
    """Build and upload this rank's parts (those that hold CRC fields after the CRC exchange);
    rank 0 completes every upload and writes the other files. Returns this rank's bytes."""
    import signal

    import torch.distributed as dist

    from .convert import _agree, _message

    rank = dist.get_rank()
    share = sum(parts[i].nbytes for i in mine)
    builder = _Builder(layout, segments)
    killer = os.environ.get(kill)
    done = 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        if killer is not None and int(killer) == rank:
            os.kill(os.getpid(), signal.SIGKILL)
        if progress is not None:
            progress(Progress(done, share, 0, 0, f"rank {rank}"))

    def check() -> None:
        if cancel is not None:
            cancel.check()

    etags: list[tuple[str, int, str]] = []
    crcs: list[tuple[int, int, int]] = []
    kept: list[tuple[int, int]] = []  # (part, offset in the spill file)
    error = None
    with tempfile.TemporaryFile(prefix="dcpstudio-parts-") as spill:  # unlinked: nothing left by a kill
        try:
            for i, (data, got) in prefetch(lambda i: builder.build(parts[i], check), mine):
                crcs += got
                p = parts[i]
                if i in late:
                    kept.append((i, spill.tell()))
                    spill.write(data)
                else:
                    etags.append((p.file, p.number, store.put(p.file, uploads[p.file], p.number, data)))
                advance(p.nbytes)
        except Exception as e:
            error = _message(e)
        everyone = [c for rank_crcs in _agree(error, crcs) for c in rank_crcs]

        error = None
        final = segments
        try:
            if layout.crc and (kept or rank == 0):
                laid, final = _laid_out(recorder, combine_crcs(layout, everyone))
                if laid.digest() != layout.digest():
                    raise DCPStudioError("internal error: the output laid out again differs")
            spill.flush()
            for i, at in kept:
                check()
                p = parts[i]
                data = bytearray(os.pread(spill.fileno(), p.nbytes, at))
                builder.overlay(p, memoryview(data), final)  # the CRC fields, now final
                etags.append((p.file, p.number, store.put(p.file, uploads[p.file], p.number, data)))
        except Exception as e:
            error = _message(e)
    gathered = _agree(error, etags)

    error = None
    if rank == 0:
        try:
            by_file: dict[str, list[tuple[int, str]]] = {}
            for name, number, etag in (t for rank_etags in gathered for t in rank_etags):
                by_file.setdefault(name, []).append((number, etag))
            for name in sorted(uploads):
                store.complete(name, uploads[name], by_file.get(name, []))
            whole = sorted(set(layout.files) - set(uploads), key=lambda n: (n.rsplit("/", 1)[-1] in _LAST, n))
            for name in whole:
                with create_file(store.object(name)) as f:
                    for _, data in final[name]:
                        f.write(data)
                    sync_file(f)
        except Exception as e:
            error = _message(e)
    _agree(error, None)
    return share
