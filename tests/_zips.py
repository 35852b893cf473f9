"""Hand-built ZIP archives for tests: records stored or deflated as given, sizes and directories
that may lie. torch.save stores every record as it is; other tools repack with deflate.

A deflate stream of zeros is one compressed MiB repeated (after a full flush each MiB compresses
to the same bytes), so a stream that inflates to a GiB is built in a fraction of a second."""

from __future__ import annotations

import io
import struct
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

MIB = 1 << 20
Record = tuple[str, bytes, int, int, int]  # name, payload, method, declared (inflated) size, CRC-32


def zeros_deflated(head: bytes, zeros: int, tail: bytes) -> tuple[bytes, int]:
    """A raw deflate stream of ``head + bytes(zeros) + tail`` (``zeros`` a multiple of 1 MiB) and its CRC-32."""
    c = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    start = c.compress(head) + c.flush(zlib.Z_FULL_FLUSH)
    block = c.compress(bytes(MIB)) + c.flush(zlib.Z_FULL_FLUSH)
    end = c.compress(tail) + c.flush()
    crc, mib = zlib.crc32(head), bytes(MIB)
    for _ in range(zeros // MIB):
        crc = zlib.crc32(mib, crc)
    return start + block * (zeros // MIB) + end, zlib.crc32(tail, crc)


def zip_archive(records: list[Record], extra: bytes = b"", extra_count: int = 0, first: bool = False) -> bytes:
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


def stored(name: str, data: bytes) -> Record:
    return name, data, 0, len(data), zlib.crc32(data)


def torch_records(numel: int, data: bool = False) -> list[Record]:
    """The records of a torch.save archive of ``{"w": <numel float32 zeros>}``, stored, data.pkl
    first as torch.save writes it; the storage's (``data/0``, zeros) only if ``data``. Made without
    the tensor, so a large one costs nothing."""
    from dcpstudio.core.dtypes import dtype_of
    from dcpstudio.core.formats.torchsave.writer import TorchSaveWriter
    from dcpstudio.core.pickles.refs import StorageRef, TensorRef

    f32 = dtype_of("float32")
    buf = io.BytesIO()
    writer = TorchSaveWriter(buf)
    writer.write_pickle({"w": TensorRef.contiguous(StorageRef.for_tensor("0", f32, numel, None), f32, (numel,))})
    if data:
        writer.write_storage("0", bytes(4 * numel))
    writer.finish()
    with zipfile.ZipFile(buf) as z:
        return [stored(i.filename, z.read(i.filename)) for i in z.infolist()]


def repack(src: Path, dst: Path, deflate: Callable[[str], bool]) -> Path:
    """``src`` (a torch.save file) rewritten with the records ``deflate`` names deflated, in order."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            method = zipfile.ZIP_DEFLATED if deflate(info.filename) else zipfile.ZIP_STORED
            zout.writestr(zipfile.ZipInfo(info.filename), zin.read(info.filename), compress_type=method)
    return dst
