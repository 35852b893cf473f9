"""Range reads with bounds, and one request for a run of sequential reads.

:func:`fetch` reads the bytes ``[start, end)`` of an object and nothing more: over HTTP and S3
the response is read through the backend's stream in bounded pieces, its headers checked before
its body (a 206 must carry the range asked for; a Content-Length beyond it, a 200 for a range of
a large object, or compressed bytes are refused as a server that does not honour ``Range``), and
it is cut off at the range. A small object (<= :data:`SMALL_OBJECT`) whose server ignores ranges
is read from its start up to the range's end instead. The time is bounded by the operation's
:class:`~.calls.Clock` (deadline and minimum rate). Other backends (GCS, Azure, the
Hub) read by their SDK's ranged call under the same deadline, its length checked.

A conversion reads a file's records in order. Asking for each record by range costs a request's
latency each time (and some servers, moto among them, pay for the whole object on every range
request); instead :class:`Stream` issues one GET from the first record on and serves the reads that
follow from it. It reads on its own thread at most :data:`AHEAD` bytes ahead of the furthest byte
asked for, and keeps the last :data:`BEHIND` bytes before that: a DCP chunk's ZIP directory is
read at the chunk's end before its data, which lies behind. A read outside that window is not
served (the caller asks by range); a dropped connection is resumed from where it broke.
"""

from __future__ import annotations

import contextlib
import queue
import re
import threading
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from ...units import human_bytes
from .calls import Abandoned, Clock, attempts_for, call, on_loop, retried
from .fs import RemoteError, count, explain, transient

__all__ = ["AHEAD", "BEHIND", "PIECE", "SMALL_OBJECT", "Stream", "fetch"]

PIECE = 4 << 20  # what the stream's thread reads at a time
AHEAD = 32 << 20  # received, not yet asked for
BEHIND = 64 << 20  # kept behind the furthest byte asked for
SMALL_OBJECT = 4 << 20  # an object this small may be read from its start when its server ignores ranges
_EXTRA_WAIT = 0.5  # seconds to look for bytes past the range when the server gave no length

T = TypeVar("T")


@dataclass
class _Response:
    """What a backend answered, as the checks need it."""

    status: int
    length: int | None  # Content-Length
    content_range: str | None
    encoding: str
    read: Callable[[int], Awaitable[bytes]]  # at most n bytes; b"" at the end
    close: Callable[[], Any]


def _is_http(fs: Any) -> bool:
    return type(fs).__name__ == "HTTPFileSystem"


def _is_s3(fs: Any) -> bool:
    return hasattr(fs, "_call_s3") and hasattr(fs, "split_path")


async def _timed(aw: Awaitable[T], clock: Clock, wanted: int) -> T:
    left = clock.left()
    if left <= 0:
        raise clock.too_slow(wanted)
    import asyncio  # here: the event loop machinery is loaded only by remote reads

    try:
        return await asyncio.wait_for(aw, left)
    except TimeoutError:
        raise clock.too_slow(wanted) from None


async def _request(fs: Any, path: str, start: int, end: int, clock: Clock) -> _Response:
    wanted = f"bytes={start}-{end - 1}"
    if _is_s3(fs):
        bucket, key, version = fs.split_path(path)
        extra = {"VersionId": version} if version else {}
        request = fs._call_s3("get_object", Bucket=bucket, Key=key, Range=wanted, **extra)
        resp = await _timed(request, clock, end - start)
        body = resp["Body"]
        status = int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode") or 200)
        encoding = resp.get("ContentEncoding") or ""
        return _Response(status, resp.get("ContentLength"), resp.get("ContentRange"), encoding, body.read, body.close)
    kw = dict(fs.kwargs)
    headers = {**kw.pop("headers", {}), "Range": wanted, "Accept-Encoding": "identity"}
    session = await fs.set_session()
    r = await _timed(session.get(fs.encode_url(path), headers=headers, **kw), clock, end - start)
    try:
        fs._raise_not_found_for_status(r, path)
    except BaseException:
        r.close()
        raise
    length = r.headers.get("Content-Length")
    return _Response(
        r.status,
        int(length) if length and length.isdigit() else None,
        r.headers.get("Content-Range"),
        r.headers.get("Content-Encoding", ""),
        r.content.read,
        r.close,
    )


_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$", re.IGNORECASE)


def _skip(r: _Response, label: str, start: int, end: int, size: int) -> int:
    """How many bytes of ``r``'s body come before ``start`` (0 for a proper 206), or why the
    response cannot serve ``[start, end)``."""
    n = end - start
    ignores = f"{label}: the server does not honour range requests (asked for bytes {start}-{end - 1}, "
    if r.encoding.lower() not in ("", "identity"):
        raise RemoteError(f"{label}: the server compresses its answer ({r.encoding}); a range of it is not the file's")
    if r.status == 206:
        m = _CONTENT_RANGE.match(r.content_range or "")
        if m is None or int(m.group(1)) != start or int(m.group(2)) > end - 1:
            raise RemoteError(ignores + f"it sent {r.content_range or 'no Content-Range'})")
        if int(m.group(2)) < end - 1 or (m.group(3) != "*" and int(m.group(3)) != size):
            raise RemoteError(f"{label}: the object is no longer {size} bytes (it changed); open it again")
        if r.length is not None and r.length != n:
            raise RemoteError(ignores + f"it announced {human_bytes(r.length)})")
        return 0
    if r.status == 200:
        if r.length is not None and r.length != size:
            raise RemoteError(ignores + f"it sent the whole object as {human_bytes(r.length)}, not {size} bytes)")
        if start == 0 or end <= SMALL_OBJECT:
            return start  # read from the object's start up to the range's end: bounded
        raise RemoteError(ignores + "it sent the whole object)")
    raise RemoteError(f"{label}: unexpected answer to a range request (HTTP {r.status})")


async def _pieces(
    fs: Any, path: str, label: str, start: int, end: int, size: int, clock: Clock
) -> AsyncIterator[bytes]:
    """The bytes ``[start, end)`` in pieces of at most :data:`PIECE`, exactly; see the module."""
    r = await _request(fs, path, start, end, clock)
    try:
        skip = _skip(r, label, start, end, size)
        left = skip + end - start
        parts: list[bytes] = []
        held = 0
        while left:
            chunk = await _timed(r.read(min(left, PIECE - held)), clock, end - start)
            if not chunk:
                raise RemoteError(f"{label}: the answer ended {left} bytes short of byte {end} (the object changed?)")
            clock.got += len(chunk)
            left -= len(chunk)
            if skip:
                cut = min(skip, len(chunk))
                chunk, skip = chunk[cut:], skip - cut
            if chunk:
                parts.append(chunk)
                held += len(chunk)
            if held == PIECE or (not left and held):
                yield parts[0] if len(parts) == 1 else b"".join(parts)
                parts, held = [], 0
        # a body without a length must end where the range (or, read from the start, the object) does
        if r.length is None and (r.status == 206 or end == size) and await _more(r):
            raise RemoteError(
                f"{label}: the server does not honour range requests (it sent more than bytes {start}-{end - 1})"
            )
    finally:
        r.close()


async def _more(r: _Response) -> bool:
    """Whether a body without a length goes on past what was asked (looked for briefly)."""
    import asyncio

    with contextlib.suppress(TimeoutError):
        return bool(await asyncio.wait_for(r.read(1), _EXTRA_WAIT))
    return False


def streams_ranges(fs: Any) -> bool:
    """Whether ``fs``'s answers are read here through a bounded stream (HTTP, S3)."""
    return (_is_http(fs) or _is_s3(fs)) and getattr(fs, "loop", None) is not None


async def _collect(pieces: AsyncIterator[bytes]) -> bytes:
    parts = [p async for p in pieces]
    return parts[0] if len(parts) == 1 else b"".join(parts)


def fetch(fs: Any, path: str, url: str, label: str, start: int, end: int, size: int, stop: Any = None) -> bytes:
    """The bytes ``[start, end)`` of the object, exactly, retried within one deadline; ``stop``
    (an event) abandons the read, as when another part of a large read failed."""
    if not streams_ranges(fs):
        data = call(url, "read", fs.cat_file, path, start=start, end=end)
        if len(data) != end - start:
            raise RemoteError(f"{label}: asked for bytes {start}-{end - 1}, got {len(data)}; the object changed")
        return bytes(data)

    def attempt(clock: Clock) -> bytes:
        return on_loop(fs.loop, _collect(_pieces(fs, path, label, start, end, size, clock)), clock, stop)

    return retried(url, "read", attempt, stop)


async def _next(pieces: AsyncIterator[bytes]) -> bytes | None:
    return await anext(pieces, None)


def _streamed(fs: Any, path: str, url: str, label: str, start: int, end: int, stop: Any) -> Iterator[bytes]:
    """The bytes ``[start, end)`` (the object's end) for a thread, each piece an operation of its
    own: one request where the backend streams a range (S3, HTTP), else range requests."""
    if not streams_ranges(fs):
        for a in range(start, end, PIECE):
            yield fetch(fs, path, url, label, a, min(end, a + PIECE), end, stop)
        return
    clock = Clock(label)
    pieces = _pieces(fs, path, label, start, end, end, clock)
    try:
        while (piece := on_loop(fs.loop, _next(pieces), clock, stop)) is not None:
            yield piece
            clock.restart()
    finally:
        with contextlib.suppress(Exception):
            on_loop(fs.loop, _close(pieces), Clock(label))


async def _close(pieces: AsyncIterator[bytes]) -> None:
    await pieces.aclose()  # type: ignore[attr-defined]


class Stream:
    """The bytes ``[start, end)`` of one remote object, arriving on a thread; see the module."""

    def __init__(self, fs: Any, path: str, url: str, label: str, start: int, end: int) -> None:
        self.start, self.end = start, end
        self._fs, self._path, self._url, self._label = fs, path, url, label
        self._queue: queue.Queue[bytes | BaseException | None] = queue.Queue(maxsize=max(2, AHEAD // PIECE))
        self._held: deque[tuple[int, bytes]] = deque()  # received pieces still kept, in order
        self._lo = self._hi = start  # the held bytes are [lo, hi)
        self._mark = start  # the end of the furthest read so far
        self._done = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dcpstudio-stream", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pos, attempt = self.start, 0
        while pos < self.end and not self._stop.is_set():
            try:
                count(0)
                for piece in _streamed(self._fs, self._path, self._url, self._label, pos, self.end, self._stop):
                    count(len(piece), requests=0)
                    pos += len(piece)
                    attempt = 0
                    if not self._put(piece):
                        return
                if pos < self.end:
                    raise RemoteError(f"{self._label}: the object ends at byte {pos}, before {self.end} (changed?)")
            except Abandoned:
                return
            except Exception as e:
                attempt += 1
                if attempt >= attempts_for(self._url) or not transient(e):
                    self._put(explain(e, self._url))
                    return
        self._put(None)

    def _put(self, item: bytes | BaseException | None) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def serves(self, offset: int, n: int) -> bool:
        """Whether a read of ``n`` bytes at ``offset`` lies in this stream's window."""
        if offset < self._lo or offset + n > self.end:
            return False
        return offset + n <= self._hi or offset - self._mark <= AHEAD

    def read(self, offset: int, out: memoryview) -> bool:
        """Fill ``out`` from the stream; False when the read lies outside its window (or the
        stream ended short). Pieces are copied out as they arrive and dropped once far behind, so
        a large read holds no second copy of itself."""
        n = len(out)
        if not self.serves(offset, n):
            return False
        pos = 0
        while pos < n:
            if offset + pos >= self._hi and not self._pull():
                return False
            pos += self._copy(offset + pos, out[pos:])
            self._mark = max(self._mark, offset + pos)
            while self._held and self._held[0][0] + len(self._held[0][1]) <= self._mark - BEHIND:
                start, piece = self._held.popleft()
                self._lo = start + len(piece)
        return True

    def _pull(self) -> bool:
        if self._done:
            return False
        item = self._queue.get()
        if item is None or isinstance(item, BaseException):
            self._done = True
            if item is None:
                return False
            raise item
        self._held.append((self._hi, item))
        self._hi += len(item)
        return True

    def _copy(self, at: int, out: memoryview) -> int:
        """Copy the held bytes from ``at`` on into ``out``; how many."""
        got = 0
        for start, piece in self._held:
            end = start + len(piece)
            if end <= at + got or got == len(out):
                continue
            a = at + got - start
            take = piece[a : a + len(out) - got]
            out[got : got + len(take)] = take
            got += len(take)
        return got

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
        self._held.clear()  # the thread (a daemon) ends soon: its request is cancelled; nobody waits
