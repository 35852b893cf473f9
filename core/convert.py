"""Streaming conversion between any two checkpoint formats -- including a format to itself (re-save
with entries dropped, floats cast, safetensors re-sharded).

Plain path-in / path-out functions, like torch's ``format_utils``, that the CLI and the window
call. Unlike torch's, they never hold the whole checkpoint (one tensor at a time, the next read
overlapping the current write), read pickles with restricted unpicklers unless ``trust_pickle``,
copy bytes that lie in place inside the kernel, and let the output appear at ``dst`` only when
complete and flushed. They import no torch unless a tensor must be computed (a dtype cast, a
non-contiguous view, chunks that are not whole-row slabs).
"""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ._fanout import check_output_size
from ._output import (
    SUFFIX_TARGETS,
    TRUST_WARNING,
    ConversionResult,
    Target,
    check_paths,
    check_replaceable,
    destination_kind,
    write_dcp_output,
    write_safetensors_output,
    write_torch_save_output,
)
from ._refs import StorageRef, TensorRef
from ._remote import as_location
from ._tensor_io import materialize, to_bytes
from ._tree import iter_tensors, set_element
from .dtypes import DTYPES, DType
from .errors import DCPStudioError, UnsupportedFormatError
from .formats.dcp import DCPItem
from .formats.detect import Format, detect_format
from .formats.values import ENCODING, ENCODING_KEY, VALUES_KEY, NotStorable, encode_value
from .inspect import ROOT_KEY, Checkpoint, TorchCheckpoint, open_checkpoint
from .model import refuse_expanded
from .names import NameFilter
from .progress import CancelToken, ProgressCallback, Reporter

__all__ = [
    "SUFFIX_TARGETS",
    "ConversionResult",
    "convert",
    "dcp_to_torch_save",
    "destination_kind",
    "parse_size",
    "torch_save_to_dcp",
]

_NAMES = {"dcp": "a DCP checkpoint", "torch": "a torch.save file", "safetensors": "a safetensors checkpoint"}
_CASTS = {"bf16": DTYPES["bfloat16"], "fp16": DTYPES["float16"], "fp32": DTYPES["float32"]}
_MAX_STORED_VALUES = 64 << 10


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"5GiB"`` -> 5 * 2**30 (the units Hugging Face uses)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"invalid size {text!r}; use e.g. 500MB, 5GB or 2GiB")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    scale = (1024 if binary else 1000) ** "_KMGT".index(unit or "_")
    size = int(number * scale)
    if size <= 0:
        raise ValueError(f"invalid size {text!r}: must be positive")
    return size


class _Cast:
    """The storage of a tensor cast to another dtype: its bytes are computed (with torch) when
    they are written."""

    def __init__(self, source: TensorRef, to: DType, label: str) -> None:
        self.source = source
        self.to = to
        self.label = label

    def storage_range(self, ref: StorageRef) -> None:
        return None

    def storage_bytes(self, ref: StorageRef) -> memoryview:
        return to_bytes(materialize(self.source).to(self.to.torch))


def _cast(t: TensorRef, to: DType, label: str) -> TensorRef:
    storage = StorageRef.for_tensor(f"cast:{label}", to, t.numel, _Cast(t, to, label))
    return TensorRef.contiguous(storage, to, t.shape)


def _cast_view(t: TensorRef, to: DType, label: str, done: dict[tuple[int, str], StorageRef]) -> TensorRef | None:
    """``t`` as the same view of its storage cast whole to ``to`` (once per storage and dtype, in
    ``done``): a torch.save target keeps views that share a storage sharing one. None when the
    storage does not hold whole elements of ``t``'s dtype."""
    src = t.storage
    if src is None or src.nbytes % t.dtype.itemsize:
        return None
    key = (id(src), t.dtype.name)
    storage = done.get(key)
    if storage is None:
        whole = TensorRef(src, t.dtype, (src.nbytes // t.dtype.itemsize,), (1,))
        storage = done[key] = StorageRef.for_tensor(f"cast:{label}", to, whole.numel, _Cast(whole, to, label))
    return TensorRef(storage, to, t.shape, t.stride, t.storage_offset, t.requires_grad)


@dataclass
class _Entry:
    """One entry of the output: its name, its place in the nested state dict, and its tensor or
    value (tensors inside a value stay :class:`TensorRef`)."""

    fqn: str
    path: tuple[str | int, ...]
    tensor: TensorRef | None
    value: Any = None


def _plan(ckpt: Checkpoint, keep: NameFilter, cast: DType | None, views: bool) -> list[_Entry]:
    """The output's entries; ``views`` when the target keeps views as views (torch.save: a cast
    casts each storage once, and its views stay views of it)."""
    paths = ckpt.paths()
    out = []
    casts: dict[tuple[int, str], StorageRef] = {}
    for fqn, entry in ckpt.entries.items():
        if not keep(fqn):
            continue
        path = paths.get(fqn, (fqn,))
        if entry.kind == "tensor":
            t = ckpt.tensor_ref(fqn)
            compact = views
            if cast is not None and t.dtype.is_floating_point and t.dtype is not cast:
                view = _cast_view(t, cast, fqn, casts) if views else None
                compact = view is not None
                t = view if view is not None else _cast(t, cast, fqn)
            if not compact:
                refuse_expanded(entry, str(ckpt.path), "write")
            out.append(_Entry(fqn, path, t))
        else:
            out.append(_Entry(fqn, path, None, ckpt.read_object(fqn)))
    return out


def _result(src: Path, dst: Path, target: Target, plan: list[_Entry], notes: tuple[str, ...] = ()) -> ConversionResult:
    tensors = [e.tensor for e in plan if e.tensor is not None]
    return ConversionResult(
        src, dst, target, len(tensors), len(plan) - len(tensors), sum(t.nbytes for t in tensors), notes
    )


def _to_torch(
    ckpt: Checkpoint, plan: list[_Entry], dst: Path, overwrite: bool, reporter: Reporter, whole: bool
) -> None:
    obj: Any
    if whole and isinstance(ckpt, TorchCheckpoint) and ckpt.obj is not None:
        obj = ckpt.obj  # the file's own object tree: views, shared storages and key types kept
    else:
        obj = {}
        for e in plan:
            value = e.tensor if e.tensor is not None else e.value
            if e.path == (ROOT_KEY,) and isinstance(ckpt, TorchCheckpoint):
                obj = value
                break
            set_element(obj, e.path, value, max_index=len(ckpt.entries) + (1 << 16))
    names: dict[int, str] = {}
    for e in reversed(plan):  # a storage is reported under the first entry that uses it
        for t in iter_tensors(e.tensor if e.tensor is not None else e.value):
            if isinstance(t, TensorRef) and t.storage is not None:
                names[id(t.storage)] = e.fqn
    storages = {id(t.storage): t.storage for t in iter_tensors(obj) if isinstance(t, TensorRef) and t.storage}
    reporter.total_bytes = sum(ref.nbytes for ref in storages.values())
    write_torch_save_output(dst, overwrite, obj, reporter, str(ckpt.path), names)


def _to_dcp(
    ckpt: Checkpoint,
    plan: list[_Entry],
    dst: Path,
    overwrite: bool,
    reporter: Reporter,
    files: int | None,
    max_file_size: int | None,
) -> None:
    if isinstance(ckpt, TorchCheckpoint) and ckpt.obj is not None and not isinstance(ckpt.obj, dict):
        raise UnsupportedFormatError(
            f"{ckpt.path}: holds a {type(ckpt.obj).__name__}; DCP stores a dict (state dict) at the top level"
        )
    items = [DCPItem(e.fqn, e.path, e.tensor, e.value) for e in plan]
    write_dcp_output(
        dst, overwrite, items, reporter, str(ckpt.path), files=files, max_file_size=max_file_size, source=ckpt.path
    )


def _json_values(values: dict[str, Any]) -> tuple[str | None, list[str]]:
    """The tagged JSON to store for the values that can be (None if none, or too large), and the
    names left out."""
    stored: dict[str, Any] = {}
    dropped = []
    for fqn, value in values.items():
        try:
            stored[fqn] = encode_value(value)
        except NotStorable:
            dropped.append(fqn)
    text = json.dumps(stored) if stored else None
    if text is not None and len(text) > _MAX_STORED_VALUES:
        return None, sorted(values)
    return text, dropped


def _to_safetensors(
    ckpt: Checkpoint,
    plan: list[_Entry],
    dst: Path,
    overwrite: bool,
    reporter: Reporter,
    *,
    max_shard_size: int | None,
    strip_prefix: str | None,
    directory: bool,
) -> tuple[str, ...]:
    names: dict[str, str] = {}
    tensors: list[tuple[str, TensorRef]] = []
    values: dict[str, Any] = {}
    for e in plan:
        name = e.fqn[len(strip_prefix) :] if strip_prefix and e.fqn.startswith(strip_prefix) else e.fqn
        if name in names:
            raise DCPStudioError(f"{e.fqn} and {names[name]} both become {name!r}; adjust --strip-prefix")
        names[name] = e.fqn
        if e.tensor is None:
            values[name] = e.value
        elif e.tensor.dtype.safetensors is None:
            raise UnsupportedFormatError(f"safetensors cannot store {e.tensor.dtype} (tensor {e.fqn})")
        else:
            tensors.append((name, e.tensor))
    stored_json, dropped = _json_values(values)
    notes: list[str] = []
    if stored_json is not None or dropped:
        kept = sorted(set(values) - set(dropped))
        text = f"safetensors holds tensors only: stored {len(kept)} value(s) as JSON in the header metadata"
        text += f" ({', '.join(kept[:5])}{', ...' if len(kept) > 5 else ''})" if kept else ""
        if dropped:
            text += f"; left out {len(dropped)} non-JSON value(s): {', '.join(dropped[:8])}"
            text += ", ..." if len(dropped) > 8 else ""
        notes.append(text)
        warnings.warn(text, stacklevel=3)
    metadata = {"format": "pt"}
    if stored_json is not None:
        metadata[VALUES_KEY] = stored_json
        metadata[ENCODING_KEY] = ENCODING
    shards: list[list[tuple[str, TensorRef]]] = [[]]
    size = 0
    for name, t in tensors:
        if max_shard_size is not None and shards[-1] and size + t.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += t.nbytes
    single = max_shard_size is None and not directory
    write_safetensors_output(dst, overwrite, shards, metadata, reporter, str(ckpt.path), single_file=single)
    return tuple(notes)


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: Literal["dcp", "torch", "safetensors"] | None = None,
    progress: ProgressCallback | None = None,
    cancel: CancelToken | None = None,
    include: str | None = None,
    exclude: str | None = None,
    overwrite: bool = False,
    trust_pickle: bool = False,
    max_shard_size: int | str | None = None,
    dtype: Literal["bf16", "fp16", "fp32"] | None = None,
    strip_prefix: str | None = None,
    files: int | None = None,
    max_file_size: int | str | None = None,
    allow_expansion: bool = False,
    allow_empty: bool = False,
) -> ConversionResult:
    """Convert ``src`` to format ``to`` at ``dst``; by default DCP -> torch.save, torch.save -> DCP,
    safetensors -> DCP. ``include``/``exclude`` select entries by name (regular expressions
    searched in fully-qualified names); ``dtype`` casts floating tensors. For safetensors targets,
    ``max_shard_size`` (bytes, or "5GB") writes shards plus ``model.safetensors.index.json`` into
    the directory ``dst`` (as does a ``dst`` ending in a path separator), and ``strip_prefix``
    drops a prefix from names. For DCP targets, ``files`` spreads the data over that many files
    and ``max_file_size`` keeps each file under a size (one file by default). An output many times
    larger than what the source stores (one storage under many names) is refused with
    :class:`ExpansionError` unless ``allow_expansion`` (see :mod:`._fanout`). Patterns that keep
    no entry are refused with :class:`EmptySelectionError` unless ``allow_empty``; a pattern that
    matches nothing while others select is warned about (and listed in the result's notes)."""
    src_p, dst_p = as_location(src), as_location(dst)
    directory = str(dst).endswith((os.sep, "/"))
    fmt: Format = detect_format(src_p)
    target = to or ("torch" if fmt == "dcp" else "dcp")
    if target not in _NAMES:
        raise UnsupportedFormatError(f"unknown target format {target!r} (expected dcp, torch or safetensors)")
    if target != "safetensors" and (max_shard_size is not None or strip_prefix is not None):
        raise ValueError("--max-shard-size and --strip-prefix apply to --to safetensors only")
    if target != "dcp" and (files is not None or max_file_size is not None):
        raise ValueError("--files and --max-file-size apply to --to dcp only")
    if files is not None and files < 1:
        raise ValueError("files must be at least 1")
    file_limit = parse_size(max_file_size) if isinstance(max_file_size, str) else max_file_size
    if dtype is not None and dtype not in _CASTS:
        raise ValueError(f"unknown dtype {dtype!r} (expected bf16, fp16 or fp32)")
    shard_limit = parse_size(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    if shard_limit is not None and shard_limit <= 0:
        raise ValueError("max_shard_size must be positive")
    check_paths(src_p, dst_p, target)
    check_replaceable(dst_p, target, overwrite, src_p)
    keep = NameFilter(include, exclude)
    if trust_pickle:
        warnings.warn(TRUST_WARNING.format(src_p), stacklevel=2)
    cast = _CASTS[dtype] if dtype else None
    with open_checkpoint(src_p, trust_pickle=trust_pickle) as ckpt:
        selection_notes = (*ckpt.info.get("notes", ()), *keep.check(ckpt.entries, allow_empty=allow_empty))
        for note in selection_notes:
            warnings.warn(note, stacklevel=2)
        plan = _plan(ckpt, keep, cast, views=target == "torch")
        written = [(e.fqn, e.tensor if e.tensor is not None else e.value) for e in plan]
        if target == "safetensors":
            written = [(fqn, t) for fqn, t in written if isinstance(t, TensorRef)]
        check_output_size(ckpt, written, shared=target == "torch", allow=allow_expansion)
        total = sum(e.tensor.nbytes for e in plan if e.tensor is not None)
        reporter = Reporter(progress, cancel, total_bytes=total, total_items=len(plan))
        reporter.check()
        notes: tuple[str, ...] = ()
        if target == "torch":
            whole = len(plan) == len(ckpt.entries) and cast is None
            _to_torch(ckpt, plan, dst_p, overwrite, reporter, whole)
        elif target == "dcp":
            _to_dcp(ckpt, plan, dst_p, overwrite, reporter, files, file_limit)
        else:
            notes = _to_safetensors(
                ckpt,
                plan,
                dst_p,
                overwrite,
                reporter,
                max_shard_size=shard_limit,
                strip_prefix=strip_prefix,
                directory=directory,
            )
    return _result(src_p, dst_p, target, plan, selection_notes + notes)


def _expect(src: str | os.PathLike[str], fmt: Format, what: str) -> None:
    found = detect_format(src)
    if found != fmt:
        raise UnsupportedFormatError(f"{src}: not {what} (it is {_NAMES[found]})")


def torch_save_to_dcp(src: str | os.PathLike[str], dst: str | os.PathLike[str], **options: Any) -> ConversionResult:
    """torch.save file -> DCP directory (``format_utils.torch_save_to_dcp``, streaming and safe).
    Options as for :func:`convert`."""
    _expect(src, "torch", "a torch.save file")
    return convert(src, dst, to="dcp", **options)


def dcp_to_torch_save(src: str | os.PathLike[str], dst: str | os.PathLike[str], **options: Any) -> ConversionResult:
    """DCP directory (saved by any number of ranks) -> torch.save file, restoring the nesting the
    checkpoint's planner data records (``format_utils.dcp_to_torch_save``). Options as for
    :func:`convert`."""
    _expect(src, "dcp", "a DCP checkpoint directory")
    return convert(src, dst, to="torch", **options)
