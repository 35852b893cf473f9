"""Remote objects as files: :class:`RemoteFile` read by byte range, :class:`RemoteWriter` uploaded
as it is written. Small reads go through a bounded read-ahead cache of blocks (a ZIP directory, a
safetensors header or a pickle is parsed from a few); large ones are split into parallel range
requests written straight into the caller's buffer."""

from __future__ import annotations

import contextlib
import io
import threading
from concurrent.futures import wait
from typing import Any, Protocol

from .calls import call
from .fs import Memo, count, explain, threads
from .stream import Stream, fetch


class _Where(Protocol):  # a RemotePath (above this module)
    url: str
    path: str
    fs: Any

    def forget(self) -> None: ...


__all__ = ["BLOCK", "PART", "OffsetReader", "RemoteFile", "RemoteWriter", "Spans", "shared_spans"]

BLOCK = 256 << 10  # read-ahead unit for small reads
CACHED_BYTES = 4 << 20  # read-ahead spans kept per file
RUN_MAX = 2 << 20  # the largest read-ahead span, reached by reads walking through the file
PART = 8 << 20  # large reads are split into range requests of this size, fetched in parallel
SEQUENTIAL_GAP = 1 << 20  # a large read starting this close after the last one streams
UPLOAD_PART = 16 << 20  # multipart upload part size (memory held per file being written)


class Spans:
    """Read-ahead spans of one object, oldest first, at most :data:`CACHED_BYTES` of them."""

    def __init__(self) -> None:
        self._spans: list[tuple[int, bytes]] = []
        self._cached = 0
        self._lock = threading.Lock()

    def copy(self, offset: int, out: memoryview) -> bool:
        """Fill ``out`` from a span holding ``[offset, offset + len(out))``; False if none does."""
        n = len(out)
        with self._lock:
            for start, data in reversed(self._spans):
                if start <= offset and offset + n <= start + len(data):
                    out[:] = data[offset - start : offset - start + n]
                    return True
        return False

    def add(self, start: int, data: bytes) -> None:
        with self._lock:
            self._spans.append((start, data))
            self._cached += len(data)
            while self._cached > CACHED_BYTES and len(self._spans) > 1:
                self._cached -= len(self._spans.pop(0)[1])


SHARED_FOR = 10.0  # seconds
_shared: Memo[tuple[str, int, str], Spans] = Memo(SHARED_FOR)


def shared_spans(url: str, size: int, etag: str) -> Spans | None:
    """The spans already read of this object (same URL, size and ETag) by a file opened in the last
    few seconds -- format detection and the reader then fetch its header once -- or new ones."""
    if not etag:
        return None
    return _shared.setdefault((url, size, etag), Spans)


_live: list[RemoteFile] = []  # files holding a stream, the most recent last
_live_lock = threading.Lock()
MAX_STREAMS = 2  # streams alive at once, whatever the number of files open (each holds up to ~100 MiB)


def _track_stream(f: RemoteFile) -> None:
    """Count ``f``'s new stream among the live ones; end the oldest beyond :data:`MAX_STREAMS` (a
    file busy reading is skipped: its lock is not waited for, so two files never wait on each other)."""
    with _live_lock:
        if f in _live:
            _live.remove(f)
        _live.append(f)
        victims = _live[:-MAX_STREAMS]
    for v in victims:
        if v._stream_lock.acquire(blocking=False):
            try:
                v._drop_stream()
            finally:
                v._stream_lock.release()


class OffsetReader(io.RawIOBase):
    """A read-only binary file of ``length`` bytes, read at explicit offsets by :meth:`read_at`;
    the position, seeking and ``readinto`` serve code that reads sequentially (zipfile, pickle)."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.length = length
        self._pos = 0

    def read_at(self, pos: int, out: memoryview) -> int:
        """Fill ``out`` from ``pos`` (fewer bytes at the end); how many."""
        raise NotImplementedError

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, b: Any) -> int:
        n = self.read_at(self._pos, memoryview(b).cast("B"))
        self._pos += n
        return n


class RemoteFile(OffsetReader):
    """A remote object read by byte range. :meth:`pread` is thread-safe (no shared position)."""

    def __init__(self, where: _Where, size: int, label: str, spans: Spans | None = None) -> None:
        super().__init__(size)
        self.where = where
        self.label = label
        self.name = str(where)
        self._spans = spans if spans is not None else Spans()
        self._stream: Stream | None = None  # serving a run of sequential reads
        self._stream_lock = threading.Lock()
        self._last_end = -(1 << 62)  # where the last large read ended (none yet: a stream needs two)
        self._run_end, self._run_size = -(1 << 62), BLOCK  # the last read-ahead span's end and size

    @property
    def size(self) -> int:
        return self.length

    def fileno(self) -> int:
        raise io.UnsupportedOperation("a remote object has no file descriptor")

    def read_at(self, pos: int, out: memoryview) -> int:
        return self.pread(pos, out)

    def readall(self) -> bytes:
        out = bytearray(max(0, self.size - self._pos))
        n = self.readinto(out)
        return bytes(out[:n])

    def _fetch(self, start: int, end: int, stop: threading.Event | None = None) -> bytes:
        w = self.where
        data = fetch(w.fs, w.path, w.url, self.label, start, end, self.size, stop)
        count(len(data))
        return data

    def pread(self, offset: int, out: memoryview, within: tuple[int, int] | None = None) -> int:
        """Fill ``out`` with the bytes at ``offset`` (fewer at the end of the object).

        A large read is fetched exactly, in parallel parts. A small one is served from the bytes
        already fetched or fetches a read-ahead span of :data:`BLOCK` bytes around it, kept inside
        ``within`` (a record's range: a DCP chunk's bytes) or the object."""
        end = min(self.size, offset + len(out))
        if end <= offset:
            return 0
        n = end - offset
        if self._streamed(offset, out[:n]):
            return n
        if n >= BLOCK:
            self._read_large(offset, out[:n])
            self._last_end = end
        else:
            self._read_small(offset, out[:n], within)
        return n

    def _streamed(self, offset: int, out: memoryview) -> bool:
        """Serve the read from the stream when it lies in its window; start a stream for a large
        read that continues the previous one (a conversion reading records in order)."""
        n = len(out)
        with self._stream_lock:
            if self._stream is not None and self._stream.serves(offset, n):
                return self._stream.read(offset, out)
            if n < BLOCK or not 0 <= offset - self._last_end <= SEQUENTIAL_GAP or self.size - offset < 2 * PART:
                return False
            if self._stream is not None:
                self._stream.close()
            w = self.where
            self._stream = Stream(w.fs, w.path, w.url, self.label, offset, self.size)
            self._last_end = offset + n
            _track_stream(self)
            return self._stream.read(offset, out)

    def close(self) -> None:
        with self._stream_lock:
            self._drop_stream()
        super().close()

    def _drop_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        with _live_lock:
            if self in _live:
                _live.remove(self)

    def _read_large(self, offset: int, out: memoryview) -> None:
        n = len(out)
        spans = [(s, min(n, s + PART)) for s in range(0, n, PART)]

        stop = threading.Event()

        def one(span: tuple[int, int]) -> None:
            a, b = span
            data = self._fetch(offset + a, offset + b, stop)
            if not stop.is_set():
                out[a:b] = data

        if len(spans) == 1:
            one(spans[0])
            return
        futures = [threads().submit(one, s) for s in spans]
        try:
            for f in futures:
                f.result()
        except BaseException:
            # the other parts are abandoned (their requests cancelled) before the caller frees ``out``
            stop.set()
            for f in futures:
                f.cancel()
            wait(futures)
            raise

    def _read_small(self, offset: int, out: memoryview, within: tuple[int, int] | None) -> None:
        n = len(out)
        if self._spans.copy(offset, out):
            return
        if self._run_end - BLOCK <= offset <= self._run_end + BLOCK:
            # reads walking through the file (many small tensors, DCP chunks one after another):
            # each span twice the last, up to RUN_MAX, past the record asked about
            a = offset
            b = min(self.size, max(offset + n, a + min(RUN_MAX, 2 * self._run_size)))
        else:
            lo, hi = within if within is not None else (0, self.size)
            lo, hi = max(0, min(lo, offset)), min(self.size, max(hi, offset + n))
            a = max(lo, min(offset, hi - BLOCK))  # a span of BLOCK from here, moved back at the end
            b = min(hi, max(offset + n, a + BLOCK))
        self._run_end, self._run_size = b, max(BLOCK, b - a)
        data = self._fetch(a, b)
        out[:] = data[offset - a : offset - a + n]
        self._spans.add(a, data)


class RemoteWriter(io.RawIOBase):
    """A new remote object, uploaded as it is written (multipart on object stores) and published
    only by a successful close; an exception inside ``with`` discards it (aborts the upload)."""

    def __init__(self, where: _Where) -> None:
        super().__init__()
        self.where = where
        self.name = str(where)
        self._f = call(where.url, "write", where.fs.open, where.path, "wb", block_size=UPLOAD_PART)
        self._pos = 0

    def fileno(self) -> int:
        raise io.UnsupportedOperation("a remote object has no file descriptor")

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            for start in range(0, len(view), UPLOAD_PART):  # s3fs buffers what it is given, whole
                self._f.write(view[start : start + UPLOAD_PART])
        except Exception as e:
            raise explain(e, self.where.url, "write") from None
        self._pos += len(view)
        return len(view)

    def close(self) -> None:
        if self.closed:
            return
        self.where.forget()
        try:
            self._f.close()
        except Exception as e:
            self.discard()
            raise explain(e, self.where.url, "write") from None
        finally:
            super().close()

    def discard(self) -> None:
        """Abandon the object: abort its upload, publish nothing."""
        with contextlib.suppress(Exception):
            if hasattr(self._f, "discard"):
                self._f.discard()
            self._f.closed = True
        with contextlib.suppress(Exception):
            super().close()

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is not None:
            self.discard()
        else:
            self.close()
