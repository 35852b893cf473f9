"""Huge DCP ``.metadata`` files, written fast: the pickle stream torch's ``FileSystemWriter`` writes
for a run of ``ranks`` processes that each saved one dim-0 shard of every tensor (FSDP).

Building 20 million of torch's metadata dataclasses and pickling them would need tens of GB and
many minutes, so :func:`write_metadata` emits the protocol-4 stream directly -- the same opcodes,
in the same order, with the same memo references, as ``pickle.dump`` of :func:`torch_metadata`
(only the frame boundaries may fall elsewhere); ``tests/core/test_big_metadata.py`` checks that on
small instances. As in a real multi-rank save, every rank's storage keys and chunk sizes are
separate objects (gathered from each rank), so each storage key repeats its tensor's name.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_MD = "torch.distributed.checkpoint.metadata"
_FRAME = 64 * 1024
_I4 = struct.Struct("<i")
_U4 = struct.Struct("<I")


def name(i: int) -> str:
    return f"model.layers.{i // 10}.block.{i % 10}.weight"


def layout(tensors: int, ranks: int, rows: int = 4, cols: int = 4096) -> Iterator[tuple[str, tuple[int, int]]]:
    for i in range(tensors):
        yield name(i), (ranks * rows, cols)


def item_length(rows: int, cols: int) -> int:
    return rows * cols * 2 + 1100  # a bf16 chunk's torch.save archive


def torch_metadata(tensors: int, ranks: int, rows: int = 4, cols: int = 4096) -> Any:
    """The same metadata built from torch's classes (small instances: it is slow and large)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    sdm = {}
    for fqn, shape in layout(tensors, ranks, rows, cols):
        chunks = [ChunkStorageMetadata(torch.Size([r * rows, 0]), torch.Size([rows, cols])) for r in range(ranks)]
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size(shape), chunks)
    storage = {}
    length = item_length(rows, cols)
    for r in range(ranks):
        path = f"__{r}_0.distcp"  # one object per rank, as gathered from it
        for i in range(tensors):
            fqn = "".join(name(i))  # each rank's own string
            storage[MetadataIndex(fqn, torch.Size([r * rows, 0]))] = _StorageInfo(path, i * length, length)
    return Metadata(
        state_dict_metadata=sdm,
        planner_data={k: tuple(k.split(".", 1)) for k in sdm},
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id="big", save_id="5f7c1d2e-0000-4000-8000-000000000000"),
        version="1.0.0",
    )


def _int(v: int) -> bytes:
    if 0 <= v < 0x100:
        return b"K" + bytes((v,))
    if 0 <= v < 0x10000:
        return b"M" + v.to_bytes(2, "little")
    if -(2**31) <= v < 2**31:
        return b"J" + _I4.pack(v)
    raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes((len(raw),)) + raw


class _Stream:
    """Opcodes out, framed at object boundaries; ``memo`` names the shared objects already stored."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.buf = bytearray()
        self.memo: dict[Any, int] = {}
        self.count = 0
        f.write(b"\x80\x04")

    def boundary(self) -> None:
        if len(self.buf) >= _FRAME:
            self.flush()

    def flush(self) -> None:
        if len(self.buf) >= 4:
            self.f.write(b"\x95" + len(self.buf).to_bytes(8, "little"))
        self.f.write(self.buf)
        self.buf = bytearray()

    def memoize(self, key: Any = None) -> None:
        self.buf += b"\x94"
        if key is not None:
            self.memo[key] = self.count
        self.count += 1

    def get(self, key: Any) -> bytes:
        i = self.memo[key]
        return b"h" + bytes((i,)) if i < 0x100 else b"j" + _U4.pack(i)

    def text(self, s: str, shared: bool = True) -> None:
        """A string: a memo reference when this (shared) string was stored before."""
        if shared and ("s", s) in self.memo:
            self.buf += self.get(("s", s))
            return
        raw = s.encode()
        self.buf += (b"\x8c" + bytes((len(raw),)) if len(raw) < 0x100 else b"X" + _U4.pack(len(raw))) + raw
        self.memoize(("s", s) if shared else None)

    def glob(self, module: str, qualname: str, *, shared_module: bool = True) -> None:
        """A global; ``shared_module``: its module name is the same string object as others'
        (a Python class's ``__module__``), not made anew on each access (a C type's)."""
        if ("g", module, qualname) in self.memo:
            self.buf += self.get(("g", module, qualname))
            return
        self.text(module, shared=shared_module)
        self.text(qualname, shared=False)
        self.buf += b"\x93"
        self.memoize(("g", module, qualname))

    def new(self, module: str, qualname: str) -> None:
        """A dataclass instance up to its state: class, NEWOBJ."""
        self.glob(module, qualname)
        self.buf += b")\x81"
        self.memoize()

    def size(self, dims: tuple[int, ...]) -> None:
        self.glob("torch", "Size", shared_module=False)
        self.ints(dims)
        self.buf += b"\x85"
        self.memoize()
        self.buf += b"R"
        self.memoize()

    def ints(self, dims: tuple[int, ...]) -> None:
        if not dims:
            self.buf += b")"
            return
        body = b"".join(_int(d) for d in dims)
        self.buf += (body + b"\x85\x86\x87"[len(dims) - 1 : len(dims)]) if len(dims) <= 3 else b"(" + body + b"t"
        self.memoize()

    def dict_batches(self, n: int) -> Iterator[int]:
        """MARK ... SETITEMS batches of 1,000 as the C pickler writes them (SETITEM for one item)."""
        if n == 1:
            yield 1
            self.buf += b"s"
            return
        done = 0
        while True:
            batch = min(1000, n - done)
            self.buf += b"("
            yield batch
            self.buf += b"u"
            done += batch
            if batch < 1000:
                return

    def list_batches(self, n: int) -> Iterator[int]:
        if n == 1:
            yield 1
            self.buf += b"a"
            return
        done = 0
        while done < n:
            batch = min(1000, n - done)
            self.buf += b"("
            yield batch
            self.buf += b"e"
            done += batch


def write_metadata(path: Path, tensors: int, ranks: int, rows: int = 4, cols: int = 4096) -> None:
    """Write ``path`` (a ``.metadata``) equal to ``pickle.dump(torch_metadata(...))``."""
    length = item_length(rows, cols)
    with open(path, "wb", buffering=1 << 20) as f:
        out = _Stream(f)
        out.new(_MD, "Metadata")
        out.buf += b"}"
        out.memoize()
        fields = iter(out.dict_batches(5))
        next(fields)
        out.text("state_dict_metadata")
        out.buf += b"}"
        out.memoize()
        names = list(layout(tensors, ranks, rows, cols))
        at = 0
        replay: tuple[bytes, int] | None = None  # every tensor after the first pickles the same
        for batch in out.dict_batches(len(names)):
            for k, (fqn, shape) in enumerate(names[at : at + batch], at):
                out.text(fqn)
                if replay is None:
                    start, count = len(out.buf), out.count
                    _tensor(out, shape, ranks, rows, cols)
                    if k == 1:
                        replay = (bytes(out.buf[start:]), out.count - count)
                else:
                    out.buf += replay[0]
                    out.count += replay[1]
                out.boundary()
            at += batch
        out.text("planner_data")
        out.buf += b"}"
        out.memoize()
        at = 0
        for batch in out.dict_batches(len(names)):
            for fqn, _ in names[at : at + batch]:
                out.text(fqn)
                head, tail = fqn.split(".", 1)
                out.text(head, shared=False)
                out.text(tail, shared=False)
                out.buf += b"\x86"
                out.memoize()
                out.boundary()
            at += batch
        out.text("storage_data")
        out.buf += b"}"
        out.memoize()
        _storage(out, tensors, ranks, rows, length)
        out.text("storage_meta")
        out.new(_MD, "StorageMeta")
        out.buf += b"}"
        out.memoize()
        for _ in out.dict_batches(4):
            out.text("checkpoint_id")
            out.text("big", shared=False)
            out.text("save_id")
            out.text("5f7c1d2e-0000-4000-8000-000000000000", shared=False)
            out.text("load_id")
            out.buf += b"N"
            out.text("modules")
            out.buf += b"]"
            out.memoize()
        out.buf += b"b"
        out.text("version")
        out.text("1.0.0", shared=False)
        for _ in fields:
            pass
        out.buf += b"b."
        out.flush()


def _tensor(out: _Stream, shape: tuple[int, int], ranks: int, rows: int, cols: int) -> None:
    out.new(_MD, "TensorStorageMetadata")
    out.buf += b"}"
    out.memoize()
    out.buf += b"("
    out.text("properties")
    out.new(_MD, "TensorProperties")
    out.buf += b"("
    out.glob("torch", "bfloat16")
    if ("layout",) in out.memo:
        out.buf += out.get(("layout",))
    else:
        out.glob("torch.serialization", "_get_layout")
        out.text("torch.strided", shared=False)
        out.buf += b"\x85"
        out.memoize()
        out.buf += b"R"
        out.memoize(("layout",))
    out.buf += b"\x89"
    if ("contiguous",) in out.memo:
        out.buf += out.get(("contiguous",))
    else:
        out.glob(_MD, "_MEM_FORMAT_ENCODING")
        out.buf += b"K\x00\x85"
        out.memoize()
        out.buf += b"R"
        out.memoize(("contiguous",))
    out.buf += b"\x89t"
    out.memoize()
    out.buf += b"b"
    out.text("size")
    out.size(shape)
    out.text("chunks")
    out.buf += b"]"
    out.memoize()
    for batch_start, batch in _spans(out.list_batches(ranks)):
        for r in range(batch_start, batch_start + batch):
            out.new(_MD, "ChunkStorageMetadata")
            out.buf += b"}"
            out.memoize()
            out.buf += b"("
            out.text("offsets")
            out.size((r * rows, 0))
            out.text("sizes")
            out.size((rows, cols))
            out.buf += b"ub"
    out.buf += b"ub"


def _spans(batches: Iterator[int]) -> Iterator[tuple[int, int]]:
    start = 0
    for n in batches:
        yield start, n
        start += n


def _storage(out: _Stream, tensors: int, ranks: int, rows: int, length: int) -> None:
    """Rank by rank, as the coordinator merges what each rank wrote. After the first record every
    name, class and key is a memo reference: the rest is filled into a template (8 memo entries)."""
    keys = ((r, i) for r in range(ranks) for i in range(tensors))
    names = [b"\x8c" + bytes((len(n),)) + n + b"\x94" for n in (name(i).encode() for i in range(tensors))]
    parts: tuple[bytes, ...] | None = None
    for batch in out.dict_batches(ranks * tensors):
        for _ in range(batch):
            r, i = next(keys)
            if parts is not None and ("path", r) in out.memo:
                a, b, c, d, e = parts
                at = _int(r * rows) + b"K\x00\x86\x94\x85\x94R\x94"
                out.buf += b"".join((a, names[i], b, at, c, out.get(("path", r)), d, _int(i * length), e))
                out.count += 8
                out.boundary()
                continue
            _record(out, r, i, rows, length)
            if parts is None:
                get = out.get
                parts = (
                    get(("g", _MD, "MetadataIndex")) + b")\x81\x94}\x94(" + get(("s", "fqn")),
                    get(("s", "index")) + b"N" + get(("s", "offset")) + get(("g", "torch", "Size")),
                    b"ub"
                    + get(("g", "torch.distributed.checkpoint.filesystem", "_StorageInfo"))
                    + b")\x81\x94}\x94("
                    + get(("s", "relative_path")),
                    get(("s", "offset")),
                    get(("s", "length")) + _int(length) + b"ub",
                )


def _record(out: _Stream, r: int, i: int, rows: int, length: int) -> None:
    out.new(_MD, "MetadataIndex")
    out.buf += b"}"
    out.memoize()
    out.buf += b"("
    out.text("fqn")
    out.text(name(i), shared=False)
    out.text("index")
    out.buf += b"N"
    out.text("offset")
    out.size((r * rows, 0))
    out.buf += b"ub"
    out.new("torch.distributed.checkpoint.filesystem", "_StorageInfo")
    out.buf += b"}"
    out.memoize()
    out.buf += b"("
    out.text("relative_path")
    if ("path", r) in out.memo:
        out.buf += out.get(("path", r))
    else:
        out.text(f"__{r}_0.distcp", shared=False)
        out.memo[("path", r)] = out.count - 1
    out.text("offset")
    out.buf += _int(i * length)
    out.text("length")
    out.buf += _int(length)
    out.buf += b"ub"
    out.boundary()
