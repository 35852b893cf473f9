"""Checks a pickle stream before anything unpickles it: what the stream can make the unpickler do
must fit in budgets derived from the stream itself.

CPython's unpickler trusts two things a hostile stream controls: memo indices (``LONG_BINPUT``
with index 2**30 makes it allocate gigabytes for a 9-byte file) and nesting (a tuple nested a
million deep, used as a dict key, overflows the C stack while it is hashed: a segfault, no
exception). :func:`scan` walks the opcodes once, without building anything, and refuses unknown
opcodes, arguments that run past the stream, memo indices beyond the entries stored so far, and
out-of-band buffers; it returns where the pickle ends and how many nesting containers it builds.
:func:`run_with_stack` then runs the unpickling on a thread whose C stack can hold that much
nesting (a tuple's depth never exceeds the number of containers the stream builds), reading it
through :class:`YieldingStream` so that other threads run meanwhile.
"""

from __future__ import annotations

import mmap
import pickletools
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import CorruptCheckpointError

__all__ = ["StreamInfo", "YieldingStream", "lands_on", "run_with_stack", "scan"]

T = TypeVar("T")

# What each opcode is to the scan: _PLAIN no argument; _FIXED an argument of _LEN[op] bytes; a
# memo store (_MEMOIZE, _PUT with a binary index, _PUT_LINE with a text one); _NESTING a hashable
# container (TUPLE*, FROZENSET); _LINES text argument(s) up to newline; _SIZED a length-prefixed
# argument (_LEN[op] bytes of length); _STOP; _BAD unknown or refused (out-of-band buffers).
_PLAIN, _FIXED, _MEMOIZE, _PUT, _PUT_LINE, _NESTING, _LINES, _SIZED, _STOP, _BAD = range(10)
_KIND = [_BAD] * 256
_LEN = [0] * 256
_SIGNED = {ord("T"), 0x8B}  # BINSTRING, LONG4: signed 4-byte lengths
_TWO_LINES = {ord("c"), ord("i")}  # GLOBAL, INST: module and name
for _op in pickletools.opcodes:
    _code = ord(_op.code)
    _n = None if _op.arg is None else _op.arg.n
    if _code in (0x97, 0x98):
        continue  # NEXT_BUFFER, READONLY_BUFFER: nothing a checkpoint needs
    if _n is None:
        _KIND[_code] = {0x94: _MEMOIZE, ord("."): _STOP}.get(_code, _PLAIN)
        if _code in (ord("t"), 0x85, 0x86, 0x87, 0x91):
            _KIND[_code] = _NESTING
    elif _n > 0:
        _KIND[_code] = _PUT if _code in (ord("q"), ord("r")) else _FIXED
        _LEN[_code] = _n
    elif _n == -1:
        _KIND[_code] = _PUT_LINE if _code == ord("p") else _LINES
    else:
        _KIND[_code] = _SIZED
        _LEN[_code] = {-2: 1, -3: 4, -4: 4, -5: 8}[_n]
# opcodes stepped over by their length alone (everything but the kinds the scan must look into)
_STEP = [1 + _LEN[c] if _KIND[c] in (_PLAIN, _FIXED, _MEMOIZE, _NESTING) else 0 for c in range(256)]


def _run_pattern() -> re.Pattern[bytes]:
    """A run of opcodes stepped over: each of _STEP's opcodes with its fixed-size argument, and the
    short length-prefixed ones (SHORT_BINUNICODE, SHORT_BINBYTES, SHORT_BINSTRING) with theirs. Every
    alternative starts with its own opcode bytes, so the possessive repeat never backtracks."""
    by_step: dict[int, list[int]] = {}
    for code, size in enumerate(_STEP):
        if size:
            by_step.setdefault(size, []).append(code)

    def one_of(codes: list[int]) -> bytes:
        return b"[" + b"".join(re.escape(bytes([c])) for c in codes) + b"]"

    def any_bytes(k: int) -> bytes:
        return b"[\\x00-\\xff]{%d}" % k if k else b""

    alternatives = [one_of(codes) + any_bytes(size - 1) for size, codes in sorted(by_step.items())]
    shorts = [c for c in range(256) if _KIND[c] == _SIZED and _LEN[c] == 1 and c not in _SIGNED]
    lengths = b"|".join(re.escape(bytes([k])) + any_bytes(k) for k in range(256))
    alternatives.append(one_of(shorts) + b"(?:" + lengths + b")")
    return re.compile(b"(?:" + b"|".join(alternatives) + b")*+")


_RUN = _run_pattern()
_WINDOW = 1 << 20  # bytes one match of _RUN may step over (~10 ms)
# counted (with any equal byte inside arguments: an over-count) to bound nesting
_NESTING_OPS = (b"t", b"\x85", b"\x86", b"\x87", b"\x91")

_SAFE_NESTING = 20_000  # nesting any thread's default 8 MiB stack hashes safely (measured: ~150,000)
_STACK_PER_LEVEL = 96  # bytes of C stack per level of tuple hashing (measured: under 64)
_MAX_STACK = 2 << 30


@dataclass(frozen=True)
class StreamInfo:
    end: int  # offset just after the STOP opcode
    nesting: int  # at least the hashable containers it builds: an upper bound on their nesting depth
    puts: int = 0  # memo stores at an index the stream gives (PUT, BINPUT, LONG_BINPUT), not MEMOIZE


def _damaged(label: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{label}: damaged pickle ({why})")


def scan(data: bytes | bytearray | mmap.mmap, label: str, start: int = 0) -> StreamInfo:
    """Walk the opcodes of the pickle at ``data[start:]`` up to its STOP; raise
    :class:`CorruptCheckpointError` for anything an honest pickler never writes.

    Runs of opcodes that need no look inside are stepped over by one regular expression, in C (a
    71 MiB ``.metadata`` scans in 0.8 s; opcode by opcode in Python: 1.7 s). A
    stored memo index must not exceed half the stream read so far (every memo entry costs an
    honest stream at least two bytes), which bounds the memo's memory by the stream's size."""
    n = len(data)
    i = start
    run, step, kinds, lengths = _RUN.match, _STEP, _KIND, _LEN
    puts = 0
    while i < n:
        # a window at a time: one match over many MiB would hold the GIL (a GUI thread) that long
        i = run(data, i, min(n, i + _WINDOW)).end()  # type: ignore[union-attr]  # matches the empty run at least
        if i >= n:
            break
        op = data[i]
        if step[op]:  # an opcode stepped over stops the run at the window's end, or where it runs past the end
            if i + step[op] <= n:
                continue
            break
        i += 1
        kind = kinds[op]
        if kind == _SIZED:
            width = lengths[op]
            size = int.from_bytes(data[i : i + width], "little", signed=op in _SIGNED)
            if size < 0:
                raise _damaged(label, "negative length")
            i += width + size
        elif kind == _PUT:
            puts += 1
            width = lengths[op]
            _check_memo(int.from_bytes(data[i : i + width], "little"), i - start, label)
            i += width
        elif kind == _STOP:
            stream = data if isinstance(data, bytes) else bytes(data[start:i])
            a, b = (start, i) if stream is data else (0, len(stream))
            return StreamInfo(i, sum(stream.count(code, a, b) for code in _NESTING_OPS), puts)
        elif kind in (_LINES, _PUT_LINE):
            for _ in range(2 if op in _TWO_LINES else 1):
                end = data.find(b"\n", i)
                if end < 0:
                    raise _damaged(label, "unterminated text argument")
                if kind == _PUT_LINE:
                    puts += 1
                    text = bytes(data[i:end])
                    if not text.isdigit():
                        raise _damaged(label, "bad memo index")
                    _check_memo(int(text), i - start, label)
                i = end + 1
        else:
            raise _damaged(label, f"unknown or unsupported opcode 0x{op:02x} at byte {i - 1}")
    raise _damaged(label, "it ends before its STOP opcode; truncated?")


def lands_on(data: bytes, positions: list[int], start: int = 0) -> bool:
    """Whether each of ``positions`` (ascending) is where an opcode starts when the stream is read
    from ``start`` (an opcode start) as the unpickler reads it: one walk over every opcode up to the
    last position, no position inside an argument and none past a STOP.

    This is what proves a shortcut over a pickle sound: a byte pattern found by searching the raw
    stream can lie inside an argument (a ``BINBYTES`` whose length swallows it), where the unpickler
    never executes it. Runs of plain opcodes are stepped over by the scan's expression (in C, a
    window at a time); each other opcode by its argument's length."""
    n = len(data)
    i = start
    run, step, kinds, lengths = _RUN.match, _STEP, _KIND, _LEN
    for pos in positions:
        if pos > n:
            return False
        while i < pos:
            i = run(data, i, min(pos, i + _WINDOW)).end()  # type: ignore[union-attr]  # the empty run at least
            if i >= pos:
                break
            op = data[i]
            if step[op]:  # stopped by the window or by ``pos``: this opcode ends past it unless the window
                i += step[op]
                continue
            kind = kinds[op]
            i += 1
            if kind == _SIZED:
                width = lengths[op]
                size = int.from_bytes(data[i : i + width], "little", signed=op in _SIGNED)
                if size < 0:
                    return False
                i += width + size
            elif kind == _PUT:
                i += lengths[op]
            elif kind in (_LINES, _PUT_LINE):
                for _ in range(2 if op in _TWO_LINES else 1):
                    end = data.find(b"\n", i)
                    if end < 0:
                        return False
                    i = end + 1
            else:  # STOP (nothing after it is read), or an opcode the scan refuses
                return False
        if i != pos:
            return False
    return True


def _check_memo(index: int, offset: int, label: str) -> None:
    if index > offset // 2 + 1:
        raise _damaged(label, f"memo index {index} at byte {offset}: more entries than the stream can hold")


def run_with_stack(info: StreamInfo, label: str, fn: Callable[[], T]) -> T:
    """``fn()`` -- the unpickling of a scanned stream -- on a thread whose C stack can hash
    containers nested as deep as the stream could nest them; on this thread when that is shallow."""
    if info.nesting <= _SAFE_NESTING:
        return fn()
    size = (8 << 20) + info.nesting * _STACK_PER_LEVEL
    if size > _MAX_STACK:
        raise CorruptCheckpointError(
            f"{label}: the pickle builds {info.nesting} nested containers; too many to unpickle safely"
        )
    result: list[Any] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as e:
            error.append(e)

    with _STACK_LOCK:
        previous = threading.stack_size(size)
        try:
            worker = threading.Thread(target=run, name="dcpstudio-unpickle", daemon=True)
            worker.start()
        finally:
            threading.stack_size(previous)
    worker.join()
    if error:
        raise error[0]
    found: T = result[0]
    return found


_STACK_LOCK = threading.Lock()


class YieldingStream:
    """The stream as the C unpickler reads it, through Python methods: ``io.BytesIO`` is read from
    C, and an unpickler fed from it holds the GIL for the whole load (seconds for a large DCP
    ``.metadata``: a window's GUI thread would freeze). Called once or twice per 64 KiB frame (or per
    ``peek`` of an unframed stream), these let the interpreter hand the GIL to other threads."""

    _PREFETCH = 1 << 17

    def __init__(self, data: bytes | bytearray) -> None:
        self._bytes = data
        self._data = memoryview(data)
        self._pos = 0

    def read(self, n: int = -1) -> bytes:
        end = len(self._data) if n < 0 else min(len(self._data), self._pos + n)
        out = bytes(self._data[self._pos : end])
        self._pos = end
        return out

    def readinto(self, buffer: Any) -> int:
        out = self.read(len(buffer))
        buffer[: len(out)] = out
        return len(out)

    def peek(self, n: int = 0) -> bytes:
        return bytes(self._data[self._pos : self._pos + max(n, self._PREFETCH)])

    def readline(self) -> bytes:
        end = self._bytes.find(b"\n", self._pos)
        return self.read(-1 if end < 0 else end + 1 - self._pos)
