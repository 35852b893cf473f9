"""One request for a run of sequential reads: a remote object streamed from an offset on.

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
import threading
from collections import deque
from collections.abc import Iterator
from typing import Any

from ._remote_fs import RemoteError, attempts_for, count, explain, transient

__all__ = ["AHEAD", "BEHIND", "PIECE", "Stream"]

PIECE = 4 << 20  # what the stream's thread reads at a time
AHEAD = 32 << 20  # received, not yet asked for
BEHIND = 64 << 20  # kept behind the furthest byte asked for


def _pieces(fs: Any, path: str, start: int, end: int) -> Iterator[bytes]:
    """The bytes ``[start, end)`` of the object, as they arrive from one request where the backend
    can stream a range (S3, HTTP), else by range requests of :data:`PIECE`."""
    from fsspec.asyn import sync

    if hasattr(fs, "_call_s3") and hasattr(fs, "split_path"):
        bucket, key, version = fs.split_path(path)
        extra = {"VersionId": version} if version else {}
        resp = sync(
            fs.loop, fs._call_s3, "get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", **extra
        )
        body = resp["Body"]
        try:
            while piece := sync(fs.loop, body.read, PIECE):
                yield piece
        finally:
            body.close()
        return
    if type(fs).__name__ == "HTTPFileSystem":
        f = fs.open(path, "rb", block_size=0, headers={"Range": f"bytes={start}-{end - 1}"})
        try:
            status = getattr(getattr(f, "r", None), "status", 206)
            if status != 206 and start != 0:
                raise RemoteError("the server ignores range requests")
            while piece := f.read(PIECE):
                yield piece
        finally:
            f.close()
        return
    for a in range(start, end, PIECE):
        yield fs.cat_file(path, start=a, end=min(end, a + PIECE))


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
                for piece in _pieces(self._fs, self._path, pos, self.end):
                    count(len(piece), requests=0)
                    pos += len(piece)
                    attempt = 0
                    if not self._put(piece):
                        return
                if pos < self.end:
                    raise RemoteError(f"{self._label}: the object ends at byte {pos}, before {self.end} (changed?)")
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
        self._held.clear()  # the thread (a daemon) ends at its next piece; nobody waits for it
