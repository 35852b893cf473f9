"""Crafted-but-loadable DCP ``.metadata`` streams, and what torch's own reader reads from them.

Each case is a ``Metadata`` built from torch's classes, pickled the way torch's writer does (any
protocol 2-5), then rewritten at the opcode level in ways the real unpickler reads the same or
that an attacker would use: memo stores as MEMOIZE, BINPUT, LONG_BINPUT or PUT; frames of random
sizes; a length-prefixed argument (``BINBYTES`` and friends, popped at once) holding record-shaped
bytes from another checkpoint's stream; storage keys for a byte item or a 0-d tensor under both
``offset=None`` and ``offset=()``; a key set twice; shared records; names holding the MEMOIZE byte.

:func:`truth` is what torch reads: ``pickle.loads`` with torch's classes (these are our own test
files, so torch may unpickle them in full) and, for every entry, the storage record torch's planner
asks for (``MetadataIndex(fqn, chunk.offsets)`` per tensor chunk, ``MetadataIndex(fqn)`` for a byte
item). :func:`ours` is what DCP Studio's parsers make of the same bytes. Used by
``test_differential.py``; ``DCPSTUDIO_DIFF_CASES=5000`` runs a longer campaign.
"""

from __future__ import annotations

import pickle
import pickletools
import random
import struct
from typing import Any

MAX_FRAME = 1 << 16


def _metadata(rng: random.Random) -> tuple[Any, list[str]]:
    """A Metadata of a few dozen entries (tensors of 0-3 dimensions, chunked over 1-4 ranks, and byte
    items), with some of the tricks torch's own checkpoints never hold but its reader takes."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.float16, torch.bool]
    sdm: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    ranks = rng.randint(1, 4)
    tricks: list[str] = []
    keyed = rng.random() < 0.4  # storage keys under both offsets, or set twice
    odd_names = rng.random() < 0.3
    n = rng.randint(12, 60)
    shared = ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))
    for i in range(n):
        name = f"model.layers.{i}.w" if not odd_names or rng.random() < 0.7 else f"model.\u0454{i}.\u0094"
        kind = rng.random()
        file = f"__{rng.randrange(ranks)}_0.distcp"
        if kind < 0.12:
            sdm[name] = BytesStorageMetadata()
            key = MetadataIndex(name)
            storage[key] = _StorageInfo(file, rng.randrange(1 << 20), rng.randint(1, 999))
            if keyed and rng.random() < 0.5:
                tricks.append("bytes-under-both-keys")
                decoy = _StorageInfo(f"__{rng.randrange(ranks)}_9.distcp", 7, 13)
                both = [(MetadataIndex(name, ()), decoy), (key, storage.pop(key))]
                rng.shuffle(both)
                storage.update(both)
            continue
        if kind < 0.22:  # a 0-d tensor
            sdm[name] = TensorStorageMetadata(
                TensorProperties(dtype=rng.choice(dtypes)),
                torch.Size([]),
                [ChunkStorageMetadata(torch.Size([]), torch.Size([]))],
            )
            key = MetadataIndex(name, ())
            storage[key] = _StorageInfo(file, rng.randrange(1 << 20), rng.randint(1, 999))
            if keyed and rng.random() < 0.5:
                tricks.append("scalar-under-both-keys")
                decoy = _StorageInfo(f"__{rng.randrange(ranks)}_9.distcp", 11, 17)
                both = [(MetadataIndex(name), decoy), (key, storage.pop(key))]
                rng.shuffle(both)
                storage.update(both)
            continue
        ndim = rng.randint(1, 3)
        rows = 4 * rng.randint(1, 3)
        shape = [rows * ranks] + [rng.randint(1, 9) for _ in range(ndim - 1)]
        chunks = [
            ChunkStorageMetadata(torch.Size([r * rows] + [0] * (ndim - 1)), torch.Size([rows, *shape[1:]]))
            for r in range(ranks)
        ]
        if ndim == 1 and rows == 4 and ranks == 1 and rng.random() < 0.5:
            chunks = [shared]  # one record shared (a memo reference where a record would be)
            tricks.append("shared-record")
        sdm[name] = TensorStorageMetadata(TensorProperties(dtype=rng.choice(dtypes)), torch.Size(shape), chunks)
        for c in chunks:
            storage[MetadataIndex(name, c.offsets)] = _StorageInfo(
                file, rng.randrange(1 << 30), rng.randint(1, 1 << 20)
            )
        if keyed and rng.random() < 0.1:
            tricks.append("key-set-twice")
            storage[MetadataIndex(name, chunks[0].offsets)] = _StorageInfo(file, 3, 5)  # the later value is kept
    planner = {fqn: tuple(fqn.split(".")) for fqn in sdm}
    md = Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage)
    if rng.random() < 0.3:  # as Megatron-Core's torch_dist saves: every rank's plan, after the index
        md.all_local_plans = _save_plans(sdm)  # type: ignore[attr-defined]
        tricks.append("save-plans")
    return md, tricks


def _save_plans(sdm: dict[str, Any]) -> list[Any]:
    """One ``SavePlan`` holding a write item per chunk and byte item (their records shaped as the
    index's: chunk records, ``MetadataIndex`` keys, ``torch.Size``)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    items = []
    for fqn, smd in sdm.items():
        if not isinstance(smd, TensorStorageMetadata):
            items.append(WriteItem(MetadataIndex(fqn), WriteItemType.BYTE_IO))
            continue
        for c in smd.chunks:
            data = TensorWriteData(c, smd.properties, smd.size)
            items.append(WriteItem(MetadataIndex(fqn, c.offsets), WriteItemType.SHARD, tensor_data=data))
    return [SavePlan(items, planner_data={}), SavePlan([], usable=True)]


def _ops(data: bytes) -> list[tuple[str, bytes]]:
    """The stream's opcodes as (name, raw bytes), FRAME opcodes dropped."""
    out = []
    items = list(pickletools.genops(data))
    for k, (op, _arg, pos) in enumerate(items):
        end = items[k + 1][2] if k + 1 < len(items) else len(data)
        if op.name != "FRAME":
            out.append((op.name, data[pos:end]))
    return out


def _memo_variants(ops: list[tuple[str, bytes]], rng: random.Random) -> list[tuple[str, bytes]]:
    """Each memo store (the pickler's are at 0, 1, 2, ... in turn) as MEMOIZE, BINPUT, LONG_BINPUT or
    PUT with the same index: the same memo."""
    style = rng.choice(["memoize", "binput", "long", "text", "mixed"])
    out, index = [], 0
    for name, raw in ops:
        if name in ("MEMOIZE", "BINPUT", "LONG_BINPUT", "PUT"):
            pick = style if style != "mixed" else rng.choice(["memoize", "binput", "long", "text"])
            if pick == "binput" and index < 256:
                raw = b"q" + bytes([index])
            elif pick == "long":
                raw = b"r" + struct.pack("<I", index)
            elif pick == "text":
                raw = b"p%d\n" % index
            elif pick == "memoize":
                raw = b"\x94"
            index += 1
        out.append((name, raw))
    return out


def _decoy(other: bytes, rng: random.Random) -> bytes:
    """Record-shaped bytes from another checkpoint's stream (its storage records, mostly), in a
    length-prefixed argument popped at once: the real unpickler reads them as one value."""
    at = max(other.find(b"_StorageInfo"), 0) if rng.random() < 0.7 else rng.randrange(len(other) // 2)
    at = max(0, at + rng.randint(-64, 64))
    blob = other[at : at + rng.choice([200, 1500, 6000, 40000])]
    if len(blob) < 256 and rng.random() < 0.5:
        return b"C" + bytes([len(blob)]) + blob + b"0"  # SHORT_BINBYTES
    if rng.random() < 0.2:
        return b"\x8e" + struct.pack("<Q", len(blob)) + blob + b"0"  # BINBYTES8
    if rng.random() < 0.2:
        return b"\x96" + struct.pack("<Q", len(blob)) + blob + b"0"  # BYTEARRAY8
    return b"B" + struct.pack("<I", len(blob)) + blob + b"0"  # BINBYTES


def _framed(proto: bytes, body: list[bytes], rng: random.Random) -> bytes:
    """``body`` (opcodes after PROTO) in frames of random sizes cut at opcode boundaries."""
    out = [proto]
    limit = rng.choice([64, 700, 4096, MAX_FRAME])
    frame: list[bytes] = []
    size = 0
    for raw in body:
        if frame and size + len(raw) > limit:
            out.append(b"\x95" + struct.pack("<Q", size) + b"".join(frame))
            frame, size = [], 0
            limit = rng.choice([64, 700, 4096, MAX_FRAME])
        frame.append(raw)
        size += len(raw)
    if frame:
        out.append(b"\x95" + struct.pack("<Q", size) + b"".join(frame))
    return b"".join(out)


def case(seed: int) -> tuple[bytes, list[str]]:
    """One crafted stream and the tricks it holds."""
    rng = random.Random(seed)
    md, tricks = _metadata(rng)
    protocol = rng.choice([2, 3, 4, 4, 4, 5])
    data = pickle.dumps(md, protocol=protocol)
    ops = _ops(data)
    if rng.random() < 0.4:
        ops = _memo_variants(ops, rng)
        tricks.append("memo-variants")
    raws = [raw for _, raw in ops]
    if rng.random() < 0.6:
        other, _ = _metadata(random.Random(seed + 1_000_003))
        other_data = pickle.dumps(other, protocol=max(protocol, 4))
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(1, len(raws) - 1)  # any opcode boundary after PROTO, before STOP
            if rng.random() < 0.5:  # after the last storage record: where a decoy would take effect
                names = [name for name, _ in ops]
                last = max((k for k, name in enumerate(names) if name == "BUILD"), default=at)
                at = min(last + 1, len(raws) - 1)
            raws.insert(at, _decoy(other_data, rng))
        tricks.append("decoy-argument")
    if protocol >= 4 and rng.random() < 0.7:
        data = _framed(raws[0], raws[1:], rng)
        tricks.append("frames")
    else:
        data = b"".join(raws)
    return data, tricks


# -- what each side reads ----------------------------------------------------------------------------
def truth(data: bytes) -> dict[str, Any]:
    """Per entry, what torch's reader reads: kind, dtype, shape and each chunk's box with the storage
    record its planner's key finds (None: torch's read would fail there)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    md = pickle.loads(data)  # our own test stream, built above
    out: dict[str, Any] = {}
    for fqn, smd in md.state_dict_metadata.items():
        if isinstance(smd, TensorStorageMetadata):
            rows = [
                (tuple(c.offsets), tuple(c.sizes), _where(md.storage_data.get(MetadataIndex(fqn, c.offsets))))
                for c in smd.chunks
            ]
            out[fqn] = ("tensor", str(smd.properties.dtype).removeprefix("torch."), tuple(smd.size), rows)
        else:
            out[fqn] = ("bytes", None, None, [((), (), _where(md.storage_data.get(MetadataIndex(fqn))))])
    return out


def _where(info: Any) -> tuple[str, int, int, tuple[str, ...]] | None:
    if info is None:
        return None
    return (info.relative_path, info.offset, info.length, tuple(getattr(info, "transform_descriptors", None) or ()))


def described(index: Any, entries: dict[str, Any]) -> dict[str, Any]:
    """The same description of one of our parses (an entry whose chunks we refuse: 'refused')."""
    out: dict[str, Any] = {}
    for fqn, e in entries.items():
        if index.error(fqn) is not None:
            out[fqn] = "refused"
            continue
        rows = [
            (o, s, None if st is None else (st.file, st.offset, st.length, st.transforms))
            for o, s, st in index.chunks(fqn)
        ]
        if e.kind == "tensor":
            out[fqn] = ("tensor", e.dtype.name, tuple(e.shape), rows)
        else:
            out[fqn] = ("bytes", None, None, rows)
    return out


def ours(data: bytes) -> dict[str, Any]:
    """What each of our parsers makes of ``data``: 'generic' (the restricted unpickler), 'fast' (the
    bulk parse; absent when it hands over) and 'head' (the entries its head gives), or the error a
    parser refused the stream with."""
    from dcpstudio.core.checkpoints.dcp.fast import fast_head, fast_index
    from dcpstudio.core.checkpoints.dcp.metadata import entries_from_metadata, index_of
    from dcpstudio.core.errors import DCPStudioError
    from dcpstudio.core.pickles.unpicklers import load_light_metadata

    found: dict[str, Any] = {}
    try:
        md = load_light_metadata(data, "x")
        entries = entries_from_metadata(md, "x")
        found["generic"] = described(index_of(md, entries, "x"), entries)
    except DCPStudioError as e:
        found["generic"] = e
    fast = fast_index(data, "x")
    if fast is not None:
        found["fast"] = described(*fast)
    head = fast_head(data, "x")
    if head is not None:
        found["head"] = {fqn: (e.kind, e.dtype.name if e.dtype else None, e.shape) for fqn, e in head.entries.items()}
    return found


def differences(data: bytes) -> list[str]:
    """Where our parsers read ``data`` differently from torch without refusing it."""
    want = truth(data)
    got = ours(data)
    out = []
    for parser in ("generic", "fast"):
        seen = got.get(parser)
        if seen is None or isinstance(seen, Exception):
            continue
        if list(seen) != list(want):
            out.append(f"{parser}: entries {list(seen)[:5]}... != torch's {list(want)[:5]}...")
            continue
        for fqn, row in seen.items():
            if row != "refused" and row != want[fqn]:
                out.append(f"{parser}: {fqn}: {row} != torch's {want[fqn]}")
    head = got.get("head")
    if head is not None:
        torch_head = {fqn: (w[0], w[1], w[2]) for fqn, w in want.items()}
        if head != torch_head:
            out.append("head: entries differ from torch's")
    return out
