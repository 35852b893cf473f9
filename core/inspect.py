"""Open any checkpoint as a :class:`Checkpoint` model and read single tensors or values from it.

Opening reads only structure, and imports no torch: DCP's ``.metadata`` (restricted, into light
records), torch.save's pickle (weights-only, tensors as :class:`~._refs.TensorRef` descriptions)
or safetensors headers. Tensor data is read on request, one tensor or one region at a time,
touching only the bytes that hold it; torch is imported when a torch tensor is made. Each kind of
checkpoint lives in its own module of :mod:`dcpstudio.core.checkpoints`.
"""

from __future__ import annotations

import os

from ._remote import as_location
from .checkpoints import ROOT_KEY, Checkpoint, DCPCheckpoint, Region, SafetensorsCheckpoint, TorchCheckpoint
from .checkpoints.dcp_children import stop_index_children
from .checkpoints.dcp_sidecars import DCPWithSidecars, sidecars_in
from .errors import UnsupportedFormatError
from .formats.detect import detect_format

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
    path: str | os.PathLike[str], *, trust_pickle: bool = False, full_index: bool = False
) -> Checkpoint:
    """Open a DCP directory, torch.save file or safetensors checkpoint without reading tensor data.
    ``full_index``: read a DCP's whole storage index now (see :class:`DCPCheckpoint`), not on first
    use -- for callers that will show every entry's chunks and sizes anyway."""
    p = as_location(path)
    fmt = detect_format(p)
    if fmt == "dcp":
        kind = DCPWithSidecars if sidecars_in(p) else DCPCheckpoint
        return kind(p, trust_pickle=trust_pickle, full_index=full_index)
    if fmt == "torch":
        return TorchCheckpoint(p, trust_pickle=trust_pickle)
    if fmt == "safetensors":
        return SafetensorsCheckpoint(p)
    raise UnsupportedFormatError(f"{p}: unknown format {fmt}")
