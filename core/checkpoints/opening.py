"""Open any checkpoint as a :class:`Checkpoint` model and read single tensors or values from it.

Opening reads only structure, and imports no torch: DCP's ``.metadata`` (restricted, into light
records), torch.save's pickle (weights-only, tensors as :class:`~..pickles.refs.TensorRef` descriptions)
or safetensors headers. Tensor data is read on request, one tensor or one region at a time,
touching only the bytes that hold it; torch is imported when a torch tensor is made. Each kind of
checkpoint lives in its own module of :mod:`dcpstudio.core.checkpoints`.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import UnsupportedFormatError
from ..formats.detect import Format, detect_format
from ..io.remote.locations import as_location
from . import ROOT_KEY, Checkpoint, DCPCheckpoint, NestedDCPCheckpoint, Region, SafetensorsCheckpoint, TorchCheckpoint
from .dcp.children import stop_index_children
from .dcp.sidecars import DCPWithSidecars, sidecars_in
from .itemsets import ItemSetCheckpoint, item_set_files
from .shardset import ShardSetCheckpoint, shard_set_files

__all__ = [
    "ROOT_KEY",
    "Checkpoint",
    "DCPCheckpoint",
    "Region",
    "SafetensorsCheckpoint",
    "TorchCheckpoint",
    "open_checkpoint",
    "stop_index_children",
]


def open_checkpoint(
    path: str | os.PathLike[str],
    *,
    trust_pickle: bool = False,
    full_index: bool = False,
    fmt: Format | None = None,
    dequantize: bool = False,
) -> Checkpoint:
    """Open a DCP directory, torch.save file or safetensors checkpoint without reading tensor data.
    ``full_index``: read a DCP's whole storage index now (see :class:`DCPCheckpoint`), not on first
    use -- for callers that will show every entry's chunks and sizes anyway. ``fmt``: the format
    the caller has already detected for this location (an operation detects it once).
    ``dequantize``: a trusted torch.save file's tensor subclasses as their ``dequantize()`` (see
    :mod:`.checkpoints._subclasses`)."""
    p = as_location(path)
    fmt = fmt or detect_format(p)
    if fmt == "dcp":
        kind = DCPWithSidecars if sidecars_in(p) else NestedDCPCheckpoint
        return kind(p, trust_pickle=trust_pickle, full_index=full_index)
    if fmt == "torch":
        ranks = shard_set_files(p) if isinstance(p, Path) else None
        if ranks is not None:
            return ShardSetCheckpoint(p, ranks, trust_pickle=trust_pickle)
        items = item_set_files(p) if isinstance(p, Path) else None
        if items is not None:
            return ItemSetCheckpoint(p, items, trust_pickle=trust_pickle)
        return TorchCheckpoint(p, trust_pickle=trust_pickle, dequantize=dequantize)
    if fmt == "safetensors":
        return SafetensorsCheckpoint(p)
    raise UnsupportedFormatError(f"{p}: unknown format {fmt}")
