"""A DCP checkpoint as ``dcp.save`` writes it from many ranks, written by one process: one data file
per rank (``__R_0.distcp``) holding that rank's chunks, each tensor's chunks listed in the
``.metadata`` in the order of the files that hold them, as torch's global plan lists them.

What goes into which file is the caller's choice (:mod:`dcpstudio.core.ops.convert.reshard` lays a
checkpoint out for a target world size); this module only writes the files it is given, in order,
each fsynced, and the ``.metadata`` last -- after the manifest, when a :class:`Watch` computes one
from the bytes written (its tensors' pieces lie in several files, so what reads them back is the
caller's: it knows the layout). No torch is imported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ...dtypes import DType
from ...io.files import abandon, create_file, sync_file
from ...io.raw import FileRange
from ...pickles.refs import Size
from ..manifest import Manifest
from ..torchsave.writer import write_tensor_archive
from .files import _record, check_tiling, storage_info, write_metadata

__all__ = ["ItemData", "StoredItem", "Watch", "rank_file", "write_ranked_dcp"]


def rank_file(rank: int) -> str:
    """The data file torch's ``FileSystemWriter`` gives rank ``rank`` (one file per rank)."""
    return f"__{rank}_0.distcp"


@dataclass(frozen=True)
class StoredItem:
    """One item of a data file: the chunk ``offsets + sizes`` of tensor ``fqn``, or (``offsets``
    None) the value ``fqn``."""

    fqn: str
    offsets: tuple[int, ...] | None = None
    sizes: tuple[int, ...] = ()


ItemData = bytes | FileRange | Iterator[bytes | bytearray | memoryview]
"""A value's whole torch.save archive; a chunk's row-major bytes copied from a file, or streamed."""


class Watch(Protocol):
    """What follows the bytes as they are written, for a manifest: told of each data file when it
    is created and of each item once its bytes are in the file (``data_at``: where a chunk's
    elements start; ``f`` holds them, not yet flushed), then asked for the manifest once every data
    file is fsynced."""

    def file(self, path: Path) -> None: ...

    def written(self, item: StoredItem, file_name: str, data_at: int, f: Any) -> None: ...

    def manifest(self) -> Manifest: ...


def write_ranked_dcp(
    directory: Path,
    files: Sequence[tuple[str, Iterable[tuple[StoredItem, ItemData]]]],
    tensors: Mapping[str, tuple[DType, tuple[int, ...]]],
    paths: Mapping[str, tuple[str | int, ...]],
    *,
    checkpoint_id: str,
    label: str,
    on_item: Callable[[StoredItem], None],
    watch: Watch | None = None,
) -> None:
    """Write the data files ``files`` -- each a name and its items with their data, in order --
    into the new directory ``directory``, then a ``.metadata`` for the entries ``paths`` (every one
    written; ``tensors`` gives each tensor's dtype and shape, the others are values). Each
    tensor's chunks must tile it. ``on_item`` is called after each item (it may raise to cancel).
    With ``watch``, its manifest is written before ``.metadata``."""
    directory.mkdir()
    storage_data: dict[Any, Any] = {}
    chunks: dict[str, list[Any]] = {fqn: [] for fqn in tensors}
    for file_name, items in files:
        f = create_file(directory / file_name)
        try:
            if watch is not None:
                watch.file(directory / file_name)
            for item, data in items:
                offset = at = f.tell()
                if item.offsets is None:
                    assert isinstance(data, bytes)
                    f.write(data)
                    index = _record("MetadataIndex", fqn=item.fqn, index=None)
                else:
                    dtype, _ = tensors[item.fqn]
                    at = write_tensor_archive(f, dtype, item.sizes, data, label=f"{label} ({item.fqn})")
                    found = chunks[item.fqn]
                    index = _record("MetadataIndex", fqn=item.fqn, index=len(found), offset=Size(item.offsets))
                    found.append(_record("ChunkStorageMetadata", offsets=Size(item.offsets), sizes=Size(item.sizes)))
                storage_data[index] = storage_info(file_name, offset, f.tell() - offset)
                if watch is not None:
                    watch.written(item, file_name, at, f)
                on_item(item)
            sync_file(f)
        except BaseException:
            abandon(f)
            raise
        f.close()
    state_dict_metadata: dict[str, Any] = {}
    for fqn in paths:
        if fqn not in tensors:
            state_dict_metadata[fqn] = _record("BytesStorageMetadata")
            continue
        dtype, shape = tensors[fqn]
        check_tiling(shape, [(c.offsets, c.sizes) for c in chunks[fqn]], f"{label} ({fqn!r})")
        props = _record("TensorProperties", dtype=dtype, requires_grad=False)
        state_dict_metadata[fqn] = _record(
            "TensorStorageMetadata", properties=props, size=Size(shape), chunks=chunks[fqn]
        )
    manifest = watch.manifest() if watch is not None else None
    write_metadata(directory, state_dict_metadata, dict(paths), storage_data, checkpoint_id, manifest)
