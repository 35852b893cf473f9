"""A run of elements cast into a buffer the caller gives (a direct writer's block), bit for bit as
torch's ``Tensor.to`` casts them.

float32 -> bfloat16, the cast conversions make most, is done without torch when torch is not
loaded yet (``import torch`` costs 1.2-1.8 s here, the cast of 2 GiB on one core 0.5 s): round to
nearest, ties to even, on the bit patterns, as every torch kernel does it (c10's
``round_to_nearest_even``, the AVX2/AVX-512 ``cvtfp32_bf16``). NaNs are the exception: torch's
scalar kernel writes ``0x7FC0``, its vector kernels ``0xFFFF``, so which one a machine gets depends
on its CPU -- a run holding a NaN is cast by torch itself. tests/core/test_casting.py compares the
two over every special value, subnormals, ties and random bit patterns. With torch loaded (the ranks
of a process group), torch casts: it is faster, and the bytes are the same.
"""

from __future__ import annotations

import sys

from ...dtypes import DType

__all__ = ["bf16_from_f32", "cast_into"]

_STEP = 1 << 16  # elements per numpy pass: the temporaries stay in the core's cache


def bf16_from_f32(src: memoryview, out: memoryview) -> bool:
    """``src`` (float32 values) rounded to bfloat16 into ``out``; False, leaving ``out`` unfinished,
    when ``src`` holds a NaN (whose bytes torch makes differently on different CPUs)."""
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
