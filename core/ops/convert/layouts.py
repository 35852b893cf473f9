"""Where each rank's part of a tensor lies in a sharded job: the layouts ``load`` knows, as plain
data (no torch, no process group), so a checkpoint can be laid out for ranks that do not exist yet.

A layout gives each tensor one placement per mesh dimension -- sharded along a tensor dimension,
or replicated -- as :func:`~dcpstudio.core.ranks.load.placements` makes them for DTensors. A
rank's region is what torch's ``compute_local_shape_and_global_offset`` computes for it: along a
sharded dimension of size ``L`` over ``m`` ranks, ``torch.chunk``'s split (``ceil(L / m)`` each,
the last ones shorter or empty), an empty shard sitting at offset ``L``. Ranks that hold the same
region (a replicated tensor, or a 2-D mesh's replicated dimension) share it: :func:`target_chunks`
lists each distinct region once with the ranks that hold it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["LAYOUTS", "TargetChunk", "parse_mesh", "rank_region", "shard_dims", "target_chunks"]

LAYOUTS = ("replicate", "shard0", "shard1", "fsdp")

Placement = int | None  # the tensor dimension a mesh dimension shards, None: replicated over it


def parse_mesh(text: str | None, world: int) -> tuple[int, ...]:
    """``"2x2"`` -> ``(2, 2)``; None -> ``(world,)``. At most 2 dimensions, their product ``world``."""
    if not text:
        return (world,)
    try:
        shape = tuple(int(x) for x in text.lower().split("x"))
    except ValueError as e:
        raise ValueError(f"invalid mesh {text!r}; use e.g. 4 or 2x2") from e
    n = 1
    for s in shape:
        n *= s
    if n != world or any(s < 1 for s in shape) or len(shape) > 2:
        raise ValueError(f"mesh {text} needs {n} ranks and at most 2 dimensions; {world} ranks were asked for")
    return shape


def shard_dims(layout: str, ndim: int, mesh_ndim: int) -> list[Placement]:
    """Per mesh dimension, the tensor dimension ``layout`` shards along it (None: replicated)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    if layout == "replicate" or ndim == 0:
        return [None] * mesh_ndim
    if layout == "fsdp":
        return [0] if mesh_ndim == 1 else [0, 1 if ndim >= 2 else None]
    dim = 1 if layout == "shard1" and ndim >= 2 else 0
    return [*([None] * (mesh_ndim - 1)), dim]


def rank_region(
    shape: Sequence[int], dims: Sequence[Placement], mesh: Sequence[int], coordinate: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ``(offsets, sizes)`` of the rank at ``coordinate`` on ``mesh`` (placements ``dims``)."""
    offsets, sizes = [0] * len(shape), list(shape)
    for dim, m, c in zip(dims, mesh, coordinate, strict=True):
        if dim is None:
            continue
        local = sizes[dim]
        full = -(-local // m) if local % m else local // m
        start = full * c
        size = max(0, min(local, start + full) - start)
        offsets[dim] = offsets[dim] + start if size else shape[dim]
        sizes[dim] = size
    return tuple(offsets), tuple(sizes)


@dataclass(frozen=True)
class TargetChunk:
    """One distinct region of a tensor in the target layout, and the ranks whose shard it is."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    ranks: tuple[int, ...]


def target_chunks(shape: Sequence[int], layout: str, mesh: Sequence[int]) -> list[TargetChunk]:
    """Each distinct rank region of a tensor of ``shape`` in ``layout`` on ``mesh``, in the order of
    the first rank holding it (ranks numbered row-major over the mesh, as ``init_device_mesh`` does).
    Together they tile the tensor exactly."""
    dims = shard_dims(layout, len(shape), len(mesh))
    found: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for rank, coordinate in enumerate(itertools.product(*(range(m) for m in mesh))):
        found.setdefault(rank_region(shape, dims, mesh, coordinate), []).append(rank)
    return [TargetChunk(o, s, tuple(r)) for (o, s), r in found.items()]
