"""The deflated records of one ZIP archive, inflated on demand and never past what they may hold.

torch.save stores every record as it is; archives other tools repack may deflate some. Each is
inflated in bounded blocks (:func:`.zip.inflate`) into where it goes: a whole small record
(``data.pkl``) into memory, a storage of an archive in memory into its buffer, a storage of a file
into an unlinked temporary file -- inflated once, then copied and read from there like a stored
record, so a record that inflates to gigabytes never sits in memory unless a caller asks for all of
its bytes. An archive in memory (a DCP value) also has a budget for everything it inflates.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable
from typing import IO

from ...errors import CorruptCheckpointError
from ...io.remote.files import OffsetReader
from ...units import human_bytes
from .zip import ZipRecord, inflate

__all__ = ["Inflated"]


class Inflated:
    """Inflates the records of the archive ``view`` (one at a time: a local view has one file
    position); ``budget``, if given, bounds the total, each record charged once."""

    def __init__(self, view: OffsetReader, label: str, budget: int | None) -> None:
        self._view, self._label = view, label
        self._budget, self._total = budget, budget
        self._charged: set[str] = set()
        self._spill: IO[bytes] | None = None
        self._spilled: dict[str, int] = {}  # record name -> where its bytes start in the spill file
        self._lock = threading.RLock()

    def record_bytes(self, rec: ZipRecord, limit: int) -> bytes:
        """A whole record, at most ``limit`` bytes inflated."""
        return bytes(self.into_memory(rec, limit))

    def into_memory(self, rec: ZipRecord, limit: int) -> bytearray:
        out = bytearray()
        self._inflate(rec, limit, out.extend)
        return out

    def spilled(self, rec: ZipRecord, limit: int) -> tuple[IO[bytes], int]:
        """The temporary file ``rec`` is inflated into, and where its bytes start (inflated now if
        they were not yet)."""
        with self._lock:
            if rec.name not in self._spilled:
                if self._spill is None:
                    self._spill = tempfile.TemporaryFile(prefix="dcpstudio-inflated-")  # noqa: SIM115 - kept open
                spill = self._spill
                start = spill.seek(0, os.SEEK_END)
                try:
                    self._inflate(rec, limit, spill.write)
                    spill.flush()
                except BaseException:
                    spill.truncate(start)
                    raise
                self._spilled[rec.name] = start
            assert self._spill is not None
            return self._spill, self._spilled[rec.name]

    def _inflate(self, rec: ZipRecord, limit: int, sink: Callable[[bytes], object]) -> None:
        with self._lock:
            if self._budget is not None and rec.name not in self._charged:
                if rec.size > self._budget:
                    raise CorruptCheckpointError(
                        f"{self._label}: its deflated records would inflate to more than the "
                        f"{human_bytes(self._total or 0)} a value may hold"
                    )
                self._charged.add(rec.name)
                self._budget -= rec.size
            inflate(self._view, rec, self._label, limit, sink)

    def close(self) -> None:
        if self._spill is not None:
            self._spill.close()
            self._spill = None
