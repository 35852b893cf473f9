"""Restricted unpicklers: nothing a checkpoint's pickle names is called unless it is allow-listed.

Two pickles occur in checkpoints:

* torch.save's ``data.pkl`` (whole files and every DCP tensor chunk). It is read with torch's own
  weights-only unpickler -- the semantics of ``torch.load(weights_only=True)`` -- and a
  ``persistent_load`` that turns each storage reference into a *meta* storage of the right size.
  Tensors come out as meta tensors with their true dtype, shape, stride and offset; their bytes are
  read later, one storage at a time (:class:`LazyStorages` remembers which record backs which).
* DCP's ``.metadata``: a pickle of torch's metadata dataclasses, read by :class:`MetadataUnpickler`
  which admits only those classes and the few torch types they contain.

``trust=True`` swaps in the standard unpickler (full pickle semantics) for inputs the user vouches
for; the callers warn when they do.
"""

from __future__ import annotations

import contextlib
import gc
import io
import pathlib
import pickle
import re
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import torch
import torch._weights_only_unpickler as _weights_only
from torch.distributed.checkpoint import filesystem as _dcp_fs
from torch.distributed.checkpoint import metadata as _dcp_md

from .errors import CorruptCheckpointError, UnsafePickleError, UnsupportedFormatError

__all__ = [
    "LazyStorages",
    "LightRecord",
    "MetadataUnpickler",
    "StorageRef",
    "gc_paused",
    "load_light_metadata",
    "load_light_metadata_head",
    "load_metadata_pickle",
    "load_torch_pickle",
]


@dataclass(frozen=True)
class StorageRef:
    """One storage of a torch.save pickle: its record key, element dtype and size."""

    key: str
    dtype: torch.dtype
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * _element_size(self.dtype)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


_STORAGE_DTYPES: dict[type, torch.dtype] = {}


def _storage_dtype(storage_type: Any) -> torch.dtype:
    if storage_type is torch.UntypedStorage:
        return torch.uint8
    if storage_type not in _STORAGE_DTYPES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dtype = getattr(storage_type, "dtype", None)
        if not isinstance(dtype, torch.dtype):
            raise CorruptCheckpointError(f"unknown storage type {storage_type!r}")
        _STORAGE_DTYPES[storage_type] = dtype
    return _STORAGE_DTYPES[storage_type]


class LazyStorages:
    """``persistent_load`` for torch.save pickles that allocates no memory for tensor data.

    Each storage reference becomes a meta storage of the recorded size; tensors rebuilt on it keep
    their dtype, shape, stride and storage offset. :meth:`ref_of` maps a rebuilt tensor back to the
    record that holds its bytes; tensors that share a storage in the file share it here too.
    """

    def __init__(self) -> None:
        self.refs: dict[str, StorageRef] = {}
        self._storages: dict[str, torch.storage.TypedStorage] = {}
        self._by_cdata: dict[int, StorageRef] = {}

    def persistent_load(self, saved_id: Any) -> torch.storage.TypedStorage:
        if not isinstance(saved_id, tuple) or len(saved_id) < 5:
            raise CorruptCheckpointError(f"unexpected persistent id {saved_id!r}")
        typename = saved_id[0].decode("ascii") if isinstance(saved_id[0], bytes) else saved_id[0]
        if typename != "storage":
            raise CorruptCheckpointError(f"unknown persistent id type {typename!r}")
        storage_type, key, _location, numel = saved_id[1:5]
        key = key.decode("ascii") if isinstance(key, bytes) else str(key)
        if not isinstance(numel, int) or numel < 0:
            raise CorruptCheckpointError(f"storage {key} has an invalid size {numel!r}")
        if key in self._storages:
            return self._storages[key]
        dtype = _storage_dtype(storage_type)
        ref = StorageRef(key, dtype, numel)
        untyped = torch.UntypedStorage(ref.nbytes, device="meta")
        typed = torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)
        self.refs[key] = ref
        self._storages[key] = typed
        self._by_cdata[untyped._cdata] = ref
        return typed

    def ref_of(self, tensor: torch.Tensor) -> StorageRef | None:
        """The storage record behind a tensor rebuilt by this loader (None for any other tensor)."""
        if tensor.device.type != "meta":
            return None
        return self._by_cdata.get(tensor.untyped_storage()._cdata)


_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")


def _names_a_global(message: str) -> bool:
    """Whether an unpickling error is a refused import (hostile) rather than damaged data."""
    return "global" in message.lower()


def _unsafe_message(label: str, error: Exception) -> str:
    match = _GLOBAL_RE.search(str(error))
    what = f"'{match.group(1)}'" if match else "an object outside the weights-only allow-list"
    return (
        f"{label}: refused to load {what} from its pickle (it could run code); "
        "if you trust this file, pass --trust-pickle"
    )


_CORRUPT_ERRORS = (
    EOFError,
    IndexError,
    KeyError,
    ValueError,
    TypeError,
    AttributeError,
    RuntimeError,
    OverflowError,
    MemoryError,
    RecursionError,
    UnicodeDecodeError,
    ImportError,
    __import__("struct").error,
)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pickles of large checkpoints create millions of containers; the cyclic GC's walks over them
    cost more than the unpickling itself (measured: 7-10 s vs 1.3 s for 100k tensors).

    On exit the new objects are moved to the GC's permanent generation (``gc.freeze``): they hold
    no reference cycles and are freed by reference counting, and otherwise the first collection
    after re-enabling would walk them all at once (another 0.9 s)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def load_torch_pickle(f: IO[bytes], label: str, storages: LazyStorages, *, trust: bool = False) -> Any:
    """Unpickle a torch.save pickle with weights-only semantics (or full, when ``trust``)."""
    unpickler: Any
    if trust:

        class _Trusting(pickle.Unpickler):
            def persistent_load(self, pid: Any) -> Any:
                return storages.persistent_load(pid)

        unpickler = _Trusting(f, encoding="utf-8")
    else:
        unpickler = _weights_only.Unpickler(f, encoding="utf-8")
        unpickler.persistent_load = storages.persistent_load
    try:
        with gc_paused():
            return unpickler.load()
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{label}: {e}") from e
    except NotImplementedError as e:  # e.g. quantized tensors cannot be rebuilt without their data
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UnsupportedFormatError(f"{label}: holds a tensor type DCP Studio cannot read ({first[:160]})") from e
    except pickle.UnpicklingError as e:
        text = str(e)
        if not trust and _names_a_global(text):
            raise UnsafePickleError(_unsafe_message(label, e)) from e
        raise CorruptCheckpointError(
            f"{label}: damaged pickle ({text.splitlines()[0] if text else 'unreadable'})"
        ) from e
    except _CORRUPT_ERRORS as e:
        raise CorruptCheckpointError(f"{label}: damaged pickle ({type(e).__name__}: {e})") from e


_DCP_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name): getattr(_dcp_md, name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
        "MetadataIndex",
        "StorageMeta",
    )
}
_DCP_CLASSES[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _dcp_fs._StorageInfo
with contextlib.suppress(ImportError, AttributeError):
    from torch.distributed.checkpoint import _hf_utils

    _DCP_CLASSES[("torch.distributed.checkpoint._hf_utils", "_HFStorageInfo")] = _hf_utils._HFStorageInfo

_SAFE_GLOBALS: dict[tuple[str, str], Any] = {
    **_DCP_CLASSES,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("collections", "OrderedDict"): OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("builtins", "slice"): slice,
    **{
        ("pathlib", n): getattr(pathlib, n)
        for n in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")
    },
}


class MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata dataclasses, torch dtypes/Size/layout and plain containers only."""

    def __init__(self, f: IO[bytes], label: str) -> None:
        super().__init__(f)
        self._label = label

    def find_class(self, module: str, name: str) -> Any:
        found = _SAFE_GLOBALS.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafePickleError(
            f"{self._label}: refused to load '{module}.{name}' from the DCP metadata pickle "
            "(it is not a DCP metadata class and could run code); if you trust this checkpoint, "
            "pass --trust-pickle"
        )


def load_metadata_pickle(data: bytes, label: str, *, trust: bool = False) -> Any:
    """Unpickle a DCP ``.metadata`` blob, restricted unless ``trust``."""
    f = io.BytesIO(data)
    unpickler = pickle.Unpickler(f) if trust else MetadataUnpickler(f, label)
    try:
        with gc_paused():
            return unpickler.load()
    except UnsafePickleError:
        raise
    except (pickle.UnpicklingError, *_CORRUPT_ERRORS) as e:
        raise CorruptCheckpointError(f"{label}: damaged metadata pickle ({type(e).__name__}: {e})") from e


class LightRecord:
    """Stands in for one of DCP's metadata dataclasses when metadata is only read, not used to
    plan a load: no dataclass machinery, no ``torch.Size`` objects. Opening a ``.metadata`` that
    lists 100,000 tensors this way takes well under half the time of torch's own classes."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class LightProperties(LightRecord):
    """``TensorProperties`` pickles its fields as a tuple: (dtype, layout, requires_grad, ...)."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.dtype, self.layout, self.requires_grad = state[0], state[1], state[2]


_LIGHT: dict[tuple[str, str], Any] = {
    key: type(key[1], (LightRecord,), {"__module__": __name__}) for key in _DCP_CLASSES
}
_LIGHT[("torch.distributed.checkpoint.metadata", "TensorProperties")] = LightProperties
_LIGHT[("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")] = int
_LIGHT[("torch", "Size")] = tuple


class LightMetadataUnpickler(MetadataUnpickler):
    """The same allow-list as :class:`MetadataUnpickler`, resolved to :class:`LightRecord` types."""

    def find_class(self, module: str, name: str) -> Any:
        light = _LIGHT.get((module, name))
        return light if light is not None else super().find_class(module, name)


def load_light_metadata(data: bytes, label: str) -> Any:
    """Unpickle a DCP ``.metadata`` into :class:`LightRecord` objects (restricted, GC paused)."""
    try:
        with gc_paused():
            return LightMetadataUnpickler(io.BytesIO(data), label).load()
    except UnsafePickleError:
        raise
    except (pickle.UnpicklingError, *_CORRUPT_ERRORS) as e:
        raise CorruptCheckpointError(f"{label}: damaged metadata pickle ({type(e).__name__}: {e})") from e


_STORAGE_KEY = b"\x8c\x0cstorage_data\x94"  # SHORT_BINUNICODE "storage_data", MEMOIZE


def _frames(data: bytes) -> list[tuple[int, int]] | None:
    """``(start, end)`` of each protocol-4 frame, or None when the stream is not fully framed."""
    if data[:2] != b"\x80\x04":
        return None
    frames = []
    pos = 2
    while pos < len(data):
        if data[pos] != 0x95:
            return None
        length = int.from_bytes(data[pos + 1 : pos + 9], "little")
        frames.append((pos, pos + 9 + length))
        pos += 9 + length
    return frames


def load_light_metadata_head(data: bytes, label: str) -> Any | None:
    """DCP metadata *without its storage index*, parsing only the bytes before it.

    torch pickles ``Metadata`` fields in order -- ``state_dict_metadata``, ``planner_data``,
    ``storage_data``, ... -- and the storage index is over half of a large pickle. This cuts the
    stream at the ``storage_data`` key, closes the half-built object (SETITEMS, BUILD, STOP) and
    unpickles that, with the same allow-list. Returns None when the stream does not have the
    expected shape; the caller then parses everything.
    """
    frames = _frames(data)
    if frames is None:
        return None
    pos = data.find(_STORAGE_KEY)
    while pos >= 0:
        frame = next(((s, e) for s, e in frames if s + 9 <= pos < e), None)
        if frame is not None:
            start = frame[0]
            head = data[: start + 1] + (pos - start - 9 + 3).to_bytes(8, "little") + data[start + 9 : pos] + b"ub."
            try:
                md = load_light_metadata(head, label)
            except CorruptCheckpointError:
                md = None
            if isinstance(getattr(md, "state_dict_metadata", None), dict):
                return md
        pos = data.find(_STORAGE_KEY, pos + 1)
    return None
