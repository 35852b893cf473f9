"""A distributed conversion into S3: one multipart upload per output object, its parts uploaded by
the ranks that hold them, the same bytes as one process uploads.

An object store takes no positioned writes, but S3 takes the parts of one multipart upload from
any number of writers: every part but the last of at least :data:`~.parts.MIN_PART` bytes,
numbered, put together in number order when the upload is completed. So every rank lays the output
out (as for a shared filesystem: :func:`~..ops.convert.layout.lay_out`), and all cut each object the
same way into parts (:func:`~.parts.plan_parts`); the parts, in order over all objects, are split
between the ranks by bytes at part granularity. Rank 0 starts one multipart upload per object that
holds tensor bytes and hands every rank the upload ids; each rank builds its parts -- the layout's
headers, pickles and directories with its tensor ranges computed from the source -- and uploads them.

A ZIP record (torch.save, DCP) holds the CRC-32 of its bytes in its local header and in the
directory (:func:`~.parts.crc_fields`). A part that holds such a field goes up as soon as the
rank has computed all of the tensors whose CRCs it holds and filled them in (most local headers:
a tensor within one rank's share); until then it waits in a spill file in the temporary folder
(unlinked at once: a rank killed leaves nothing there), and the rest -- the directories, a tensor
cut between two ranks -- once the ranks have exchanged their CRCs. A safetensors header
depends on the layout only: its parts go up at once. The random save ids (``.data/serialization_id``,
DCP's ``save_id``) are derived from one seed rank 0 draws (as from ``$DCPSTUDIO_SAVE_ID``, which is
used when set), so every rank's layout has the same bytes.

Rank 0 completes the uploads once every rank's parts are in -- as the single-process writer closes
its uploads at the end -- then writes the objects without tensor bytes, ``.metadata`` or the index
last (a folder that replaces another goes through a temporary prefix, as one process writes it:
:func:`~..io.atomic.atomic_output`). A DCP's manifest (one process uploads one, hashing as it
writes) needs each data file's SHA-256, over bytes no rank holds whole: once the data objects are
complete, the ranks read them back from the store, each its share of the tensors' pieces and of the
files (the read-back of the shared-filesystem conversion), and rank 0 lays the manifest out from
their digests. A torch.save or safetensors object carries none (one process uploads none: its
header goes out before the bytes it would describe). A failure anywhere aborts every upload (every
rank aborts them all, so a rank 0 that dies is covered by its peers) and removes what was
published: no object is left, and no pending upload. Other stores (GCS, Azure, HTTP, the Hub) take
no parts of one object from many writers here: a destination there is refused, naming the limitation.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Any

from ..errors import DCPStudioError
from ..io.atomic import atomic_output
from ..io.crc import crc32_combine
from ..io.files import SAVE_ID_VARIABLE, create_file, sync_file
from ..io.pipeline import prefetch
from ..io.remote.calls import on_loop, retried
from ..io.remote.fs import backend
from ..io.remote.locations import RemotePath, as_location
from ..ops.convert.layout import Layout, Recorder, combine_crcs
from ..progress import CancelToken, ProgressCallback
from .parts import Fields, Part, PartBuilder, Segments, crc_fields, laid_out, patch, plan_parts, uploaded
from .share import ShareProgress

__all__ = ["ReadBack", "Steps", "check_upload", "refuse_store", "upload_on_ranks"]

_LAST = (".metadata", "model.safetensors.index.json")  # published last


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
    """The recorded output as it is uploaded: a torch.save or safetensors file without a manifest
    (one process uploads none: its header or directory goes out before the bytes it would describe)."""
    if recorder.kind == "dcp":
        return recorder
    if recorder.kind == "torch" and len(recorder.args) > 7:  # positional: (dst, overwrite, obj, ..., manifest)
        return replace(recorder, args=(*recorder.args[:7], False, *recorder.args[8:]))
    return replace(recorder, kwargs={**recorder.kwargs, "manifest": False})


class _Store:
    """The S3 calls of a multipart upload, each retried and bounded as every remote call is."""

    def __init__(self, where: RemotePath) -> None:
        self.where = where
        self.fs = where.fs
        self.published = False  # every rank knows the output is in place

    def _extra(self) -> dict[str, Any]:
        """What one process's uploads carry beside (encryption, ACL, requester pays): s3fs keeps
        those of each call the method takes."""
        extra = dict(getattr(self.fs, "s3_additional_kwargs", {}) or {})
        if getattr(self.fs, "requester_pays", False):
            extra["RequestPayer"] = "requester"
        return extra

    def _call(self, doing: str, method: str, **kwargs: Any) -> Any:
        fs, extra = self.fs, self._extra()
        return retried(
            self.where.url, doing, lambda clock: on_loop(fs.loop, fs._call_s3(method, extra, **kwargs), clock)
        )

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
            "write",
            "complete_multipart_upload",
            Bucket=bucket,
            Key=key,
            UploadId=upload,
            MultipartUpload={"Parts": parts},
        )
        self.object(name).forget()

    def remove(self, names: list[str]) -> None:
        """Remove the output's objects ``names`` (quietly: they may not exist). Only this output's
        objects are named: its folder did not exist, or it is a temporary prefix of its own."""
        for name in names:
            with contextlib.suppress(Exception):
                self.object(name).unlink(missing_ok=True)

    def abort(self, uploads: dict[str, str]) -> None:
        """Abort the uploads (quietly: another rank may have aborted them already)."""
        for name, upload in uploads.items():
            bucket, key = self.key(name)
            with contextlib.suppress(Exception):
                self.fs.call_s3("abort_multipart_upload", self._extra(), Bucket=bucket, Key=key, UploadId=upload)


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


ReadBack = Callable[..., tuple[list[list[Any]], dict[int, str]]]
"""How the ranks read a manifest's pieces and files back (:func:`~.convert._read_back`, given an
output root that may be a :class:`RemotePath`): each tensor's piece digests, each span's SHA-256."""


@dataclass(frozen=True)
class Steps:
    """What the distributed conversion (:mod:`.convert`) hands the upload: this rank and the world;
    ``agree(error, value)``, the step that ends each stage (every rank's value, or every rank raising
    the first error one reported); ``message``, an error's one line; the manifest's shared
    ``read_back``; the fault injection's variable; where to lay the output out (``None``: the
    temporary folder)."""

    rank: int
    world: int
    agree: Callable[[str | None, Any], list[Any]]
    message: Callable[[BaseException], str]
    read_back: ReadBack
    kill: str
    scratch: str | None


def upload_on_ranks(
    recorder: Recorder, progress: ProgressCallback | None, cancel: CancelToken | None, started: float, steps: Steps
) -> tuple[int, int, float]:
    """This rank's part of uploading the recorded output (every rank calls it): its bytes, its
    parts, and the seconds since ``started``."""
    rank, _agree, _message = steps.rank, steps.agree, steps.message
    seed = _agree(None, os.environ.get(SAVE_ID_VARIABLE) or secrets.token_hex(16))[0]
    with _seeded(seed), ExitStack() as stack:
        error = digest = None
        try:
            recorder = check_upload(recorder)
            layout, segments = laid_out(recorder, steps.scratch)
            parts = plan_parts(layout, steps.world)
            late = crc_fields(layout, parts, segments, recorder, steps.scratch)
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
                for name in uploaded(layout):
                    uploads[name] = store.start(name)
            except Exception as e:
                error = _message(e)
                if store is not None:
                    store.abort(uploads)
        url, uploads = _agree(error, (where.url if where is not None else None, uploads))[0]
        store = store or _Store(RemotePath(url))
        try:
            share = _upload(
                layout, segments, parts, mine, late, recorder, store, uploads, progress, cancel, stack.close, steps
            )
        except BaseException:
            store.abort(uploads)  # every rank: a rank 0 that died aborts nothing ...
            if rank != 0 and not store.published:  # ... nor removes the objects it completed
                store.remove(sorted(layout.files))
            raise
    return share, len(mine), time.monotonic() - started


def _upload(
    layout: Layout,
    segments: Segments,
    parts: list[Part],
    mine: list[int],
    late: Fields,
    recorder: Recorder,
    store: _Store,
    uploads: dict[str, str],
    progress: ProgressCallback | None,
    cancel: CancelToken | None,
    publish: Callable[[], None],
    steps: Steps,
) -> int:
    """Build and upload this rank's parts (one holding the CRC-32 of a tensor another rank has
    bytes of, after the CRC exchange); rank 0 completes every upload, writes the other files and
    calls ``publish`` (a folder replacing another is copied into place from its temporary prefix).
    Returns this rank's bytes."""
    rank, _agree, _message = steps.rank, steps.agree, steps.message
    share = sum(parts[i].nbytes for i in mine)
    builder = PartBuilder(layout, segments)
    tally = ShareProgress(rank, share, progress, cancel, steps.kill)
    advance, check = tally.advance, tally.check

    etags: list[tuple[str, int, str]] = []
    crcs: list[tuple[int, int, int]] = []
    known = {h: 0 for h, hole in enumerate(layout.holes) if not hole[2]}  # CRC-32s computed whole here
    running: dict[int, tuple[int, int]] = {}  # hole -> (its bytes computed here, their CRC-32)
    kept: list[tuple[int, int]] = []  # parts waiting for CRC-32s: (part, offset in the spill file)

    def put(i: int, data: bytearray) -> None:
        p = parts[i]
        etags.append((p.file, p.number, store.put(p.file, uploads[p.file], p.number, data)))

    def ready(i: int) -> bool:
        return all(h is not None and h in known for _, h in late.get(i, ()))

    def learn(i: int, got: list[tuple[int, int, int]]) -> None:
        """Fold part ``i``'s pieces into their holes' CRC-32s; a hole all computed here is known."""
        p = parts[i]
        for h, start, crc in got:
            _, offset, n, _ = layout.holes[h]
            length = min(n, p.end - offset) - start
            done_h, whole = running.get(h, (0, 0))
            if done_h != start:  # not this rank's from the start: known only by the exchange
                running[h] = (-1, 0)
                continue
            running[h] = (start + length, crc32_combine(whole, crc, length) if start else crc)
            if start + length == n:
                known[h] = running[h][1]

    error = None
    with tempfile.TemporaryFile(prefix="dcpstudio-parts-") as spill:  # unlinked: nothing left by a kill
        try:
            for i, (data, got) in prefetch(lambda i: builder.build(parts[i], check), mine):
                crcs += got
                learn(i, got)
                if i in late and not ready(i):
                    kept.append((i, spill.tell()))
                    spill.write(data)
                else:
                    patch(parts[i], data, late.get(i, []), known)
                    put(i, data)
                for j, at in [k for k in kept if ready(k[0])]:  # its tensors now computed whole here
                    kept.remove((j, at))
                    data = bytearray(os.pread(spill.fileno(), parts[j].nbytes, at))
                    patch(parts[j], data, late[j], known)
                    put(j, data)
                advance(parts[i].nbytes)
        except Exception as e:
            error = _message(e)
        everyone = [c for rank_crcs in _agree(error, crcs) for c in rank_crcs]
        crcs_all = combine_crcs(layout, everyone) if layout.crc else None

        error = None
        final = segments
        try:
            if layout.crc and (any(h is None for i, _ in kept for _, h in late[i]) or rank == 0):
                laid, final = laid_out(recorder, steps.scratch, crcs_all)
                if laid.digest() != layout.digest():
                    raise DCPStudioError("internal error: the output laid out again differs")
            spill.flush()
            for i, at in kept:
                check()
                data = bytearray(os.pread(spill.fileno(), parts[i].nbytes, at))
                if any(h is None for _, h in late[i]):
                    builder.overlay(parts[i], memoryview(data), final)  # the bytes that change with the CRCs
                else:
                    assert crcs_all is not None
                    patch(parts[i], data, late[i], dict(enumerate(crcs_all)))
                put(i, data)
        except Exception as e:
            error = _message(e)
    gathered = _agree(error, etags)

    hashed = {name for name, _, _ in layout.spans}  # a manifest's files: uploaded whole, then read back
    error = None
    if rank == 0:
        try:
            by_file: dict[str, list[tuple[int, str]]] = {}
            for name, number, etag in (t for rank_etags in gathered for t in rank_etags):
                by_file.setdefault(name, []).append((number, etag))
            for name in sorted(uploads):
                store.complete(name, uploads[name], by_file.get(name, []))
            _write_whole(store, sorted(hashed - set(uploads)), final)
        except Exception as e:
            error = _message(e)
    _agree(error, None)

    if layout.spans:  # each rank reads back its share of the tensors' pieces and of the files (from the store)
        store.fs.invalidate_cache(store.where.path)  # listings cached while planning know none of them
        from ..ops.convert.replay import Replay

        digests, shas = steps.read_back(layout, store.where, True, list(range(len(layout.spans))), check)
        if rank == 0:
            try:
                replay = Replay(digests, [shas[k] for k in range(len(layout.spans))])
                laid, final = laid_out(recorder, steps.scratch, crcs_all, replay)
                if laid.digest(sizes=False) != layout.digest(sizes=False):
                    raise DCPStudioError("internal error: the output laid out again differs")
            except Exception as e:
                error = _message(e)
    if rank == 0 and error is None:
        try:
            _write_whole(store, sorted(set(layout.files) - set(uploads) - hashed), final)
            publish()
        except Exception as e:
            error = _message(e)
    _agree(error, None)
    store.published = True
    return share


def _write_whole(store: _Store, names: list[str], segments: Segments) -> None:
    """Upload the files ``names`` whole (they hold no tensor bytes), ``.metadata`` or the index last."""
    for name in sorted(names, key=lambda n: (n.rsplit("/", 1)[-1] in _LAST, n)):
        with create_file(store.object(name)) as f:
            for _, chunk in segments[name]:
                f.write(chunk)
            sync_file(f)
