"""Read several boxes of one tensor -- the regions many ranks want -- each into a given tensor,
sharing the reads between boxes that share rows.

A box that is one contiguous run of the stored tensor is read straight into its tensor. Boxes
that cut rows (a 2-D mesh, column sharding) are grouped by their rows; when together they want
most of each row, the rows are read once, in bands of at most 4 MiB through one reused scratch
buffer, and each box is copied out of the band -- instead of each box reading about twice its
bytes through a fresh buffer. A tensor the format does not store in place is read whole once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index

from ..checkpoints import Checkpoint
from ..io.blocks import box_slices
from ..io.raw import contiguous_span

__all__ = ["Box", "RegionReader", "aligned", "nbytes"]

Box = tuple[Sequence[int], Sequence[int], torch.Tensor]  # offsets, lengths, the tensor to fill
_BAND = 4 << 20


def nbytes(lengths: Sequence[int], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for s in lengths:
        n *= s
    return n


def aligned(n: int) -> int:
    """Boxes start 64-byte aligned in a shared buffer, so each can be viewed as any dtype."""
    return (n + 63) // 64 * 64


class RegionReader:
    """Reads boxes of ``ckpt``'s tensors; keeps one band buffer between calls (one thread only)."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self._scratch = torch.empty(0, dtype=torch.uint8)

    def read(self, fqn: str, boxes: Sequence[Box]) -> None:
        """Fill each box's tensor (contiguous, of the box's shape and the stored dtype)."""
        ckpt = self.ckpt
        if not ckpt.reads_in_place(fqn):
            full = ckpt.read_tensor(fqn)
            for offsets, lengths, out in boxes:
                out.copy_(narrow_tensor_by_index(full, offsets, lengths))
            return
        shape = tuple(ckpt.tensor_entry(fqn).shape or ())
        rows: dict[tuple[int, int], list[Box]] = {}
        for box in boxes:
            offsets, lengths, out = box
            if not shape or contiguous_span(shape, offsets, lengths) is not None:
                ckpt.read_into(fqn, box_slices(offsets, lengths), out)
            else:
                rows.setdefault((offsets[0], lengths[0]), []).append(box)
        row = 1
        for s in shape[1:]:
            row *= s
        for (first, count), group in rows.items():
            wanted = sum(out.numel() // max(1, count) for _, _, out in group)
            if 2 * wanted < row:  # a small part of each row: each box alone reads less
                for offsets, lengths, out in group:
                    ckpt.read_into(fqn, box_slices(offsets, lengths), out)
            else:
                self._by_bands(fqn, shape, first, count, group)

    def _by_bands(self, fqn: str, shape: tuple[int, ...], first: int, count: int, group: list[Box]) -> None:
        dtype = group[0][2].dtype
        row_bytes = nbytes(shape[1:], dtype)
        step = max(1, _BAND // max(1, row_bytes))
        if self._scratch.numel() < min(step, count) * row_bytes:
            self._scratch = torch.empty(min(step, count) * row_bytes, dtype=torch.uint8)
        for a in range(first, first + count, step):
            n = min(step, first + count - a)
            band = self._scratch[: n * row_bytes].view(dtype).view(n, *shape[1:])
            self.ckpt.read_into(fqn, [slice(a, a + n)], band)
            for offsets, lengths, out in group:
                out[a - first : a - first + n].copy_(band[(slice(None), *box_slices(offsets[1:], lengths[1:]))])
