"""Just enough ZIP to read torch.save archives record by record (:mod:`.zip_writer` writes them).

torch.save writes an uncompressed ZIP whose records live under one top-level folder and whose
tensor data starts on 64-byte boundaries. We locate each record's data in the file so a storage
can be read alone, straight into its destination. Only the records a caller names are built, so a
directory of millions of entries costs a walk, not memory; a deflated record (other writers make
them) is inflated in bounded blocks, never past what its reader has room for.
"""

from __future__ import annotations

import contextlib
import os
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any

from ...errors import CorruptCheckpointError, UnsupportedFormatError
from ...io.remote.files import OffsetReader
from ...io.remote.locations import RemoteFile
from ...units import human_bytes

__all__ = ["FileView", "ZipDirectory", "ZipRecord", "inflate", "read_zip_records"]

_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_EOCD = struct.Struct("<IHHHHIIH")
_EOCD64 = struct.Struct("<IQHHIIQQQQ")
_LOCATOR = struct.Struct("<IIQI")
_MAX32 = 0xFFFFFFFF
_TAIL = _EOCD.size + 0xFFFF  # the end record and the longest comment it may carry
_SHORT = _EOCD.size + _LOCATOR.size  # what the end holds when the archive has no comment
_BLOCK = 1 << 20  # bytes of directory, or of inflated output, handled at a time


class FileView(OffsetReader):
    """A read-only window ``[offset, offset + length)`` of a seekable binary file."""

    def __init__(self, f: IO[bytes], offset: int, length: int) -> None:
        super().__init__(length)
        self._f = f
        self._offset = offset

    def pread_exact(self, pos: int, out: bytearray) -> int:
        """Read ``out`` at ``pos`` of the window by one exact request (a remote file's record
        header: no read-ahead into the tensor bytes after it); 0 if it does not fit."""
        if pos + len(out) > self.length or not isinstance(self._f, RemoteFile):
            return 0
        return self._f.pread(self._offset + pos, memoryview(out), (self._offset + pos, self._offset + pos + len(out)))

    def read_at(self, pos: int, out: memoryview) -> int:
        n = max(0, min(len(out), self.length - pos))
        if n == 0:
            return 0
        if isinstance(self._f, RemoteFile):  # read ahead inside the window only
            return self._f.pread(self._offset + pos, out[:n], (self._offset, self._offset + self.length))
        self._f.seek(self._offset + pos)
        return int(self._f.readinto(out[:n]))  # type: ignore[attr-defined]


class ZipRecord:
    """Where one record's bytes are, relative to the start of the archive. The data offset comes
    from the record's local header; for a remote archive that header is read when first needed
    (opening a 2 GiB torch.save file reads its directory and ``data.pkl``, not 100 headers)."""

    __slots__ = ("_locate", "_offset", "crc", "method", "name", "packed", "size")

    def __init__(
        self, name: str, data_offset: int | None, size: int, method: int, crc: int, packed: int, locate: Any = None
    ) -> None:
        self.name, self.size, self.crc = name, size, crc
        self.method, self.packed = method, packed  # compression method; bytes the record takes in the file
        self._offset, self._locate = data_offset, locate

    @property
    def stored(self) -> bool:
        """Uncompressed: its bytes lie in the file as they are (else see :func:`inflate`)."""
        return self.method == zipfile.ZIP_STORED

    @property
    def unresolved(self) -> bool:
        return self._offset is None

    @property
    def data_offset(self) -> int:
        if self._offset is None:
            self._offset = self._locate()
        return self._offset


def _bad(label: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{label}: not a readable ZIP archive ({why}); the file may be truncated")


class ZipDirectory:
    """The central directory of the archive at ``[offset, offset+length)`` of ``f``, read without
    building a record per entry: :meth:`find` walks it once and keeps only the names asked for.

    A directory may list millions of entries in a small file; building each (as ``zipfile``
    does) costs ~700 bytes and 15 us apiece, so callers look up what the pickle references and
    judge :attr:`count` against it. Like torch's reader (miniz), offsets are taken as written and
    :attr:`count` entries are read; the archive's folder is the first entry's (``prefix``)."""

    def __init__(self, f: IO[bytes], label: str, offset: int = 0, length: int | None = None) -> None:
        if length is None:
            f.seek(0, os.SEEK_END)
            length = f.tell() - offset
        self.label, self.view = label, FileView(f, offset, length)
        self._lazy = isinstance(f, RemoteFile)
        tail = self._read(max(0, length - _SHORT), min(length, _SHORT), "end of central directory")
        at = len(tail) - _EOCD.size  # where it is when the archive has no comment, as torch writes
        if at < 0 or tail[at : at + 4] != b"PK\x05\x06" or tail[-2:] != b"\0\0":
            tail = self._read(max(0, length - _TAIL), min(length, _TAIL), "end of central directory")
            at = tail.rfind(b"PK\x05\x06")
        if at < 0 or at + _EOCD.size > len(tail):
            raise _bad(label, "no end of central directory record")
        _, _, _, _, count, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, at)
        end = length - len(tail) + at  # where the directory must end
        if at >= _LOCATOR.size and tail[at - _LOCATOR.size : at - _LOCATOR.size + 4] == b"PK\x06\x07":
            _, _, where, _ = _LOCATOR.unpack_from(tail, at - _LOCATOR.size)
            head = self._read(where, _EOCD64.size, "ZIP64 end of central directory")
            if head[:4] != b"PK\x06\x06":
                raise _bad(label, "damaged ZIP64 end of central directory")
            count, cd_size, cd_offset = _EOCD64.unpack(head)[7:10]
            end = where
        if cd_offset + cd_size > end or count * _CENTRAL.size > cd_size:
            raise _bad(label, f"a directory of {count} entries in {cd_size} bytes at {cd_offset} does not fit")
        self.count, self._start, self._end = count, cd_offset, cd_offset + cd_size
        self._head = self._read(cd_offset, min(cd_size, _BLOCK), "central directory") if count else b""
        entry = next(self._walk(), None)
        self.first = None if entry is None else self._record(*entry)  # torch.save writes data.pkl first
        self.prefix = "" if entry is None or "/" not in entry[0] else entry[0].split("/", 1)[0] + "/"

    def _read(self, pos: int, size: int, what: str) -> bytes:
        buf = bytearray(size)
        if self.view.read_at(pos, memoryview(buf)) != size:
            raise _bad(self.label, f"its {what} lies past the end")
        return bytes(buf)

    def _walk(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, tuple[int, ...], bytes]]:
        """The name, fixed fields and extra field of each entry (or of each named one, its raw
        name matched without decoding the others: a walk of millions costs about a second), in
        directory order, the directory read in blocks."""
        by_flag: tuple[dict[bytes, str], dict[bytes, str]] | None = None
        if names is not None:
            by_flag = ({}, {})  # the names as entries without and with the UTF-8 flag spell them
            for wanted in names:
                by_flag[1][wanted.encode()] = wanted
                with contextlib.suppress(UnicodeEncodeError):
                    by_flag[0][wanted.encode("cp437")] = wanted
        unpack, fixed = _CENTRAL.unpack_from, _CENTRAL.size
        buf, at, pos = self._head, 0, self._start + len(self._head)  # the first block is read once
        for _ in range(self.count):
            if len(buf) - at < fixed:
                buf, at, pos = self._more(buf, at, pos, fixed)
            fields = unpack(buf, at)
            if fields[0] != 0x02014B50:
                raise _bad(self.label, "damaged central directory entry")
            n = fields[10]
            total = fixed + n + fields[11] + fields[12]
            if len(buf) - at < total:
                buf, at, pos = self._more(buf, at, pos, total)
            raw = buf[at + fixed : at + fixed + n]
            utf8 = fields[3] & 0x800
            name: str | None = None
            if by_flag is None:
                try:
                    name = raw.decode("utf-8" if utf8 else "cp437")
                except UnicodeDecodeError as err:
                    raise _bad(self.label, f"an entry name is not UTF-8 ({err})") from err
            else:
                name = by_flag[1 if utf8 else 0].get(raw)
            if name is not None:
                yield name, fields, buf[at + fixed + n : at + fixed + n + fields[11]]
            at += total

    def _more(self, buf: bytes, at: int, pos: int, need: int) -> tuple[bytes, int, int]:
        size = min(max(need, _BLOCK), self._end - pos)
        if len(buf) - at + size < need:
            raise _bad(self.label, "the central directory ends inside an entry")
        return buf[at:] + self._read(pos, size, "central directory"), 0, pos + size

    def find(self, names: Iterable[str]) -> dict[str, ZipRecord]:
        """The records of those of ``names`` the archive holds; a name listed twice is refused
        (which of the two a reader takes is up to the reader)."""
        found: dict[str, ZipRecord] = {}
        for name, fields, extra in self._walk(names):
            if name in found:
                raise CorruptCheckpointError(f"{self.label}: the ZIP directory lists {name} twice")
            found[name] = self._record(name, fields, extra)
        return found

    def _record(self, name: str, fields: tuple[int, ...], extra: bytes) -> ZipRecord:
        packed, size, header = fields[8], fields[9], fields[16]
        big = [v for v in (size, packed, header) if v == _MAX32]
        if big:
            values = _zip64_extra(extra, len(big), self.label, name)
            size = values.pop(0) if size == _MAX32 else size
            packed = values.pop(0) if packed == _MAX32 else packed
            header = values.pop(0) if header == _MAX32 else header
        rec = ZipRecord(name, None, size, fields[4], fields[7], packed, lambda: self._locate(name, header, packed))
        if not self._lazy:
            _ = rec.data_offset
        return rec

    def _locate(self, name: str, header: int, packed: int) -> int:
        head = bytearray(_LOCAL.size)
        view = self.view
        got = view.pread_exact(header, head) if self._lazy else 0
        if not got:
            got = view.read_at(header, memoryview(head))
        if got != _LOCAL.size or head[:4] != b"PK\x03\x04":
            raise CorruptCheckpointError(f"{self.label}: record {name} has a damaged header")
        fields = _LOCAL.unpack(head)
        data_offset = header + _LOCAL.size + fields[9] + fields[10]
        if data_offset + packed > view.length:
            raise CorruptCheckpointError(f"{self.label}: record {name} runs past the end of the file (truncated?)")
        return int(data_offset)


def _zip64_extra(extra: bytes, n: int, label: str, name: str) -> list[int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        if tag == 1 and size >= 8 * n:
            return list(struct.unpack_from(f"<{n}Q", extra, pos + 4))
        pos += 4 + size
    raise CorruptCheckpointError(f"{label}: record {name} lacks the ZIP64 sizes its directory entry calls for")


def read_zip_records(
    f: IO[bytes], label: str, offset: int = 0, length: int | None = None, max_entries: int | None = None
) -> dict[str, ZipRecord]:
    """Every record of the archive at ``[offset, offset+length)`` of ``f``, by name; refused when
    its directory lists more than ``max_entries``."""
    directory = ZipDirectory(f, label, offset, length)
    if max_entries is not None and directory.count > max_entries:
        raise CorruptCheckpointError(
            f"{label}: its ZIP directory lists {directory.count} entries; an archive like this holds at most "
            f"{max_entries}"
        )
    return {name: directory._record(name, fields, extra) for name, fields, extra in directory._walk()}


def inflate(view: OffsetReader, rec: ZipRecord, label: str, limit: int, sink: Callable[[bytes], object]) -> int:
    """Stream a deflated record into ``sink`` in blocks of at most 1 MiB; its CRC-32.

    A record may not declare more than ``limit`` bytes (what the reader has room for, derived from
    what the format declares), nor inflate to more or fewer than it declares, nor fail its CRC:
    each refused in one line, before or as soon as the bytes say so."""
    if rec.method != zipfile.ZIP_DEFLATED:
        raise UnsupportedFormatError(
            f"{label}: record {rec.name} is compressed with ZIP method {rec.method}; torch reads stored or deflated "
            "records only"
        )
    if rec.size > limit:
        raise CorruptCheckpointError(
            f"{label}: record {rec.name} would inflate to {human_bytes(rec.size)}, more than the "
            f"{human_bytes(limit)} it may hold"
        )
    d = zlib.decompressobj(-zlib.MAX_WBITS)
    pos, end = rec.data_offset, rec.data_offset + rec.packed
    total = crc = 0
    try:
        while not d.eof:
            feed = d.unconsumed_tail
            if not feed and pos < end:
                piece = bytearray(min(_BLOCK, end - pos))
                feed = bytes(piece[: view.read_at(pos, memoryview(piece))])
                pos = pos + len(feed) if feed else end
            out = d.decompress(feed, _BLOCK)
            if not out and not feed:
                break
            total += len(out)
            if total > rec.size:
                raise CorruptCheckpointError(
                    f"{label}: record {rec.name} inflates past the {rec.size} bytes its directory declares"
                )
            crc = zlib.crc32(out, crc)
            sink(out)
    except zlib.error as e:
        raise CorruptCheckpointError(f"{label}: record {rec.name} holds damaged deflate data ({e})") from e
    if total != rec.size:
        raise CorruptCheckpointError(
            f"{label}: record {rec.name} inflates to {total} bytes, its directory says {rec.size}"
        )
    if crc != rec.crc:
        raise CorruptCheckpointError(f"{label}: record {rec.name} fails its CRC-32 check (damaged)")
    return crc
