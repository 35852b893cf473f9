"""DCP chunks read through torch's own read plan: those whose bytes do not lie in place in their data
file (compressed or otherwise transformed), which torch decodes whole."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from ..model import Chunk, Entry

if TYPE_CHECKING:
    import torch

__all__ = ["read_planned"]


def read_planned(
    path: Path,
    trust: bool,
    fqn: str,
    entry: Entry,
    chunks: list[Chunk],
    descriptors: Callable[[str, tuple[int, ...]], list[str] | None],
    offsets: list[int],
    sizes: list[int],
    target: torch.Tensor,
) -> None:
    """Read the box (``offsets``, ``sizes``) of tensor ``fqn``'s overlap with ``chunks`` into ``target``
    through torch's read plan; ``descriptors`` gives each chunk's stream transforms."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    from ...formats.dcp.planners import RegionPlanner
    from ...formats.dcp.storage import DCPReader

    md = TensorStorageMetadata(
        TensorProperties(dtype=target.dtype),
        torch.Size(entry.shape or ()),
        [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in chunks],
    )
    reader = DCPReader(path, trust_pickle=trust)
    storage = {
        MetadataIndex(fqn, torch.Size(c.offsets)): SimpleNamespace(  # what DCPReader reads of an info
            relative_path=c.file or "",
            offset=c.offset or 0,
            length=c.length or 0,
            transform_descriptors=descriptors(fqn, c.offsets),
        )
        for c in chunks
    }
    reader.set_up_storage_reader(Metadata(state_dict_metadata={fqn: md}, storage_data=storage), True)
    box = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
    items = create_read_items_for_chunk_list(fqn, md, [box])
    reader.read_data(LoadPlan(items), RegionPlanner(target)).wait()
