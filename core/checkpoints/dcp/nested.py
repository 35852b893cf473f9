"""DCP checkpoints saved without flattening (``DefaultSavePlanner(flatten_state_dict=False)``):
each top-level value, a whole nested dict of tensors included, is one byte item -- a torch.save
archive. torch's readers give it back as that nested dict (``dcp_to_torch_save``), so its entries
are shown and converted as a flattened DCP's are: ``model.a``, ``model.sub.b``, by dotted name,
each with its path in the nested dict.

A flattened save never stores a dict as a byte item (torch's flattening walks into every mapping)
and records every name in its planner data; so only byte items the planner data does not name are
read at open -- those of a small ``.metadata`` (a large one, opened from its head, is a flattened
save's). An item larger than :data:`VALUE_LIMIT` is left whole (its archive is read into memory);
a safetensors target then refuses it rather than lose its tensors; so is one whose archive is refused
(its pickle unsafe, or damaged), which says so when its value is asked for, as before.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from ...errors import DCPStudioError
from ...formats.torchsave.archive import VALUE_LIMIT
from ...pickles.refs import TensorRef, is_tensor
from ...pickles.tensor_io import materialize
from ...pickles.tree import flatten_state_dict
from ..base import Region, _box
from ..model import Chunk, Entry
from .checkpoint import DCPCheckpoint

__all__ = ["NestedDCPCheckpoint"]


class NestedDCPCheckpoint(DCPCheckpoint):
    """A :class:`DCPCheckpoint` whose unflattened byte items holding dicts are shown as their entries."""

    def __init__(self, path: Path, *, trust_pickle: bool = False, full_index: bool = False) -> None:
        super().__init__(path, trust_pickle=trust_pickle, full_index=full_index)
        self._nested: dict[str, tuple[str, Any]] = {}  # entry -> (its byte item, its value or TensorRef)
        self._nested_paths: dict[str, tuple[str | int, ...]] = {}
        if self._index is None and (self._head is not None or self._head_only):
            return  # a large .metadata: a flattened save
        named = set(super().paths()) if self._planner_names() else set()
        entries: dict[str, Entry] = {}
        for fqn, entry in self.entries.items():
            found = self._expand(fqn) if entry.kind == "bytes" and fqn not in named else None
            if found is None:
                entries[fqn] = entry
                continue
            flat, paths = found
            for sub, value in flat.items():
                name = f"{fqn}.{sub}"
                self._nested[name] = (fqn, value)
                self._nested_paths[name] = (fqn, *paths[sub])
                entries[name] = _entry(name, value)
        if self._nested:
            self.entries = entries

    def _planner_names(self) -> bool:
        data = self._index.paths() if self._index is not None else getattr(self._md, "planner_data", None)
        return bool(data)

    def _expand(self, fqn: str) -> tuple[dict[str, Any], dict[str, tuple[str | int, ...]]] | None:
        try:
            (c,) = self.chunks(fqn)
            value = super().read_object(fqn) if (c.length or 0) <= VALUE_LIMIT else None
        except DCPStudioError:  # refused or damaged: left whole, to say so when its value is asked for
            return None
        if not isinstance(value, dict) or not value:
            return None
        try:
            return flatten_state_dict(value)
        except (ValueError, RecursionError):
            return None

    def paths(self) -> dict[str, tuple[str | int, ...]]:
        out = {k: v for k, v in super().paths().items() if k in self.entries}
        out.update(self._nested_paths)
        return out

    def chunk_count(self, fqn: str) -> int:
        return 1 if fqn in self._nested else super().chunk_count(fqn)

    def chunks(self, fqn: str) -> list[Chunk]:
        """A nested entry lies inside its byte item's archive: that item's byte range."""
        if fqn not in self._nested:
            return super().chunks(fqn)
        (c,) = super().chunks(self._nested[fqn][0])
        shape = self.entries[fqn].shape or ()
        return [Chunk((0,) * len(shape), shape, c.file, c.offset, c.length)]

    def resolve_chunks(self, fqn: str) -> list[Chunk]:
        return self.chunks(fqn) if fqn in self._nested else super().resolve_chunks(fqn)

    def tensor_ref(self, fqn: str) -> TensorRef:
        if fqn not in self._nested:
            return super().tensor_ref(fqn)
        self.tensor_entry(fqn)
        ref: TensorRef = self._nested[fqn][1]
        return ref

    def read_object(self, fqn: str, limit: int | None = None) -> Any:
        return self._nested[fqn][1] if fqn in self._nested else super().read_object(fqn, limit)

    def read_tensor(self, fqn: str, region: Region | None = None) -> torch.Tensor:
        if fqn not in self._nested:
            return super().read_tensor(fqn, region)
        import torch

        offsets, sizes = _box(self.tensor_entry(fqn), region)
        ref = self.tensor_ref(fqn)
        if math.prod(sizes) == 0:
            return torch.empty(sizes, dtype=ref.dtype.torch)
        return materialize(ref.narrow(offsets, sizes)).clone(memory_format=torch.contiguous_format)


def _entry(name: str, value: Any) -> Entry:
    if not is_tensor(value):
        return Entry(name, "object", value=value)
    stored = value.storage.nbytes if value.storage is not None else 0
    return Entry(
        name,
        "tensor",
        value.dtype,
        value.shape,
        storage_offset=value.storage_offset,
        stride=value.stride,
        stored=stored,
    )
