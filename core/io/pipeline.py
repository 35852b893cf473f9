"""Overlap producing the next item with consuming the current one, with bounded look-ahead."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

__all__ = ["prefetch"]

T = TypeVar("T")
R = TypeVar("R")


def prefetch(fn: Callable[[T], R], items: Iterable[T], depth: int = 1) -> Iterator[tuple[T, R]]:
    """Yield ``(item, fn(item))`` in order, computing up to ``depth`` results ahead on one thread.

    File reads and tensor copies release the GIL, so reading tensor N+1 proceeds while the caller
    writes tensor N. At most ``depth + 1`` results exist at once (bounded memory). If the consumer
    stops early, pending work is cancelled or awaited before returning, so no thread outlives it.
    """
    pending: deque[tuple[T, Future[R]]] = deque()
    source = iter(items)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcpstudio-prefetch") as pool:
        try:
            for item in source:
                pending.append((item, pool.submit(fn, item)))
                if len(pending) > depth:
                    head, fut = pending.popleft()
                    yield head, fut.result()
            while pending:
                head, fut = pending.popleft()
                yield head, fut.result()
        finally:
            for _, fut in pending:
                fut.cancel()
