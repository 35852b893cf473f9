"""Stream transforms from the caller's own extensions, as torch's ``FileSystemReader`` /
``FileSystemWriter`` apply them (``_extension_registry`` / ``_extensions``, torch's experimental
``torch.distributed.checkpoint._extension`` API).

The code that undoes a transform is the caller's, never the checkpoint's: a checkpoint only names
descriptors, which the caller's registry maps to classes. Without a registry, readers keep to the
built-in transforms (:func:`~.files.decode_item`: zstd). What a transform produces is bounded like
any decompression: past ``limit`` bytes the item is refused.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import IO, Any, cast

from ...errors import CorruptCheckpointError, UnsupportedFormatError

__all__ = ["undo_transforms", "write_transformed"]

_BLOCK = 1 << 20


def _first_line(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def undo_transforms(registry: Any, descriptors: Sequence[str], raw: bytes, label: str, limit: int) -> bytes:
    """An item's bytes with its transforms undone by ``registry``'s extensions -- chained as
    torch's reader chains them, so this reads exactly what torch reads -- at most ``limit``."""
    try:
        extensions = registry.from_descriptor_list(list(descriptors))
    except Exception as e:  # the registry's own lookup: ValueError for a name it lacks
        raise UnsupportedFormatError(
            f"{label}: stored with the transform(s) {list(descriptors)}, which the extension registry cannot "
            f"undo ({_first_line(e)})"
        ) from None
    from torch.distributed.checkpoint._extension import StreamTransformExtension

    stream: IO[bytes] = io.BytesIO(raw)
    for ex in extensions:
        if isinstance(ex, StreamTransformExtension):
            stream = ex.transform_from(stream)
    out = bytearray()
    try:
        while len(out) <= limit:
            block = stream.read(min(_BLOCK, limit + 1 - len(out)))
            if not block:
                break
            out += block
    except Exception as e:  # the extension's code, on this item's bytes
        raise CorruptCheckpointError(
            f"{label}: undoing its transforms {list(descriptors)} failed ({_first_line(e)})"
        ) from e
    if len(out) > limit:
        raise CorruptCheckpointError(f"{label}: its transforms produce more than the {limit} bytes it can hold")
    return bytes(out)


class _NoClose(io.RawIOBase):
    """The file under the transforms: closing the outermost one flushes through, never closes."""

    def __init__(self, raw: IO[bytes]) -> None:
        super().__init__()
        self.raw = raw

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self.raw.write(b)
        return len(memoryview(b))

    def close(self) -> None:
        if not self.closed:
            self.raw.flush()
        super().close()


def write_transformed(extensions: Sequence[Any], f: IO[bytes], data: Any) -> list[str]:
    """Write ``data`` to ``f`` through ``extensions`` (the first one outermost on disk, as torch's
    writer nests them); the descriptors to store, in the order torch stores them."""
    stream = cast(IO[bytes], _NoClose(f))
    for ex in extensions:
        stream = ex.transform_to(stream)
    stream.write(data)
    stream.close()
    return [ex.get_descriptor() for ex in reversed(extensions)]
