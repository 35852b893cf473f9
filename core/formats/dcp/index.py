"""A DCP ``.metadata`` in compact arrays: its entries (names, kinds, dtypes, shapes), each tensor's
chunk boxes and every item's storage (file, byte range, stream transforms).

Opening and browsing a checkpoint needs only this. Built once from the unpickled metadata
(:meth:`DCPIndex.from_metadata`), it holds a handful of typed arrays instead of millions of Python
objects, and it serialises to bytes that hold no pickle -- JSON for names and typed arrays for
numbers -- which :mod:`dcpstudio.core.io.index_cache` keeps between runs. Chunk tables are built per
tensor on demand (:meth:`DCPIndex.chunks`); whoever uses them checks them (tiling, bounds) the same
way whether they came from the pickle or from a cache.
"""

from __future__ import annotations

import json
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, chain, repeat
from operator import mul
from typing import Any

__all__ = ["DCPIndex", "Stored", "small_ints"]

_ARRAYS = ("dtype", "shape_start", "dims", "chunk_start", "box_start", "boxes", "file", "offset", "length", "transform")
_LEN = struct.Struct("<Q")
_VERSION = 2  # 2: byte items keyed by offset None, as torch reads them (1 folded None into ())


@dataclass(frozen=True)
class Stored:
    """Where one DCP item (a tensor chunk's archive or a value's) lies: validated storage info."""

    file: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()


def small_ints(value: Any) -> tuple[int, ...]:
    if type(value) is not tuple:
        if not isinstance(value, (tuple, list)):
            raise TypeError(f"expected a short tuple of integers, got {type(value).__name__}")
        value = tuple(value)
    if len(value) > 64:
        raise TypeError("expected a short tuple of integers")
    for v in value:
        if type(v) is not int or v < 0:
            raise TypeError("expected non-negative integers")
    return value


def _stored(info: Any) -> Stored:
    file, offset, length = info.relative_path, info.offset, info.length
    transforms = getattr(info, "transform_descriptors", None) or ()
    if not isinstance(file, str) or type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
        raise TypeError("storage info needs a file name and non-negative offset and length")
    if not isinstance(transforms, (list, tuple)) or not all(isinstance(t, str) for t in transforms):
        raise TypeError("storage info has invalid transform descriptors")
    return Stored(file, offset, length, tuple(transforms))


class DCPIndex:
    """Entry ``k`` (in metadata order) is a tensor of dtype ``dtype_names[dtype[k]]`` and shape
    ``dims[shape_start[k]:shape_start[k+1]]``, or a non-tensor value (``dtype[k] == -1``). Its chunks
    are ``chunk_start[k]:chunk_start[k+1]``: their boxes (offsets then sizes, each chunk after the
    previous) fill ``boxes[box_start[k]:box_start[k+1]]``, and chunk ``c`` is stored in
    ``files[file[c]]`` (-1: the metadata lists no storage for it) at ``offset[c]``, ``length[c]``
    bytes, through ``transforms[transform[c]]`` (-1: stored plain). A non-tensor value is one chunk
    with an empty box. ``errors`` holds why an entry's chunk list could not be read."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.dtype_names: list[str] = []
        self.files: list[str] = []
        self.transforms: list[list[str]] = []
        self.errors: dict[int, str] = {}
        self.version: Any = None
        self.planner_data: Any = "{}"  # JSON text until first asked for (it can be large)
        self.dtype = array("h")
        self.shape_start = array("q", [0])
        self.dims = array("q")
        self.chunk_start = array("q", [0])
        self.box_start = array("q", [0])
        self.boxes = array("q")
        self.file = array("i")
        self.offset = array("q")
        self.length = array("q")
        self.transform = array("i")
        self._position: dict[str, int] | None = None
        # while building: ids of the dtype names, file names and transform lists met so far
        self._ids: tuple[dict[str, int], dict[str, int], dict[tuple[str, ...], int]] = ({}, {}, {})

    # -- building ---------------------------------------------------------------------------------
    @classmethod
    def from_metadata(cls, md: Any, entries: Sequence[tuple[str, str | None, Sequence[int] | None]]) -> DCPIndex:
        """From light metadata records (fully unpickled) and its already validated entries
        ``(name, dtype name or None for a non-tensor value, shape)``. A damaged storage index raises
        ``TypeError`` / ``AttributeError``; a tensor whose chunk list is damaged is recorded in
        ``errors`` (asking for its chunks raises then, as it would have from the pickle)."""
        out = cls()
        storage: dict[str, dict[Any, Any]] = {}
        for key, info in md.storage_data.items():
            fqn, offset = key.fqn, getattr(key, "offset", None)
            if type(fqn) is not str:
                raise TypeError("a storage key without a name")
            per = storage.get(fqn)
            if per is None:
                per = storage[fqn] = {}
            per[offset] = info  # None and () are different keys to torch: see add()
        sdm = md.state_dict_metadata
        no_chunks: dict[Any, Any] = {}
        for name, dtype, shape in entries:
            listed: Any = [None] if dtype is None else (lambda name=name: sdm[name].chunks)
            out.add(name, dtype, shape, listed, storage.get(name, no_chunks).get)
        out.finish(md)
        return out

    def add(self, name: str, dtype: str | None, shape: Sequence[int] | None, listed: Any, stored: Any) -> None:
        """Append entry ``name``: its chunk records ``listed`` (or a function returning them; ``[None]``
        for a non-tensor value) and ``stored(offsets)``, the storage info of the chunk at ``offsets``
        (None: none listed). A damaged chunk list is recorded in ``errors``.

        The storage key is what torch's planner asks ``storage_data`` for: ``MetadataIndex(fqn,
        chunk.offsets)`` for a tensor chunk (``()`` for a 0-d tensor), ``MetadataIndex(fqn)`` -- offset
        None -- for a byte item. A record under the other key is one torch never reads."""
        ids = self._ids
        k = len(self.names)
        self.names.append(name)
        self.dtype.append(-1 if dtype is None else ids[0].setdefault(dtype, len(ids[0])))
        self.dims.extend(shape or ())
        self.shape_start.append(len(self.dims))
        boxes, file, offset, length, transform = self.boxes, self.file, self.offset, self.length, self.transform
        b0, c0 = len(boxes), len(file)
        try:
            if callable(listed):
                listed = listed()
                if not isinstance(listed, (list, tuple)):
                    raise TypeError("chunks is not a list")
            ndim = len(shape or ())
            for c in listed:
                o: Any = None
                if c is not None:
                    o, sizes = c.offsets, c.sizes
                    if len(o) != ndim or len(sizes) != ndim:
                        raise TypeError("a chunk's dimensions differ from its tensor's")
                    boxes.extend(o)  # TypeError unless integers
                    boxes.extend(sizes)
                info = stored(o)
                if info is None:
                    file.append(-1)
                    offset.append(0)
                    length.append(0)
                    transform.append(-1)
                    continue
                where = info.relative_path
                if type(where) is not str:
                    raise TypeError("storage info needs a file name")
                offset.append(info.offset)
                length.append(info.length)
                file.append(ids[1].setdefault(where, len(ids[1])))
                steps = getattr(info, "transform_descriptors", None)
                if steps:
                    if not isinstance(steps, (list, tuple)) or not all(type(t) is str for t in steps):
                        raise TypeError("storage info has invalid transform descriptors")
                    transform.append(ids[2].setdefault(tuple(steps), len(ids[2])))
                else:
                    transform.append(-1)
            self.check_tail(b0, c0)
        except (AttributeError, TypeError, IndexError, KeyError, OverflowError) as e:
            self.fail(k, b0, c0, f"{type(e).__name__}: {e}")
        self.chunk_start.append(len(file))
        self.box_start.append(len(boxes))

    def add_many(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[tuple[int, ...]],
        counts: list[int],
        offsets: list[tuple[int, ...]],
        sizes: list[tuple[int, ...]],
        rows: list[tuple[str, int, int]],
    ) -> None:
        """Append tensors ``names`` whose ``counts`` chunks (``offsets``, ``sizes`` of each, tensor after
        tensor) are stored plain at ``rows`` (file, offset, length), all checked -- in bulk what
        :meth:`add` makes of records saying so."""
        ids = self._ids
        self.names.extend(names)
        for name in dict.fromkeys(dtypes):
            ids[0].setdefault(name, len(ids[0]))
        self.dtype.extend(map(ids[0].__getitem__, dtypes))
        self.dims.extend(chain.from_iterable(shapes))
        self.shape_start.extend(accumulate(map(len, shapes), initial=self.shape_start[-1]))
        del self.shape_start[-len(names) - 1]
        self.boxes.extend(chain.from_iterable(map(tuple.__add__, offsets, sizes)))
        paths = [r[0] for r in rows]
        for path in dict.fromkeys(paths):
            ids[1].setdefault(path, len(ids[1]))
        self.file.extend(map(ids[1].__getitem__, paths))
        self.offset.extend([r[1] for r in rows])
        self.length.extend([r[2] for r in rows])
        self.transform.extend(repeat(-1, len(rows)))
        self.chunk_start.extend(accumulate(counts, initial=self.chunk_start[-1]))
        del self.chunk_start[-len(names) - 1]
        box_counts = map(mul, map(len, shapes), counts)
        self.box_start.extend(accumulate(map(mul, box_counts, repeat(2)), initial=self.box_start[-1]))
        del self.box_start[-len(names) - 1]

    def check_tail(self, b0: int, c0: int) -> None:
        if (
            min(self.boxes[b0:], default=0) < 0
            or min(self.offset[c0:], default=0) < 0
            or min(self.length[c0:], default=0) < 0
        ):
            raise TypeError("expected non-negative integers")

    def fail(self, k: int, b0: int, c0: int, why: str) -> None:
        self.errors[k] = why
        for arr, at in ((self.boxes, b0), (self.file, c0), (self.offset, c0), (self.length, c0), (self.transform, c0)):
            del arr[at:]

    def finish(self, md: Any) -> None:
        """Name tables, version and planner data, once every entry is added."""
        self.dtype_names = list(self._ids[0])
        self.files = list(self._ids[1])
        self.transforms = [list(t) for t in self._ids[2]]
        self.version = md.__dict__.get("version")
        self.planner_data = json.dumps(_json_paths(getattr(md, "planner_data", None)), separators=(",", ":"))

    # -- reading ----------------------------------------------------------------------------------
    def position(self, fqn: str) -> int:
        if self._position is None:
            self._position = {name: k for k, name in enumerate(self.names)}
        return self._position[fqn]

    def error(self, fqn: str) -> str | None:
        """Why ``fqn``'s chunk list could not be read (None: it could)."""
        return self.errors.get(self.position(fqn))

    def chunk_count(self, fqn: str) -> int:
        k = self.position(fqn)
        return self.chunk_start[k + 1] - self.chunk_start[k]

    def chunks(self, fqn: str) -> list[tuple[tuple[int, ...], tuple[int, ...], Stored | None]]:
        """``(offsets, sizes, storage)`` of each chunk of ``fqn`` (storage None: none listed; no
        chunks for an entry with an :meth:`error`). ``ValueError`` when the arrays disagree."""
        k = self.position(fqn)
        ndim = self.shape_start[k + 1] - self.shape_start[k]
        first, last = self.chunk_start[k], self.chunk_start[k + 1]
        flat = self.boxes[self.box_start[k] : self.box_start[k + 1]].tolist()
        if last < first or len(flat) != 2 * ndim * (last - first) or min(flat, default=0) < 0:
            raise ValueError("chunk boxes do not match the tensor")
        out = []
        for c in range(first, last):
            at = 2 * ndim * (c - first)
            f, t, offset, length = self.file[c], self.transform[c], self.offset[c], self.length[c]
            stored = None
            if f >= 0:
                if offset < 0 or length < 0 or t < -1:
                    raise ValueError("bad storage row")
                transforms = tuple(self.transforms[t]) if t >= 0 else ()
                stored = Stored(self.files[f], offset, length, transforms)
            out.append((tuple(flat[at : at + ndim]), tuple(flat[at + ndim : at + 2 * ndim]), stored))
        return out

    def paths(self) -> dict[str, list[str | int]]:
        if isinstance(self.planner_data, str):
            self.planner_data = json.loads(self.planner_data)
        return self.planner_data if isinstance(self.planner_data, dict) else {}

    # -- serialising (no pickle) ------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        head = {
            "format": _VERSION,
            "names": None,  # filled in below, in slices
            "dtype_names": self.dtype_names,
            "files": self.files,
            "transforms": self.transforms,
            "errors": {str(k): v for k, v in self.errors.items()},
            "version": self.version if isinstance(self.version, (str, int, float, type(None))) else str(self.version),
        }
        planner = self.planner_data
        if not isinstance(planner, str):  # read since (paths()): written back as it was read
            planner = json.dumps(planner, separators=(",", ":"))
        parts = [_with_names(json.dumps(head, separators=(",", ":")), self.names).encode(), planner.encode()]
        narrow = [_narrow(getattr(self, name)) for name in _ARRAYS]
        parts[0] = parts[0][:-1] + b',"types":"' + "".join(a.typecode for a in narrow).encode() + b'"}'
        parts += [a.tobytes() for a in narrow]
        return b"".join(_LEN.pack(len(p)) + p for p in parts)

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> DCPIndex:
        """Raises ``ValueError`` (or ``TypeError``, ``KeyError``) unless ``data`` is an index of this
        format whose arrays fit together."""
        view = memoryview(data)
        parts = []
        at = 0
        for _ in range(2 + len(_ARRAYS)):
            (n,) = _LEN.unpack_from(view, at)
            if at + 8 + n > len(view):
                raise ValueError("truncated index")
            parts.append(view[at + 8 : at + 8 + n])
            at += 8 + n
        if at != len(view):
            raise ValueError("trailing bytes")
        head = json.loads(bytes(parts[0]))
        if head.get("format") != _VERSION:
            raise ValueError("another index format")
        out = cls()
        out.names, out.dtype_names, out.files = head["names"], head["dtype_names"], head["files"]
        out.transforms, out.version = head["transforms"], head["version"]
        out.errors = {int(k): str(v) for k, v in head["errors"].items()}
        out.planner_data = bytes(parts[1]).decode()
        types = head["types"]
        if not isinstance(types, str) or len(types) != len(_ARRAYS) or not set(types) <= {"h", "i", "q"}:
            raise ValueError("bad array types")
        for name, raw, code in zip(_ARRAYS, parts[2:], types, strict=True):
            arr = array(code)
            arr.frombytes(raw)
            setattr(out, name, arr)
        n, chunks = len(out.names), len(out.file)
        if not (
            len(out.dtype) == n
            and len(out.shape_start) == len(out.chunk_start) == len(out.box_start) == n + 1
            and out.shape_start[-1] == len(out.dims)
            and out.chunk_start[-1] == chunks
            and out.box_start[-1] == len(out.boxes)
            and len(out.offset) == len(out.length) == len(out.transform) == chunks
            and (not chunks or (max(out.file) < len(out.files) and max(out.transform) < len(out.transforms)))
            and all(type(s) is str for s in out.names)
            and all(type(s) is str for s in [*out.dtype_names, *out.files])
            and all(type(t) is list and all(type(s) is str for s in t) for t in out.transforms)
        ):
            raise ValueError("the index's parts do not fit together")
        return out


def _narrow(values: array[int]) -> array[int]:
    """``values`` as 32-bit integers when they fit (most do: halves what the cache reads)."""
    if values.typecode == "q" and (not values or (min(values) >= -(2**31) and max(values) < 2**31)):
        return array("i", values)
    return values


def _with_names(head: str, names: list[str]) -> str:
    """``head`` with its ``"names": null`` replaced by the JSON list of ``names``, encoded in slices:
    json's C encoder holds the GIL for a whole list (0.3 s for 100,000 names; a window would
    freeze), and between slices other threads get their turns."""
    listed = ",".join(json.dumps(names[k : k + 5000])[1:-1] for k in range(0, len(names), 5000))
    return head.replace('"names":null', f'"names":[{listed}]', 1)


def _json_paths(data: Any) -> dict[str, list[str | int]]:
    """The planner data's entry paths that are tuples of names and indices (others are dropped,
    as :meth:`~dcpstudio.core.checkpoints.dcp.checkpoint.DCPCheckpoint.paths` ignores them)."""
    out: dict[str, list[str | int]] = {}
    if isinstance(data, dict):
        for fqn, path in data.items():
            if isinstance(fqn, str) and isinstance(path, tuple) and path and all(type(p) in (str, int) for p in path):
                out[fqn] = list(path)
    return out
