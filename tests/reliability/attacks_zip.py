"""Crafted torch.save ZIP archives (issue 24, items 4 and 10): deflated records that inflate far
past what they declare or what their reader has room for, and central directories that list
millions of entries in a small file. Generators with attacks.py's signature; registered there.

torch.save stores every record as it is, so these archives are built by hand (tests/_zips.py); a
768 MiB bomb takes a fraction of a second to build and about 1 MiB on disk."""

from __future__ import annotations

import io
import random
import struct
from collections.abc import Callable
from pathlib import Path

from tests._zips import MIB, stored, torch_records, zeros_deflated, zip_archive
from tests.reliability.attacks import EVERY, VALUES, Attack, _dcp, _replace_byte_item

BOMB = 768 << 20  # what a bomb inflates to: past the 600 MiB the attack suite allows, if held
STORAGE = 256 << 20  # a storage this large took 792 MiB to convert when inflated whole (and copied)


def _pickle_bomb(rng: random.Random) -> tuple[bytes, str]:
    """A torch archive whose deflated data.pkl is ``{"x": <BOMB zero bytes>}``, declaring its true
    size or a small one."""
    head = b"\x80\x02}X\x01\x00\x00\x00x\x8e" + struct.pack("<Q", BOMB)
    stream, crc = zeros_deflated(head, BOMB, b"s.")
    how = rng.choice(["honest-size", "lying-size"])
    size = len(head) + BOMB + 2 if how == "honest-size" else rng.choice([100, 4096, 60 << 20])
    pkl = ("archive/data.pkl", stream, 8, size, crc)
    return zip_archive([pkl, stored("archive/byteorder", b"little"), stored("archive/version", b"3\n")]), how


def zip_pickle_bomb(work: Path, rng: random.Random) -> Attack:
    """A deflated data.pkl of ~1 MiB that inflates to 768 MiB (declaring so, or declaring little)."""
    data, how = _pickle_bomb(rng)
    path = work / "bomb.pt"
    path.write_bytes(data)
    return Attack(path, EVERY, secret=None, note=how)


def zip_value_bomb(work: Path, rng: random.Random) -> Attack:
    """The same archive as a DCP byte item (a non-tensor value is a torch.save archive)."""
    data, how = _pickle_bomb(rng)
    ckpt = _dcp(work / "ckpt")
    _replace_byte_item(ckpt, rng.choice(["step", "cfg.name"]), data)
    return Attack(ckpt, VALUES, secret=None, note=how)


def zip_storage_bomb(work: Path, rng: random.Random) -> Attack:
    """A deflated storage record: 256 MiB of zeros declared honestly (a real tensor, to be read in
    bounded memory), or a record whose declared size lies about what it inflates to (768 MiB) or
    about the storage it holds."""
    how = rng.choice(["honest", "inflates-past", "record-larger", "short"])
    numel = STORAGE // 4 if how in ("honest", "short") else 1024
    pkl = torch_records(numel)[0][1]
    zeros = {"honest": STORAGE, "inflates-past": BOMB, "record-larger": MIB, "short": STORAGE // 2}[how]
    stream, crc = zeros_deflated(b"", zeros, b"")
    declared = {"honest": STORAGE, "inflates-past": numel * 4, "record-larger": BOMB, "short": STORAGE}[how]
    records = [
        stored("archive/data.pkl", pkl),
        stored("archive/byteorder", b"little"),
        ("archive/data/0", stream, 8, declared, crc),
        stored("archive/version", b"3\n"),
    ]
    path = work / "storage.pt"
    path.write_bytes(zip_archive(records))
    must = {"honest": frozenset(), "inflates-past": VALUES, "record-larger": EVERY, "short": VALUES}[how]
    return Attack(path, must, secret=None, note=how)


def zip_directory_bomb(work: Path, rng: random.Random) -> Attack:
    """A torch archive of one small tensor whose directory lists 1.5 million more entries (all
    pointing at one record), data.pkl first as torch.save writes it, or last (after 1 million:
    found only by walking them all, at each of the suite's opens)."""
    real = torch_records(4, data=True)
    how = rng.choice(["pickle-first", "pickle-last"])
    count = 1_500_000 if how == "pickle-first" else 1_000_000
    name = rng.choice([b"archive/pad", b"archive/data/1", b"archive/.data/x"])
    entry = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 0, 0, 0x21, 0, 0, 0, len(name), 0, 0, 0, 0, 0, 0)
    data = zip_archive(real, (entry + name) * count, count, first=how == "pickle-last")
    path = work / "directory.pt"
    path.write_bytes(data)
    return Attack(path, EVERY, secret=None, note=f"{how} {name.decode()}")


def _zstd_zeros(size: int, head: bytes = b"") -> bytes:
    import zstandard

    out = io.BytesIO()
    with zstandard.ZstdCompressor().stream_writer(out, closefd=False) as writer:
        writer.write(head)
        for _ in range(size // MIB):
            writer.write(bytes(MIB))
    return out.getvalue()


def dcp_zstd_bomb(work: Path, rng: random.Random) -> Attack:
    """A DCP item compressed the way torch's ZStandard extension does, that decompresses to 768 MiB:
    a byte item, a tensor chunk (declaring a few bytes), or a small byte item whose archive inside
    holds the deflated data.pkl bomb."""
    how = rng.choice(["value", "tensor", "value-of-deflated-pickle"])
    ckpt = _dcp(work / "ckpt")
    payload = _zstd_zeros(0, _pickle_bomb(rng)[0]) if how == "value-of-deflated-pickle" else _zstd_zeros(BOMB)
    _replace_byte_item(ckpt, "model.b" if how == "tensor" else "step", payload, ["stream.zstd/1"])
    return Attack(ckpt, VALUES, secret=None, note=how)


ATTACKS_ZIP: dict[str, Callable[[Path, random.Random], Attack]] = {
    "zip-pickle-bomb": zip_pickle_bomb,
    "zip-value-bomb": zip_value_bomb,
    "zip-storage-bomb": zip_storage_bomb,
    "zip-directory-bomb": zip_directory_bomb,
    "dcp-zstd-bomb": dcp_zstd_bomb,
}
