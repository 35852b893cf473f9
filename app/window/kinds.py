"""One vocabulary for what an entry is, in every pane and for every format (no Qt).

A tensor -- of any rank, a 0-d one included -- is "tensor" (the tree's Type column shows its dtype);
anything else is "value", with its Python type once it has been read ("value (int)"). The tree never
reads values (a DCP keeps them pickled in its data files), so it says "value" for every format;
Details says "value (int)" for every format once the value is at hand.
"""

from __future__ import annotations

from dcpstudio.core import Entry
from dcpstudio.core.checkpoints.model import dtype_name

__all__ = ["UNREAD", "kind_text", "value_type"]

UNREAD = object()  # kind_text's "the value has not been read"


def value_type(entry: Entry) -> str:
    """What the tree's Type column says of an entry: a tensor's dtype, else "value"."""
    if entry.kind == "tensor":
        return dtype_name(entry.dtype) or "tensor"
    return "value"


def kind_text(entry: Entry, value: object = UNREAD) -> str:
    """What Details' Kind says: "tensor", or "value (int)" once ``value`` (or the entry's own,
    for a format that keeps it in the model) is known, "value" until then."""
    if entry.kind == "tensor":
        return "tensor"
    if value is UNREAD and entry.kind == "object" and entry.value is not None:
        value = entry.value
    return "value" if value is UNREAD else f"value ({type(value).__name__})"
