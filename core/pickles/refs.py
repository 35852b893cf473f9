"""What a checkpoint's pickle says about its tensors, held without torch.

torch.save pickles describe each tensor as a *storage* (a record of raw bytes in the archive) and
a view of it: dtype, shape, stride and offset. :class:`TensorRef` and :class:`StorageRef` hold
exactly that, validated (a view never reaches past its storage), so structure can be read,
shown and re-written without importing torch; bytes are fetched from the storage's ``archive``
only when a value is needed. The small stand-ins below (:class:`Size`, :class:`Device`,
:class:`Layout`) take the place of the torch objects a pickle may name, and pickle back as them
(see :mod:`dcpstudio.core.pickles.unpicklers`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ..dtypes import BY_STORAGE, DTYPES, DType
from ..errors import CorruptCheckpointError

if TYPE_CHECKING:
    from ..io.raw import FileRange

__all__ = ["Device", "Layout", "Size", "StorageRef", "StorageSource", "StorageType", "TensorRef", "is_tensor"]

_UINT8 = DTYPES["uint8"]
MAX_DIMS = 64


class StorageSource(Protocol):
    """Where a storage's bytes live: a torch.save archive on disk or in memory, or a tensor of
    another checkpoint standing in as one storage."""

    label: str

    def storage_bytes(self, ref: StorageRef) -> memoryview:
        """The storage's bytes in native byte order."""
        ...

    def storage_range(self, ref: StorageRef) -> FileRange | None:
        """Where the storage's bytes lie verbatim in a file (CRC set when known), else None."""
        ...


class StorageType:
    """A storage class named in a pickle (``torch.FloatStorage``, ``torch.UntypedStorage``)."""

    __slots__ = ("dtype", "name")

    def __init__(self, name: str, dtype: DType) -> None:
        self.name = name
        self.dtype = dtype

    def __repr__(self) -> str:
        return f"torch.{self.name}"

    def __reduce__(self) -> Any:
        return (_storage_type, (self.name,))  # checkpoint pickles write ``torch.<name>`` (see _pickle)


STORAGE_TYPES: dict[str, StorageType] = {name: StorageType(name, d) for name, d in BY_STORAGE.items()}
STORAGE_TYPES["UntypedStorage"] = StorageType("UntypedStorage", _UINT8)


def _storage_type(name: str) -> StorageType:
    return STORAGE_TYPES[name]


class StorageRef:
    """One storage of a torch.save archive: its record key, element dtype and element count.
    Tensors that share a storage in the file share one StorageRef. An *untyped* storage
    (``torch.UntypedStorage``, for dtypes without a legacy storage class) counts bytes."""

    __slots__ = ("archive", "dtype", "key", "numel", "typed")

    def __init__(
        self, key: str, dtype: DType, numel: int, archive: StorageSource | None = None, *, typed: bool = True
    ) -> None:
        self.key = key
        self.dtype = dtype
        self.numel = numel
        self.archive = archive
        self.typed = typed

    @classmethod
    def for_tensor(cls, key: str, dtype: DType, numel: int, archive: StorageSource | None) -> StorageRef:
        """The storage torch.save would write for a contiguous tensor of ``dtype``."""
        if dtype.storage is not None:
            return cls(key, dtype, numel, archive)
        return cls(key, _UINT8, numel * dtype.itemsize, archive, typed=False)

    @property
    def storage_type(self) -> StorageType:
        return STORAGE_TYPES[self.dtype.storage or "ByteStorage"] if self.typed else STORAGE_TYPES["UntypedStorage"]

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"StorageRef({self.key!r}, {self.dtype}, {self.numel})"


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or len(value) > MAX_DIMS:
        raise CorruptCheckpointError(f"tensor {what} is not a short tuple of integers: {str(value)[:80]}")
    out = tuple(value)
    for v in out:
        if type(v) is not int or v < 0:
            raise CorruptCheckpointError(f"tensor {what} holds {v!r}; expected non-negative integers")
    return out


class TensorRef:
    """A dense tensor as a pickle describes it: a view of ``storage`` (None for a tensor saved
    without data, e.g. on the meta device). ``parameter`` marks an ``nn.Parameter``."""

    __slots__ = ("dtype", "parameter", "requires_grad", "shape", "storage", "storage_offset", "stride")

    def __init__(
        self,
        storage: StorageRef | None,
        dtype: DType,
        shape: Sequence[int],
        stride: Sequence[int],
        storage_offset: int = 0,
        requires_grad: bool = False,
    ) -> None:
        self.storage = storage
        self.dtype = dtype
        self.shape = _ints(shape, "size")
        self.stride = _ints(stride, "stride")
        if len(self.stride) != len(self.shape):
            raise CorruptCheckpointError(f"tensor has {len(self.shape)} dimensions but {len(self.stride)} strides")
        if type(storage_offset) is not int or storage_offset < 0:
            raise CorruptCheckpointError(f"tensor storage offset {storage_offset!r} is invalid")
        self.storage_offset = storage_offset
        self.requires_grad = bool(requires_grad)
        self.parameter = False
        if storage is not None and self.numel:
            last = storage_offset + sum((s - 1) * st for s, st in zip(self.shape, self.stride, strict=True))
            if (last + 1) * dtype.itemsize > storage.nbytes:
                raise CorruptCheckpointError(
                    f"tensor view {list(self.shape)} (stride {list(self.stride)}, offset {storage_offset}) reaches "
                    f"past its storage of {storage.nbytes} bytes"
                )

    @classmethod
    def contiguous(cls, storage: StorageRef | None, dtype: DType, shape: Sequence[int]) -> TensorRef:
        return cls(storage, dtype, shape, contiguous_strides(shape))

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def byte_offset(self) -> int:
        """Where the first element lies in the storage, in bytes."""
        return self.storage_offset * self.dtype.itemsize

    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def covers_storage(self) -> bool:
        """A contiguous view of its whole storage (its bytes are the storage record, as is)."""
        return (
            self.storage is not None
            and self.storage_offset == 0
            and self.is_contiguous()
            and self.nbytes == self.storage.nbytes
        )

    def narrow(self, offsets: Sequence[int], sizes: Sequence[int]) -> TensorRef:
        """The view of the box ``offsets + sizes`` (a region of this tensor)."""
        offset = self.storage_offset + sum(o * st for o, st in zip(offsets, self.stride, strict=True))
        return TensorRef(self.storage, self.dtype, sizes, self.stride, offset, self.requires_grad)

    def __setstate__(self, state: Any) -> None:
        """BUILD: python attributes of a tensor subclass are dropped (no values DCP Studio shows)."""
        if not isinstance(state, (dict, tuple)) or not hasattr(self, "dtype"):
            raise CorruptCheckpointError("damaged tensor state in pickle")

    def __repr__(self) -> str:
        return f"TensorRef({self.dtype}, {list(self.shape)})"


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = []
    step = 1
    for s in reversed(shape):
        strides.append(step)
        step *= max(s, 1)
    return tuple(reversed(strides))


def is_tensor(value: Any) -> bool:
    """A tensor of any kind: a :class:`TensorRef`, or a ``torch.Tensor`` if torch is loaded (or
    loading: the window imports it in the background while checkpoints are opened)."""
    if isinstance(value, TensorRef):
        return True
    import sys

    torch = sys.modules.get("torch")  # being imported on another thread: may not have Tensor yet
    return torch is not None and isinstance(value, getattr(torch, "Tensor", ()))


class Size(tuple[int, ...]):
    """``torch.Size`` in a pickle; pickles back as ``torch.Size``."""

    __slots__ = ()

    def __reduce__(self) -> Any:
        return (Size, (tuple(self),))


class Device:
    """``torch.device`` in a pickle (a location such as ``"cpu"`` or ``"cuda:0"``)."""

    __slots__ = ("spec",)

    def __init__(self, kind: Any, index: Any = None) -> None:
        if not isinstance(kind, str) or (index is not None and type(index) is not int):
            raise CorruptCheckpointError(f"invalid device {kind!r}")
        self.spec = kind if index is None else f"{kind}:{index}"

    def __reduce__(self) -> Any:
        return (Device, (self.spec,))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash(self.spec)

    def __repr__(self) -> str:
        return f"device(type={self.spec!r})"


class Layout(str):
    """``torch.strided`` and friends, as ``torch.serialization._get_layout`` names them."""

    __slots__ = ()
