"""Domain exceptions: every failure a user can act on has a class and a one-line message.

The CLI prints ``str(error)`` and exits non-zero; the window shows it in its notifier. Messages name
the file involved and say what to do, so no traceback is ever needed to understand them.
"""

from __future__ import annotations

__all__ = [
    "CancelledError",
    "CorruptCheckpointError",
    "DCPStudioError",
    "DestinationExistsError",
    "UnsafePickleError",
    "UnsupportedFormatError",
]


class DCPStudioError(Exception):
    """Base of every error DCP Studio reports to a user."""


class UnsupportedFormatError(DCPStudioError):
    """The input is not a checkpoint format we read (or the variant is not supported)."""


class CorruptCheckpointError(DCPStudioError):
    """The input claims to be a checkpoint but is truncated or internally inconsistent."""


class UnsafePickleError(DCPStudioError):
    """A pickle references something outside the allow-list; nothing from it was executed."""


class DestinationExistsError(DCPStudioError):
    """The destination exists and ``overwrite`` was not given."""


class CancelledError(DCPStudioError):
    """The operation was cancelled through its cancel token; nothing was left behind."""
