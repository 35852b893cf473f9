"""What a checkpoint stores, checked record by record with the readers' own checks.

The readers refuse damage when they meet it -- at open (safetensors headers, torch.save archives),
on first use (DCP chunk tables) or when a value is read (a DCP item's archive, its zstd frame).
:func:`check_entry` walks those same checks for one entry without reading its tensor's elements,
so an integrity check asks each entry in turn and collects every refusal rather than the first;
:func:`stored_ranges` lists the byte range of every DCP item, so a data file's gaps and tail --
bytes no entry names -- can be found.
"""

from __future__ import annotations

from ..formats.dcp.files import open_chunk, volume
from .base import Checkpoint
from .dcp.checkpoint import DCPCheckpoint
from .dcp.metadata import check_stored
from .dcp.nested import NestedDCPCheckpoint

__all__ = ["check_entry", "data_file_size", "listed_chunks", "stored_ranges"]

_SLACK = 1 << 20  # an archive's own records around a chunk's elements


def check_entry(ckpt: Checkpoint, fqn: str) -> None:
    """Every stored record of ``fqn`` parses and holds what the checkpoint says it holds: a DCP
    chunk's archive (decoded from its zstd frame first, bounded by the chunk's own size), a value's
    archive; a tensor's chunks tile it. Raises the reader's refusal (a one-line domain error)."""
    entry = ckpt.entry(fqn)
    if not isinstance(ckpt, DCPCheckpoint):
        ckpt.resolve_chunks(fqn) if entry.kind == "tensor" else ckpt.read_object(fqn)
        return
    if isinstance(ckpt, NestedDCPCheckpoint) and fqn in ckpt._nested:
        ckpt.chunks(fqn)  # its byte item was read and parsed at open
        return
    chunks = ckpt.chunks(fqn)  # tiling, and each plain chunk at least as long as its elements
    if entry.kind != "tensor":
        ckpt.read_object(fqn)
        return
    assert entry.dtype is not None
    for c in chunks:
        if not ckpt._descriptors(fqn, c.offsets):
            ckpt._raw_offset(fqn, c)
            continue
        limit = volume(c.sizes) * entry.dtype.itemsize + _SLACK
        f, offset, length, label = ckpt._item_bytes(c, fqn, limit)
        check_stored(open_chunk(f, offset, length, label, fqn).tensor, entry, c, label)


def listed_chunks(ckpt: DCPCheckpoint, fqn: str) -> list[tuple[tuple[int, ...], tuple[int, ...], str, int, int]]:
    """``(offsets, sizes, file, offset, length)`` of each chunk the ``.metadata`` lists for ``fqn``
    with a storage record, as listed -- not checked to tile the tensor (what a refused chunk table
    holds, to name its files); empty when the listing itself is unreadable."""
    try:
        rows = ckpt._storage().chunks(fqn)
    except Exception:
        return []
    return [(o, s, info.file, info.offset, info.length) for o, s, info in rows if info is not None]


def stored_ranges(ckpt: DCPCheckpoint) -> dict[str, dict[tuple[int, int], str]]:
    """Each data file's stored items: ``{file: {(offset, length): fqn}}``, every item once (the
    entries of an unflattened byte item share its range). An entry whose chunk table is refused
    (:func:`check_entry` names it) still names the records it lists."""
    out: dict[str, dict[tuple[int, int], str]] = {}
    for fqn in ckpt.entries:
        try:
            listed = [(c.file, c.offset or 0, c.length or 0) for c in ckpt.chunks(fqn)]
        except Exception:
            listed = [(file, offset, length) for _, _, file, offset, length in listed_chunks(ckpt, fqn)]
        for file, offset, length in listed:
            if file is not None:
                out.setdefault(file, {}).setdefault((offset, length), fqn)
    return out


def data_file_size(ckpt: DCPCheckpoint, name: str) -> int:
    """The size of a data file the checkpoint names (which must lie inside it and be a regular
    file: refused as the readers refuse it)."""
    return ckpt._files.size(name)
