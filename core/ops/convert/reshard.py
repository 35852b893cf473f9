"""Offline resharding: a checkpoint laid out as a DCP for a target world size and layout, so a job
resumed on N ranks has each rank read its bytes from its own file.

Each tensor is cut into the target ranks' regions (:mod:`.layouts`: the chunks torch's planner
records for DTensors of that layout on N ranks). A region one rank holds goes into that rank's
file ``__R_0.distcp``; a region several ranks hold (a replicated tensor, a 2-D mesh's replicated
dimension) is stored once, in the file of the lowest of them -- so rank 0's file holds what every
rank shares (0-d tensors, biases under ``shard0`` on a 2-D mesh...) and the non-tensor values,
which every rank's ``dcp.load`` reads. A rank thus opens its own file, plus the files of the lower
ranks it shares regions with (rank 0's, when the checkpoint has replicated entries or values):
DCP's metadata gives every chunk one place, so a shared region cannot be in every sharer's file.

Chunks are read from the source in bands of at most :data:`BAND` bytes (a region of any size is
streamed, the next band read while the current one is written) and their CRC computed as they
pass; a region that is a whole tensor lying verbatim in a source file is copied in the kernel.
The output's manifest is read back from the chunks written (:mod:`.reshard_manifest`).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...checkpoints import Checkpoint
from ...dtypes import DType
from ...errors import DCPStudioError, UnsupportedFormatError
from ...formats.dcp.ranked import ItemData, StoredItem, rank_file, write_ranked_dcp
from ...formats.torchsave.writer import write_archive
from ...io.pipeline import prefetch
from ...io.raw import FileRange
from ...pickles.refs import TensorRef
from ...pickles.tensor_io import to_bytes
from ...progress import Reporter
from .layouts import LAYOUTS, parse_mesh, target_chunks
from .output import io_error, output_context
from .reshard_manifest import RankedReadBack
from .transform import Transform

__all__ = ["BAND", "RankedEntry", "bands", "check_rank_options", "plan_files", "to_ranks", "write_for_ranks"]

BAND = 16 << 20
"""The most bytes of a chunk read from the source at once."""

Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class RankedEntry:
    """One entry to write: its name, its place in the nested state dict, and its tensor (dtype and
    shape as written: cast when ``cast``) or value."""

    fqn: str
    path: tuple[str | int, ...]
    tensor: TensorRef | None
    value: Any = None
    cast: DType | None = None


def bands(offsets: Sequence[int], sizes: Sequence[int], itemsize: int, limit: int = BAND) -> list[Box]:
    """The box ``offsets + sizes`` cut, in row-major order, into boxes of at most ``limit`` bytes
    (or one element of the innermost dimension, when a single element is larger): whole trailing
    dimensions, a run of the first one that does not fit whole, single indices before it."""
    dims = len(sizes)
    if any(s == 0 for s in sizes):
        return []
    k, tail = dims - 1, itemsize
    while k > 0 and tail * sizes[k] <= limit:
        tail *= sizes[k]
        k -= 1
    if dims == 0 or tail * sizes[0] <= limit:
        return [(tuple(offsets), tuple(sizes))]
    step = max(1, limit // tail)
    out = []
    for outer in itertools.product(*(range(s) for s in sizes[:k])):
        for a in range(0, sizes[k], step):
            n = min(step, sizes[k] - a)
            lo = (*(o + i for o, i in zip(offsets, outer, strict=False)), offsets[k] + a, *offsets[k + 1 :])
            out.append((lo, (*([1] * k), n, *sizes[k + 1 :])))
    return out


def plan_files(entries: Sequence[RankedEntry], layout: str, mesh: Sequence[int]) -> list[list[StoredItem]]:
    """Each target rank's items, in the order they are written: values (rank 0), then chunks."""
    ranks = 1
    for m in mesh:
        ranks *= m
    files: list[list[StoredItem]] = [[] for _ in range(ranks)]
    files[0] = [StoredItem(e.fqn) for e in entries if e.tensor is None]
    for e in entries:
        if e.tensor is not None:
            for c in target_chunks(tuple(e.tensor.shape), layout, mesh):
                files[c.ranks[0]].append(StoredItem(e.fqn, c.offsets, c.sizes))
    return files


def _whole_range(t: TensorRef, cast: DType | None) -> FileRange | None:
    """Where ``t``'s bytes lie verbatim in one file, with their CRC (needed to copy a record)."""
    ref = t.storage
    if cast is not None or ref is None or ref.archive is None or not t.is_contiguous() or not t.covers_storage():
        return None
    where = ref.archive.storage_range(ref)
    if where is None or where.crc is None:
        return None
    return FileRange(where.fd, where.offset + t.byte_offset, t.nbytes, where.crc, where.base)


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """torch's intra-op threads off while chunks are cut: the cuts are strided copies of a few MiB,
    which on a busy machine (2 cores, load 7) took 21 s for 512 MiB with 2 threads spinning for
    their turn, and 2.6 s with one; the read of the next band overlaps them anyway. Process-wide
    (torch has no other switch), restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class _Items:
    """One data file's items with their data, the next band read on a helper thread meanwhile."""

    def __init__(self, ckpt: Checkpoint, entries: dict[str, RankedEntry], items: list[StoredItem], reporter: Reporter):
        self.ckpt, self.entries, self.items, self.reporter = ckpt, entries, items, reporter
        self._ranges: dict[str, FileRange] = {}

    def _work(self, item: StoredItem) -> list[tuple[StoredItem, Box | None]]:
        e = self.entries[item.fqn]
        if item.offsets is None or e.tensor is None:
            return [(item, None)]
        t = e.tensor
        if item.sizes == tuple(t.shape):
            where = _whole_range(t, e.cast)
            if where is not None:
                self._ranges[item.fqn] = where
                return [(item, None)]
        return [(item, box) for box in bands(item.offsets, item.sizes, t.dtype.itemsize, BAND)]

    def _produce(self, work: tuple[StoredItem, Box | None]) -> Any:
        self.reporter.check()
        item, box = work
        e = self.entries[item.fqn]
        if e.tensor is None:
            return write_archive(e.value)
        if box is None:
            return self._ranges[item.fqn]
        region = [slice(o, o + n) for o, n in zip(*box, strict=True)]
        data = self.ckpt.read_tensor(item.fqn, region)
        return to_bytes(data.to(e.cast.torch) if e.cast is not None else data)

    def __iter__(self) -> Iterator[tuple[StoredItem, ItemData]]:
        plans = [self._work(item) for item in self.items]
        stream = prefetch(self._produce, itertools.chain.from_iterable(plans))
        try:
            for item, plan in zip(self.items, plans, strict=True):
                if item.offsets is None or (plan and plan[0][1] is None):
                    yield item, next(stream)[1]
                else:
                    yield item, (data for _, data in itertools.islice(stream, len(plan)))
        finally:  # the pending read finished or cancelled, not left running (a failed write)
            getattr(stream, "close", lambda: None)()


def write_for_ranks(
    ckpt: Checkpoint,
    entries: Sequence[RankedEntry],
    dst: Path,
    overwrite: bool,
    reporter: Reporter,
    *,
    layout: str,
    mesh: Sequence[int],
    source: Any = None,
    manifest: bool = True,
) -> None:
    """Write ``entries`` of ``ckpt`` at ``dst`` as a DCP laid out for ``layout`` on ``mesh`` (its
    product the world size): ``__R_0.distcp`` per rank that stores something, ``.metadata`` last,
    into an atomic temporary (into ``dst`` beside ``source`` when :func:`~.output.writes_into` says
    so: :func:`~.output.output_context`). With ``manifest`` (a local ``dst``), the output's
    ``dcpstudio-manifest.json`` is computed from the bytes written (:mod:`.reshard_manifest`)."""
    by_name = {e.fqn: e for e in entries}
    files = plan_files(entries, layout, mesh)
    reporter.total_items = sum(map(len, files))
    tensors = {e.fqn: (e.tensor.dtype, tuple(e.tensor.shape)) for e in entries if e.tensor is not None}

    def on_item(item: StoredItem) -> None:
        nbytes = 0
        if item.offsets is not None:
            nbytes = tensors[item.fqn][0].itemsize
            for s in item.sizes:
                nbytes *= s
        reporter.advance(nbytes, current=item.fqn)

    try:
        out = output_context(dst, overwrite, source=source)
        written = [(rank_file(r), items) for r, items in enumerate(files) if items]
        watch = RankedReadBack([items for _, items in written], tensors, reporter.check) if manifest else None
        with _one_torch_thread(), out as tmp, watch or contextlib.nullcontext():
            write_ranked_dcp(
                tmp,
                [(name, _Items(ckpt, by_name, items, reporter)) for name, items in written],
                tensors,
                {e.fqn: e.path for e in entries},
                checkpoint_id=str(dst),
                label=str(ckpt.path),
                on_item=on_item,
                watch=watch,
            )
    except OSError as e:
        raise io_error(dst, e) from e


def check_rank_options(
    target: str, for_ranks: int | None, layout: str | None, mesh: str | None, files: int | None, max_file_size: Any
) -> tuple[int, ...] | None:
    """The target mesh of ``--for-ranks`` (None without it); an option that cannot apply with it,
    or without it, is refused."""
    if for_ranks is None:
        if layout is not None or mesh is not None:
            raise ValueError("--layout and --mesh apply with --for-ranks only")
        return None
    if for_ranks < 1:
        raise ValueError(f"--for-ranks {for_ranks}: needs at least 1 rank")
    if target != "dcp":
        what = {"torch": "a torch.save file", "safetensors": "safetensors"}.get(target, target)
        raise ValueError(f"--for-ranks writes a DCP checkpoint, not {what}; drop --to or change the destination")
    if files is not None or max_file_size is not None:
        raise ValueError("--files and --max-file-size do not apply with --for-ranks: each rank's chunks go to its file")
    if (layout or "shard0") not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    return parse_mesh(mesh, for_ranks)


def to_ranks(
    ckpt: Checkpoint,
    plan: Sequence[Any],
    transform: Transform,
    dst: Path,
    overwrite: bool,
    reporter: Reporter,
    layout: str | None,
    mesh: Sequence[int],
    manifest: bool = True,
) -> tuple[str, ...]:
    """:func:`write_for_ranks` for a conversion's plan (entries with ``fqn``, ``path``, ``tensor``,
    ``value``), cast as ``transform`` casts, with a manifest unless ``manifest`` is False; the
    notes for the user (none). A remote destination is refused: a chunk streamed in bands has its
    archive's CRC filled in after its bytes, which an upload cannot seek back to."""
    if not isinstance(dst, Path):
        raise DCPStudioError(
            f"{dst}: --for-ranks writes each chunk's archive and then its CRC before it, which an upload cannot "
            "(no seeking back); write to a local or shared filesystem and copy the folder"
        )
    obj = getattr(ckpt, "obj", None)
    if ckpt.format == "torch" and obj is not None and not isinstance(obj, dict):
        raise UnsupportedFormatError(
            f"{ckpt.path}: holds a {type(obj).__name__}; DCP stores a dict (state dict) at the top level"
        )
    entries = []
    for e in plan:
        dtype = ckpt.entries[e.fqn].dtype if e.tensor is not None else None
        cast = transform.cast_of(dtype) if dtype is not None else None
        entries.append(RankedEntry(e.fqn, e.path, e.tensor, e.value, cast))
    write_for_ranks(
        ckpt, entries, dst, overwrite, reporter, layout=layout or "shard0", mesh=mesh, source=ckpt.path,
        manifest=manifest,
    )  # fmt: skip
    return ()
