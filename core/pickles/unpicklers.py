"""Restricted unpicklers, and a pickler, for checkpoint pickles -- none of them imports torch.

Two pickles occur in checkpoints:

* torch.save's ``data.pkl`` (whole files, every DCP tensor chunk and byte item). It is read with
  the allow-list of ``torch.load(weights_only=True)``: containers, numbers, strings, dtypes and
  torch's tensor-rebuild functions -- each resolved here to a stand-in from
  :mod:`dcpstudio.core.pickles.refs` that *describes* the tensor (:class:`~.refs.TensorRef`) instead of
  building it. Nothing the pickle names outside the list is looked up. A storage reference becomes
  a :class:`~.refs.StorageRef`; its bytes are read only when a value is asked for.
* DCP's ``.metadata``: torch's metadata dataclasses (and the save plans Megatron adds,
  :mod:`.plan_records`), read into light records with the same restriction
  (:func:`load_light_metadata`).

The allow-list and its stand-ins are in :mod:`.stand_ins`. ``trust=True`` keeps the stand-ins
but lets any other name be imported (full pickle semantics) for inputs the user vouches for; the
callers warn when they do.

:class:`TorchPickler` writes the stand-ins back as the torch globals they stand for, so
torch.save archives and DCP metadata are written without torch too.
"""

from __future__ import annotations

import _compat_pickle
import contextlib
import gc
import pathlib
import pickle
import re
import types
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import IO, Any

from ..dtypes import BY_NAME, DType
from ..errors import CorruptCheckpointError, MissingClassError, UnsafePickleError, UnsupportedFormatError
from .guard import YieldingStream, run_with_stack, scan
from .plan_records import PLANNER_CLASSES, WriteItemKind
from .refs import Device, Layout, Size, StorageType, TensorRef
from .stand_ins import REBUILD, TORCH_SAVE_GLOBALS, LazyStorages, _rebuild_tensor_v2, _rebuild_tensor_v3, get_layout
from .subclass import ForeignNames, check_contained

__all__ = [
    "DCP_METADATA_CLASSES",
    "LazyStorages",
    "LightRecord",
    "Restricted",
    "TorchPickler",
    "gc_paused",
    "load_light_metadata",
    "load_light_metadata_head",
    "load_torch_pickle",
    "protocol4_frames",
]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pickles of large checkpoints create millions of containers; the cyclic GC's walks over them
    cost more than the unpickling itself (measured: 7-10 s vs 1.3 s for 100k tensors).

    On exit the new objects are moved to the GC's permanent generation (``gc.freeze``): they hold
    no reference cycles and are freed by reference counting, and otherwise the first collection
    after re-enabling would walk them all at once (another 0.9 s)."""
    enabled = gc.isenabled()
    gc.disable()
    done = False
    try:
        yield
        done = True
    finally:
        if done:  # not on a failure: its traceback's frames (and what they hold) would never be collected
            gc.freeze()
        if enabled:
            gc.enable()


_GLOBAL_RE = re.compile(r"'([\w.]+)'")


def unsafe_message(label: str, what: str) -> str:
    return (
        f"{label}: refused to load '{what}' from its pickle (it could run code); "
        "if you trust this file, pass --trust-pickle"
    )


class Restricted(pickle.Unpickler):
    """Resolves a pickle's globals through ``allowed``; anything else is refused (or, when
    ``trust``, imported as plain pickle would)."""

    def __init__(self, f: IO[bytes], label: str, allowed: dict[tuple[str, str], Any], *, trust: bool = False) -> None:
        super().__init__(f, encoding="utf-8")
        self._label = label
        self._allowed = allowed
        self._trust = trust
        self._storages: LazyStorages | None = None
        self.foreign = ForeignNames()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _compat_pickle.NAME_MAPPING:  # pickles written by Python 2
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        found = self._allowed.get((module, name))
        if found is not None:
            return found
        if not self._trust and self._allowed is TORCH_SAVE_GLOBALS and ForeignNames.admits(module):
            return self.foreign.resolve(module, name)  # a subclass's class or value: see _subclass
        if self._trust:
            try:
                return super().find_class(module, name)
            except (ImportError, AttributeError) as e:
                raise MissingClassError.for_class(self._label, module, name) from e
        raise UnsafePickleError(
            unsafe_message(self._label, f"{module}.{name}"), source=self._label, what=f"{module}.{name}"
        )

    def persistent_load(self, pid: Any) -> Any:
        if self._storages is None:
            raise CorruptCheckpointError("a persistent id in a pickle that has no storages")
        return self._storages.persistent_load(pid)


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


def _load(
    data: bytes | bytearray,
    label: str,
    what: str,
    allowed: dict[tuple[str, str], Any],
    *,
    trust: bool,
    storages: LazyStorages | None = None,
) -> Any:
    """Scan the stream (:mod:`.guard`), then unpickle it with ``allowed`` globals."""
    info = scan(data, label)

    def run() -> Any:
        unpickler = Restricted(YieldingStream(data), label, allowed, trust=trust)  # type: ignore[arg-type]  # a file
        unpickler._storages = storages
        with gc_paused():
            obj = unpickler.load()
        if unpickler.foreign.types and (what := check_contained(obj)) is not None:
            raise UnsafePickleError(unsafe_message(label, what), source=label, what=what)
        return obj

    try:
        return run_with_stack(info, label, run)
    except (UnsafePickleError, MissingClassError):
        raise
    except (CorruptCheckpointError, UnsupportedFormatError) as e:
        raise type(e)(f"{label}: {e}") from e
    except pickle.UnpicklingError as e:
        text = str(e).splitlines()[0] if str(e) else "unreadable"
        raise CorruptCheckpointError(f"{label}: damaged {what} ({text})") from e
    except _CORRUPT_ERRORS as e:
        raise CorruptCheckpointError(f"{label}: damaged {what} ({type(e).__name__}: {e})") from e


def load_torch_pickle(data: bytes | bytearray, label: str, storages: LazyStorages, *, trust: bool = False) -> Any:
    """Unpickle a torch.save pickle with weights-only semantics (or full, when ``trust``);
    tensors come out as :class:`TensorRef` over ``storages``."""
    return _load(data, label, "pickle", TORCH_SAVE_GLOBALS, trust=trust, storages=storages)


# -- DCP .metadata ---------------------------------------------------------------------------------
_MD = "torch.distributed.checkpoint.metadata"
DCP_METADATA_CLASSES: tuple[tuple[str, str], ...] = (
    (_MD, "Metadata"),
    (_MD, "TensorStorageMetadata"),
    (_MD, "BytesStorageMetadata"),
    (_MD, "ChunkStorageMetadata"),
    (_MD, "TensorProperties"),
    (_MD, "_MEM_FORMAT_ENCODING"),
    (_MD, "MetadataIndex"),
    (_MD, "StorageMeta"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint._hf_utils", "_HFStorageInfo"),
)
PLAIN_GLOBALS: dict[tuple[str, str], Any] = {
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


class LightRecord:
    """Stands in for one of DCP's metadata dataclasses: no dataclass machinery, no torch. Opening
    a ``.metadata`` that lists 100,000 tensors this way takes well under half the time of torch's
    own classes, and needs no torch at all."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class LightProperties(LightRecord):
    """``TensorProperties`` pickles its fields as a tuple: (dtype, layout, requires_grad, ...)."""

    torch_global = (_MD, "TensorProperties")

    def __getstate__(self) -> tuple[Any, ...]:
        return (self.dtype, Layout("torch.strided"), bool(self.requires_grad), MemoryFormat(0), False)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.dtype, self.layout, self.requires_grad = state[0], state[1], state[2]


class MemoryFormat(int):
    """A member of DCP's ``_MEM_FORMAT_ENCODING`` enum (0: contiguous)."""

    torch_global = (_MD, "_MEM_FORMAT_ENCODING")

    def __reduce__(self) -> Any:
        return (MemoryFormat, (int(self),))


def _light_class(module: str, name: str) -> Any:
    special = {"TensorProperties": LightProperties, "_MEM_FORMAT_ENCODING": MemoryFormat}
    special["WriteItemType"] = WriteItemKind
    return special.get(name) or type(name, (LightRecord,), {"__module__": __name__, "torch_global": (module, name)})


LIGHT_METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **PLAIN_GLOBALS,
    **{key: _light_class(*key) for key in (*DCP_METADATA_CLASSES, *PLANNER_CLASSES, WriteItemKind.torch_global)},
    ("torch", "Size"): tuple,
    ("torch.serialization", "_get_layout"): get_layout,
    **{("torch", name): dtype for name, dtype in BY_NAME.items()},
}


def _unsafe_metadata(label: str) -> Callable[[UnsafePickleError], UnsafePickleError]:
    def reword(e: UnsafePickleError) -> UnsafePickleError:
        match = _GLOBAL_RE.search(str(e))
        what = match.group(1) if match else "an unknown object"
        return UnsafePickleError(
            f"{label}: refused to load '{what}' from the DCP metadata pickle (it is not a DCP metadata class "
            "and could run code); if you trust this checkpoint, pass --trust-pickle",
            source=label,
            what=what,
        )

    return reword


def load_light_metadata(data: bytes, label: str, *, trust: bool = False) -> Any:
    """Unpickle a DCP ``.metadata`` into :class:`LightRecord` objects (restricted, GC paused)."""
    try:
        return _load(data, label, "metadata pickle", LIGHT_METADATA_GLOBALS, trust=trust)
    except UnsafePickleError as e:
        raise _unsafe_metadata(label)(e) from None


_STORAGE_KEY = b"\x8c\x0cstorage_data\x94"  # SHORT_BINUNICODE "storage_data", MEMOIZE


def protocol4_frames(data: bytes) -> list[tuple[int, int]] | None:
    """``(start, end)`` of each frame of a protocol 4 or 5 stream, or None when the stream is not
    wholly framed (the last frame ending where the stream does)."""
    if data[:2] not in (b"\x80\x04", b"\x80\x05"):
        return None
    frames = []
    pos = 2
    while pos < len(data):
        if data[pos] != 0x95:
            return None
        length = int.from_bytes(data[pos + 1 : pos + 9], "little")
        frames.append((pos, pos + 9 + length))
        pos += 9 + length
    return frames if pos == len(data) else None


def load_light_metadata_head(data: bytes, label: str) -> Any | None:
    """DCP metadata *without its storage index*, parsing only the bytes before it.

    torch pickles ``Metadata`` fields in order -- ``state_dict_metadata``, ``planner_data``,
    ``storage_data``, ... -- and the storage index is over half of a large pickle. This cuts the
    stream at the ``storage_data`` key, closes the half-built object (SETITEMS, BUILD, STOP) and
    unpickles that, with the same allow-list. Returns None when the stream does not have the
    expected shape; the caller then parses everything.
    """
    frames = protocol4_frames(data)
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


# -- writing ---------------------------------------------------------------------------------------
GLOBAL_NAMES: dict[Any, tuple[str, str]] = {
    Size: ("torch", "Size"),
    Device: ("torch", "device"),
    get_layout: ("torch.serialization", "_get_layout"),
    **{fn: ("torch._utils", name) for name, fn in REBUILD.items()},
}


def _reduce_tensor(t: TensorRef) -> Any:
    """What torch.save writes for a tensor: ``_rebuild_tensor_v2`` over a typed storage, or ``_v3``
    with an untyped one (dtypes without a legacy storage class)."""
    if t.storage is None:
        raise UnsupportedFormatError("a tensor saved without data cannot be written")
    args: tuple[Any, ...] = (t.storage, t.storage_offset, t.shape, t.stride, False, OrderedDict())
    if not t.storage.typed:
        return (_rebuild_tensor_v3, (*args, t.dtype))
    return (_rebuild_tensor_v2, args)


def global_name(obj: Any) -> tuple[str, str] | None:
    """The torch global a stand-in is written as (None for anything else)."""
    if type(obj) is DType:
        return ("torch", obj.name)
    if type(obj) is StorageType:  # where torch defines them: torch.FloatStorage, torch.storage.UntypedStorage
        return ("torch.storage" if obj.name == "UntypedStorage" else "torch", obj.name)
    if isinstance(obj, type) and "torch_global" in vars(obj):
        found: tuple[str, str] = vars(obj)["torch_global"]
        return found
    try:
        return GLOBAL_NAMES.get(obj)
    except TypeError:  # unhashable
        return None


_GLOBAL_KINDS = (type, types.FunctionType, DType, StorageType)
_PurePickler: Any = getattr(pickle, "_Pickler")  # noqa: B009 - the Python implementation: save_global can be overridden


class TorchPickler(_PurePickler):
    """The pure-Python pickler, writing stand-ins (dtypes, Size, rebuild functions, storage types,
    light DCP records) as the torch globals they stand for -- no torch import, same bytes a
    reader expects. ``persistent_id`` is the caller's."""

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        # The base class dispatches functions to its own save_global; route every stand-in here.
        if isinstance(obj, _GLOBAL_KINDS) and global_name(obj) is not None:
            memo = self.memo.get(id(obj))
            if memo is not None:
                self.write(self.get(memo[0]))
            else:
                self.save_global(obj)
            return
        super().save(obj, save_persistent_id)

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is TensorRef:
            return _reduce_tensor(obj)
        if type(obj) is Layout:
            return (get_layout, (str(obj),))
        return NotImplemented

    def save_global(self, obj: Any, name: str | None = None) -> None:
        target = global_name(obj)
        if target is None:
            super().save_global(obj, name)
            return
        module, qualname = target
        if self.proto >= 4:
            self.save(module)
            self.save(qualname)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
        self.memoize(obj)
