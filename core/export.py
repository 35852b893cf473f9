"""Conversions that involve safetensors, streaming like the torch.save <-> DCP converters.

To safetensors: any checkpoint's tensors, named by their flattened fully-qualified names (the
keys DCP uses), optionally cast and sharded with a ``model.safetensors.index.json``. Tensors whose
bytes lie verbatim in the source are copied in the kernel. Non-tensor values cannot be tensors in
safetensors: small JSON-able ones are stored as JSON in the header metadata under
``dcpstudio.values`` (and read back by DCP Studio); the rest are named in a warning.

From safetensors: every tensor (and stored value) becomes an entry of a flat state dict.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from ._atomic import atomic_output
from ._io import FileRange, crc32, tensor_buffer
from ._pipeline import prefetch
from .convert import TRUST_WARNING, ConversionResult, Loaded, _check_paths, _io_error, save_as_dcp, write_torch_save
from .errors import DCPStudioError
from .formats.safetensors import SafetensorsWriter
from .inspect import VALUES_KEY, Checkpoint, open_checkpoint
from .planners import LazySavePlanner, NameFilter
from .progress import CancelToken, ProgressCallback, Reporter

__all__ = ["checkpoint_to_dcp", "checkpoint_to_torch", "parse_size", "to_safetensors"]

INDEX_FILE = "model.safetensors.index.json"
_MAX_STORED_VALUES = 64 << 10
_CASTS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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


@dataclass(frozen=True)
class _Item:
    fqn: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


def _plan_shards(items: list[_Item], max_shard: int | None) -> list[list[_Item]]:
    if max_shard is None:
        return [items]
    shards: list[list[_Item]] = [[]]
    size = 0
    for item in items:
        if shards[-1] and size + item.nbytes > max_shard:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item.nbytes
    return shards


def _json_values(values: dict[str, Any]) -> tuple[str | None, list[str]]:
    """The JSON to store for the JSON-able values (None if none or too large) and the names left out."""
    stored: dict[str, Any] = {}
    dropped = []
    for fqn, value in values.items():
        try:
            json.dumps(value, allow_nan=False)
            stored[fqn] = value
        except (TypeError, ValueError):
            dropped.append(fqn)
    text = json.dumps(stored, allow_nan=False) if stored else None
    if text is not None and len(text) > _MAX_STORED_VALUES:
        return None, sorted(values)
    return text, dropped


def to_safetensors(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    max_shard_size: int | str | None = None,
    dtype: Literal["bf16", "fp16", "fp32"] | None = None,
    strip_prefix: str | None = None,
    progress: ProgressCallback | None = None,
    cancel: CancelToken | None = None,
    include: str | None = None,
    exclude: str | None = None,
    overwrite: bool = False,
    trust_pickle: bool = False,
) -> ConversionResult:
    """Write a checkpoint's tensors as safetensors: one file, or shards of at most
    ``max_shard_size`` bytes plus ``model.safetensors.index.json`` in the directory ``dst``."""
    src_p, dst_p = Path(src), Path(dst)
    _check_paths(src_p, dst_p)
    shard_limit = parse_size(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    if shard_limit is not None and shard_limit <= 0:
        raise ValueError("max_shard_size must be positive")
    cast_to = _CASTS[dtype] if dtype else None
    keep = NameFilter(include, exclude)
    if trust_pickle:
        warnings.warn(TRUST_WARNING.format(src_p), stacklevel=2)
    with open_checkpoint(src_p, trust_pickle=trust_pickle) as ckpt:
        items: list[_Item] = []
        names: dict[str, str] = {}
        values: dict[str, Any] = {}
        for fqn, entry in ckpt.entries.items():
            if not keep(fqn):
                continue
            name = fqn[len(strip_prefix) :] if strip_prefix and fqn.startswith(strip_prefix) else fqn
            if name in names:
                raise DCPStudioError(f"{fqn} and {names[name]} both become {name!r}; adjust --strip-prefix")
            names[name] = fqn
            if entry.kind != "tensor":
                values[name] = ckpt.read_value(fqn)
                continue
            assert entry.dtype is not None
            target = cast_to if cast_to is not None and entry.dtype.is_floating_point else entry.dtype
            items.append(_Item(fqn, name, target, entry.shape or ()))
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
            warnings.warn(text, stacklevel=2)
        metadata = {"format": "pt"}
        if stored_json is not None:
            metadata[VALUES_KEY] = stored_json
        shards = _plan_shards(items, shard_limit)
        total = sum(i.nbytes for i in items)
        reporter = Reporter(progress, cancel, total_bytes=total, total_items=len(items))
        reporter.check()

        def produce(item: _Item) -> FileRange | torch.Tensor:
            reporter.check()
            entry = ckpt.entries[item.fqn]
            if item.dtype == entry.dtype:
                found = ckpt.file_range(item.fqn)
                if found is not None:
                    return found
            t = ckpt.read_tensor(item.fqn)
            return t.to(item.dtype).contiguous() if t.dtype != item.dtype else t

        try:
            with atomic_output(dst_p, overwrite=overwrite) as tmp:
                if len(shards) == 1 and shard_limit is None:
                    files = [(tmp, shards[0])]
                else:
                    tmp.mkdir()
                    n = len(shards)
                    files = [
                        (tmp / ("model.safetensors" if n == 1 else f"model-{k:05d}-of-{n:05d}.safetensors"), s)
                        for k, s in enumerate(shards, 1)
                    ]
                for path, shard in files:
                    with open(path, "wb") as f:
                        writer = SafetensorsWriter(f, [(i.name, i.dtype, i.shape) for i in shard], metadata)
                        for item, data in prefetch(produce, shard):
                            if isinstance(data, FileRange):
                                writer.copy(item.name, data, f"{src_p} ({item.fqn})")
                            else:
                                writer.write(item.name, data)
                            reporter.advance(item.nbytes, current=item.fqn)
                        writer.finish()
                if len(files) > 1:
                    index = {
                        "metadata": {"total_size": total},
                        "weight_map": {i.name: path.name for path, shard in files for i in shard},
                    }
                    with open(tmp / INDEX_FILE, "w") as index_file:
                        json.dump(index, index_file, indent=2)
                        index_file.flush()
                        os.fsync(index_file.fileno())
        except OSError as e:
            raise _io_error(dst_p, e) from e
    return ConversionResult(src_p, dst_p, "safetensors", len(items), len(values), total, tuple(notes))


def _placeholders(ckpt: Checkpoint, keep: NameFilter) -> tuple[dict[str, Any], dict[int, str]]:
    """A flat state dict of meta placeholders (tensors) and values, and placeholder id -> fqn."""
    state: dict[str, Any] = {}
    fqn_of: dict[int, str] = {}
    for fqn, entry in ckpt.entries.items():
        if not keep(fqn):
            continue
        if entry.kind == "tensor":
            t = torch.empty(entry.shape or (), dtype=entry.dtype, device="meta")
            fqn_of[id(t)] = fqn
            state[fqn] = t
        else:
            state[fqn] = ckpt.read_value(fqn)
    return state, fqn_of


def checkpoint_to_torch(
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
    """Any checkpoint (used for safetensors) -> a torch.save file of a flat ``{name: tensor}`` dict."""
    src_p, dst_p = Path(src), Path(dst)
    _check_paths(src_p, dst_p)
    keep = NameFilter(include, exclude)
    with open_checkpoint(src_p, trust_pickle=trust_pickle) as ckpt:
        state, fqn_of = _placeholders(ckpt, keep)
        placeholders = {i: state[f] for i, f in fqn_of.items()}
        total = sum(t.numel() * t.element_size() for t in placeholders.values())
        reporter = Reporter(progress, cancel, total_bytes=total, total_items=len(state))
        reporter.check()

        def load(batch: list[tuple[str, torch.Tensor]]) -> Loaded:
            reporter.check()
            out: Loaded = []
            for key, placeholder in batch:
                t = ckpt.read_tensor(fqn_of[id(placeholder)])
                out.append((key, (t, crc32(tensor_buffer(t)))))
            return out

        write_torch_save(dst_p, overwrite, state, placeholders, load, reporter, str(src_p), fqn_of)
    return ConversionResult(src_p, dst_p, "torch", len(fqn_of), len(state) - len(fqn_of), total)


def checkpoint_to_dcp(
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
    """Any checkpoint (used for safetensors) -> a DCP directory whose keys are the entry names."""
    src_p, dst_p = Path(src), Path(dst)
    _check_paths(src_p, dst_p)
    keep = NameFilter(include, exclude)
    with open_checkpoint(src_p, trust_pickle=trust_pickle) as ckpt:
        state, fqn_of = _placeholders(ckpt, keep)
        total = sum(ckpt.entries[f].nbytes for f in fqn_of.values())
        reporter = Reporter(progress, cancel, total_bytes=total, total_items=len(state))
        reporter.check()

        def on_item(_length: int, fqn: str) -> None:
            entry = ckpt.entries.get(fqn)
            reporter.advance(entry.nbytes if entry is not None and entry.kind == "tensor" else 0, current=fqn)

        planner = LazySavePlanner(
            lambda t: ckpt.read_tensor(fqn_of[id(t)]) if id(t) in fqn_of else t, before_item=reporter.check
        )
        save_as_dcp(state, dst_p, overwrite, planner, on_item)
    return ConversionResult(src_p, dst_p, "dcp", len(fqn_of), len(state) - len(fqn_of), total)
