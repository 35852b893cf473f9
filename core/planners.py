"""Planners built on torch's defaults: lazy tensors on save, safe unpickling on load.

Both are ordinary ``SavePlanner`` / ``LoadPlanner`` objects, usable with
``torch.distributed.checkpoint.save`` / ``load``.
"""

from __future__ import annotations

import io
import pickle
import re
import struct
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import ReadItem, WriteItem, WriteItemType

from ._io import FileRange
from ._pickle import _names_a_global, _unsafe_message
from ._tree import map_tensors
from .errors import CorruptCheckpointError, UnsafePickleError

__all__ = ["LazySavePlanner", "NameFilter", "RegionPlanner", "SafeLoadPlanner", "safe_torch_load"]


class NameFilter:
    """``include`` / ``exclude`` regular expressions, searched in fully-qualified names.

    A name is kept when it matches ``include`` (or ``include`` is None) and does not match
    ``exclude``. Patterns use :func:`re.search`: anchor them (``^model\\.``) to match a prefix.
    """

    def __init__(self, include: str | None = None, exclude: str | None = None) -> None:
        try:
            self._include = re.compile(include) if include else None
            self._exclude = re.compile(exclude) if exclude else None
        except re.error as e:
            raise ValueError(f"invalid name pattern: {e}") from e

    def __call__(self, fqn: str) -> bool:
        if self._include is not None and not self._include.search(fqn):
            return False
        return not (self._exclude is not None and self._exclude.search(fqn))


def _core_reason(text: str) -> str:
    """The informative line of torch's long weights-only error text."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if line.startswith("WeightsUnpickler error") and i + 1 < len(lines):
            return lines[i + 1]
    return lines[0] if lines else "unreadable"


def safe_torch_load(data: io.BytesIO, label: str, *, trust: bool = False) -> Any:
    """``torch.load`` of a DCP byte item: weights-only unless ``trust``, errors made actionable."""
    try:
        return torch.load(data, map_location="cpu", weights_only=not trust)
    except pickle.UnpicklingError as e:
        if not trust and _names_a_global(str(e)):
            raise UnsafePickleError(_unsafe_message(label, e)) from e
        raise CorruptCheckpointError(f"{label}: damaged pickle ({_core_reason(str(e))})") from e
    except (
        RuntimeError,
        EOFError,
        ValueError,
        KeyError,
        AttributeError,
        ImportError,
        TypeError,
        IndexError,
        OverflowError,
        MemoryError,
        RecursionError,
        UnicodeDecodeError,
        NotImplementedError,
        struct.error,
    ) as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise CorruptCheckpointError(f"{label}: damaged value ({type(e).__name__}: {first})") from e


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose non-tensor values are unpickled with weights-only semantics.

    torch's own planner calls ``torch.load(..., weights_only=False)`` on every byte item, so a
    hostile checkpoint runs code on load; this one refuses unless ``trust_pickle`` is set.
    """

    def __init__(self, *args: Any, trust_pickle: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trust_pickle = trust_pickle

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = safe_torch_load(value, f"value {fqn!r}", trust=self.trust_pickle)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class RegionPlanner(DefaultLoadPlanner):
    """Resolves every read item into one destination tensor: the box of a tensor being read.

    Pair it with read items from ``create_read_items_for_chunk_list(fqn, md, [box])``; each item's
    ``dest_offsets`` are relative to the box, so ``target`` has the box's shape.
    """

    def __init__(self, target: torch.Tensor) -> None:
        super().__init__()
        self.target = target

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return narrow_tensor_by_index(self.target, read_item.dest_offsets, read_item.lengths)


class LazySavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` for state dicts whose tensors are materialised on demand.

    ``materialize(t)`` turns a placeholder tensor (e.g. a meta tensor backed by a storage record
    of a torch.save file) into a CPU tensor; it is called once per write item, just before the
    writer needs the bytes. ``keep(fqn)`` drops entries from the checkpoint (include/exclude).
    """

    def __init__(
        self,
        materialize: Callable[[torch.Tensor], torch.Tensor],
        keep: Callable[[str], bool] | None = None,
        before_item: Callable[[], None] | None = None,
        source_range: Callable[[torch.Tensor], FileRange | None] | None = None,
    ) -> None:
        super().__init__()
        self._materialize = materialize
        self._keep = keep
        self._before_item = before_item
        self._source_range = source_range

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        if self._keep is not None:
            self.state_dict = {k: v for k, v in self.state_dict.items() if self._keep(k)}
            self.mappings = {k: v for k, v in self.mappings.items() if k in self.state_dict}

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if self._before_item is not None:
            self._before_item()
        obj = self.lookup_object(write_item.index)
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(map_tensors(obj, self._materialize), buf)
            return buf
        return self._materialize(obj)

    def resolve_range(self, write_item: WriteItem) -> FileRange | None:
        """Where a tensor item's bytes lie verbatim in a source file, so a writer that knows this
        hook (:class:`~dcpstudio.core.formats.dcp.DCPWriter`) can copy them without reading them."""
        if self._source_range is None or write_item.type == WriteItemType.BYTE_IO:
            return None
        obj = self.lookup_object(write_item.index)
        return self._source_range(obj) if isinstance(obj, torch.Tensor) else None
