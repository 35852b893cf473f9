"""One module per kind of checkpoint, each behind the :class:`~.base.Checkpoint` model;
:mod:`.canonical` reads any kind's tensor bytes in place without torch (hash, value counts,
bitwise comparison)."""

from __future__ import annotations

from .base import ROOT_KEY, Checkpoint, Region
from .dcp.checkpoint import DCPCheckpoint
from .dcp.nested import NestedDCPCheckpoint
from .safetensors import SafetensorsCheckpoint
from .torchsave import TorchCheckpoint, torch_index

__all__ = [
    "ROOT_KEY",
    "Checkpoint",
    "DCPCheckpoint",
    "NestedDCPCheckpoint",
    "Region",
    "SafetensorsCheckpoint",
    "TorchCheckpoint",
    "torch_index",
]
