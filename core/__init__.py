"""DCP Studio's core: checkpoint formats, converters and inspection. Pure Python + torch, no Qt.

Importing it does not import torch (seconds): reading structure and moving bytes need none. The
names built on torch's DCP classes -- :class:`DCPReader`, :class:`DCPWriter`, :func:`read_metadata`,
:class:`SafeLoadPlanner`, :class:`LazySavePlanner` -- and the operations (:func:`convert`,
:func:`diff`, :func:`tensor_stats` ...) are imported on first use, so a command loads only its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .checkpoints.model import Chunk, Entry, Node
from .checkpoints.opening import Checkpoint, open_checkpoint, stop_index_children
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
from .formats.detect import detect_format
from .progress import CancelToken, Progress

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
    "DCPReader": "formats.dcp.storage",
    "DCPWriter": "formats.dcp.storage",
    "read_metadata": "formats.dcp.storage",
    "LazySavePlanner": "formats.dcp.planners",
    "SafeLoadPlanner": "formats.dcp.planners",
    # the operations: a command imports only the one it runs (start-up time)
    "DiffReport": "ops.compare.diff",
    "EntryComparison": "ops.compare.diff",
    "compare": "ops.compare.diff",
    "diff": "ops.compare.diff",
    "ConversionResult": "ops.convert.convert",
    "convert": "ops.convert.convert",
    "dcp_to_torch_save": "ops.convert.convert",
    "torch_save_to_dcp": "ops.convert.convert",
    "ExportResult": "ops.explore.extract",
    "export_tensor": "ops.explore.extract",
    "TensorStats": "ops.explore.stats",
    "tensor_stats": "ops.explore.stats",
}

if TYPE_CHECKING:
    from .formats.dcp.planners import LazySavePlanner, SafeLoadPlanner
    from .formats.dcp.storage import DCPReader, DCPWriter, read_metadata
    from .ops.compare.diff import DiffReport, EntryComparison, compare, diff
    from .ops.convert.convert import ConversionResult, convert, dcp_to_torch_save, torch_save_to_dcp
    from .ops.explore.extract import ExportResult, export_tensor
    from .ops.explore.stats import TensorStats, tensor_stats


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
