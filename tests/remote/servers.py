"""Local servers for remote-checkpoint tests: an S3 API (moto) behind a recording, fault-injecting
proxy, and a read-only HTTP server with byte ranges. Both bind 127.0.0.1 on a port the kernel
picks, serve each connection on a daemon thread (clients read ranges in parallel), keep
connections alive, and stop cleanly (``stop()`` or ``with``).

Every request is recorded as a :class:`Request`, so a test can assert how a reader used the store:
how many GETs, which ranges, how many body bytes. A record is filled in as its response goes out
and is complete before the client can have read the whole response, so a test may look at the log
as soon as its client call returns. Faults are armed
for the next matching request(s) and disarm themselves after ``times`` uses:

* ``fail(status)`` answers with an error (an S3 XML error body on the S3 server) without
  forwarding the request;
* ``drop(after_bytes)`` sends the headers and ``after_bytes`` of the body, then closes the
  connection, as a network that drops mid-read;
* ``S3Server.fail_upload_part(after_parts)`` lets ``after_parts`` UploadPart requests through,
  then fails the next ones with 500.
"""

from __future__ import annotations

import contextlib
import dataclasses
import email.utils
import hashlib
import http.client
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit
from xml.sax.saxutils import escape

__all__ = ["RangeHTTPServer", "Request", "S3Server"]

_CHUNK = 64 * 2**10

# Headers that describe one hop, never forwarded. Transfer-Encoding is kept on requests: a chunked
# (possibly aws-chunked, with trailing checksums) body is relayed byte for byte, framing included.
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade", "expect"}

_S3_ERRORS = {
    400: ("BadRequest", "Bad Request"),
    403: ("AccessDenied", "Access Denied"),
    404: ("NoSuchKey", "The specified key does not exist."),
    409: ("OperationAborted", "A conflicting conditional operation is in progress."),
    416: ("InvalidRange", "The requested range is not satisfiable"),
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
}

# Query parameters a GET of an object may carry; any other marks a listing or a sub-resource.
_OBJECT_GET_PARAMS = {"versionId", "partNumber", "x-id"}


@dataclass
class Request:
    """One request as the server answered it.

    ``path`` is the URL path, unquoted, without the leading slash: ``bucket/key`` on the S3
    server, ``dir/file`` on the HTTP server. ``status`` is 0 until the response starts.
    ``bytes_sent`` counts response body bytes handed to the connection. ``fault`` is ``"fail"`` or
    ``"drop"`` when an armed fault shaped the response, else None."""

    method: str
    path: str
    query: str
    range: str | None
    status: int = 0
    bytes_sent: int = 0
    fault: str | None = None

    @property
    def params(self) -> dict[str, str]:
        return dict(parse_qsl(self.query, keep_blank_values=True))


Match = str | Callable[[str, str, str], bool] | None
"""Which requests a fault applies to: None (all), a substring of the path, or a predicate
``(method, path, query) -> bool``."""


@dataclass
class _Fault:
    kind: str  # "fail" or "drop"
    status: int
    after_bytes: int
    method: str | None
    match: Match
    times: int | None  # None: until reset()
    skip: int = 0  # matching requests let through before the fault applies
    longer_than: int | None = None  # only requests asking for more bytes than this (by Range)

    def matches(self, method: str, path: str, query: str, range: str | None = None) -> bool:
        if self.method is not None and method != self.method.upper():
            return False
        if self.longer_than is not None and _asked(range) <= self.longer_than:
            return False
        if self.match is None:
            return True
        if isinstance(self.match, str):
            return self.match in path
        return bool(self.match(method, path, query))


def _asked(range: str | None) -> float:
    """How many bytes a Range header asks for: infinite without one or without an end."""
    first, _, last = (range or "").partition("=")[2].partition("-")
    try:
        return int(last) if not first.strip() else int(last) - int(first) + 1
    except ValueError:
        return float("inf")


class _Recorder:
    """The request log and the armed faults, shared by the handler threads of one server."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._log: list[Request] = []
        self._faults: list[_Fault] = []

    @property
    def log(self) -> list[Request]:
        """A copy of the requests received so far, in the order they arrived."""
        with self._lock:
            return [dataclasses.replace(r) for r in self._log]

    def reset(self) -> None:
        """Forget the log and disarm every fault."""
        with self._lock:
            self._log.clear()
            self._faults.clear()

    def requests(self, method: str | None = None, key_prefix: str | None = None) -> list[Request]:
        return [
            r
            for r in self.log
            if (method is None or r.method == method.upper()) and (key_prefix is None or r.path.startswith(key_prefix))
        ]

    def bytes_sent(self, key_prefix: str | None = None) -> int:
        """Response body bytes sent, over the requests whose path starts with ``key_prefix``."""
        return sum(r.bytes_sent for r in self.requests(key_prefix=key_prefix))

    def gets(self, key_prefix: str | None = None) -> list[Request]:
        """GETs of file contents (not listings), whose path starts with ``key_prefix``."""
        return [r for r in self.requests("GET", key_prefix) if self._is_content_get(r)]

    def _is_content_get(self, r: Request) -> bool:
        return True

    def fail(self, status: int, *, method: str | None = None, match: Match = None, times: int | None = 1) -> None:
        """Answer the next ``times`` matching requests with ``status`` (None: until reset())."""
        self._arm(_Fault("fail", status, 0, method, match, times))

    def drop(
        self, after_bytes: int, *, match: Match = None, times: int | None = 1, longer_than: int | None = None
    ) -> None:
        """Close the connection after ``after_bytes`` body bytes of the responses to the next
        ``times`` matching GETs (one answered other than 200 or 206 uses the fault up, whole).
        ``longer_than``: only GETs whose Range asks for more bytes than that (or has no end), so
        that a long streamed read is cut while the small reads before it go through."""
        self._arm(_Fault("drop", 0, after_bytes, "GET", match, times, longer_than=longer_than))

    def _arm(self, fault: _Fault) -> None:
        if fault.times is not None and fault.times < 1:
            raise ValueError("times must be at least 1 (or None)")
        with self._lock:
            self._faults.append(fault)

    def _take_fault(self, method: str, path: str, query: str, range: str | None = None) -> _Fault | None:
        """The first armed fault this request triggers, used up by one."""
        with self._lock:
            for fault in self._faults:
                if not fault.matches(method, path, query, range):
                    continue
                if fault.skip:
                    fault.skip -= 1
                    continue
                if fault.times is not None:
                    fault.times -= 1
                    if fault.times == 0:
                        self._faults.remove(fault)
                return fault
        return None

    def _begin(self, method: str, path: str, query: str, range: str | None) -> Request:
        """The record of a request just received, logged now and filled in by its handler."""
        request = Request(method, path, query, range)
        with self._lock:
            self._log.append(request)
        return request


class _Server(ThreadingHTTPServer):
    """A threading HTTP server that knows its recorder and its open connections (so that stop()
    can close idle keep-alive connections whose threads would otherwise wait for the client)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, handler: type[BaseHTTPRequestHandler], owner: Any) -> None:
        self.owner = owner
        self.connections: set[socket.socket] = set()
        self.connections_lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that goes away mid-response is normal here; the handler records what it can

    def close_connections(self) -> None:
        with self.connections_lock:
            connections = list(self.connections)
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    """Shared parts: HTTP/1.1 keep-alive, connection tracking, and a body writer that counts bytes
    and can drop the connection part way."""

    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        with self.server.connections_lock:
            self.server.connections.add(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            with self.server.connections_lock:
                self.server.connections.discard(self.connection)

    def log_message(self, format: str, *args: Any) -> None:
        pass

    @property
    def owner(self) -> Any:
        return self.server.owner

    def _begin(self) -> Request:
        """Log this request and return its record, which ``_start`` and ``_write_body`` fill in."""
        split = urlsplit(self.path)
        path = unquote(split.path).lstrip("/")
        self.record = self.owner._begin(self.command, path, split.query, self.headers.get("Range"))
        return self.record

    def _read_body(self) -> bytes:
        """The request body as it came on the wire: chunked framing (and trailers) kept."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raw = bytearray()
            while True:
                line = self.rfile.readline(65537)
                raw += line
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while True:
                        trailer = self.rfile.readline(65537)
                        raw += trailer
                        if trailer in (b"\r\n", b"\n", b""):
                            return bytes(raw)
                raw += self.rfile.read(size + 2)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _start(self, status: int, headers: list[tuple[str, str]], reason: str | None = None) -> None:
        self.record.status = status
        self.send_response_only(status, reason)
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()

    def _write_body(self, chunks: Iterator[bytes], drop_after: int | None = None) -> None:
        """Send ``chunks``, counting each piece before it goes; with ``drop_after``, stop after
        that many bytes and close the connection (FIN, so the client sees a short body)."""
        record = self.record
        try:
            for chunk in chunks:
                if drop_after is not None and record.bytes_sent + len(chunk) >= drop_after:
                    piece = chunk[: drop_after - record.bytes_sent]
                    record.bytes_sent += len(piece)
                    self.wfile.write(piece)
                    break
                record.bytes_sent += len(chunk)
                self.wfile.write(chunk)
        except OSError:
            self.close_connection = True
            return
        if drop_after is not None:
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)

    def _reply(self, status: int, body: bytes, content_type: str) -> None:
        self._start(status, [("Content-Type", content_type), ("Content-Length", str(len(body)))])
        if self.command != "HEAD":
            self._write_body(iter([body]))


class _ServerBase(_Recorder):
    _handler: type[_Handler]

    def __init__(self) -> None:
        super().__init__()
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    def _serve(self) -> None:
        self._httpd = _Server(self._handler, self)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name=type(self).__name__, daemon=True
        )  # stop() waits for the next poll
        self._thread.start()

    @property
    def port(self) -> int:
        assert self._httpd is not None, "server not started"
        return self._httpd.server_address[1]

    def stop(self) -> None:
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.close_connections()
        self._httpd.server_close()
        assert self._thread is not None
        self._thread.join(timeout=10)
        self._httpd = None

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------------------------------------
# S3


class _ProxyHandler(_Handler):
    def setup(self) -> None:
        super().setup()
        self._upstream: http.client.HTTPConnection | None = None

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self._close_upstream()

    def _close_upstream(self) -> None:
        if self._upstream is not None:
            self._upstream.close()
            self._upstream = None

    def do_GET(self) -> None:
        self._proxy()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_OPTIONS = do_PATCH = do_GET

    def _proxy(self) -> None:
        body = self._read_body()
        record = self._begin()
        fault = self.owner._take_fault(record.method, record.path, record.query, record.range)
        if fault is not None and fault.kind == "fail":
            record.fault = "fail"
            self._reply(fault.status, _s3_error(fault.status, record.path), "application/xml")
            return
        headers = [(k, v) for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP]
        try:
            response = self._forward(record.method, headers, body)
        except (OSError, http.client.HTTPException) as e:
            self._reply(502, f"proxy: {e}".encode(), "text/plain")
            return
        self._relay(record.method, response, fault)

    def _forward(self, method: str, headers: list[tuple[str, str]], body: bytes) -> http.client.HTTPResponse:
        """Send the request upstream on this connection's own moto connection; a kept-alive one
        that moto has closed meanwhile is replaced once."""
        for _ in range(2):
            reused = self._upstream is not None
            if self._upstream is None:
                self._upstream = http.client.HTTPConnection("127.0.0.1", self.owner._moto_port, timeout=60)
            conn = self._upstream
            try:
                conn.putrequest(method, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in headers:
                    conn.putheader(name, value)
                conn.endheaders(body or None)
                return conn.getresponse()
            except (ConnectionError, http.client.RemoteDisconnected, http.client.BadStatusLine):
                self._close_upstream()
                if not reused:
                    raise
        raise AssertionError("unreachable")

    def _relay(self, method: str, response: http.client.HTTPResponse, fault: _Fault | None) -> None:
        """Relay moto's response, cut short by ``fault`` (a drop) if it has a 200 or 206 body."""
        headers = [(k, v) for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP | {"transfer-encoding"}]
        has_body = method != "HEAD" and response.status not in (204, 304) and response.status >= 200
        length = response.getheader("Content-Length")
        if has_body and length is None:  # chunked from moto: buffer it, send with a length
            data = response.read()
            headers.append(("Content-Length", str(len(data))))
            chunks: Iterator[bytes] = iter([data])
        else:
            chunks = iter(lambda: response.read(_CHUNK), b"")
        drop_after = None
        if fault is not None and has_body and response.status in (200, 206):
            drop_after = fault.after_bytes
            self.record.fault = "drop"
        self._start(response.status, headers, response.reason)
        if has_body:
            self._write_body(chunks, drop_after)
        else:
            response.read()
        if response.will_close or not response.isclosed():
            self._close_upstream()  # moto asked to close, or the body was cut short


def _s3_error(status: int, path: str) -> bytes:
    code, message = _S3_ERRORS.get(status, (http.client.responses.get(status, "Error").replace(" ", ""), "Error"))
    request_id = hashlib.sha1(f"{path}{threading.get_ident()}".encode()).hexdigest()[:16].upper()
    bucket, _, key = path.partition("/")
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{escape(message)}</Message>"
        f"<BucketName>{escape(bucket)}</BucketName><Key>{escape(key)}</Key>"
        f"<RequestId>{request_id}</RequestId></Error>"
    ).encode()


class S3Server(_ServerBase):
    """moto's S3 server behind a recording, fault-injecting proxy; clients use ``endpoint``."""

    _handler = _ProxyHandler

    def __init__(self) -> None:
        super().__init__()
        from moto.server import ThreadedMotoServer

        # moto's werkzeug server logs every request at INFO to stderr; tests read our log instead.
        self._werkzeug = logging.getLogger("werkzeug")
        self._werkzeug_level = self._werkzeug.level
        self._werkzeug.setLevel(logging.WARNING)
        self._moto: ThreadedMotoServer | None = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._moto.start()
        self._moto_port = self._moto.get_host_and_port()[1]
        self._serve()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _is_content_get(self, r: Request) -> bool:
        _, _, key = r.path.partition("/")
        params = r.params
        return bool(key) and all(p in _OBJECT_GET_PARAMS or p.startswith("response-") for p in params)

    def fail_upload_part(self, after_parts: int = 0, *, times: int | None = 1) -> None:
        """Let ``after_parts`` UploadPart requests succeed, then answer the next ``times`` with 500
        (None: every one until reset())."""

        def is_upload_part(method: str, path: str, query: str) -> bool:
            return method == "PUT" and "partNumber" in dict(parse_qsl(query))

        self._arm(_Fault("fail", 500, 0, "PUT", is_upload_part, times, skip=after_parts))

    def stop(self) -> None:
        super().stop()
        if self._moto is not None:
            self._moto.stop()
            server = self._moto._server  # ThreadedMotoServer.stop() leaves its socket open
            if server is not None:
                server.server_close()
            self._moto = None
            self._werkzeug.setLevel(self._werkzeug_level)


# ---------------------------------------------------------------------------------------------
# HTTP


def _parse_range(header: str | None, size: int) -> tuple[int, int] | str | None:
    """``(start, end)`` inclusive for one satisfiable ``bytes=`` range; None to send the whole
    file (no header, several ranges, or a header we do not understand, as RFC 9110 allows);
    ``"unsatisfiable"`` for a 416."""
    if not header:
        return None
    unit, _, spec = header.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    first, dash, last = spec.strip().partition("-")
    if not dash:
        return None
    try:
        if not first:
            n = int(last)
            if n <= 0 or size == 0:
                return "unsatisfiable"
            return max(0, size - n), size - 1
        start = int(first)
        end = int(last) if last else size - 1
    except ValueError:
        return None
    if start >= size:
        return "unsatisfiable"
    if end < start:
        return None
    return start, min(end, size - 1)


def _file_chunks(path: Path, start: int, length: int) -> Iterator[bytes]:
    with path.open("rb") as f:
        f.seek(start)
        while length > 0:
            chunk = f.read(min(_CHUNK, length))
            if not chunk:
                return
            length -= len(chunk)
            yield chunk


class _FileHandler(_Handler):
    def do_GET(self) -> None:
        self._serve_file()

    do_HEAD = do_GET

    def _serve_file(self) -> None:
        owner: RangeHTTPServer = self.owner
        self._read_body()
        record = self._begin()
        fault = owner._take_fault(record.method, record.path, record.query, record.range)
        if fault is not None and fault.kind == "fail":
            record.fault = "fail"
            message = f"{fault.status} {http.client.responses.get(fault.status, 'Error')}\n".encode()
            self._reply(fault.status, message, "text/plain")
            return
        file = owner._resolve(record.path)
        if file is None:
            self._reply(404, b"404 Not Found\n", "text/plain")
            return
        st = file.stat()
        size = st.st_size
        common = [
            ("Accept-Ranges", "bytes"),
            ("ETag", f'"{st.st_mtime_ns:x}-{size:x}"'),
            ("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True)),
        ]
        span = _parse_range(record.range, size)
        if span == "unsatisfiable":
            self._start(416, [*common, ("Content-Range", f"bytes */{size}"), ("Content-Length", "0")])
            return
        if span is None:
            status, start, length = 200, 0, size
            headers = common
        else:
            assert isinstance(span, tuple)
            status, start, length = 206, span[0], span[1] - span[0] + 1
            headers = [*common, ("Content-Range", f"bytes {span[0]}-{span[1]}/{size}")]
        drop_after = None
        if fault is not None and record.method == "GET":
            drop_after = fault.after_bytes
            record.fault = "drop"
        self._start(status, [*headers, ("Content-Type", "application/octet-stream"), ("Content-Length", str(length))])
        if record.method == "GET":
            self._write_body(_file_chunks(file, start, length), drop_after)


class RangeHTTPServer(_ServerBase):
    """Serves the files under ``root`` read-only (GET, HEAD, single byte ranges) at ``url``."""

    _handler = _FileHandler

    def __init__(self, root: str | Path) -> None:
        super().__init__()
        self.root = Path(root).resolve()
        self._serve()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _resolve(self, path: str) -> Path | None:
        file = (self.root / path).resolve()
        if not file.is_relative_to(self.root) or not file.is_file():
            return None
        return file
