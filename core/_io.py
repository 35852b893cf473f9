"""Raw byte movement between files and tensor memory, without intermediate copies."""

from __future__ import annotations

import ctypes
from typing import IO

import torch

from .errors import CorruptCheckpointError

__all__ = ["read_exact", "tensor_buffer", "swap_bytes"]


def tensor_buffer(t: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes. The caller keeps ``t`` alive."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("tensor_buffer needs a contiguous CPU tensor")
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


def read_exact(f: IO[bytes], offset: int, out: memoryview, label: str) -> None:
    """Fill ``out`` from ``f`` at ``offset``; a short read means the file is truncated."""
    f.seek(offset)
    view = out
    while len(view):
        got = f.readinto(view)  # type: ignore[attr-defined]
        if not got:
            raise CorruptCheckpointError(
                f"{label}: expected {len(out)} bytes at offset {offset}, the file ends early (truncated?)"
            )
        view = view[got:]


def swap_bytes(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Byte-swap a uint8 buffer of big-endian ``dtype`` elements into native order."""
    width = torch.empty((), dtype=dtype).element_size()
    if dtype.is_complex:
        width //= 2
    if width == 1:
        return raw
    return raw.view(-1, width).flip(1).contiguous().view(-1)
