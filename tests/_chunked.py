"""DCP checkpoints of tensors saved as several chunks -- what several ranks would write -- made in
one process by a save planner that cuts each tensor into given boxes."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

Box = tuple[tuple[int, ...], tuple[int, ...]]


class ChunkedPlanner(DefaultSavePlanner):
    """Saves each tensor as the chunks ``boxes[fqn]`` (what several ranks would write), in one process."""

    def __init__(self, boxes: dict[str, list[Box]]) -> None:
        super().__init__()
        self.boxes = boxes

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, t in self.state_dict.items():
            for offsets, sizes in self.boxes.get(fqn, [((0,) * t.dim(), tuple(t.shape))]):
                chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
                data = TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(t), size=t.size())
                items.append(
                    WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD, tensor_data=data)
                )
        self.plan = SavePlan(items, planner_data=self.mappings)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        assert write_item.tensor_data is not None
        c = write_item.tensor_data.chunk
        return cut(self.state_dict[write_item.index.fqn], c.offsets, c.sizes).contiguous()


def cut(t: torch.Tensor, offsets: Any, sizes: Any) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]


def split(shape: tuple[int, ...], dims: dict[int, list[int]]) -> list[Box]:
    """The boxes that cut ``shape`` at the given points of each dimension."""
    edges = [[0, *dims.get(d, []), n] for d, n in enumerate(shape)]
    boxes: list[Box] = [((), ())]
    for e in edges:
        boxes = [((*o, a), (*s, b - a)) for o, s in boxes for a, b in itertools.pairwise(e)]
    return boxes
