"""What torch.save pickles may name, resolved to stand-ins that describe instead of build.

torch's weights-only allow-list (``torch.load(weights_only=True)``): containers, numbers, strings,
dtypes, storage classes and torch's tensor-rebuild functions. Here each rebuild function returns a
:class:`~.refs.TensorRef` -- validated, never allocated -- and each storage reference a
:class:`~.refs.StorageRef` (:class:`LazyStorages`). Kinds of tensor DCP Studio cannot read
(quantized, sparse, nested, subclasses) and tensor classes that build uninitialised memory raise
one-line errors.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

from ..dtypes import BY_NAME, DTYPES, DType
from ..errors import CorruptCheckpointError, UnsupportedFormatError
from .dtensor import DTENSOR_GLOBALS, DTensorRef, is_dtensor_class
from .refs import STORAGE_TYPES, Device, Layout, Size, StorageRef, StorageSource, StorageType, TensorRef
from .subclass import SubclassRef, UnreadableRef

__all__ = ["GET_LAYOUT", "REBUILD", "TORCH_SAVE_GLOBALS", "LazyStorages", "UnreadableRef", "get_layout"]


def _tensor(
    storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any = False, dtype: DType | None = None
) -> TensorRef:
    if not isinstance(storage, StorageRef):
        raise CorruptCheckpointError(f"tensor rebuilt from {type(storage).__name__}, not a storage")
    if dtype is not None and storage.typed and dtype is not storage.dtype:
        raise CorruptCheckpointError(f"a {dtype} tensor over a {storage.dtype} storage")
    return TensorRef(storage, dtype or storage.dtype, size, stride, storage_offset, bool(requires_grad))


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any) -> TensorRef:
    return _tensor(storage, storage_offset, size, stride)


def _rebuild_tensor_v2(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    backward_hooks: Any,
    metadata: Any = None,
) -> TensorRef:
    return _tensor(storage, storage_offset, size, stride, requires_grad)


def _rebuild_tensor_v3(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    backward_hooks: Any,
    dtype: Any,
    metadata: Any = None,
) -> TensorRef:
    if not isinstance(dtype, DType):
        raise CorruptCheckpointError(f"tensor with element type {dtype!r}")
    return _tensor(storage, storage_offset, size, stride, requires_grad, dtype)


def _as_parameter(data: Any, requires_grad: Any = True) -> TensorRef:
    if not isinstance(data, TensorRef):
        raise CorruptCheckpointError(f"parameter built from {type(data).__name__}, not a tensor")
    data.parameter = True
    data.requires_grad = bool(requires_grad)
    return data


def _rebuild_parameter(data: Any, requires_grad: Any, backward_hooks: Any) -> TensorRef:
    return _as_parameter(data, requires_grad)


def _rebuild_parameter_with_state(data: Any, requires_grad: Any, backward_hooks: Any, state: Any) -> TensorRef:
    return _as_parameter(data, requires_grad)


def _rebuild_meta_tensor_no_storage(dtype: Any, size: Any, stride: Any, requires_grad: Any) -> TensorRef:
    if not isinstance(dtype, DType):
        raise CorruptCheckpointError(f"tensor with element type {dtype!r}")
    return TensorRef(None, dtype, size, stride, 0, bool(requires_grad))


class ParameterType:
    """``torch.nn.Parameter``: ``Parameter(tensor, requires_grad)`` marks the tensor."""

    def __new__(cls, data: Any = None, requires_grad: Any = True) -> Any:
        return _as_parameter(data, requires_grad)


class TensorType:
    """``torch.Tensor`` as a type argument of ``_rebuild_from_type_v2``; never built directly."""

    def __new__(cls, *args: Any) -> Any:
        raise UnsupportedFormatError("holds a tensor pickled in a pre-1.0 layout; re-save it with current torch")


def _rebuild_wrapper_subclass(cls: Any, dtype: Any, *args: Any) -> Any:
    """A DTensor's wrapper (:class:`~.dtensor.DTensorRef`), or any other subclass's description
    (:class:`~.subclass.SubclassRef`); either is filled by its state."""
    if len(args) != 6:
        raise CorruptCheckpointError("damaged tensor subclass in pickle")
    size, stride, _offset, _layout, _device, requires_grad = args
    if is_dtensor_class(cls):
        return DTensorRef(dtype, size, stride, requires_grad)
    if not isinstance(cls, type) or issubclass(cls, (TensorType, ParameterType)):
        raise CorruptCheckpointError(f"a tensor subclass of type {str(cls)[:80]!r}")
    return SubclassRef(cls, dtype, size, stride, requires_grad)


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    if not isinstance(args, tuple):
        raise CorruptCheckpointError("damaged tensor rebuild in pickle")
    if getattr(func, "refuses", False):
        return func(*args)  # an UnreadableRef
    if func is _rebuild_wrapper_subclass:
        out = func(*args)
        if new_type is not args[0]:
            raise CorruptCheckpointError("a tensor subclass rebuilt as another type")
        out.__setstate__(state)
        return out
    if func not in _TENSOR_BUILDERS:
        name = getattr(func, "__qualname__", type(func).__name__)
        raise CorruptCheckpointError(f"tensor rebuilt through {str(name)[:80]!r}")
    out = func(*args)
    if new_type is ParameterType:
        _as_parameter(out, out.requires_grad)
    elif new_type is not TensorType:
        raise CorruptCheckpointError(f"tensor of type {new_type!r}")
    return out


def _unsupported(kind: str) -> Callable[..., Any]:
    def rebuild(*args: Any) -> Any:
        what = kind
        if args and isinstance(args[0], Layout):
            what = str(args[0]).removeprefix("torch.")
        return UnreadableRef(
            f"a {what} tensor; only dense tensors are supported (a tensor type DCP Studio cannot read)"
        )

    rebuild.refuses = True  # type: ignore[attr-defined]
    return rebuild


def _no_data(name: str) -> Callable[..., Any]:
    def construct(*args: Any) -> Any:
        raise CorruptCheckpointError(
            f"builds a tensor without stored data (torch.{name}); refusing uninitialised memory"
        )

    return construct


def get_layout(name: Any) -> Layout:
    if name not in ("torch.strided", "torch.sparse_coo", "torch.sparse_csr", "torch.sparse_csc", "torch.sparse_bsr",
                    "torch.sparse_bsc", "torch._mkldnn", "torch.jagged"):  # fmt: skip
        raise CorruptCheckpointError(f"unknown tensor layout {name!r}")
    return Layout(name)


_MAX_ENCODED = 1 << 30


def _encode(text: Any, encoding: Any = "utf-8", errors: Any = "strict") -> bytes:
    """``_codecs.encode``, as protocol-2 pickles use it for ``bytes`` (latin-1 only)."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1", "iso-8859-1") or errors != "strict":
        raise CorruptCheckpointError(
            f"its pickle encodes {type(text).__name__} with {str(encoding)[:20]!r}; only text to latin-1 is allowed"
        )
    return text.encode("latin1")


def _bytearray(source: Any = b"") -> bytearray:
    """``bytearray``, as pickles use it: from bytes only (``bytearray(2**28)`` would allocate them)."""
    if not isinstance(source, (bytes, bytearray)):
        raise CorruptCheckpointError(
            f"its pickle builds bytearray({type(source).__name__}); only a copy of bytes is allowed"
        )
    return bytearray(source)


REBUILD: dict[str, Callable[..., Any]] = {
    "_rebuild_tensor": _rebuild_tensor,
    "_rebuild_tensor_v2": _rebuild_tensor_v2,
    "_rebuild_tensor_v3": _rebuild_tensor_v3,
    "_rebuild_parameter": _rebuild_parameter,
    "_rebuild_parameter_with_state": _rebuild_parameter_with_state,
    "_rebuild_meta_tensor_no_storage": _rebuild_meta_tensor_no_storage,
}
_TENSOR_BUILDERS = set(REBUILD.values())
GET_LAYOUT = get_layout
_LEGACY_TENSOR_CLASSES = [
    f"{d.storage.removesuffix('Storage')}Tensor" for d in DTYPES.values() if d.storage and d.kind != "q"
]

TORCH_SAVE_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): OrderedDict,
    ("collections", "Counter"): Counter,
    ("torch.nn.parameter", "Parameter"): ParameterType,
    ("torch.serialization", "_get_layout"): get_layout,
    ("torch", "Size"): Size,
    ("torch", "Tensor"): TensorType,
    ("torch", "device"): Device,
    ("_codecs", "encode"): _encode,
    ("builtins", "bytearray"): _bytearray,
    ("builtins", "set"): set,
    ("builtins", "complex"): complex,
    **{("torch", name): dtype for name, dtype in BY_NAME.items()},
    **{("torch", name): st for name, st in STORAGE_TYPES.items()},
    ("torch.storage", "UntypedStorage"): STORAGE_TYPES["UntypedStorage"],
    **{("torch._utils", name): fn for name, fn in REBUILD.items()},
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch._utils", "_rebuild_qtensor"): _unsupported("quantized"),
    ("torch._utils", "_rebuild_sparse_tensor"): _unsupported("sparse"),
    ("torch._utils", "_rebuild_nested_tensor"): _unsupported("nested"),
    ("torch._utils", "_rebuild_wrapper_subclass"): _rebuild_wrapper_subclass,
    **DTENSOR_GLOBALS,
    ("torch._utils", "_rebuild_device_tensor_from_numpy"): _unsupported("device (numpy)"),
    ("torch._utils", "_rebuild_device_tensor_from_cpu_tensor"): _unsupported("device"),
    **{
        ("torch", q): Layout(f"torch.{q}")
        for q in (
            "per_tensor_affine",
            "per_tensor_symmetric",
            "per_channel_affine",
            "per_channel_symmetric",
            "per_channel_affine_float_qparams",
        )
    },
    **{(m, n): _no_data(n) for n in _LEGACY_TENSOR_CLASSES for m in ("torch", "torch.cuda")},
    **{(m, n): _unsupported("sparse") for n in _LEGACY_TENSOR_CLASSES for m in ("torch.sparse", "torch.cuda.sparse")},
}


class LazyStorages:
    """``persistent_load`` for torch.save pickles: each storage reference becomes a
    :class:`StorageRef` of ``archive`` (the same object for every use of one record)."""

    def __init__(self, archive: StorageSource | None = None) -> None:
        self.archive = archive
        self.refs: dict[str, StorageRef] = {}

    def persistent_load(self, saved_id: Any) -> StorageRef:
        if not isinstance(saved_id, tuple) or len(saved_id) not in (5, 6):
            raise CorruptCheckpointError(f"invalid persistent id {str(saved_id)[:80]!r}")
        typename = saved_id[0].decode("ascii", "replace") if isinstance(saved_id[0], bytes) else saved_id[0]
        if typename != "storage":
            raise CorruptCheckpointError(f"unknown persistent id type {str(typename)[:40]!r}")
        storage_type, key, _location, numel = saved_id[1:5]
        if len(saved_id) == 6 and saved_id[5] is not None:
            raise UnsupportedFormatError("holds storage views of the pre-1.6 format; re-save it with current torch")
        if not isinstance(storage_type, StorageType):
            raise CorruptCheckpointError(f"storage of type {str(storage_type)[:60]}")
        key = key.decode("ascii", "replace") if isinstance(key, bytes) else key
        if not isinstance(key, (str, int)) or type(numel) is not int or numel < 0:
            raise CorruptCheckpointError(f"storage {str(key)[:40]} has an invalid key or size")
        key = str(key)
        ref = self.refs.get(key)
        if ref is None:
            typed = storage_type.name != "UntypedStorage"
            ref = self.refs[key] = StorageRef(key, storage_type.dtype, numel, self.archive, typed=typed)
        elif ref.dtype is not storage_type.dtype or ref.numel != numel:
            raise CorruptCheckpointError(f"storage {key} is described twice, differently")
        return ref
