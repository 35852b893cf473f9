"""safetensors headers against the safetensors library: crafted mutations of valid files are read
exactly as ``safe_open`` reads them, or refused in one domain error."""

from __future__ import annotations

import json
import random
import re
import struct
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dcpstudio.core.checkpoints.safetensors import SafetensorsCheckpoint
from dcpstudio.core.errors import CorruptCheckpointError, UnsupportedFormatError

safetensors = pytest.importorskip("safetensors")

_DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
LIMITS: dict[str, Callable[[bytes], bool]] = {
    # the library keeps the last of two equal keys; we refuse the ambiguity
    "duplicate key": lambda raw: any(n > 1 for n in _key_counts(raw)),
    # torch sizes are int64: a size or offset of 2**63 or more cannot index a tensor
    "below 2**63": lambda raw: any(int(m) >= 2**63 for m in re.findall(rb"\d{19,20}", raw)),
}
"""Where the library accepts a header we refuse: the project's documented limits, by the words of
the refusal and a check that the header really is such a case."""


def _key_counts(raw: bytes) -> list[int]:
    counts: list[int] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        counts.extend(Counter(k for k, _ in items).values())
        return dict(items)

    try:
        json.loads(raw, object_pairs_hook=pairs)
    except ValueError:
        return []
    return counts


Mutation = Callable[[dict[str, Any], random.Random], bytes]


def _valid(rng: random.Random) -> tuple[dict[str, Any], bytes]:
    header: dict[str, Any] = {}
    if rng.random() < 0.3:
        header["__metadata__"] = {"format": "pt", "note": rng.choice(["x", "", "é"])}
    names = [f"t{k}" for k in range(rng.randint(1, 4))]
    rng.shuffle(names)
    offset, data = 0, bytearray()
    for name in names:
        dtype = rng.choice(sorted(_DTYPES))
        shape = [rng.choice([0, 1, 2, 3]) for _ in range(rng.randint(0, 3))]
        n = _DTYPES[dtype]
        for s in shape:
            n *= s
        raw = bytes(rng.choice([0, 1]) if dtype == "BOOL" else rng.randrange(256) for _ in range(n))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
        data += raw
    return header, bytes(data)


def _dump(header: dict[str, Any]) -> bytes:
    return json.dumps(header).encode()


def _entry(header: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    return header[rng.choice(sorted(k for k in header if k != "__metadata__"))]


def _replace_value(header: dict[str, Any], rng: random.Random) -> bytes:
    e = _entry(header, rng)
    field = rng.choice(["shape", "data_offsets"])
    if not e[field]:
        e[field] = [0]
    k = rng.randrange(len(e[field]))
    token = rng.choice(["2.0", "1e0", "true", "-1", "-0", '"1"', "null", "Infinity", "NaN", str(2**63), str(2**64)])
    token = rng.choice([token, "9" * 5000, str(2**63 - 1), str(e[field][k] + rng.choice([-1, 1]))])
    e[field][k] = "@@"
    return _dump(header).replace(b'"@@"', token.encode())


def _extra_field(header: dict[str, Any], rng: random.Random) -> bytes:
    e = _entry(header, rng)
    depth = rng.choice([1, 100, 125, 126, 127])
    value = rng.choice(["1", "1e999", "9" * 5000, "9" * 300, "NaN", '"\\ud800"', '"\\ud83d\\ude00"', "-0", "[]"])
    e["x"] = "@@"
    return _dump(header).replace(b'"@@"', (b"[" * depth + value.encode() + b"]" * depth))


def _duplicate(header: dict[str, Any], rng: random.Random) -> bytes:
    name = rng.choice(sorted(header))
    text = _dump(header)
    copy = json.dumps({name: header[name]}).encode()[1:-1]
    return text[:-1] + b"," + copy + b"}"


def _metadata(header: dict[str, Any], rng: random.Random) -> bytes:
    header["__metadata__"] = rng.choice([{"k": 1}, ["a"], None, {"k": None}, "text", {"k": "v", "j": "w"}])
    return _dump(header)


def _structure(header: dict[str, Any], rng: random.Random) -> bytes:
    e = _entry(header, rng)
    how = rng.randrange(5)
    if how == 0:
        del e[rng.choice(["dtype", "shape", "data_offsets"])]
    elif how == 1:
        e["shape"] = rng.choice(["12", {"a": 1}, 3])
    elif how == 2:
        e["data_offsets"] = [*e["data_offsets"], e["data_offsets"][1]]
    elif how == 3:
        e["dtype"] = rng.choice(["Q32", "f32", 7, "F8_E4M3", "C64", "U64"])
    else:
        e["data_offsets"] = e["data_offsets"][::-1]
    return _dump(header)


def _bytes(header: dict[str, Any], rng: random.Random) -> bytes:
    raw = bytearray(_dump(header))
    k = rng.randrange(len(raw))
    raw[k] = rng.choice(b' {}[],:"0129.-e\\\x00\xff\x80')
    return bytes(raw)


MUTATIONS: list[Mutation] = [_replace_value, _extra_field, _duplicate, _metadata, _structure, _bytes]


def _library(path: Path) -> dict[str, Any] | None:
    import torch
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return {k: f.get_tensor(k).view(-1).view(torch.uint8) for k in f.keys()}  # noqa: SIM118
    except Exception:  # the library refuses: any of its exceptions
        return None


def _ours(path: Path) -> dict[str, Any]:
    import torch

    ckpt = SafetensorsCheckpoint(path)
    try:
        return {k: ckpt.read_tensor(k).reshape(-1).view(torch.uint8) for k, e in ckpt.entries.items()}
    finally:
        ckpt.close()


def test_headers_read_as_the_library_reads_them(tmp_path: Path) -> None:
    import torch

    rng = random.Random(9)
    seen = {"both": 0, "neither": 0, "limit": 0}
    for case in range(1500):
        header, data = _valid(rng)
        raw = _dump(header) if case % 10 == 0 else rng.choice(MUTATIONS)(header, rng)
        raw += b" " * rng.choice([0, 0, 3])
        tail = rng.choice([b"", b"", b"", b"\x00"])
        path = tmp_path / f"{case}.safetensors"
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + data + tail)
        want = _library(path)
        try:
            got = _ours(path)
        except (CorruptCheckpointError, UnsupportedFormatError) as e:
            assert "\n" not in str(e)
            if want is not None:
                limit = [words for words, applies in LIMITS.items() if words in str(e) and applies(raw)]
                assert limit, f"refused what the library reads: {raw[:300]!r}: {e}"
                seen["limit"] += 1
            else:
                seen["neither"] += 1
            path.unlink()
            continue
        assert want is not None, f"read what the library refuses: {raw[:300]!r}"
        assert sorted(got) == sorted(want), raw[:300]
        for k, v in want.items():
            assert torch.equal(got[k], v), (k, raw[:300])
        seen["both"] += 1
        path.unlink()
    assert min(seen.values()) > 20, seen


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (b'{"a":{"dtype":"F32","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,4]}}', "out of range"),
        (b'{"a":{"dtype":"F32","shape":[Infinity],"data_offsets":[0,4]}}', "Infinity is not JSON"),
        (b'{"a":{"dtype":"F32","shape":[' + str(2**64).encode() + b',0],"data_offsets":[0,0]}}', "below 2**63"),
        (b'{"a":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}}', "below 2**63"),
        (b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0.0,4]}}', "below 2**63"),
        (b'{"a":{"dtype":"F32","shape":[true],"data_offsets":[0,4]}}', "below 2**63"),
        (b'{"a":{"dtype":"F32","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}}', "overflows"),
        (
            b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
            "duplicate key",
        ),
        (b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', "does not start"),
    ],
)
def test_malformed_headers_are_one_line_errors(tmp_path: Path, text: bytes, words: str) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * 8)
    with pytest.raises(CorruptCheckpointError, match=words.replace("*", r"\*")):
        SafetensorsCheckpoint(path)
