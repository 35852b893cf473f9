"""Planners built on torch's defaults: lazy tensors on save, safe unpickling on load.

Both are ordinary ``SavePlanner`` / ``LoadPlanner`` objects, usable with
``torch.distributed.checkpoint.save`` / ``load``.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import ReadItem, WriteItem, WriteItemType

from ...errors import CorruptCheckpointError, MissingClassError
from ...io.raw import FileRange
from ...pickles.tree import map_tensors

__all__ = ["LazySavePlanner", "RegionPlanner", "SafeLoadPlanner", "safe_torch_load"]


def safe_torch_load(data: io.BytesIO, label: str, *, trust: bool = False) -> Any:
    """Load a DCP byte item (a torch.save archive): with DCP Studio's weights-only unpickler and
    its tensors made real, or -- when ``trust`` -- with ``torch.load(weights_only=False)``."""
    if not trust:
        from ...pickles.tensor_io import materialize
        from ..torchsave.archive import TorchSaveFile

        return map_tensors(TorchSaveFile(data, label=label).obj, materialize)
    try:
        return torch.load(data, map_location="cpu", weights_only=False)
    except (ImportError, AttributeError) as e:  # a class of the saving script (__main__.Foo) or a missing package
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise MissingClassError(
            f"{label}: its pickle needs a class that is not importable here ({first}); the file is not damaged, "
            "but it can only be loaded where that class exists"
        ) from e
    except Exception as e:  # a trusted pickle can raise anything
        first = str(e).splitlines()[0] if str(e) else ""
        raise CorruptCheckpointError(f"{label}: cannot load value ({type(e).__name__}: {first})") from e


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
        hook (:class:`~dcpstudio.core.formats.dcp.files.DCPWriter`) can copy them without reading them."""
        if self._source_range is None or write_item.type == WriteItemType.BYTE_IO:
            return None
        obj = self.lookup_object(write_item.index)
        return self._source_range(obj) if isinstance(obj, torch.Tensor) else None
