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
    "EmptySelectionError",
    "ExpansionError",
    "MissingClassError",
    "NotATensorError",
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
    """A pickle references something outside the allow-list; nothing from it was executed.

    ``source`` names the file (or item) and ``what`` the refused global, so a front end can word
    its own advice (the window offers to open the file trusting it; the CLI names its flag)."""

    def __init__(self, message: str, *, source: str = "", what: str = "") -> None:
        super().__init__(message)
        self.source = source
        self.what = what


class MissingClassError(UnsupportedFormatError):
    """A trusted pickle needs a class that cannot be imported here (``__main__.Foo``: defined in
    the script that saved the file). The file is not damaged; it can only be read where the
    class exists."""

    def __init__(self, message: str, *, what: str = "") -> None:
        super().__init__(message)
        self.what = what

    @classmethod
    def for_class(cls, label: str, module: str, name: str) -> MissingClassError:
        where = (
            "defined in the script that saved the file"
            if module == "__main__"
            else f"from {module.split('.')[0]!r}, which is not installed here or has no such name"
        )
        return cls(
            f"{label}: its pickle needs the class {module}.{name} ({where}); the file is not damaged, but "
            "it can only be loaded where that class exists (or re-saved there with plain types: tensors, "
            "dicts, lists, numbers)",
            what=f"{module}.{name}",
        )


class NotATensorError(DCPStudioError, ValueError):
    """An operation on tensors was asked for an entry that is a plain value: a fault of the input
    named, not of the command's flags (still a ``ValueError`` for callers that catch that)."""


class EmptySelectionError(DCPStudioError):
    """``include``/``exclude`` keep no entry: the output would be an empty checkpoint."""


class DestinationExistsError(DCPStudioError):
    """The destination exists and ``overwrite`` was not given."""


class ExpansionError(DCPStudioError):
    """An output would be many times larger than what its source stores: one storage viewed under
    many names (or read many times), each written out in full. ``name`` is one of those entries,
    ``views`` how many entries view that storage, ``total``/``stored`` the output's and the source's
    bytes -- so a front end can ask whether to write it anyway."""

    def __init__(self, message: str, *, name: str = "", views: int = 0, total: int = 0, stored: int = 0) -> None:
        super().__init__(message)
        self.name = name
        self.views = views
        self.total = total
        self.stored = stored


class LimitError(DCPStudioError):
    """The system refused what the operation needs (open descriptors): no fault of the checkpoint,
    so a check reports it as an error, not as a finding."""


class CancelledError(DCPStudioError):
    """The operation was cancelled through its cancel token; nothing was left behind."""
