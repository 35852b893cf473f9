"""The total output bound: what a conversion will write, summed over all its entries, against what
its source stores.

Each entry's own expansion is judged where it is read (:func:`~...checkpoints.model.refuse_expanded`), but a
small storage viewed under many names passes that test name by name: one 16 MiB storage under
1,024 names is a 16 GiB safetensors file. So, before anything is written, the output's bytes are
summed over every entry -- counting a storage once where the target keeps storages shared
(torch.save), once per entry where it does not -- and compared with the bytes the source stores
(each storage, or each stored byte range, counted once at its declared size). An output over
:data:`OUTPUT_RATIO` times that and over :data:`OUTPUT_FLOOR` is refused, naming the most-viewed
storage, unless the caller allows it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

from ...checkpoints.opening import Checkpoint
from ...errors import ExpansionError
from ...pickles.refs import TensorRef
from ...pickles.tree import iter_tensors
from ...units import human_bytes

__all__ = ["OUTPUT_FLOOR", "OUTPUT_RATIO", "check_output_size", "output_bytes"]

OUTPUT_FLOOR = 1 << 30  # outputs this large may always be written...
OUTPUT_RATIO = 16  # ...and larger ones when they hold at most this many times what the source stores

Item = tuple[str, Any]  # (entry name, its output tensor or value)


def _storages(value: Any) -> dict[int, int]:
    """The distinct storages of the tensors in ``value``: id -> bytes."""
    return {id(t.storage): t.storage.nbytes for t in iter_tensors(value) if isinstance(t, TensorRef) and t.storage}


def output_bytes(items: Iterable[Item], *, shared: bool) -> int:
    """The tensor bytes the output will hold. ``shared``: the target writes each storage once,
    whole (torch.save); else each tensor is written on its own, and a value's tensors once per
    value (DCP byte items, which are torch.save archives)."""
    total = 0
    seen: dict[int, int] = {}
    for _, value in items:
        if shared:
            seen.update(_storages(value))
        elif isinstance(value, TensorRef):
            total += value.nbytes
        else:
            total += sum(_storages(value).values())
    return total + sum(seen.values())


def _units(ckpt: Checkpoint, fqn: str) -> list[tuple[Hashable, int]]:
    """What the source stores for an entry: each storage (torch.save) or stored byte range (DCP,
    safetensors) it reads, with a key equal for entries that read the same one, and its size as
    declared (elements x itemsize: a compressed record counts what it holds)."""
    entry = ckpt.entry(fqn)
    if ckpt.format == "torch":
        value = ckpt.tensor_ref(fqn) if entry.kind == "tensor" else ckpt.read_object(fqn)
        return [(("storage", key), n) for key, n in _storages(value).items()]
    out: list[tuple[Hashable, int]] = []
    for c in ckpt.chunks(fqn):
        size = c.length or 0
        if entry.kind == "tensor" and entry.dtype is not None:
            size = entry.dtype.itemsize
            for s in c.sizes:
                size *= s
        out.append(((c.file, c.offset, c.length), size))
    return out


def check_output_size(ckpt: Checkpoint, items: list[Item], *, shared: bool, allow: bool = False) -> int:
    """The output's tensor bytes (see :func:`output_bytes`); raises :class:`ExpansionError` when
    they exceed both :data:`OUTPUT_FLOOR` and :data:`OUTPUT_RATIO` times what the source stores
    for these entries, unless ``allow``."""
    total = output_bytes(items, shared=shared)
    if allow or total <= OUTPUT_FLOOR:
        return total
    sizes: dict[Hashable, int] = {}
    views: dict[Hashable, list[str]] = {}
    for fqn, _ in items:
        for key, size in _units(ckpt, fqn):
            sizes[key] = size
            views.setdefault(key, []).append(fqn)
    stored = sum(sizes.values())
    if total <= OUTPUT_RATIO * stored:
        return total
    key = max(views, key=lambda k: (len(views[k]), sizes[k])) if views else None
    names = views[key] if key is not None else []
    count = len(names)
    distinct = len(set(names))
    what = (
        f"{distinct} entries view one stored {human_bytes(sizes[key])} ({names[0]!r} is one)"
        if key is not None and distinct > 1
        else f"{names[0]!r} reads one stored {human_bytes(sizes[key])} {count} times"
        if key is not None
        else "its entries repeat what is stored"
    )
    raise ExpansionError(
        f"{ckpt.path}: the output would hold {human_bytes(total)}, {total / max(stored, 1):.0f}x the "
        f"{human_bytes(stored)} the source stores: {what}; refusing to write it (pass --allow-expansion to write it "
        "anyway, or leave entries out with --exclude)",
        name=names[0] if names else "",
        views=distinct,
        total=total,
        stored=stored,
    )
