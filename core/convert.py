"""Streaming converters between torch.save files and DCP directories.

Plain path-in / path-out functions, like torch's ``format_utils``, that the CLI and the window
call. Unlike torch's, they never hold the whole checkpoint: tensors are read and written one at a
time (the next read overlapping the current write), pickles are read with restricted unpicklers
unless ``trust_pickle``, and the output appears at ``dst`` only when complete and flushed.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ._atomic import atomic_output
from ._io import FileRange, crc32, tensor_buffer
from ._pipeline import prefetch
from .errors import CorruptCheckpointError, DCPStudioError, UnsupportedFormatError
from .formats.dcp import DCPReader, DCPWriter, read_metadata
from .formats.detect import detect_format
from .formats.torchsave import TorchSaveFile, TorchSaveWriter, archive_name
from .planners import LazySavePlanner, NameFilter, SafeLoadPlanner
from .progress import CancelToken, ProgressCallback, Reporter

__all__ = ["ConversionResult", "convert", "dcp_to_torch_save", "torch_save_to_dcp"]

TRUST_WARNING = "trusting pickles in {}: code embedded in the checkpoint can run"
_BATCH_BYTES = 64 << 20
_BATCH_ITEMS = 256


@dataclass(frozen=True)
class ConversionResult:
    """What a conversion wrote."""

    src: Path
    dst: Path
    target: Literal["dcp", "torch", "safetensors"]
    tensors: int
    values: int
    tensor_bytes: int
    notes: tuple[str, ...] = ()  # what the user should know (also issued as warnings)


def _unwrap(error: CheckpointException) -> BaseException:
    """DCP wraps every exception raised by a planner or storage layer; give back the original."""
    for failure in error.failures.values():
        inner = failure[0] if isinstance(failure, tuple) and failure else getattr(failure, "exc", None)
        if isinstance(inner, BaseException):
            return inner
    return error


def _check_paths(src: Path, dst: Path) -> None:
    s, d = src.resolve(), dst.resolve()
    if s == d or s in d.parents:
        raise DCPStudioError(f"destination {dst} is the source or inside it; choose another path")


def _io_error(dst: Path, e: OSError) -> DCPStudioError:
    return DCPStudioError(f"cannot write {dst}: {e.strerror or e}" + (f" ({e.filename})" if e.filename else ""))


def torch_save_to_dcp(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    progress: ProgressCallback | None = None,
    cancel: CancelToken | None = None,
    include: str | None = None,
    exclude: str | None = None,
    overwrite: bool = False,
    trust_pickle: bool = False,
) -> ConversionResult:
    """Convert a torch.save file into a DCP directory, one tensor in memory at a time."""
    src_p, dst_p = Path(src), Path(dst)
    if detect_format(src_p) != "torch":
        raise UnsupportedFormatError(f"{src_p}: not a torch.save file")
    _check_paths(src_p, dst_p)
    keep = NameFilter(include, exclude)
    if trust_pickle:
        warnings.warn(TRUST_WARNING.format(src_p), stacklevel=2)
    with TorchSaveFile(src_p, trust_pickle=trust_pickle) as tsf:
        if not isinstance(tsf.obj, dict):
            raise UnsupportedFormatError(
                f"{src_p}: holds a {type(tsf.obj).__name__}; DCP stores a dict (state dict) at the top level"
            )
        try:
            flat, _ = flatten_state_dict(tsf.obj)
        except (ValueError, RecursionError) as e:
            raise CorruptCheckpointError(f"{src_p}: cannot flatten its names ({type(e).__name__}: {e})") from e
        kept = {k: v for k, v in flat.items() if keep(k)}
        tensors = [v for v in kept.values() if isinstance(v, torch.Tensor)]
        total = sum(t.numel() * t.element_size() for t in tensors)
        reporter = Reporter(progress, cancel, total_bytes=total, total_items=len(kept))
        reporter.check()

        def on_item(_length: int, fqn: str) -> None:
            value = kept.get(fqn)
            reporter.advance(
                value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0, current=fqn
            )

        planner = LazySavePlanner(tsf.materialize, keep, before_item=reporter.check, source_range=tsf.source_range)
        save_as_dcp(tsf.obj, dst_p, overwrite, planner, on_item)
    return ConversionResult(src_p, dst_p, "dcp", len(tensors), len(kept) - len(tensors), total)


def _tensor_batches(items: list[tuple[str, torch.Tensor]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    batch: list[tuple[str, torch.Tensor]] = []
    size = 0
    for key, placeholder in items:
        nbytes = placeholder.numel() * placeholder.element_size()
        if batch and (size + nbytes > _BATCH_BYTES or len(batch) >= _BATCH_ITEMS):
            yield batch
            batch, size = [], 0
        batch.append((key, placeholder))
        size += nbytes
    if batch:
        yield batch


def _read_values(reader: DCPReader, md: Metadata, wanted: dict[str, Any], trust: bool) -> dict[str, Any]:
    """Read the entries of ``wanted`` (fqn -> destination tensor, or None for a non-tensor value)."""
    planner = SafeLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False, trust_pickle=trust)
    planner.set_up_planner(wanted, md, True)
    reader.read_data(planner.create_local_plan(), planner).wait()
    return planner.state_dict


def dcp_to_torch_save(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    progress: ProgressCallback | None = None,
    cancel: CancelToken | None = None,
    include: str | None = None,
    exclude: str | None = None,
    overwrite: bool = False,
    trust_pickle: bool = False,
) -> ConversionResult:
    """Convert a DCP directory (saved by any number of ranks) into one torch.save file.

    The nesting recorded in the checkpoint's planner data is restored, as torch's converter does;
    sharded tensors are assembled from their chunks one tensor at a time.
    """
    src_p, dst_p = Path(src), Path(dst)
    if detect_format(src_p) != "dcp":
        raise UnsupportedFormatError(f"{src_p}: not a DCP checkpoint directory")
    _check_paths(src_p, dst_p)
    keep = NameFilter(include, exclude)
    if trust_pickle:
        warnings.warn(TRUST_WARNING.format(src_p), stacklevel=2)
    md = read_metadata(src_p, trust_pickle=trust_pickle)
    reader = DCPReader(src_p, trust_pickle=trust_pickle)
    reader.set_up_storage_reader(md, True)

    entries = {fqn: smd for fqn, smd in md.state_dict_metadata.items() if keep(fqn)}
    placeholders: dict[int, torch.Tensor] = {}
    fqn_of: dict[int, str] = {}
    values: dict[str, Any] = {}
    for fqn, smd in entries.items():
        if isinstance(smd, TensorStorageMetadata):
            t = torch.empty(smd.size, dtype=smd.properties.dtype, device="meta")
            placeholders[id(t)] = t
            fqn_of[id(t)] = fqn
            values[fqn] = t
    byte_fqns = [fqn for fqn in entries if fqn not in values]
    total = sum(t.numel() * t.element_size() for t in placeholders.values())
    reporter = Reporter(progress, cancel, total_bytes=total, total_items=len(entries))
    reporter.check()
    if byte_fqns:
        values.update(_read_values(reader, md, dict.fromkeys(byte_fqns), trust_pickle))
        reporter.advance(0, items=len(byte_fqns))

    mappings = md.planner_data if isinstance(md.planner_data, dict) else {}
    state_dict: dict[str, Any] = {}
    for fqn in entries:
        path = mappings.get(fqn)
        if isinstance(path, tuple) and path:
            set_element(state_dict, path, values[fqn])
        else:
            state_dict[fqn] = values[fqn]

    def load_batch(
        batch: list[tuple[str, torch.Tensor]],
    ) -> list[tuple[str, FileRange | tuple[torch.Tensor, int]]]:
        """Runs on the prefetch thread: where to copy each tensor from, or its bytes and CRC."""
        reporter.check()
        ranges = {}
        dests = {}
        for key, p in batch:
            fqn = fqn_of[id(p)]
            found = reader.whole_tensor_range(fqn, cast(TensorStorageMetadata, entries[fqn]))
            if found is not None:
                ranges[key] = found
            else:
                dests[fqn] = torch.empty(p.size(), dtype=p.dtype)
        if dests:
            _read_values(reader, md, dests, trust_pickle)
        out: Loaded = []
        for key, p in batch:
            if key in ranges:
                out.append((key, ranges[key]))
            else:
                t = dests[fqn_of[id(p)]]
                out.append((key, (t, crc32(tensor_buffer(t)))))
        return out

    try:
        write_torch_save(dst_p, overwrite, state_dict, placeholders, load_batch, reporter, str(src_p), fqn_of)
    finally:
        reader.close()
    return ConversionResult(src_p, dst_p, "torch", len(placeholders), len(byte_fqns), total)


Loaded = list[tuple[str, "FileRange | tuple[torch.Tensor, int]"]]


def save_as_dcp(state: dict[str, Any], dst: Path, overwrite: bool, planner: LazySavePlanner, on_item: Any) -> None:
    """``dcp.save`` of a lazily materialised state dict into ``dst``, atomically, errors unwrapped."""
    try:
        with atomic_output(dst, overwrite=overwrite) as tmp:
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", module=r"torch\.distributed\.checkpoint")
                    dcp.save(state, storage_writer=DCPWriter(tmp, on_item=on_item), planner=planner, no_dist=True)
            except CheckpointException as e:
                raise _unwrap(e) from None
    except OSError as e:
        raise _io_error(dst, e) from e


def write_torch_save(
    dst: Path,
    overwrite: bool,
    state: Any,
    placeholders: dict[int, torch.Tensor],
    load: Callable[[list[tuple[str, torch.Tensor]]], Loaded],
    reporter: Reporter,
    src_label: str,
    fqn_of: dict[int, str],
) -> None:
    """Stream a torch.save file: the pickle, then each placeholder's storage from ``load(batch)`` --
    copied in the kernel (a :class:`FileRange`) or written from memory with its CRC -- while the
    next batch loads on a helper thread."""
    try:
        with atomic_output(dst, overwrite=overwrite) as tmp, open(tmp, "wb") as f:
            writer = TorchSaveWriter(f, archive_name(dst))
            order = writer.write_pickle(state, placeholders)
            writer.write_pending_real_storages()
            fqn_of_key = {key: fqn_of[id(p)] for key, p in order}
            for _batch, loaded in prefetch(load, _tensor_batches(order)):
                for key, data in loaded:
                    if isinstance(data, FileRange):
                        writer.copy_storage(key, data, f"{src_label} ({fqn_of_key[key]})")
                        nbytes = data.nbytes
                    else:
                        writer.write_storage(key, data[0], data[1])
                        nbytes = data[0].numel() * data[0].element_size()
                    reporter.advance(nbytes, current=fqn_of_key[key])
            writer.finish()
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise _io_error(dst, e) from e


_NAMES = {"dcp": "a DCP checkpoint", "torch": "a torch.save file", "safetensors": "a safetensors checkpoint"}
_SAFETENSORS_OPTIONS = ("max_shard_size", "dtype", "strip_prefix")


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: Literal["dcp", "torch", "safetensors"] | None = None,
    **options: Any,
) -> ConversionResult:
    """Convert ``src`` to format ``to``; by default DCP -> torch.save, torch.save -> DCP,
    safetensors -> DCP. Safetensors targets also take ``max_shard_size``, ``dtype`` and
    ``strip_prefix`` (see :func:`~dcpstudio.core.export.to_safetensors`)."""
    from . import export

    fmt = detect_format(src)
    target = to or ("torch" if fmt == "dcp" else "dcp")
    if target not in _NAMES:
        raise UnsupportedFormatError(f"unknown target format {target!r} (expected dcp, torch or safetensors)")
    if target == fmt:
        raise UnsupportedFormatError(f"{src} is already {_NAMES[fmt]}")
    if target != "safetensors" and any(options.get(k) is not None for k in _SAFETENSORS_OPTIONS):
        raise ValueError("--max-shard-size, --dtype and --strip-prefix apply to --to safetensors only")
    options = {k: v for k, v in options.items() if k not in _SAFETENSORS_OPTIONS or target == "safetensors"}
    if target == "safetensors":
        return export.to_safetensors(src, dst, **options)
    if fmt == "safetensors":
        return (export.checkpoint_to_dcp if target == "dcp" else export.checkpoint_to_torch)(src, dst, **options)
    if target == "dcp":
        return torch_save_to_dcp(src, dst, **options)
    return dcp_to_torch_save(src, dst, **options)
