"""DCP Studio's core: checkpoint formats, converters and inspection. Pure Python + torch, no Qt."""

from __future__ import annotations

from .convert import ConversionResult, convert, dcp_to_torch_save, torch_save_to_dcp
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
from .planners import LazySavePlanner, SafeLoadPlanner
from .progress import CancelToken, Progress

__all__ = [
    "CancelToken",
    "CancelledError",
    "ConversionResult",
    "CorruptCheckpointError",
    "DCPReader",
    "DCPStudioError",
    "DCPWriter",
    "DestinationExistsError",
    "LazySavePlanner",
    "Progress",
    "SafeLoadPlanner",
    "UnsafePickleError",
    "UnsupportedFormatError",
    "convert",
    "dcp_to_torch_save",
    "detect_format",
    "read_metadata",
    "torch_save_to_dcp",
]
