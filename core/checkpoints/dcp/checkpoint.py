"""DCP directories as a :class:`~.base.Checkpoint`: light metadata, validated storage index and
chunk sets, values read without torch where bytes lie in place (or as whole-row slabs)."""

from __future__ import annotations

import copy
import functools
import io
import math
import threading
import weakref
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from ...errors import CancelledError, CorruptCheckpointError, DCPStudioError, UnsafePickleError
from ...formats.dcp.files import METADATA_FILE, check_tiling, decode_item, open_chunk, volume
from ...formats.dcp.index import DCPIndex
from ...formats.detect import Format
from ...formats.torchsave.archive import VALUE_LIMIT, TorchSaveFile
from ...io.buffers import new_tensor
from ...io.files import member_path
from ...io.raw import FileRange, read_box, read_exact, source_of
from ...pickles.refs import StorageRef
from ...pickles.tensor_io import to_bytes
from ...pickles.unpicklers import gc_paused, load_light_metadata, load_light_metadata_head
from .._subclasses import refuse_subclass
from ..base import Checkpoint, Region, _box, _OpenFiles, _overlaps, _place, _read, _row_slabs
from ..model import Chunk, Entry, Node, build_tree
from .children import build_in_child, cancel_child, finish_child, index_in_child, parse_in_child, stop_child
from .fast import Head
from .metadata import (
    ambiguous,
    byte_size,
    check_head,
    check_stored,
    damaged_metadata,
    dispose,
    entries_from_metadata,
    full_after_head,
    head_first,
    index_of,
    open_fast,
    read_keyed,
    same_entries,
    same_metadata,
    store_index,
)
from .planned import read_planned

__all__ = ["DCPCheckpoint"]


class DCPCheckpoint(Checkpoint):
    """A large ``.metadata`` opens from its head (names, dtypes, shapes) while a child process parses
    its storage index into a :class:`DCPIndex` (taken on first use; kept in the user's cache,
    :mod:`...io.index_cache`, from where the unchanged ``.metadata`` opens next time with no pickle
    read). Both parses take torch's records in bulk when they can (:mod:`.fast`). Chunk tables
    are checked when first asked for. ``full_index``: the storage index at once, no head first."""

    format: Format = "dcp"

    def __init__(self, path: Path, *, trust_pickle: bool = False, full_index: bool = False) -> None:
        md_path = member_path(path, METADATA_FILE, "DCP metadata file")
        label = str(path / METADATA_FILE)
        self._trust = trust_pickle
        self._index: DCPIndex | None = None
        self._md: Any = None
        self._data, self._head_only = b"", False
        self._head: Head | None = None  # a large .metadata's head, read by .fast
        self._building = threading.Lock()  # one thread builds the index; others asking wait for it
        self._refused: Exception | None = None
        # read once: the cache key, the parse here and the child's parse all come from these bytes
        data, self._key, cached = read_keyed(md_path, label)
        self._md_path = md_path
        self._child = None  # a child process parsing the storage index meanwhile (two cores)
        self._taken: Any = None  # that child, while a thread waits for its result
        self._child_lock = threading.Lock()
        if cached is None and not trust_pickle and parse_in_child(len(data)):
            cached, self._child = index_in_child(md_path, data, self._key, wait=full_index)
        self._stop = weakref.finalize(self, stop_child, self._child)  # one whose index is never asked for
        if cached is not None:
            self._index, entries = cached
            super().__init__(path, entries, {"version": self._index.version})
        else:
            try:
                entries = self._open_pickle(data, label)
            except BaseException:
                self._stop()
                raise
            version = getattr(self._md, "version", None) if self._index is None else self._index.version
            super().__init__(path, entries, {"version": version})
        self._chunks: dict[str, list[Chunk]] = {}
        self._transforms: dict[str, dict[tuple[int, ...], tuple[str, ...]]] = {}
        self._raw: dict[tuple[str, tuple[int, ...]], int | None] = {}  # parsed once per chunk
        self._files = _OpenFiles(path, "DCP data file")

    def _open_pickle(self, data: bytes, label: str) -> dict[str, Entry]:
        fast = open_fast(data, label, self._trust)
        if fast is not None:
            entries, self._head, self._index = fast
            self._head_only, self._data = self._index is None, data
            return entries
        md: Any = None
        if head_first(len(data), self._trust):
            md = load_light_metadata_head(data, label)  # storage index parsed on first use
        self._head_only = md is not None
        if md is None:
            md = load_light_metadata(data, label, trust=self._trust)
        self._data, self._md = data, md
        return entries_from_metadata(md, label)

    def _storage(self) -> DCPIndex:
        """The storage index and chunk lists, built on first use. A large ``.metadata`` is opened
        without them; this parses the whole pickle then (100k tensors: ~3 s) and caches the result
        -- or the refusal, given again at once to whoever asks next."""
        if self._index is not None:  # published (by _indexed) before the lock is let go
            return self._index
        with self._building:
            if self._index is None:
                if self._refused is not None:
                    raise copy.copy(self._refused)  # a fresh one: no traceback holding this checkpoint
                try:
                    self._index = self._read_index()
                except (CorruptCheckpointError, UnsafePickleError, CancelledError) as e:
                    self._refused = copy.copy(e)  # cancelled (closed): whoever waited next must not start again
                    raise
        return self._index

    @damaged_metadata
    def _read_index(self) -> DCPIndex:
        with gc_paused():  # millions of records: the cyclic GC's passes would cost seconds
            return self._build_index()

    def index_ready(self) -> bool:
        return self._index is not None

    def wait_index(self) -> None:
        self._storage()

    def _build_index(self) -> DCPIndex:
        """Parse the whole pickle (it must say what its head said), index it, cache the index and free
        the records."""
        md_path = self.path / METADATA_FILE
        built = None
        with self._child_lock:  # taken from the checkpoint: close() now stops it through _taken
            child, self._child, self._taken = self._child, None, self._child
            self._stop.detach()
        if child is not None:
            try:
                built = finish_child(child, str(md_path))
            finally:
                self._taken = None
        elif not self._trust and parse_in_child(len(self._data)):
            built = build_in_child(self._data, str(md_path))
        if built is not None:
            index, entries = built
            if not same_entries(entries, self.own_entries()):  # the same bytes: head and whole disagree
                raise ambiguous(str(md_path))
            if self._head is not None:
                check_head(self._head, entries, index, str(md_path))
            return self._indexed(index)
        if self._head is not None:  # read by .dcp_fast: the whole stream, now, the same way
            index, _ = full_after_head(self._data, str(md_path), self._head)
            return self._indexed(index)
        if self._head_only:  # the whole pickle, now: it must say what its head said
            full = load_light_metadata(self._data, str(md_path))
            if not same_metadata(self._md, full):
                raise ambiguous(str(md_path))
            head, self._md, self._head_only = self._md, full, False
            dispose(head)
        return self._indexed(index_of(self._md, self.own_entries(), str(md_path)))

    def own_entries(self) -> dict[str, Entry]:
        """The entries the ``.metadata`` lists (a subclass may add others)."""
        return self.entries

    def _indexed(self, index: DCPIndex) -> DCPIndex:
        """Take ``index`` as the storage index: sizes of byte items, the cache; free the records."""
        for fqn, entry in self.entries.items():
            if entry.kind == "bytes":
                entry.byte_size = byte_size(index, fqn)
        if not self._trust:  # a trusted pickle may hold anything: never cached
            store_index(self._md_path, index, self._key)
        self._index = index  # published before what it replaces is let go (another thread may ask)
        self._data, self._head = b"", None
        md, self._md = self._md, None
        dispose(md)
        return index

    @functools.cached_property
    def tree(self) -> Node:
        self._storage()  # byte items' sizes count in the totals; a head is checked against the whole
        return build_tree(self.entries, self.path.name)

    def early_tree(self) -> Node:
        if self._index is None and all(e.kind == "tensor" for e in self.entries.values()):
            return build_tree(self.entries, self.path.name)  # no byte items, whose sizes are in the index
        return self.tree

    def paths(self) -> dict[str, tuple[str | int, ...]]:
        if self._head is not None:  # a head read in bulk stops before the planner data
            self._storage()
        out = super().paths()
        data: Any = getattr(self._md, "planner_data", None)
        if self._index is not None:
            data = {k: tuple(v) for k, v in self._index.paths().items() if isinstance(v, list)}
        if isinstance(data, dict):
            for fqn in self.entries:
                path = data.get(fqn)
                if isinstance(path, tuple) and path and all(type(p) in (str, int) for p in path):
                    out[fqn] = path
        return out

    def _descriptors(self, fqn: str, offsets: tuple[int, ...]) -> list[str] | None:
        """Stream transforms (e.g. zstd) applied to a stored item, None when it is stored plain."""
        self.chunks(fqn)
        return list(self._transforms[fqn].get(offsets, ())) or None

    def chunk_count(self, fqn: str) -> int:
        """From the metadata's chunk list alone: no storage index needed (it may not be parsed yet)."""
        if self.entry(fqn).kind != "tensor":
            return 1
        if self._index is not None:
            return self._index.chunk_count(fqn)
        if self._head is not None:
            count = self._head.counts.get(fqn)
            return count if count is not None else len(self.chunks(fqn))
        listed = getattr(self._md.state_dict_metadata.get(fqn), "chunks", None)
        return len(listed) if isinstance(listed, (list, tuple)) else len(self.chunks(fqn))

    @damaged_metadata
    def chunks(self, fqn: str) -> list[Chunk]:
        """The tensor's chunks, checked to tile it exactly (a value's one stored item)."""
        found = self._chunks.get(fqn)
        if found is not None:
            return found
        entry = self.entry(fqn)
        index = self._storage()
        error = index.error(fqn)
        if error is not None:
            raise CorruptCheckpointError(f"{self.path / METADATA_FILE}: damaged metadata ({error})")
        out = []
        transforms = {}
        for offsets, sizes, info in index.chunks(fqn):
            if info is None:
                raise CorruptCheckpointError(f"{self.path}: no storage entry for {fqn!r} at {list(offsets)}")
            out.append(Chunk(offsets, sizes, info.file, info.offset, info.length))
            transforms[offsets] = info.transforms
        if entry.kind == "tensor":
            label = f"{self.path} ({fqn!r})"
            check_tiling(entry.shape or (), [(c.offsets, c.sizes) for c in out], label)
            assert entry.dtype is not None
            for c in out:  # a plain chunk's archive holds its bytes: it cannot be smaller than them
                if not transforms[c.offsets] and volume(c.sizes) * entry.dtype.itemsize > (c.length or 0):
                    refuse_subclass(self._files, self.path, fqn, c, self._trust)
                    raise CorruptCheckpointError(
                        f"{label}: the chunk at {list(c.offsets)} declares {list(c.sizes)} but stores only "
                        f"{c.length} bytes"
                    )
        self._transforms[fqn] = transforms
        self._chunks[fqn] = out
        return out

    def _item_bytes(self, c: Chunk, fqn: str, limit: int) -> tuple[IO[bytes], int, int, str]:
        """Where a stored item's archive lies: in its data file, or (transformed) decoded in memory.
        Its byte range must lie inside the file."""
        label = f"{self.path / (c.file or '')} ({fqn!r})"
        offset, length = c.offset or 0, c.length or 0
        if offset + length > self._files.size(c.file or ""):
            raise CorruptCheckpointError(f"{label}: bytes {offset}-{offset + length} lie past the end of the file")
        f = self._files.get(c.file or "")
        descriptors = self._descriptors(fqn, c.offsets)
        if not descriptors:
            return f, offset, length, label
        raw = decode_item(descriptors, bytes(_read(f, offset, length, label)), label, limit)
        return io.BytesIO(raw), 0, len(raw), label

    def _raw_offset(self, fqn: str, c: Chunk) -> int | None:
        """Where a tensor chunk's row-major element bytes start in its data file, when they lie
        there as they are (not transformed, native byte order); parsed once per chunk."""
        key = (fqn, c.offsets)
        if key in self._raw:
            return self._raw[key]
        raw = None
        if c.file is not None and not self._descriptors(fqn, c.offsets):
            f, offset, length, label = self._item_bytes(c, fqn, 0)
            parsed = open_chunk(f, offset, length, label, fqn)
            check_stored(parsed.tensor, self.entries[fqn], c, label)
            raw = parsed.raw_offset()
        self._raw[key] = raw
        return raw

    @damaged_metadata
    def resolve_chunks(self, fqn: str) -> list[Chunk]:
        if self.entries[fqn].kind != "tensor":
            return self.chunks(fqn)
        return [
            Chunk(c.offsets, c.sizes, c.file, c.offset, c.length, self._raw_offset(fqn, c)) for c in self.chunks(fqn)
        ]

    @damaged_metadata
    def storage_range(self, ref: StorageRef) -> FileRange | None:
        fqn = ref.key
        entry = self.tensor_entry(fqn)
        chunks = self.chunks(fqn)
        if len(chunks) != 1 or any(chunks[0].offsets) or chunks[0].sizes != entry.shape:
            return None
        c = chunks[0]
        if self._descriptors(fqn, c.offsets):
            return None
        f, offset, length, label = self._item_bytes(c, fqn, 0)
        parsed = open_chunk(f, offset, length, label, fqn)
        check_stored(parsed.tensor, entry, c, label)
        return parsed.file_range(source_of(f), entry.dtype, entry.shape or ())

    @damaged_metadata
    def storage_bytes(self, ref: StorageRef) -> memoryview:
        """The tensor's bytes: read in place, or assembled from chunks that are whole-row slabs
        (what FSDP writes) without torch; other layouts go through :meth:`read_tensor`."""
        fqn = ref.key
        entry = self.tensor_entry(fqn)
        assert entry.dtype is not None
        shape = entry.shape or ()
        chunks = _row_slabs(self.chunks(fqn), shape)
        if chunks is None:
            return to_bytes(self.read_tensor(fqn))
        row_bytes = entry.dtype.itemsize
        for s in shape[1:]:
            row_bytes *= s
        out = bytearray(entry.nbytes)
        view = memoryview(out)
        for c in chunks:
            f, offset, length, label = self._item_bytes(c, fqn, entry.nbytes + (1 << 20))
            parsed = open_chunk(f, offset, length, label, fqn)
            t, raw = parsed.tensor, parsed.raw_offset()
            check_stored(t, entry, c, label)
            if raw is None:
                return to_bytes(self.read_tensor(fqn))
            start = (c.offsets[0] if c.offsets else 0) * row_bytes
            read_exact(f, raw, view[start : start + t.nbytes], label)
        return view

    def read_object(self, fqn: str, limit: int | None = None) -> Any:
        entry = self.entry(fqn)
        if entry.kind == "tensor":
            return self.tensor_ref(fqn)
        (c,) = self.chunks(fqn)
        if limit is not None and (c.length or 0) > limit:
            raise DCPStudioError(f"{fqn}: a stored value of {c.length} bytes, more than the {limit} asked for")
        f, offset, length, label = self._item_bytes(c, fqn, VALUE_LIMIT if limit is None else min(limit, VALUE_LIMIT))
        raw = _read(f, offset, length, label)
        archive = TorchSaveFile(io.BytesIO(raw), trust_pickle=self._trust, label=label)
        return archive.obj

    @damaged_metadata
    def read_tensor(self, fqn: str, region: Region | None = None) -> torch.Tensor:
        """The box's overlap with each chunk whose bytes lie in place is read alone (only about
        its bytes, however large the chunk); transformed chunks go through :class:`DCPReader`."""
        import torch

        entry = self.tensor_entry(fqn)
        assert entry.dtype is not None
        offsets, sizes = _box(entry, region)
        chunks = self.chunks(fqn)  # checked to tile the tensor, each within what its file stores
        if math.prod(sizes) == 0:
            return torch.empty(sizes, dtype=entry.dtype.torch)
        target: torch.Tensor | None = None  # every element is read below: the chunks tile it
        planned = []
        for k, local, size, at in _overlaps(offsets, sizes, [(c.offsets, c.sizes) for c in chunks]):
            c = chunks[k]
            raw = self._raw_offset(fqn, c)
            if raw is None:
                planned.append(c)
                continue
            label = f"{self.path / (c.file or '')} ({fqn!r})"
            piece = read_box(self._files.get(c.file or ""), raw, c.sizes, entry.dtype, local, size, label)
            if size == sizes:
                return piece  # one chunk holds the whole box
            target = new_tensor(sizes, entry.dtype.torch) if target is None else target
            _place(target, at, piece)
        target = new_tensor(sizes, entry.dtype.torch) if target is None else target
        if planned:
            read_planned(self.path, self._trust, fqn, entry, planned, self._descriptors, offsets, sizes, target)
        return target

    def close(self) -> None:
        with self._child_lock:
            self._child = None
            self._stop()  # a child never taken: stopped here
            cancel_child(self._taken)  # one a thread waits for: stopped, and that thread told so
        self._files.close()
