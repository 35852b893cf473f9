"""Raw byte movement between files and tensor memory, without intermediate copies.

Importing this module does not import torch: functions that make tensors import it when called.
"""

from __future__ import annotations

import ctypes
import errno
import io
import os
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

from ..dtypes import dtype_of
from ..errors import CorruptCheckpointError
from .buffers import new_tensor
from .pipeline import prefetch
from .remote.locations import RemoteFile

if TYPE_CHECKING:
    import torch

__all__ = [
    "FileRange",
    "Hole",
    "contiguous_span",
    "copy_range",
    "crc32",
    "pread_into",
    "read_box",
    "read_exact",
    "source_of",
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


def read_exact(f: IO[bytes], offset: int, out: memoryview, label: str, within: tuple[int, int] | None = None) -> None:
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
    if isinstance(f, RemoteFile):  # ``within``: the record read ahead in stays inside
        if f.pread(offset, out, within) < len(out):
            raise CorruptCheckpointError(
                f"{label}: expected {len(out)} bytes at offset {offset}, the file ends early (truncated?)"
            )
        return
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


def crc32(data: memoryview, crc: int = 0) -> int:
    """zlib's CRC-32 (several GB/s), fed in pieces so any size works; ``crc`` continues a running one."""
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

    fd: int | RemoteFile  # a descriptor, or a remote object read by range
    offset: int
    nbytes: int
    crc: int | None = None
    # Added to ``offset`` when the copy starts: a remote record's header is read then, in order
    # with the bytes before it, rather than by a request of its own ahead of time.
    base: Callable[[], int] | None = None

    def start(self) -> int:
        """Where the bytes start in the file."""
        return self.offset + (self.base() if self.base is not None else 0)


@dataclass
class Hole:
    """Output bytes a writer leaves unwritten: it lays the file out (headers, offsets) and skips
    ``nbytes`` where they go, recording the place (:meth:`place`). A distributed conversion lays
    its output out this way, then its ranks fill the holes with positioned writes. ``crc``: the
    bytes' CRC-32 once known (a ZIP header holds it; 0 stands in while laying out)."""

    nbytes: int
    crc: int | None = None
    placed: list[tuple[str, int]] = field(default_factory=list)  # (file name, offset)

    def place(self, f: IO[bytes]) -> None:
        self.placed.append((str(f.name), f.tell()))
        f.seek(self.nbytes, os.SEEK_CUR)


_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOTSUP, errno.EBADF}


def copy_range(src: FileRange, dst: IO[bytes], label: str) -> None:
    """Append ``src`` at the end of ``dst``: inside the kernel between two local files, else
    streamed in pieces, reading the next while writing the current (a remote source is fetched by
    parallel range requests; a remote destination uploads as it goes)."""
    try:
        dst_fd = dst.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        dst_fd = -1
    if isinstance(src.fd, int) and dst_fd >= 0:
        dst.flush()
        _kernel_copy(src, dst_fd, label)
        dst.seek(0, os.SEEK_END)  # the copy moved the descriptor under the buffered writer
        return

    first = src.start()
    end = first + src.nbytes

    def read(offset: int) -> bytearray:
        buf = bytearray(min(_PIECE, end - offset))
        if pread_into(src.fd, memoryview(buf), offset) < len(buf):
            raise CorruptCheckpointError(f"{label}: the file ends early (truncated?)")
        return buf

    for _, buf in prefetch(read, range(first, end, _PIECE)):
        dst.write(buf)


_PIECE = 32 << 20


def source_of(f: IO[bytes]) -> int | RemoteFile:
    """What a :class:`FileRange` of ``f`` reads from: its descriptor, or the remote file itself."""
    return f if isinstance(f, RemoteFile) else f.fileno()


def pread_into(src: int | RemoteFile, out: memoryview, offset: int) -> int:
    """Fill ``out`` from a descriptor or a remote file at ``offset``; the count read (short only at
    the end of the file)."""
    if isinstance(src, RemoteFile):
        return src.pread(offset, out)
    got = 0
    while got < len(out):
        n = os.preadv(src, [out[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def _kernel_copy(src: FileRange, dst_fd: int, label: str) -> None:
    offset, left = src.start(), src.nbytes
    kernel = hasattr(os, "copy_file_range")
    while left:
        if kernel:
            try:
                n = os.copy_file_range(src.fd, dst_fd, left, offset)  # type: ignore[arg-type]
            except OSError as e:
                if e.errno not in _NO_KERNEL_COPY:
                    raise
                kernel = False
                continue
        else:
            piece = os.pread(src.fd, min(left, 8 << 20), offset)  # type: ignore[arg-type]
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


_DENSE_FLOOR = 64 << 10  # a covering read this small costs about what a few separate reads do
_DENSE_RATIO = 2  # a covering read of at most this many times the box's bytes is taken whole
_GAP = 512  # runs at most this far apart are read together: skipping fewer bytes is not worth a call
_BAND = 4 << 20  # the most bytes one read of several runs holds (its scratch buffer)


def read_box(
    f: IO[bytes],
    data_offset: int,
    shape: Sequence[int],
    dtype: Any,
    offsets: Sequence[int],
    sizes: Sequence[int],
    label: str,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Read the box ``offsets + sizes`` of a row-major tensor stored at ``data_offset`` of ``f``
    (into ``out`` when given: a contiguous CPU tensor of the box's size and dtype, reused memory).

    The box is a grid of contiguous *runs* (along the trailing dimensions it covers whole), and
    only about their bytes are read, whatever the tensor's size: one read when the box is a single
    run, or when the bytes from its first element to its last are few (at most 64 KiB) or not much
    more than the box (at most twice); otherwise one read per run, except that runs at most 512
    bytes apart are read together, in bands of at most 4 MiB. So a 64 x 32 window reads at most
    about its own bytes plus 512 per run, and memory stays proportional to the box (plus a band).
    """
    dt = dtype_of(dtype)
    if out is None:
        out = new_tensor(sizes, dt.torch)  # from the active buffer pool, if any
    elif tuple(out.shape) != tuple(sizes) or out.dtype != dt.torch or not out.is_contiguous():
        raise ValueError(f"{label}: read_box needs out of shape {tuple(sizes)} and dtype {dt.name}, contiguous")
    if out.numel() == 0:
        return out
    itemsize = dt.itemsize
    span = contiguous_span(shape, offsets, sizes)
    if span is not None:
        read_exact(f, data_offset + span[0] * itemsize, tensor_buffer(out), label)
        return out
    strides = [itemsize] * len(shape)  # in bytes
    for j in range(len(shape) - 2, -1, -1):
        strides[j] = strides[j + 1] * shape[j + 1]
    last = max(j for j in range(len(shape)) if offsets[j] != 0 or sizes[j] != shape[j])
    run = sizes[last] * strides[last]
    base = data_offset + sum(o * s for o, s in zip(offsets, strides, strict=True))
    dims: list[tuple[int, int]] = []  # (count, byte stride) of the runs' grid, outermost first
    for j in range(last):
        if sizes[j] == 1:
            continue
        if dims and dims[-1][1] == sizes[j] * strides[j]:  # a whole dimension inside: one longer row
            dims[-1] = (dims[-1][0] * sizes[j], strides[j])
        else:
            dims.append((sizes[j], strides[j]))
    _read_runs(f, base, dims, run, tensor_buffer(out), label, _DENSE_FLOOR)
    return out


def _read_runs(
    f: IO[bytes], base: int, dims: list[tuple[int, int]], run: int, out: memoryview, label: str, floor: int
) -> None:
    """Fill ``out`` with the runs of ``run`` bytes at ``base + sum(i * stride)`` over the grid
    ``dims``, in row-major order. ``floor``: covering reads this small are taken whole (at the top
    level only, so the bytes read stay proportional to the box however many sub-grids it has)."""
    if not dims:
        read_exact(f, base, out, label)
        return
    span = sum((n - 1) * s for n, s in dims) + run
    if span <= max(_DENSE_RATIO * len(out), floor):
        _read_covering(f, base, dims, run, out, label)
        return
    (n, stride), rest = dims[0], dims[1:]
    step = len(out) // n
    if rest:
        for i in range(n):
            _read_runs(f, base + i * stride, rest, run, out[i * step : (i + 1) * step], label, 0)
    elif stride - run > _GAP:
        for i in range(n):
            read_exact(f, base + i * stride, out[i * step : (i + 1) * step], label)
    else:
        per = max(1, _BAND // stride)
        for i in range(0, n, per):
            k = min(per, n - i)
            _read_covering(f, base + i * stride, [(k, stride)], run, out[i * step : (i + k) * step], label)


def _read_covering(f: IO[bytes], base: int, dims: list[tuple[int, int]], run: int, out: memoryview, label: str) -> None:
    """One read of everything from the grid's first run to its last, then the runs copied out."""
    import torch

    span = sum((n - 1) * s for n, s in dims) + run
    if span == len(out):
        read_exact(f, base, out, label)
        return
    scratch = torch.empty(span, dtype=torch.uint8)
    read_exact(f, base, tensor_buffer(scratch), label)
    counts = [n for n, _ in dims]
    dst = torch.frombuffer(out, dtype=torch.uint8).view(*counts, run)
    dst.copy_(scratch.as_strided((*counts, run), (*(s for _, s in dims), 1)))
