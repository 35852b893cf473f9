"""DCP Studio's core: checkpoint formats, converters and inspection. Pure Python + torch, no Qt.

Importing it does not import torch (seconds): reading structure and moving bytes need none. The
names built on torch's DCP classes -- :class:`DCPReader`, :class:`DCPWriter`, :func:`read_metadata`,
:class:`SafeLoadPlanner`, :class:`LazySavePlanner` -- are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .convert import ConversionResult, convert, dcp_to_torch_save, torch_save_to_dcp
from .diff import DiffReport, EntryComparison, compare, diff
from .errors import (
    CancelledError,
    CorruptCheckpointError,
    DCPStudioError,
    DestinationExistsError,
    EmptySelectionError,
    ExpansionError,
    MissingClassError,
    NotATensorError,
    UnsafePickleError,
    UnsupportedFormatError,
)
from .extract import ExportResult, export_tensor
from .formats.detect import detect_format
from .inspect import Checkpoint, open_checkpoint, stop_index_children
from .model import Chunk, Entry, Node
from .progress import CancelToken, Progress
from .stats import TensorStats, tensor_stats

__all__ = [
    "CancelToken",
    "CancelledError",
    "Checkpoint",
    "Chunk",
    "ConversionResult",
    "CorruptCheckpointError",
    "DCPReader",
    "DCPStudioError",
    "DCPWriter",
    "DestinationExistsError",
    "DiffReport",
    "EmptySelectionError",
    "Entry",
    "EntryComparison",
    "ExpansionError",
    "ExportResult",
    "LazySavePlanner",
    "MissingClassError",
    "Node",
    "NotATensorError",
    "Progress",
    "SafeLoadPlanner",
    "TensorStats",
    "UnsafePickleError",
    "UnsupportedFormatError",
    "compare",
    "convert",
    "dcp_to_torch_save",
    "detect_format",
    "diff",
    "export_tensor",
    "open_checkpoint",
    "read_metadata",
    "stop_index_children",
    "tensor_stats",
    "torch_save_to_dcp",
]

_LAZY = {
    "DCPReader": "formats.dcp_storage",
    "DCPWriter": "formats.dcp_storage",
    "read_metadata": "formats.dcp_storage",
    "LazySavePlanner": "planners",
    "SafeLoadPlanner": "planners",
}

if TYPE_CHECKING:
    from .formats.dcp_storage import DCPReader, DCPWriter, read_metadata
    from .planners import LazySavePlanner, SafeLoadPlanner


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
