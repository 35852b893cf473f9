"""torch's ``FileSystemWriter``, faster: :class:`DCPWriter` writes the same files while the next
tensor is already being read, with zlib CRCs (torch.save's miniz CRC runs at ~0.4 GB/s), so
conversion runs at about disk speed. Use it with ``torch.distributed.checkpoint.save``.
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ...dtypes import dtype_of
from ...errors import UnsupportedFormatError
from ...io.pipeline import prefetch
from ...io.raw import FileRange, crc32, tensor_buffer
from ..torchsave.writer import write_tensor_archive
from .transforms import write_transformed

__all__ = ["DCPWriter", "storage_info"]


def storage_info(relative_path: str, offset: int, length: int, descriptors: Sequence[str] = ()) -> Any:
    """torch's private ``_StorageInfo``, built by keyword: its fields grew over releases (2.6 has
    no ``transform_descriptors``), so it is never called positionally, and the field is set only
    for an item that was transformed (as torch's writer leaves it out otherwise)."""
    if descriptors:
        return _StorageInfo(
            relative_path=relative_path, offset=offset, length=length, transform_descriptors=list(descriptors)
        )
    return _StorageInfo(relative_path=relative_path, offset=offset, length=length)


class DCPWriter(FileSystemWriter):
    """``FileSystemWriter`` that writes the same files faster and reports each item written.

    Tensors are resolved one at a time (the next one is resolved on a helper thread while the
    current one is written), so a planner that materialises tensors lazily keeps memory bounded
    by a few tensors. ``on_item(nbytes, fqn)`` is called after each item; it may raise to cancel.
    ``_extensions``: torch's ``StreamTransformExtension`` objects each item is written through
    (as ``FileSystemWriter`` takes them); a reader needs a registry that knows them.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        on_item: Callable[[int, str], None] | None = None,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        overwrite: bool = False,
        _extensions: Sequence[Any] | None = None,
    ) -> None:
        super().__init__(path, single_file_per_rank=single_file_per_rank, sync_files=sync_files, overwrite=overwrite)
        self.on_item = on_item
        self.extensions = tuple(_extensions or ())
        if self.extensions and "transform_descriptors" not in {f.name for f in dataclasses.fields(_StorageInfo)}:
            raise UnsupportedFormatError(
                f"torch {torch.__version__} records no stream transforms (_StorageInfo.transform_descriptors); "
                "_extensions needs a newer torch"
            )

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = cast(_StoragePrefix, plan.storage_data).prefix
        items = sorted(plan.items, key=lambda i: i.type != WriteItemType.BYTE_IO)
        groups = [items] if self.single_file_per_rank else [[i] for i in items]
        results: list[WriteResult] = []
        for n, group in enumerate(groups):
            if not group:
                continue
            file_name = f"{prefix}{n}.distcp"
            results += self._write_file(Path(self.path) / file_name, file_name, group, planner)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_file(
        self, path: Path, file_name: str, items: list[WriteItem], planner: SavePlanner
    ) -> list[WriteResult]:
        resolve_range = None if self.extensions else getattr(planner, "resolve_range", None)

        def produce(item: WriteItem) -> Any:
            """Runs on the prefetch thread: the item's bytes (and CRC), or where to copy them from."""
            if item.type == WriteItemType.BYTE_IO:
                return planner.resolve_data(item)
            if resolve_range is not None:
                found = resolve_range(item)
                if found is not None:
                    return found
            tensor = cast(torch.Tensor, planner.resolve_data(item)).detach().cpu()
            if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != tensor.nbytes:
                tensor = tensor.contiguous() if not tensor.is_contiguous() else tensor.clone()
            return tensor, crc32(tensor_buffer(tensor))

        results = []
        with open(path, "wb") as f:
            for item, data in prefetch(produce, items):
                offset = f.tell()
                descriptors: list[str] = []
                if self.extensions:
                    buf = io.BytesIO()
                    if item.type == WriteItemType.BYTE_IO:
                        buf = cast(io.BytesIO, data)
                    else:
                        tensor, crc = data
                        write_tensor_archive(
                            buf, dtype_of(tensor.dtype), tuple(tensor.shape), tensor_buffer(tensor), crc=crc
                        )
                    descriptors = write_transformed(self.extensions, cast(IO[bytes], f), buf.getbuffer())
                elif item.type == WriteItemType.BYTE_IO:
                    f.write(cast(io.BytesIO, data).getbuffer())
                elif isinstance(data, FileRange):
                    td = item.tensor_data
                    assert td is not None
                    dtype = dtype_of(td.properties.dtype)
                    write_tensor_archive(f, dtype, tuple(td.size), data, label=f"{path} ({item.index.fqn})")
                else:
                    tensor, crc = data
                    shape = tuple(tensor.shape)
                    write_tensor_archive(f, dtype_of(tensor.dtype), shape, tensor_buffer(tensor), crc=crc)
                length = f.tell() - offset
                results.append(
                    WriteResult(
                        index=item.index,
                        size_in_bytes=length,
                        storage_data=storage_info(file_name, offset, length, descriptors),
                    )
                )
                if self.on_item is not None:
                    self.on_item(length, item.index.fqn)
            f.flush()
            if self.sync_files:
                os.fsync(f.fileno())
        return results
