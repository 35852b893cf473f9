"""Raw byte movement between files and tensor memory, without intermediate copies.

Importing this module does not import torch: functions that make tensors import it when called.
"""

from __future__ import annotations

import ctypes
import errno
import io
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from .dtypes import dtype_of
from .errors import CorruptCheckpointError

if TYPE_CHECKING:
    import torch

__all__ = [
    "FileRange",
    "contiguous_span",
    "copy_range",
    "crc32",
    "read_box",
    "read_exact",
    "swap_bytes",
    "tensor_buffer",
]


def tensor_buffer(t: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes. The caller keeps ``t`` alive."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("tensor_buffer needs a contiguous CPU tensor")
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


def read_exact(f: IO[bytes], offset: int, out: memoryview, label: str) -> None:
    """Fill ``out`` from ``f`` at ``offset``; a short read means the file is truncated.

    Real files are read with ``preadv``, which does not move the file position, so threads may
    share one open file (the window reads previews while a worker converts)."""
    try:
        fd = f.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        fd = -1
    view = out
    pos = offset
    if offset < 0:
        raise CorruptCheckpointError(f"{label}: negative data offset {offset}")
    if fd < 0:
        f.seek(offset)
    while len(view):
        try:
            got = os.preadv(fd, [view], pos) if fd >= 0 else f.readinto(view)  # type: ignore[attr-defined]
        except (OSError, OverflowError) as e:
            raise CorruptCheckpointError(f"{label}: cannot read {len(out)} bytes at offset {offset} ({e})") from e
        if not got:
            raise CorruptCheckpointError(
                f"{label}: expected {len(out)} bytes at offset {offset}, the file ends early (truncated?)"
            )
        view = view[got:]
        pos += got


def swap_bytes(raw: torch.Tensor, dtype: Any) -> torch.Tensor:
    """Byte-swap a uint8 buffer of big-endian ``dtype`` elements into native order."""
    dt = dtype_of(dtype)
    width = dt.itemsize // 2 if dt.is_complex else dt.itemsize
    if width == 1:
        return raw
    return raw.view(-1, width).flip(1).contiguous().view(-1)


def crc32(data: memoryview) -> int:
    """zlib's CRC-32 (several GB/s), fed in pieces so any size works."""
    crc = 0
    step = 1 << 30
    for start in range(0, len(data), step):
        crc = zlib.crc32(data[start : start + step], crc)
    return crc


@dataclass(frozen=True)
class FileRange:
    """Bytes of a source file that go to the output unchanged, with their CRC-32 when known.

    Conversions copy such ranges with ``copy_file_range(2)``, inside the kernel, the way ``cp``
    does: the bytes never enter this process. The CRC comes from the source archive's directory
    (ZIP outputs need it; safetensors outputs do not).
    """

    fd: int
    offset: int
    nbytes: int
    crc: int | None = None


_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOTSUP, errno.EBADF}


def copy_range(src: FileRange, dst_fd: int, label: str) -> None:
    """Append ``src`` at the current position of ``dst_fd``; falls back to read/write where the
    kernel or file system cannot copy between the two files."""
    offset, left = src.offset, src.nbytes
    kernel = hasattr(os, "copy_file_range")
    while left:
        if kernel:
            try:
                n = os.copy_file_range(src.fd, dst_fd, left, offset)
            except OSError as e:
                if e.errno not in _NO_KERNEL_COPY:
                    raise
                kernel = False
                continue
        else:
            piece = os.pread(src.fd, min(left, 8 << 20), offset)
            n = len(piece)
            view = memoryview(piece)
            while view:
                view = view[os.write(dst_fd, view) :]
        if n == 0:
            raise CorruptCheckpointError(f"{label}: the file ends {left} bytes early (truncated?)")
        offset += n
        left -= n


def contiguous_span(size: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> tuple[int, int] | None:
    """``(first element, count)`` when the box ``offsets + lengths`` of a row-major tensor of
    ``size`` is one contiguous run of elements, else None."""
    dims = len(size)
    k = 0
    while k < dims and lengths[k] == 1:
        k += 1
    if any(offsets[j] != 0 or lengths[j] != size[j] for j in range(k + 1, dims)):
        return None
    start = 0
    for j in range(dims):
        start = start * size[j] + offsets[j]
    count = 1
    for n in lengths:
        count *= n
    return start, count


def read_box(
    f: IO[bytes],
    data_offset: int,
    shape: Sequence[int],
    dtype: Any,
    offsets: Sequence[int],
    sizes: Sequence[int],
    label: str,
) -> torch.Tensor:
    """Read the box ``offsets + sizes`` of a row-major tensor stored at ``data_offset`` of ``f``.

    One read when the box is a contiguous run; otherwise the run of whole leading-dimension
    slices that covers it is read and narrowed, so memory stays proportional to the box's rows.
    """
    import torch

    dt = dtype_of(dtype)
    dtype = dt.torch
    out = torch.empty(tuple(sizes), dtype=dtype)
    if out.numel() == 0:
        return out
    itemsize = dt.itemsize
    span = contiguous_span(shape, offsets, sizes)
    if span is not None:
        read_exact(f, data_offset + span[0] * itemsize, tensor_buffer(out), label)
        return out
    row = 1
    for s in shape[1:]:
        row *= s
    block = torch.empty((sizes[0], *shape[1:]), dtype=dtype)
    read_exact(f, data_offset + offsets[0] * row * itemsize, tensor_buffer(block), label)
    view = block
    for dim in range(1, len(shape)):
        view = view.narrow(dim, offsets[dim], sizes[dim])
    out.copy_(view)
    return out
