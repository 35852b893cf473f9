"""Export one tensor of any checkpoint to a NumPy ``.npy`` file or a torch.save ``.pt`` file.

The tensor is read block by block (row-major boxes of at most ``budget`` bytes, through
:meth:`Checkpoint.read_tensor`) and each block is written as soon as it is read, so memory stays
bounded whatever the tensor's size. The file is written into an atomic temporary (see
:mod:`...io.atomic`): it appears only complete and fsynced, and a cancelled export leaves nothing.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ...checkpoints.model import Entry, dtype_name, refuse_expanded
from ...checkpoints.opening import Checkpoint
from ...dtypes import DTYPES, DType
from ...errors import DCPStudioError, NotATensorError, UnsupportedFormatError
from ...formats.npy import npy_descr, npy_header
from ...formats.torchsave.writer import archive_name, write_tensor_archive
from ...io.atomic import atomic_output
from ...io.blocks import BLOCK_BUDGET, blocks, box_slices
from ...io.files import create_file, sync_file
from ...io.remote.locations import as_location
from ...pickles.tensor_io import numeric, to_bytes
from ...progress import CancelToken, ProgressCallback, Reporter
from ..convert.output import check_paths, io_error

__all__ = ["EXPORT_FORMATS", "ExportResult", "export_tensor"]

ExportFormat = Literal["npy", "pt"]
EXPORT_FORMATS: tuple[ExportFormat, ...] = ("npy", "pt")


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote: the file, its format, the element type written (``"float32"``), the
    bytes of tensor data written, and what the user should know (also issued as warnings)."""

    dst: Path
    fmt: ExportFormat
    dtype: str
    nbytes: int
    notes: tuple[str, ...] = ()


def _format(dst: Path, fmt: str | None) -> ExportFormat:
    name = fmt if fmt is not None else dst.suffix.lower().removeprefix(".")
    for known in EXPORT_FORMATS:
        if name == known:
            return known
    given = f"format {fmt!r}" if fmt is not None else f"{dst.name!r} (no .npy or .pt suffix)"
    raise ValueError(f"cannot export to {given}; choose .npy or .pt")


def _npy_dtype(entry: Entry) -> tuple[DType, str, str | None]:
    """The element type a ``.npy`` file holds for the entry, its type string, and a note when it
    differs from the tensor's: types NumPy lacks are widened, losslessly."""
    dtype = entry.dtype
    assert dtype is not None
    descr = npy_descr(dtype)
    if descr is not None:
        return dtype, descr, None
    if dtype.kind not in "fc":
        raise UnsupportedFormatError(f"{entry.fqn}: NumPy has no {dtype_name(dtype)} type; export it as .pt")
    wide = DTYPES["float32"] if dtype.kind == "f" else DTYPES["complex64"]
    note = (
        f"{entry.fqn}: NumPy has no {dtype_name(dtype)} type; written as {wide.name} "
        f"(every {dtype_name(dtype)} value is exactly a {wide.name} value)"
    )
    if dtype.pack > 1:
        note += f", {dtype.pack} values per element along the last dimension, low nibble first"
    return wide, npy_descr(wide) or "", note


def _pieces(ckpt: Checkpoint, entry: Entry, out: DType, budget: int, reporter: Reporter) -> Iterator[memoryview]:
    """The tensor's row-major bytes as ``out`` elements, one block at a time."""
    assert entry.dtype is not None
    shape = entry.shape or ()
    for offsets, sizes in blocks(shape, max(entry.dtype.itemsize, out.itemsize), budget):
        reporter.check()
        block = ckpt.read_tensor(entry.fqn, box_slices(offsets, sizes))
        nbytes = block.numel() * block.element_size()
        data = to_bytes(block if out is entry.dtype else numeric(block).to(out.torch))
        del block
        yield data
        del data  # one block in memory at a time: the consumer drops its reference too
        reporter.advance(nbytes, items=0, current=entry.fqn)


def export_tensor(
    ckpt: Checkpoint,
    fqn: str,
    dst: str | os.PathLike[str],
    *,
    fmt: str | None = None,
    overwrite: bool = False,
    budget: int = BLOCK_BUDGET,
    progress: ProgressCallback | None = None,
    cancel: CancelToken | None = None,
) -> ExportResult:
    """Write the tensor ``fqn`` of ``ckpt`` to ``dst``: ``.npy`` (``np.load`` reads it back; types
    NumPy lacks -- bfloat16, float8, complex32 -- are widened losslessly to float32 / complex64,
    with a note; a packed ``float4_e2m1fn_x2`` is decoded, its last dimension doubled) or ``.pt``
    (``torch.load(dst, weights_only=True)`` returns the tensor itself, bit-exact, in its own dtype).
    ``fmt`` (``"npy"`` or ``"pt"``) defaults to ``dst``'s suffix.

    Raises :class:`DestinationExistsError` when ``dst`` exists and ``overwrite`` is false,
    :class:`CancelledError` when ``cancel`` is set (nothing is left behind), ``ValueError`` for an
    unknown format, :class:`NotATensorError` (a ``ValueError``) for an entry that is not a tensor,
    ``KeyError`` for a name the checkpoint lacks.
    """
    dst_p = as_location(dst)
    kind = _format(dst_p, fmt)
    entry = ckpt.entry(fqn)
    if entry.kind != "tensor" or entry.dtype is None:
        raise NotATensorError(f"{fqn} is not a tensor; only tensors can be exported")
    refuse_expanded(entry, str(ckpt.path), "export")
    check_paths(ckpt.path, dst_p, src_format=ckpt.format)
    if dst_p.is_dir() and overwrite:
        raise DCPStudioError(f"refusing to replace {dst_p}: it is a directory; choose a file name")
    shape = tuple(entry.shape or ())
    out, descr, note = _npy_dtype(entry) if kind == "npy" else (entry.dtype, "", None)
    numel = entry.numel
    if out is not entry.dtype and entry.dtype.pack > 1:  # float4 decoded: its values, two per byte
        numel *= entry.dtype.pack
        shape = (*shape[:-1], shape[-1] * entry.dtype.pack) if shape else (entry.dtype.pack,)
    reporter = Reporter(progress, cancel, total_bytes=entry.nbytes, total_items=1)
    pieces = _pieces(ckpt, entry, out, budget, reporter)
    try:
        with atomic_output(dst_p, overwrite=overwrite) as tmp, create_file(tmp) as f:
            if kind == "npy":
                f.write(npy_header(descr, shape))
                for piece in pieces:
                    f.write(piece)
                    del piece
            else:
                write_tensor_archive(f, entry.dtype, shape, pieces, archive=archive_name(dst_p))
            sync_file(f)
            reporter.advance(0, items=1, current=fqn)
    except OSError as e:
        raise io_error(dst_p, e) from e
    if note is not None:
        warnings.warn(note, stacklevel=2)
    notes = (note,) if note is not None else ()
    return ExportResult(dst_p, kind, out.name, numel * out.itemsize, notes)
