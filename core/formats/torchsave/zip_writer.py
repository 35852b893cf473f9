"""Write torch.save archives record by record.

:class:`ZipWriter` produces the same layout as torch's ``PyTorchFileWriter`` (stored records
under one folder, data 64-byte aligned) but computes CRC-32 with zlib, which is several times
faster than the miniz routine torch uses, and streams one record at a time.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import BinaryIO

from ...io.raw import FileRange, Hole, copy_range, crc32
from .zip import _CENTRAL, _EOCD, _EOCD64, _LOCAL, _LOCATOR, _MAX32

__all__ = ["ZipWriter"]

_CRC_AT = 14  # where a local header holds the CRC-32
_DOS_DATE = 0x21  # 1980-01-01: outputs are byte-for-byte reproducible


class ZipWriter:
    """Write a torch.save-style archive: stored records under ``archive/``, data 64-byte aligned.

    Offsets are relative to the position of ``f`` at construction, so an archive can be embedded
    in a larger file (DCP's ``.distcp`` files hold one archive per tensor chunk).
    """

    def __init__(self, f: BinaryIO, archive: str, alignment: int = 64) -> None:
        self._f = f
        self._base = f.tell()
        self._archive = archive
        self._alignment = alignment
        self._entries: list[tuple[bytes, int, int, int, int]] = []
        self.data_at: dict[str, int] = {}  # where each record's bytes start in the file

    def _pos(self) -> int:
        return self._f.tell() - self._base

    def write(self, name: str, data: bytes | bytearray | memoryview, crc: int | None = None) -> None:
        """Append a record; pass ``crc`` when it is already known (e.g. computed on another thread)."""
        mv = memoryview(data).cast("B")
        self._header(name, mv.nbytes, crc32(mv) if crc is None else crc)
        self._f.write(mv)

    def write_stream(
        self, name: str, size: int, pieces: Iterable[bytes | bytearray | memoryview], known_crc: int | None = None
    ) -> None:
        """Append a record of ``size`` bytes from ``pieces`` as they come (memory holds one piece):
        the header goes first with the CRC left blank, filled in once the bytes have passed -- or,
        with ``known_crc``, written in it at once, so the file is written strictly in order."""
        start = self._f.tell()
        self._header(name, size, 0 if known_crc is None else known_crc)
        crc = written = 0
        for piece in pieces:
            mv = memoryview(piece).cast("B")
            if known_crc is None:
                crc = crc32(mv, crc)
            written += mv.nbytes
            self._f.write(mv)
            del piece, mv  # the producer may free it before making the next
        if written != size:
            raise ValueError(f"record {name}: {written} bytes were written, the header says {size}")
        if known_crc is not None:
            return
        end = self._f.tell()
        self._f.seek(start + _CRC_AT)
        self._f.write(struct.pack("<I", crc))
        self._f.seek(end)
        full, _, _, offset, flags = self._entries[-1]
        self._entries[-1] = (full, crc, size, offset, flags)

    def copy(self, name: str, src: FileRange, label: str) -> None:
        """Append a record whose bytes are copied from another file inside the kernel."""
        if src.crc is None:
            raise ValueError("a ZIP record copied from a file needs the bytes' CRC-32")
        self._header(name, src.nbytes, src.crc)
        copy_range(src, self._f, label)

    def reserve(self, name: str, hole: Hole) -> None:
        """Append a record whose bytes are left for another writer (see :class:`~...io.raw.Hole`)."""
        self._header(name, hole.nbytes, hole.crc or 0)
        hole.place(self._f)

    def set_crc(self, name: str, crc: int) -> None:
        """The CRC-32 of the last record, ``name``, once its bytes were written by another writer."""
        full, _, size, offset, flags = self._entries[-1]
        if full != f"{self._archive}/{name}".encode():
            raise ValueError(f"record {name} is not the last one written")
        end = self._f.tell()
        self._f.seek(self._base + offset + _CRC_AT)
        self._f.write(struct.pack("<I", crc))
        self._f.seek(end)
        self._entries[-1] = (full, crc, size, offset, flags)

    def _header(self, name: str, size: int, crc: int) -> None:
        full = f"{self._archive}/{name}".encode()
        zip64 = size >= _MAX32
        offset = self._pos()
        z64 = struct.pack("<HHQQ", 1, 16, size, size) if zip64 else b""
        pad = (-(offset + _LOCAL.size + len(full) + len(z64) + 4)) % self._alignment
        extra = z64 + struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # "FB" padding, as torch writes
        flags = 0 if full.isascii() else 0x800
        version = 45 if zip64 else 20
        stored_size = _MAX32 if zip64 else size
        self._f.write(
            _LOCAL.pack(
                0x04034B50,
                version,
                flags,
                0,
                0,
                _DOS_DATE,
                crc,
                stored_size,
                stored_size,
                len(full),
                len(extra),
            )
            + full
            + extra
        )
        self.data_at[name] = self._f.tell()
        self._entries.append((full, crc, size, offset, flags))

    def close(self) -> None:
        """Write the central directory (ZIP64 records when needed)."""
        cd_start = self._pos()
        for name, crc, size, offset, flags in self._entries:
            big: list[int] = []
            if size >= _MAX32:
                big += [size, size]
            if offset >= _MAX32:
                big.append(offset)
            extra = struct.pack(f"<HH{len(big)}Q", 1, 8 * len(big), *big) if big else b""
            version = 45 if big else 20
            self._f.write(
                _CENTRAL.pack(
                    0x02014B50,
                    version,
                    version,
                    flags,
                    0,
                    0,
                    _DOS_DATE,
                    crc,
                    min(size, _MAX32),
                    min(size, _MAX32),
                    len(name),
                    len(extra),
                    0,
                    0,
                    0,
                    0,
                    min(offset, _MAX32),
                )
                + name
                + extra
            )
        cd_end = self._pos()
        cd_size = cd_end - cd_start
        count = len(self._entries)
        if count >= 0xFFFF or cd_start >= _MAX32 or cd_size >= _MAX32:
            self._f.write(_EOCD64.pack(0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, cd_start))
            self._f.write(_LOCATOR.pack(0x07064B50, 0, cd_end, 1))
        self._f.write(
            _EOCD.pack(
                0x06054B50,
                0,
                0,
                min(count, 0xFFFF),
                min(count, 0xFFFF),
                min(cd_size, _MAX32),
                min(cd_start, _MAX32),
                0,
            )
        )
