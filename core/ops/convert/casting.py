"""A run of elements cast into a buffer the caller gives (a direct writer's block), bit for bit as
torch's ``Tensor.to`` casts them.

float32 -> bfloat16, the cast conversions make most, is done without torch when torch is not
loaded yet (``import torch`` costs 1.2-1.8 s here, the cast of 2 GiB on one core 0.5 s): round to
nearest, ties to even, on the bit patterns, as every torch kernel does it (c10's
``round_to_nearest_even``, the AVX2/AVX-512 ``cvtfp32_bf16``). NaNs are the exception: torch's
scalar kernel writes ``0x7FC0``, its vector kernels ``0xFFFF``, so which one a machine gets depends
on its CPU -- a run holding a NaN is cast by torch itself. tests/core/test_casting.py compares the
two over every special value, subnormals, ties and random bit patterns. A long run is cut into parts
cast on threads at once (numpy lets go of the GIL in its loops): 2 GiB here 0.77 s on one thread,
0.48 s on two. With torch loaded (the ranks of a process group), torch casts: it is faster, and the
bytes are the same.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ...dtypes import DType

T = TypeVar("T")

__all__ = ["bf16_from_f32", "cast_into", "cast_threads", "in_parts", "torch_free"]

_STEP = 1 << 16  # elements per numpy pass: the temporaries stay in the core's cache
_PART = 1 << 18  # elements a thread casts, at least (1 MiB of float32)
_ALIGN = 4096  # parts start at multiples of this many elements: torch's vector loops see the same runs


def cast_threads() -> int:
    """Threads for one cast: ``OMP_NUM_THREADS`` where it is set (ranks that share the cores set it,
    as torchrun does), else the CPUs this process may run on; at most 8 (it is memory-bound)."""
    try:
        n = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        n = 0
    if n < 1:
        n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(n, 8))


def torch_free(src_dtype: DType, dst_dtype: DType) -> bool:
    """Whether :func:`cast_into` casts ``src_dtype`` to ``dst_dtype`` without torch (NaNs aside)."""
    return src_dtype.name == "float32" and dst_dtype.name == "bfloat16" and "torch" not in sys.modules


def in_parts(elements: int, fn: Callable[[int, int], T], threads: int | None = None) -> list[T]:
    """``fn(start, end)`` over ``[0, elements)`` cut into parts of at least 256 Ki elements, each
    starting at a multiple of 4,096, run on up to ``threads`` threads at once (default
    :func:`cast_threads`; numpy and ``pread`` let go of the GIL); their results in order. An error
    in any part is raised here, once every part has ended."""
    n = max(1, min(cast_threads() if threads is None else threads, elements // _PART))
    per = -(-elements // n // _ALIGN) * _ALIGN if n > 1 else elements
    spans = [(a, min(elements, a + per)) for a in range(0, elements, per)] or [(0, 0)]
    n = len(spans)
    if n == 1:
        return [fn(*spans[0])]
    done: list[Any] = [None] * len(spans)
    failed: list[BaseException] = []

    def run(i: int) -> None:
        try:
            done[i] = fn(*spans[i])
        except BaseException as e:  # raised on the caller's thread below
            failed.append(e)

    helpers = [threading.Thread(target=run, args=(i,), name="dcpstudio-cast", daemon=True) for i in range(1, n)]
    for t in helpers:
        t.start()
    run(0)
    for t in helpers:
        t.join()
    if failed:
        raise failed[0]
    return done


def bf16_from_f32(src: memoryview, out: memoryview, threads: int | None = None) -> bool:
    """``src`` (float32 values) rounded to bfloat16 into ``out``, in parts on up to ``threads``
    threads (:func:`in_parts`); False, leaving ``out`` unfinished, when ``src`` holds a NaN (whose
    bytes torch makes differently on different CPUs)."""
    return all(in_parts(src.nbytes // 4, lambda a, b: _bf16_from_f32(src[a * 4 : b * 4], out[a * 2 : b * 2]), threads))


def _bf16_from_f32(src: memoryview, out: memoryview) -> bool:
    import numpy as np

    a = np.frombuffer(src, dtype=np.float32)
    if not a.size:
        return True
    if np.isnan(a.max()):  # max propagates NaN, in one vectorised pass
        return False
    u = a.view(np.uint32)
    r = np.frombuffer(out, dtype=np.uint16)
    t = np.empty(min(_STEP, u.size), dtype=np.uint32)
    for s in range(0, u.size, _STEP):
        x, y = u[s : s + _STEP], t[: min(_STEP, u.size - s)]
        np.right_shift(x, 16, out=y)
        np.bitwise_and(y, 1, out=y)  # the last bit kept: a tie goes to the even one
        np.add(y, x, out=y)
        np.add(y, 0x7FFF, out=y)
        np.right_shift(y, 16, out=r[s : s + y.size], casting="unsafe")  # the low half: the bfloat16
    return True


def cast_into(src: memoryview, src_dtype: DType, dst_dtype: DType, out: memoryview, threads: int | None = None) -> None:
    """``src`` (elements of ``src_dtype``) cast to ``dst_dtype`` into ``out``, as torch casts them;
    ``threads`` for a cast without torch (:func:`bf16_from_f32`)."""
    if src.nbytes // src_dtype.itemsize * dst_dtype.itemsize != out.nbytes:
        raise ValueError(f"cast of {src.nbytes} bytes of {src_dtype.name} into {out.nbytes} of {dst_dtype.name}")
    if not src.nbytes:
        return
    if torch_free(src_dtype, dst_dtype) and bf16_from_f32(src, out, threads):
        return
    import torch

    torch.frombuffer(out, dtype=dst_dtype.torch).copy_(torch.frombuffer(src, dtype=src_dtype.torch))
