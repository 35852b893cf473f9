"""From a :class:`~.refs.TensorRef` to what a writer or a viewer needs: the tensor's row-major
bytes (copied in the kernel when they lie in place, read when not) or a torch tensor.

Only the paths that compute something -- a non-contiguous view, a dtype cast, a value for display
-- import torch; a contiguous tensor moves from file to file without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..dtypes import DType
from ..errors import CorruptCheckpointError, UnsupportedFormatError
from ..io.raw import FileRange, crc32, pread_into
from .refs import TensorRef

if TYPE_CHECKING:
    import torch

__all__ = ["Payload", "materialize", "numeric", "tensor_bytes", "to_bytes"]

Payload = FileRange | tuple[memoryview, int | None]  # bytes in a file, or in memory with their CRC


def _storage(t: TensorRef) -> Any:
    if t.storage is None or t.storage.archive is None:
        raise UnsupportedFormatError("a tensor saved without data (meta device) has no values")
    return t.storage


def materialize(t: TensorRef) -> torch.Tensor:
    """A CPU torch tensor with ``t``'s values (a view over its storage's bytes)."""
    import torch

    ref = _storage(t)
    raw = ref.archive.storage_bytes(ref)
    if len(raw) < ref.nbytes:
        raise CorruptCheckpointError(f"{ref.archive.label}: storage {ref.key} is short")
    buf = torch.frombuffer(raw, dtype=torch.uint8) if len(raw) else torch.empty(0, dtype=torch.uint8)
    return torch.empty(0, dtype=t.dtype.torch).set_(buf.untyped_storage(), t.storage_offset, t.shape, t.stride)


_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # a 4-bit float's value by its low three bits


def numeric(t: torch.Tensor) -> torch.Tensor:
    """``t``, or -- for ``float4_e2m1fn_x2``, on which torch has no arithmetic, not even a cast --
    its values as float32, exactly: each byte's low nibble then its high one along the last
    dimension (torch's packing, and safetensors' ``F4`` element order), which doubles."""
    import torch

    if str(t.dtype) != "torch.float4_e2m1fn_x2":
        return t
    table = torch.tensor([*_E2M1, *(-v for v in _E2M1)], dtype=torch.float32)
    raw = t.contiguous().view(torch.uint8).to(torch.int64)
    pairs = torch.stack((table[raw & 0x0F], table[raw >> 4]), dim=-1)
    return pairs.reshape(*t.shape[:-1], t.shape[-1] * 2) if t.dim() else pairs


def to_bytes(t: torch.Tensor) -> memoryview:
    """The row-major bytes of a CPU tensor (copied only when it is not contiguous); the view keeps
    the tensor alive (through numpy, which shares its memory)."""
    import torch

    t = t.detach().cpu().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    array: Any = t.reshape(-1).view(torch.uint8).numpy()
    return memoryview(array)


def tensor_bytes(t: TensorRef, *, need_crc: bool, cast: DType | None = None) -> Payload:
    """The bytes of ``t`` (row-major, cast to ``cast`` if given) for a writer: a :class:`FileRange`
    to copy when they lie verbatim in a file (with their CRC when ``need_crc``), else the bytes
    in memory with their CRC (None when not ``need_crc``)."""
    ref = _storage(t)
    if (cast is None or cast is t.dtype) and t.is_contiguous():
        where = ref.archive.storage_range(ref)
        if where is not None:
            whole = t.covers_storage()
            span = FileRange(where.fd, where.offset + t.byte_offset, t.nbytes, where.crc if whole else None, where.base)
            if not need_crc or span.crc is not None:
                return span
            data = bytearray(span.nbytes)
            view = memoryview(data)
            if pread_into(span.fd, view, span.start()) < span.nbytes:
                raise CorruptCheckpointError(f"{ref.archive.label}: storage {ref.key} ends early (truncated?)")
            return view, crc32(view)
        raw = ref.archive.storage_bytes(ref)[t.byte_offset : t.byte_offset + t.nbytes]
        return raw, crc32(raw) if need_crc else None
    value = materialize(t)
    if cast is not None and cast is not t.dtype:
        value = value.to(cast.torch)
    raw = to_bytes(value)
    return raw, crc32(raw) if need_crc else None
