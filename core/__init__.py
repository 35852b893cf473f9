"""DCP Studio's core: checkpoint formats, converters and inspection. Pure Python + torch, no Qt."""

from __future__ import annotations

from .convert import ConversionResult, convert, dcp_to_torch_save, torch_save_to_dcp
from .diff import DiffReport, diff
from .errors import (
    CancelledError,
    CorruptCheckpointError,
    DCPStudioError,
    DestinationExistsError,
    UnsafePickleError,
    UnsupportedFormatError,
)
from .formats.dcp import DCPReader, DCPWriter, read_metadata
from .formats.detect import detect_format
from .inspect import Checkpoint, open_checkpoint
from .model import Chunk, Entry, Node
from .planners import LazySavePlanner, SafeLoadPlanner
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
    "Entry",
    "LazySavePlanner",
    "Node",
    "Progress",
    "SafeLoadPlanner",
    "TensorStats",
    "UnsafePickleError",
    "UnsupportedFormatError",
    "convert",
    "dcp_to_torch_save",
    "detect_format",
    "diff",
    "open_checkpoint",
    "read_metadata",
    "tensor_stats",
    "torch_save_to_dcp",
]
