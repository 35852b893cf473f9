"""Shapes and sizes (issue 24, items 7 and 9): safetensors headers whose numbers Python's JSON reads
and the safetensors library refuses (thousands of digits, Infinity, 2**64, floats, bools, duplicate
keys, 64-bit overflow), and a DCP tensor stored as 10,000-40,000 chunks that share their rows,
which a pairwise tiling check takes hours over. Each must end in one line, quickly."""

from __future__ import annotations

import random
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.reliability.attacks import EVERY, READING, VALUES, Attack, _dcp, edit_metadata

_ENTRY = b'"dtype":"F32","shape":%s,"data_offsets":%s'
_HEADERS = {
    "5000-digits": (b"[" + b"9" * 5000 + b"]", b"[0,4]"),
    "infinity": (b"[Infinity]", b"[0,4]"),
    "2**64-by-0": (b"[18446744073709551616,0]", b"[0,0]"),
    "2**63-by-0": (b"[9223372036854775808,0]", b"[0,0]"),
    "float-shape": (b"[1.0]", b"[0,4]"),
    "float-offsets": (b"[1]", b"[0.0,4.0]"),
    "bool-shape": (b"[true]", b"[0,4]"),
    "nan": (b"[NaN]", b"[0,4]"),
    "overflow": (b"[4294967296,4294967296,0]", b"[0,0]"),
    "string-shape": (b'"1"', b"[0,4]"),
}


def safetensors_numbers(work: Path, rng: random.Random) -> Attack:
    """A one-tensor safetensors file whose shape or offsets are numbers no tensor can have, or
    whose tensor is named twice."""
    how = rng.choice([*sorted(_HEADERS), "duplicate"])
    if how == "duplicate":
        entry = b"{" + _ENTRY % (b"[1]", b"[0,4]") + b"}"
        header = b'{"w":' + entry + b',"w":' + entry + b"}"
    else:
        header = b'{"w":{' + _ENTRY % _HEADERS[how] + b"}}"
    path = work / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x00" * 4)
    return Attack(path, must_fail=EVERY, secret=None, note=how)


def dcp_shared_rows(work: Path, rng: random.Random) -> Attack:
    """A tensor declared ``[16, 2n]`` and stored as n chunks ``[16, 2]`` side by side, all sharing
    rows 0-16 (each pointing at the same stored item, which holds another shape); or the same with
    the last chunk moved one column left, so that the volumes still add up but two chunks overlap."""
    import torch

    n = rng.choice([10_000, 40_000])  # 100,000: tests/core/test_tiling.py; the JSON listing dominates here
    overlap = rng.random() < 0.5
    ckpt = _dcp(work / "ckpt")

    def edit(md: Any) -> None:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        fqn = "model.w"
        tmd = md.state_dict_metadata[fqn]
        key = next(k for k in md.storage_data if k.fqn == fqn)
        info = md.storage_data.pop(key)
        tmd.size = torch.Size([16, 2 * n])
        tmd.chunks = []
        for k in range(n):
            at = torch.Size([0, 2 * k - (1 if overlap and k == n - 1 else 0)])
            tmd.chunks.append(ChunkStorageMetadata(at, torch.Size([16, 2])))
            md.storage_data[type(key)(fqn, at, key.index)] = info

    edit_metadata(ckpt, edit)
    return Attack(ckpt, READING if overlap else VALUES, secret=None, note=f"{n} chunks, overlap={overlap}")


ATTACKS_SHAPES: dict[str, Callable[[Path, random.Random], Attack]] = {
    "safetensors-numbers": safetensors_numbers,
    "dcp-shared-rows": dcp_shared_rows,
}
