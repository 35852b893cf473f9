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
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ...checkpoints.model import refuse_expanded
from ...checkpoints.opening import ROOT_KEY, Checkpoint, SafetensorsCheckpoint, TorchCheckpoint, open_checkpoint
from ...errors import DCPStudioError, UnsupportedFormatError
from ...formats.dcp.files import DCPItem
from ...formats.detect import Format, detect_format
from ...formats.values import ENCODING, ENCODING_KEY, VALUES_KEY, NotStorable, encode_value
from ...io.remote.locations import as_location
from ...pickles.refs import StorageRef, TensorRef
from ...pickles.tree import iter_tensors, set_element
from ...progress import CancelToken, ProgressCallback, Reporter
from ...units import parse_size
from .fanout import check_output_size
from .output import (
    SUFFIX_TARGETS,
    TRUST_WARNING,
    ConversionResult,
    Target,
    Writers,
    check_paths,
    check_replaceable,
    destination_kind,
)
from .reshard import check_rank_options, to_ranks
from .transform import CASTS, Transform, cast_ref, cast_view

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
_MAX_STORED_VALUES = 64 << 10


@dataclass
class _Entry:
    """One entry of the output: its name, its place in the nested state dict, and its tensor or
    value (tensors inside a value stay :class:`TensorRef`)."""

    fqn: str
    path: tuple[str | int, ...]
    tensor: TensorRef | None
    value: Any = None


def _plan(ckpt: Checkpoint, transform: Transform, views: bool) -> list[_Entry]:
    """The output's entries; ``views`` when the target keeps views as views (torch.save: a cast
    casts each storage once, and its views stay views of it)."""
    paths = ckpt.paths()
    out = []
    casts: dict[tuple[int, str], StorageRef] = {}
    for fqn, entry in ckpt.entries.items():
        if not transform.keep(fqn):
            continue
        path = paths.get(fqn, (fqn,))
        if entry.kind == "tensor":
            t = ckpt.tensor_ref(fqn)
            compact = views
            cast = transform.cast_of(t.dtype)
            if cast is not None:
                view = cast_view(t, cast, fqn, casts) if views else None
                compact = view is not None
                t = view if view is not None else cast_ref(t, cast, fqn)
            if not compact:
                refuse_expanded(entry, str(ckpt.path), "write")
            out.append(_Entry(fqn, path, t))
        else:
            out.append(_Entry(fqn, path, None, ckpt.read_object(fqn)))
    return out


def _result(
    src: Path, dst: Path, target: Target, plan: list[_Entry], notes: tuple[str, ...], transform: Transform
) -> ConversionResult:
    tensors = [e.tensor for e in plan if e.tensor is not None]
    return ConversionResult(
        src, dst, target, len(tensors), len(plan) - len(tensors), sum(t.nbytes for t in tensors), notes, transform
    )


def _to_torch(
    ckpt: Checkpoint,
    plan: list[_Entry],
    dst: Path,
    overwrite: bool,
    reporter: Reporter,
    whole: bool,
    manifest: bool,
    out: Writers,
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
    tensors = [(e.fqn, e.tensor) for e in plan if isinstance(e.tensor, TensorRef)]
    out.torch_save(dst, overwrite, obj, reporter, str(ckpt.path), names, tensors, manifest)


def _to_dcp(
    ckpt: Checkpoint,
    plan: list[_Entry],
    dst: Path,
    overwrite: bool,
    reporter: Reporter,
    files: int | None,
    max_file_size: int | None,
    manifest: bool,
    out: Writers,
) -> None:
    if isinstance(ckpt, TorchCheckpoint) and ckpt.obj is not None and not isinstance(ckpt.obj, dict):
        raise UnsupportedFormatError(
            f"{ckpt.path}: holds a {type(ckpt.obj).__name__}; DCP stores a dict (state dict) at the top level"
        )
    items = [DCPItem(e.fqn, e.path, e.tensor, e.value) for e in plan]
    out.dcp(
        dst,
        overwrite,
        items,
        reporter,
        str(ckpt.path),
        files=files,
        max_file_size=max_file_size,
        source=ckpt.path,
        manifest=manifest,
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


def _refuse_held_tensors(fqn: str, value: Any) -> None:
    """A value holding tensors (a tuple of them; a whole nested dict that DCP stored as one item) is
    never left out as a non-JSON value: its tensors would be lost."""
    held = sum(1 for _ in iter_tensors(value))
    if held:
        raise UnsupportedFormatError(
            f"{fqn!r} is a {type(value).__name__} value holding {held} tensor(s), which safetensors cannot store; "
            "convert to torch.save or DCP, or leave it out with --exclude"
        )


def _to_safetensors(
    ckpt: Checkpoint,
    plan: list[_Entry],
    dst: Path,
    overwrite: bool,
    reporter: Reporter,
    *,
    max_shard_size: int | None,
    transform: Transform,
    directory: bool,
    out: Writers,
    manifest: bool = True,
) -> tuple[str, ...]:
    names: dict[str, str] = {}
    tensors: list[tuple[str, TensorRef]] = []
    values: dict[str, Any] = {}
    for e in plan:
        name = transform.rename(e.fqn)
        if name in names:
            raise DCPStudioError(f"{e.fqn} and {names[name]} both become {name!r}; adjust --strip-prefix")
        names[name] = e.fqn
        if e.tensor is None:
            _refuse_held_tensors(e.fqn, e.value)
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
    carried, differ = ckpt.header_metadata() if isinstance(ckpt, SafetensorsCheckpoint) else ({}, [])
    if differ:
        notes.append(f"the source files' __metadata__ differ on {', '.join(differ[:5])}: the first file's kept")
        warnings.warn(notes[-1], stacklevel=3)
    metadata = {"format": "pt", **carried}  # theirs as they are; ours beside
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
    out.safetensors(dst, overwrite, shards, metadata, reporter, str(ckpt.path), single_file=single, manifest=manifest)
    return tuple(notes)


def convert(
    src: str | os.PathLike[str] | Checkpoint,
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
    dequantize: bool = False,
    manifest: bool = True,
    for_ranks: int | None = None,
    layout: str | None = None,
    mesh: str | None = None,
    writers: Writers | None = None,
) -> ConversionResult:
    """Convert ``src`` to format ``to`` at ``dst``; by default DCP -> torch.save, torch.save -> DCP,
    safetensors -> DCP. ``include``/``exclude`` select entries by name (regular expressions
    searched in fully-qualified names); ``dtype`` casts floating tensors. For safetensors targets,
    ``max_shard_size`` (bytes, or "5GB") writes shards plus ``model.safetensors.index.json`` into
    the directory ``dst`` (as does a ``dst`` ending in a path separator), and ``strip_prefix``
    drops a prefix from names. For DCP targets, ``files`` spreads the data over that many files
    and ``max_file_size`` keeps each file under a size (one file by default). An output many times
    larger than what the source stores (one storage under many names) is refused with
    :class:`ExpansionError` unless ``allow_expansion`` (see :mod:`.fanout`). Patterns that keep
    no entry are refused with :class:`EmptySelectionError` unless ``allow_empty``; a pattern that
    matches nothing while others select is warned about (and listed in the result's notes).
    Tensor subclasses (torchao) of a trusted torch.save source are written as their inner tensors
    (``W.qdata``, ``W.scale``), or with ``dequantize`` as their own ``dequantize()``. A local
    output carries a manifest of its tensors' digests and moments and its files' SHA-256
    (:mod:`...formats.manifest`) unless ``manifest`` is False.
    ``for_ranks`` lays a DCP out for that many ranks, ``layout`` (``load``'s; shard0) on ``mesh``
    (``"2x2"``; 1-D), each rank's chunks in its own file (:mod:`.reshard`).

    ``src`` may be a checkpoint its caller has open (it stays open): the source is located and its
    format detected once, by whoever opens it. ``writers``: what writes the planned output (by
    default :class:`Writers`; a distributed conversion runs its own, see :mod:`...ranks.convert`)."""
    out = writers or Writers()
    given = src if isinstance(src, Checkpoint) else None
    src_p = given.path if given is not None else as_location(src)
    dst_p = as_location(dst)
    directory = str(dst).endswith((os.sep, "/"))
    fmt: Format = given.format if given is not None else detect_format(src_p)
    target = to or ("torch" if fmt == "dcp" and for_ranks is None else "dcp")
    if target not in _NAMES:
        raise UnsupportedFormatError(f"unknown target format {target!r} (expected dcp, torch or safetensors)")
    if target != "safetensors" and (max_shard_size is not None or strip_prefix is not None):
        raise ValueError("--max-shard-size and --strip-prefix apply to --to safetensors only")
    if target != "dcp" and (files is not None or max_file_size is not None):
        raise ValueError("--files and --max-file-size apply to --to dcp only")
    rank_mesh = check_rank_options(target, for_ranks, layout, mesh, files, max_file_size)
    if rank_mesh is not None and writers is not None:  # its writer is its own: planning it would write
        raise ValueError("--for-ranks (resharding) runs on one process: not on ranks (--ranks, torchrun)")
    if files is not None and files < 1:
        raise ValueError("files must be at least 1")
    file_limit = parse_size(max_file_size) if isinstance(max_file_size, str) else max_file_size
    if dtype is not None and dtype not in CASTS:
        raise ValueError(f"unknown dtype {dtype!r} (expected bf16, fp16 or fp32)")
    shard_limit = parse_size(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    if shard_limit is not None and shard_limit <= 0:
        raise ValueError("max_shard_size must be positive")
    check_paths(src_p, dst_p, target, src_format=fmt)
    check_replaceable(dst_p, target, overwrite, src_p)
    transform = Transform(include, exclude, dtype, strip_prefix)
    if dequantize and not trust_pickle:
        raise ValueError("--dequantize runs the tensor subclasses' own code: it needs --trust-pickle")
    if trust_pickle:
        warnings.warn(TRUST_WARNING.format(src_p), stacklevel=2)
    opened = (
        nullcontext(given)
        if given is not None
        else open_checkpoint(src_p, trust_pickle=trust_pickle, fmt=fmt, dequantize=dequantize)
    )
    with opened as ckpt:
        selection_notes = (*ckpt.info.get("notes", ()), *transform.keep.check(ckpt.entries, allow_empty=allow_empty))
        for note in selection_notes:
            warnings.warn(note, stacklevel=2)
        plan = _plan(ckpt, transform, views=target == "torch")
        written = [(e.fqn, e.tensor if e.tensor is not None else e.value) for e in plan]
        if target == "safetensors":
            written = [(fqn, t) for fqn, t in written if isinstance(t, TensorRef)]
        check_output_size(ckpt, written, shared=target == "torch", allow=allow_expansion)
        total = sum(e.tensor.nbytes for e in plan if e.tensor is not None)
        reporter = Reporter(progress, cancel, total_bytes=total, total_items=len(plan))
        reporter.check()
        notes: tuple[str, ...] = ()
        if target == "torch":
            whole = len(plan) == len(ckpt.entries) and dtype is None
            _to_torch(ckpt, plan, dst_p, overwrite, reporter, whole, manifest, out)
        elif rank_mesh is not None:
            notes = to_ranks(ckpt, plan, transform, dst_p, overwrite, reporter, layout, rank_mesh, manifest)
        elif target == "dcp":
            _to_dcp(ckpt, plan, dst_p, overwrite, reporter, files, file_limit, manifest, out)
        else:
            notes = _to_safetensors(
                ckpt,
                plan,
                dst_p,
                overwrite,
                reporter,
                max_shard_size=shard_limit,
                transform=transform,
                directory=directory,
                out=out,
                manifest=manifest,
            )
    return _result(src_p, dst_p, target, plan, selection_notes + notes, transform)


def _convert_from(
    fmt: Format, what: str, to: Target, src: str | os.PathLike[str], dst: str | os.PathLike[str], options: Any
) -> ConversionResult:
    """Open ``src`` once, check it is ``fmt``, and convert the open checkpoint."""
    src_p = as_location(src)
    found = detect_format(src_p)
    if found != fmt:
        raise UnsupportedFormatError(f"{src}: not {what} (it is {_NAMES[found]})")
    trust, dequantize = options.get("trust_pickle", False), options.get("dequantize", False)
    with open_checkpoint(src_p, trust_pickle=trust, fmt=found, dequantize=dequantize) as ckpt:
        return convert(ckpt, dst, to=to, **options)


def torch_save_to_dcp(src: str | os.PathLike[str], dst: str | os.PathLike[str], **options: Any) -> ConversionResult:
    """torch.save file -> DCP directory (``format_utils.torch_save_to_dcp``, streaming and safe).
    Options as for :func:`convert`."""
    return _convert_from("torch", "a torch.save file", "dcp", src, dst, options)


def dcp_to_torch_save(src: str | os.PathLike[str], dst: str | os.PathLike[str], **options: Any) -> ConversionResult:
    """DCP directory (saved by any number of ranks) -> torch.save file, restoring the nesting the
    checkpoint's planner data records (``format_utils.dcp_to_torch_save``). Options as for
    :func:`convert`."""
    return _convert_from("dcp", "a DCP checkpoint directory", "torch", src, dst, options)
