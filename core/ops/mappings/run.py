"""The operations a user calls with a mapping: :func:`load_mapping` (a built-in's name or a TOML
file), :func:`plan_for` (the dry run), :func:`map_convert` (write the mapped checkpoint in any
format, streaming, through :func:`~..ops.convert.convert.convert`) and :func:`map_verify`
(recompute every destination tensor from the source and compare bit for bit, through
:func:`~..ops.compare.diff.diff`).

A destination in Hugging Face names defaults to a safetensors folder (``model.safetensors`` +
index), with the ``--config`` given written as its ``config.json`` and, from ``hf_assets``, the
tokenizer and generation files (as torchtitan's ``hf_assets_path``), so ``from_pretrained``
loads it; one in torchtitan names defaults to a DCP checkpoint, which torchtitan loads.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ...checkpoints.opening import open_checkpoint
from ...progress import CancelToken, ProgressCallback
from ..compare.diff import DiffReport, diff
from ..convert.convert import convert, destination_kind
from ..convert.output import ConversionResult
from .builtins import BUILTINS, builtin
from .expr import MappingError
from .mapped import Mapped
from .plan import Plan, load_config, plan_mapping
from .rules import Mapping, parse_mapping

__all__ = ["ASSET_FILES", "MappedConversion", "list_mappings", "load_mapping", "map_convert", "map_verify", "plan_for"]

ASSET_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "tiktoken.model",
    "original/tokenizer.model",
)
"""What ``hf_assets`` contributes to a Hugging Face destination, when present."""


@dataclass(frozen=True)
class MappedConversion:
    """What :func:`map_convert` wrote (``result`` None for a dry run) and its plan."""

    plan: Plan
    result: ConversionResult | None
    assets: tuple[str, ...] = ()


def list_mappings() -> list[tuple[str, str]]:
    """The built-ins: (name, description)."""
    return [(name, str(raw["mapping"].get("description", ""))) for name, raw in BUILTINS.items()]


def load_mapping(spec: str | os.PathLike[str]) -> Mapping:
    """A built-in by name, or a TOML file of rules (``.toml``)."""
    text = os.fspath(spec)
    if text in BUILTINS:
        return builtin(text)
    if not text.endswith(".toml"):
        raise MappingError(f"unknown mapping {text!r}: built-ins are {', '.join(BUILTINS)}, or give a rules .toml file")
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise MappingError("reading a .toml mapping needs Python 3.11, or the tomli package") from None
    try:
        raw = tomllib.loads(Path(text).read_text(encoding="utf-8"))
    except OSError as e:
        raise MappingError(f"cannot read {text}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise MappingError(f"{text}: not valid TOML: {e}") from None
    try:
        return parse_mapping(raw, default_name=Path(text).stem)
    except MappingError as e:
        raise MappingError(f"{text}: {e}") from None


def _mapping(mapping: Mapping | str | os.PathLike[str]) -> Mapping:
    return mapping if isinstance(mapping, Mapping) else load_mapping(mapping)


def _config(config: dict[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    return config if isinstance(config, dict) else load_config(config)


def plan_for(
    src: str | os.PathLike[str],
    mapping: Mapping | str | os.PathLike[str],
    config: dict[str, Any] | str | os.PathLike[str],
    *,
    allow_unmapped: bool = False,
    trust_pickle: bool = False,
) -> Plan:
    """The plan of mapping ``src`` (nothing read but its structure)."""
    with open_checkpoint(src, trust_pickle=trust_pickle) as ckpt:
        return plan_mapping(ckpt.entries, _mapping(mapping), _config(config), allow_unmapped=allow_unmapped)


def _copy_assets(dst: Path, config: Any, hf_assets: str | os.PathLike[str] | None) -> tuple[str, ...]:
    copied = []
    if hf_assets is not None:
        root = Path(hf_assets)
        if not root.is_dir():
            raise MappingError(f"--hf-assets {root}: not a folder")
        for name in ASSET_FILES:
            if (root / name).is_file():
                (dst / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(root / name, dst / name)
                copied.append(name)
    if "config.json" not in copied and not isinstance(config, dict):
        shutil.copyfile(config, dst / "config.json")
        copied.append("config.json")
    return tuple(copied)


def map_convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    mapping: Mapping | str | os.PathLike[str],
    config: dict[str, Any] | str | os.PathLike[str],
    *,
    to: Literal["dcp", "torch", "safetensors"] | None = None,
    hf_assets: str | os.PathLike[str] | None = None,
    dry_run: bool = False,
    allow_unmapped: bool = False,
    overwrite: bool = False,
    trust_pickle: bool = False,
    max_shard_size: int | str | None = None,
    manifest: bool = True,
    progress: ProgressCallback | None = None,
    cancel: CancelToken | None = None,
) -> MappedConversion:
    """Write ``src`` mapped by ``mapping`` (a :class:`Mapping`, a built-in's name or a TOML file)
    with ``config`` (a Hugging Face config.json, or its contents) at ``dst``. The whole plan is
    checked first (:func:`~.plan.plan_mapping`); ``dry_run`` stops there. ``to``: the format
    (default: a safetensors folder for Hugging Face names, DCP for the other side, or what
    ``dst``'s suffix names)."""
    m, cfg = _mapping(mapping), _config(config)
    with open_checkpoint(src, trust_pickle=trust_pickle) as ckpt:
        plan = plan_mapping(ckpt.entries, m, cfg, allow_unmapped=allow_unmapped)
        if dry_run:
            return MappedConversion(plan, None)
        hf = plan.target == "hf"
        kind = destination_kind(dst)
        target = to or (kind if kind in ("dcp", "torch", "safetensors") else "safetensors" if hf else "dcp")
        folder = target == "safetensors" and kind != "safetensors"
        out = os.fspath(dst).rstrip("/" + os.sep) + "/" if folder else dst
        if hf_assets is not None and not folder and target != "dcp":
            raise MappingError("--hf-assets copies files into a folder: the destination is a single file")
        mapped = Mapped(ckpt, plan)
        try:
            result = convert(
                mapped,
                out,
                to=target,
                overwrite=overwrite,
                max_shard_size=max_shard_size,
                manifest=manifest,
                progress=progress,
                cancel=cancel,
            )
        finally:
            mapped.close()
    assets = _copy_assets(result.dst, config if hf else cfg, hf_assets) if folder or hf_assets else ()
    return MappedConversion(plan, result, assets)


def map_verify(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    mapping: Mapping | str | os.PathLike[str],
    config: dict[str, Any] | str | os.PathLike[str],
    *,
    allow_unmapped: bool = False,
    trust_pickle: bool = False,
    progress: ProgressCallback | None = None,
    cancel: CancelToken | None = None,
) -> tuple[Plan, DiffReport]:
    """Compare ``dst`` with ``src`` mapped (each destination tensor recomputed from its sources),
    exactly: a mapping's operations move values, they do not round them."""
    m, cfg = _mapping(mapping), _config(config)
    with open_checkpoint(src, trust_pickle=trust_pickle) as a, open_checkpoint(dst, trust_pickle=trust_pickle) as b:
        plan = plan_mapping(a.entries, m, cfg, allow_unmapped=allow_unmapped)
        mapped = Mapped(a, plan)
        try:
            return plan, diff(mapped, b, progress=progress, cancel=cancel)
        finally:
            mapped.close()
