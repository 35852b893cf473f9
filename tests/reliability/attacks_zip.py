"""Crafted torch.save ZIP archives (issue 24, items 4 and 10): deflated records that inflate far
past what they declare or what their reader has room for, and central directories that list
millions of entries in a small file. Generators with attacks.py's signature; registered there.

torch.save stores every record as it is, so these archives are built by hand: a deflate stream of
zeros is made of one compressed MiB repeated (after a full flush each MiB compresses the same),
so a 1 GiB bomb takes a fraction of a second to build and about 1 MiB on disk."""

from __future__ import annotations

import io
import random
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

from tests.reliability.attacks import EVERY, VALUES, Attack, _dcp, _replace_byte_item

BOMB = 768 << 20  # what a bomb inflates to: past the 600 MiB the attack suite allows, if held
STORAGE = 256 << 20  # a storage this large took 792 MiB to convert when inflated whole (and copied)
_MIB = 1 << 20


def _zeros_stream(head: bytes, zeros: int, tail: bytes) -> tuple[bytes, int]:
    """A raw deflate stream of ``head + bytes(zeros) + tail`` (``zeros`` a multiple of 1 MiB) and its CRC-32."""
    c = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    start = c.compress(head) + c.flush(zlib.Z_FULL_FLUSH)
    block = c.compress(bytes(_MIB)) + c.flush(zlib.Z_FULL_FLUSH)
    end = c.compress(tail) + c.flush()
    crc, mib = zlib.crc32(head), bytes(_MIB)
    for _ in range(zeros // _MIB):
        crc = zlib.crc32(mib, crc)
    return start + block * (zeros // _MIB) + end, zlib.crc32(tail, crc)


def _archive(
    records: list[tuple[str, bytes, int, int, int]], extra: bytes = b"", extra_count: int = 0, first: bool = False
) -> bytes:
    """A ZIP of ``(name, payload, method, declared size, crc)`` records whose directory also lists
    ``extra_count`` raw entries (``extra``), after the records' or ``first``; ZIP64 end records
    when they are many."""
    out = io.BytesIO()
    central = []
    for name, payload, method, size, crc in records:
        offset = out.tell()
        raw = name.encode()
        out.write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0x21, crc, len(payload), size, len(raw), 0))
        out.write(raw + payload)
        fields = (0x02014B50, 20, 20, 0, method, 0, 0x21, crc, len(payload), size, len(raw), 0, 0, 0, 0, 0, offset)
        central.append(struct.pack("<IHHHHHHIIIHHHHHII", *fields) + raw)
    cd_start = out.tell()
    out.write(extra + b"".join(central) if first else b"".join(central) + extra)
    cd_end = out.tell()
    count = len(central) + extra_count
    if count >= 0xFFFF:
        out.write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, cd_end - cd_start, cd_start))
        out.write(struct.pack("<IIQI", 0x07064B50, 0, cd_end, 1))
    small = min(count, 0xFFFF)
    out.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, small, small, cd_end - cd_start, cd_start, 0))
    return out.getvalue()


def _stored(name: str, data: bytes) -> tuple[str, bytes, int, int, int]:
    return name, data, 0, len(data), zlib.crc32(data)


def _pickle_bomb(rng: random.Random) -> tuple[bytes, str]:
    """A torch archive whose deflated data.pkl is ``{"x": <BOMB zero bytes>}``, declaring its true
    size or a small one."""
    head = b"\x80\x02}X\x01\x00\x00\x00x\x8e" + struct.pack("<Q", BOMB)
    stream, crc = _zeros_stream(head, BOMB, b"s.")
    how = rng.choice(["honest-size", "lying-size"])
    size = len(head) + BOMB + 2 if how == "honest-size" else rng.choice([100, 4096, 60 << 20])
    pkl = ("archive/data.pkl", stream, 8, size, crc)
    return _archive([pkl, _stored("archive/byteorder", b"little"), _stored("archive/version", b"3\n")]), how


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


def _torch_records(numel: int) -> list[tuple[str, bytes, int, int, int]]:
    """The records of a torch.save archive of ``{"w": <numel float32 zeros>}`` but its storage's
    (data.pkl first, as torch.save writes it), made without the tensor's bytes."""
    import zipfile

    from dcpstudio.core._refs import StorageRef, TensorRef
    from dcpstudio.core.dtypes import dtype_of
    from dcpstudio.core.formats.torchsave import TorchSaveWriter

    f32 = dtype_of("float32")
    buf = io.BytesIO()
    writer = TorchSaveWriter(buf)
    writer.write_pickle({"w": TensorRef.contiguous(StorageRef.for_tensor("0", f32, numel, None), f32, (numel,))})
    writer.finish()
    with zipfile.ZipFile(buf) as z:
        return [_stored(i.filename, z.read(i.filename)) for i in z.infolist()]


def zip_storage_bomb(work: Path, rng: random.Random) -> Attack:
    """A deflated storage record: 256 MiB of zeros declared honestly (a real tensor, to be read in
    bounded memory), or a record whose declared size lies about what it inflates to (768 MiB) or
    about the storage it holds."""
    how = rng.choice(["honest", "inflates-past", "record-larger", "short"])
    numel = STORAGE // 4 if how in ("honest", "short") else 1024
    pkl = _torch_records(numel)[0][1]
    zeros = {"honest": STORAGE, "inflates-past": BOMB, "record-larger": _MIB, "short": STORAGE // 2}[how]
    stream, crc = _zeros_stream(b"", zeros, b"")
    declared = {"honest": STORAGE, "inflates-past": numel * 4, "record-larger": BOMB, "short": STORAGE}[how]
    records = [
        _stored("archive/data.pkl", pkl),
        _stored("archive/byteorder", b"little"),
        ("archive/data/0", stream, 8, declared, crc),
        _stored("archive/version", b"3\n"),
    ]
    path = work / "storage.pt"
    path.write_bytes(_archive(records))
    must = {"honest": frozenset(), "inflates-past": VALUES, "record-larger": EVERY, "short": VALUES}[how]
    return Attack(path, must, secret=None, note=how)


def zip_directory_bomb(work: Path, rng: random.Random) -> Attack:
    """A torch archive of one small tensor whose directory lists 1.5 million more entries (all
    pointing at one record), data.pkl first as torch.save writes it, or last (after 1 million:
    found only by walking them all, at each of the suite's opens)."""
    real = _torch_records(4)
    how = rng.choice(["pickle-first", "pickle-last"])
    count = 1_500_000 if how == "pickle-first" else 1_000_000
    name = rng.choice([b"archive/pad", b"archive/data/1", b"archive/.data/x"])
    entry = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 0, 0, 0x21, 0, 0, 0, len(name), 0, 0, 0, 0, 0, 0)
    data = _archive(real, (entry + name) * count, count, first=how == "pickle-last")
    path = work / "directory.pt"
    path.write_bytes(data)
    return Attack(path, EVERY, secret=None, note=f"{how} {name.decode()}")


ATTACKS_ZIP: dict[str, Callable[[Path, random.Random], Attack]] = {
    "zip-pickle-bomb": zip_pickle_bomb,
    "zip-value-bomb": zip_value_bomb,
    "zip-storage-bomb": zip_storage_bomb,
    "zip-directory-bomb": zip_directory_bomb,
}
