"""How remote operations are called: fsspec file systems made with bounded waits, retries, and
the time each operation may take.

Every operation (a metadata request, a range read with its retries, a piece of a streamed read)
has a deadline (``DCPSTUDIO_REMOTE_DEADLINE``, seconds) and a minimum transfer rate
(``DCPSTUDIO_REMOTE_MIN_RATE``, bytes per second), read from the environment so that a child
process keeps them. Coroutines of the backends run on fsspec's I/O loop through :func:`on_loop`,
which cancels them there when time is up or the caller stops: a signal leaves nothing running.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import os
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import asyncio

from ...units import human_bytes
from .fs import RETRIES, RemoteError, backend, explain, scheme, shown_url, transient

__all__ = [
    "DEADLINE_ENV",
    "MIN_RATE_ENV",
    "Abandoned",
    "Clock",
    "Limits",
    "attempts_for",
    "call",
    "filesystem",
    "limits",
    "on_loop",
    "retried",
]

_fs_lock = threading.Lock()


CONNECT_TIMEOUT, READ_TIMEOUT = 30, 120  # seconds: a stalled server fails a request, then its retries


def _timeouts(url: str) -> dict[str, Any]:
    """Bounded waits for the backends whose defaults are long (aiohttp: 5 minutes per request),
    never longer than an operation's deadline."""
    kind = backend(url)
    deadline = limits().deadline
    connect, read = min(CONNECT_TIMEOUT, deadline), min(READ_TIMEOUT, deadline)
    if kind == "http":
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect, sock_read=read)
        return {"client_kwargs": {"timeout": timeout}}
    if kind == "s3":
        return {"config_kwargs": {"connect_timeout": connect, "read_timeout": read}}
    return {}


DEADLINE_ENV, MIN_RATE_ENV = "DCPSTUDIO_REMOTE_DEADLINE", "DCPSTUDIO_REMOTE_MIN_RATE"
DEADLINE = 300.0  # seconds for one operation, its retries included
MIN_RATE = 16 << 10  # bytes per second, on average over a transfer
RATE_GRACE = 10.0  # seconds a request has for its answer to start before the rate counts


@dataclass(frozen=True)
class Limits:
    deadline: float
    min_rate: float  # 0: no minimum


def limits() -> Limits:
    """The bounds on remote operations, from the environment (so a child process has the same)."""

    def number(name: str, default: float, zero_ok: bool) -> float:
        text = os.environ.get(name, "").strip()
        if not text:
            return default
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not (value > 0 or (zero_ok and value == 0)) or value == float("inf"):
            unit = "bytes per second (0: no minimum)" if zero_ok else "seconds"
            raise RemoteError(f"{name} must be a positive number of {unit}, not {text!r}")
        return value

    return Limits(number(DEADLINE_ENV, DEADLINE, False), number(MIN_RATE_ENV, MIN_RATE, True))


class Abandoned(Exception):
    """A read given up by its caller (another part of it failed, or the process is stopping)."""


class Clock:
    """The time one remote operation is given: all of it (its attempts included) ends within the
    deadline, and each attempt must bring its bytes at the minimum rate once :data:`RATE_GRACE`
    has passed -- a server trickling a byte every few seconds is cut off, however long a single
    read's socket timeout is. A streamed read restarts it (:meth:`restart`) for each piece."""

    def __init__(self, label: str, doing: str = "read") -> None:
        self.label, self.doing = label, doing
        self.limits = limits()
        self.restart()

    def restart(self) -> None:
        self.end = time.monotonic() + self.limits.deadline
        self.attempt()

    def attempt(self) -> None:
        self.t0, self.got = time.monotonic(), 0

    def remaining(self) -> float:
        return self.end - time.monotonic()

    def left(self) -> float:
        """Seconds the next bytes may take to arrive (at most what remains of the deadline)."""
        due = self.end
        if self.limits.min_rate:
            due = min(due, self.t0 + RATE_GRACE + self.got / self.limits.min_rate)
        return due - time.monotonic()

    def too_slow(self, wanted: int) -> RemoteError:
        """The one line for a read that ran out of time, naming the bound it hit."""
        if self.remaining() <= 0.05:
            return RemoteError(
                f"{self.label}: cannot {self.doing}: no complete answer within {self.limits.deadline:g} s "
                f"(the server is too slow; {DEADLINE_ENV} allows more)"
            )
        spent = time.monotonic() - self.t0
        return RemoteError(
            f"{self.label}: cannot {self.doing}: the server sent {self.got} of {wanted} bytes in {spent:.0f} s, "
            f"slower than the minimum of {human_bytes(self.limits.min_rate)}/s ({MIN_RATE_ENV})"
        )


T = TypeVar("T")
_POLL = 0.1  # seconds between looks at a caller's stop flag


def on_loop(
    loop: asyncio.AbstractEventLoop,
    coro: Coroutine[Any, Any, T],
    clock: Clock,
    stop: threading.Event | None = None,
) -> T:
    """``coro``'s result, run on a backend's event loop (fsspec's I/O thread) from this thread,
    cancelled there when the deadline passes, ``stop`` is set, or this thread is interrupted
    (a signal): nothing is left running on the loop for the interpreter's exit to complain of."""
    import asyncio  # here: a local checkpoint's command does not load the event loop machinery

    fut = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        while not fut.done():
            concurrent.futures.wait([fut], timeout=max(0.0, min(_POLL, clock.remaining() + 1)))
            if fut.done():
                break
            if stop is not None and stop.is_set():
                raise Abandoned()
            if clock.remaining() < -1:
                raise clock.too_slow(0)
        return fut.result()
    except concurrent.futures.CancelledError:
        raise Abandoned() from None  # cancelled on the loop: the process is exiting
    except BaseException:
        fut.cancel()
        raise


def _quiet_exit() -> None:
    """Cancel what still runs on fsspec's I/O loop (a read a signal interrupted) and let it end,
    so that the interpreter's exit prints no "Task was destroyed but it is pending!"."""
    with contextlib.suppress(Exception):
        import asyncio

        import fsspec.asyn

        loop = fsspec.asyn.loop[0]
        if loop is None or loop.is_closed() or not loop.is_running():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=1)

        asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(timeout=2)


_exit_hook = threading.Lock()
_hooked = False


def _hook_exit() -> None:
    global _hooked
    with _exit_hook:
        if not _hooked:
            atexit.register(_quiet_exit)
            _hooked = True


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec file system for ``url`` and the path inside it."""
    try:
        import fsspec.core

        _hook_exit()
        with _fs_lock:
            return fsspec.core.url_to_fs(url, **_timeouts(url))
    except ValueError as e:
        if "Protocol not known" in str(e) or "not known" in str(e):
            raise RemoteError(f"{shown_url(url)}: unsupported kind of address ({scheme(url)}://)") from None
        raise explain(e, url, "open") from None
    except Exception as e:
        raise explain(e, url, "open") from None


def attempts_for(url: str) -> int:
    """Attempts at one request: the object stores' backends retry on their own (s3fs and botocore
    five times), so once more on top of them; HTTP (aiohttp) does not, so :data:`RETRIES`."""
    return 2 if backend(url) in ("s3", "gcs", "azure") else RETRIES


def call(url: str, doing: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args)`` retried on transient failures within the operation's deadline, its exceptions
    turned into one line. A method of an asynchronous file system runs as its coroutine twin
    (``info`` as ``_info``), which the deadline can cancel."""
    fs = getattr(fn, "__self__", None)
    twin = getattr(fs, "_" + getattr(fn, "__name__", ""), None)
    loop = getattr(fs, "loop", None) if getattr(fs, "async_impl", False) else None

    def attempt(clock: Clock) -> Any:
        import asyncio

        if twin is None or loop is None or not asyncio.iscoroutinefunction(twin):
            return fn(*args, **kwargs)
        return on_loop(loop, twin(*args, **kwargs), clock)

    return retried(url, doing, attempt)


def retried(url: str, doing: str, attempt: Callable[[Clock], T], stop: threading.Event | None = None) -> T:
    """``attempt(clock)`` until it succeeds, fails for good, or the deadline or attempts
    (:func:`attempts_for`) are used up; a failure becomes one line (:func:`explain`)."""
    clock = Clock(shown_url(url), doing)
    delay = 0.2
    attempts = attempts_for(url)
    for i in range(attempts):
        clock.attempt()
        try:
            return attempt(clock)
        except Abandoned:
            raise
        except Exception as e:
            last = i == attempts - 1 or clock.remaining() <= delay or (stop is not None and stop.is_set())
            if last or not transient(e):
                raise explain(e, url, doing) from None
        time.sleep(delay)
        delay *= 2.5
    raise AssertionError("unreachable")
