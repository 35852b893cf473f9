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

from ...dtypes import DType

__all__ = ["bf16_from_f32", "cast_into", "cast_threads"]

_STEP = 1 << 16  # elements per numpy pass: the temporaries stay in the core's cache


_PART = 1 << 20  # source bytes a thread casts, at least


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


def bf16_from_f32(src: memoryview, out: memoryview, threads: int | None = None) -> bool:
    """``src`` (float32 values) rounded to bfloat16 into ``out``, in parts of at least 1 MiB on up to
    ``threads`` threads at once (default :func:`cast_threads`); False, leaving ``out`` unfinished,
    when ``src`` holds a NaN (whose bytes torch makes differently on different CPUs)."""
    n = min(cast_threads() if threads is None else threads, src.nbytes // _PART)
    if n <= 1:
        return _bf16_from_f32(src, out)
    per = -(-(src.nbytes // 4) // n)  # elements per part
    parts = [(src[i * per * 4 : (i + 1) * per * 4], out[i * per * 2 : (i + 1) * per * 2]) for i in range(n)]
    done: list[bool | BaseException] = [False] * n

    def run(i: int) -> None:
        try:
            done[i] = _bf16_from_f32(*parts[i])
        except BaseException as e:  # raised on the caller's thread below
            done[i] = e

    helpers = [threading.Thread(target=run, args=(i,), name="dcpstudio-cast", daemon=True) for i in range(1, n)]
    for t in helpers:
        t.start()
    run(0)
    for t in helpers:
        t.join()
    for d in done:
        if isinstance(d, BaseException):
            raise d
    return all(done)


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


def cast_into(src: memoryview, src_dtype: DType, dst_dtype: DType, out: memoryview) -> None:
    """``src`` (elements of ``src_dtype``) cast to ``dst_dtype`` into ``out``, as torch casts them."""
    if src.nbytes // src_dtype.itemsize * dst_dtype.itemsize != out.nbytes:
        raise ValueError(f"cast of {src.nbytes} bytes of {src_dtype.name} into {out.nbytes} of {dst_dtype.name}")
    if not src.nbytes:
        return
    if (
        src_dtype.name == "float32"
        and dst_dtype.name == "bfloat16"
        and "torch" not in sys.modules
        and bf16_from_f32(src, out)
    ):
        return
    import torch

    torch.frombuffer(out, dtype=dst_dtype.torch).copy_(torch.frombuffer(src, dtype=src_dtype.torch))
