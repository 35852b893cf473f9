"""Checks of the command line's own flags, before any work: a contradiction between flags, or a
flag out of its range, is a one-line usage error (exit 2) that names the flag -- never a silent
fallback, and never an error of the library underneath that names none of our flags."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["RESHARD_FLAGS", "UsageError", "check_load_flags", "convert_options", "resolve_target"]

_FORMATS = {"dcp": "a DCP directory", "torch": "a torch.save file", "safetensors": "a safetensors checkpoint"}
_NAMED = {"torch_to_dcp": "dcp", "dcp_to_torch": "torch"}


class UsageError(ValueError):
    """A flag the command line cannot act on; :func:`dcpstudio.cli.main.main` exits 2 with its text."""


def resolve_target(dst: str, to: str | None, named: str | None = None, sharded: bool = False) -> str | None:
    """The target format of ``convert SRC DST``: ``--to`` (or the named command's) when given, else
    the destination's suffix (``.pt``/``.pth``/``.bin``: torch.save, ``.safetensors``), else a
    directory format for a trailing separator or a bare name (sharded safetensors with
    ``--max-shard-size``, DCP otherwise). None leaves it to the source (a suffix naming no format).
    A target the destination's name contradicts is refused, naming both."""
    from dcpstudio.core.ops.convert.convert import destination_kind

    kind = destination_kind(dst)
    wanted = _NAMED[named] if named is not None else to
    if wanted is None:
        if kind in ("directory", "bare"):
            return "safetensors" if sharded else "dcp"
        return kind
    if kind == wanted or kind in (None, "bare") or (kind == "directory" and wanted != "torch"):
        return wanted
    flag = named if named is not None else f"--to {to}"
    names = "a directory (trailing separator)" if kind == "directory" else _FORMATS[kind]
    fix = "change the destination" + ("" if named is not None else " or drop --to")
    raise UsageError(f"{flag} writes {_FORMATS[wanted]} but the destination {dst!r} names {names}; {fix}")


RESHARD_FLAGS = ("for_ranks", "layout", "mesh")  # resharding (`--for-ranks`): one process only


def convert_options(args: argparse.Namespace, *, mapping: bool = False, named: bool = False) -> dict[str, Any]:
    """``convert``'s keyword options from its flags, for every way it runs (one process, ranks, a
    mapping): with ``mapping``, ``map_convert``'s (``--to`` and ``--max-shard-size`` beside its
    own); ``named`` (``torch_to_dcp``, ``dcp_to_torch``), the selection only; else ``convert``'s,
    resharding included (``for_ranks``, ``layout``, ``mesh``). ``to``, progress and, for a mapping,
    ``mapping``/``config``/``dry_run`` are the caller's."""
    common: dict[str, Any] = dict(overwrite=args.overwrite, trust_pickle=args.trust_pickle, manifest=args.manifest)
    if mapping:
        return dict(
            common,
            max_shard_size=getattr(args, "max_shard_size", None),
            hf_assets=args.hf_assets,
            allow_unmapped=args.allow_unmapped,
        )
    selection = dict(
        common,
        include=args.include,
        exclude=args.exclude,
        allow_expansion=args.allow_expansion,
        allow_empty=args.allow_empty,
        dequantize=args.dequantize,
    )
    if named:
        return selection
    return dict(
        selection,
        max_shard_size=args.max_shard_size,
        dtype=args.dtype,
        strip_prefix=args.strip_prefix,
        files=args.files,
        max_file_size=args.max_file_size,
        **{name: getattr(args, name, None) for name in RESHARD_FLAGS},
    )


def check_load_flags(ranks: int | None, mesh: str | None, world: str = "--ranks is") -> int | None:
    """``load``: at least one rank; a mesh of at most 2 dimensions whose product is the rank count
    (each said on its own, naming the flag; ``world`` says where the count came from). Returns
    the mesh's size (None without ``--mesh``): the rank count when ``--ranks`` is omitted."""
    if ranks is not None and ranks < 1:
        raise UsageError(f"--ranks {ranks}: needs at least 1 rank")
    if mesh is None:
        return None
    try:
        dims = [int(d) for d in mesh.lower().split("x")]
    except ValueError:
        raise UsageError(f"--mesh {mesh!r}: expected sizes joined by x, e.g. 2x2") from None
    if any(d < 1 for d in dims):
        raise UsageError(f"--mesh {mesh}: every dimension needs at least 1 rank")
    if len(dims) > 2:
        raise UsageError(f"--mesh {mesh}: at most 2 dimensions (got {len(dims)})")
    product = 1
    for d in dims:
        product *= d
    if ranks is not None and product != ranks:
        raise UsageError(f"--mesh {mesh} needs {product} ranks but {world} {ranks}")
    return product
