"""Recognise a checkpoint by its content, not its name."""

from __future__ import annotations

import os
import re
import struct
from typing import Any, Literal

from ..errors import CorruptCheckpointError, UnsupportedFormatError
from ..io.files import file_size, open_regular
from ..io.remote.locations import RemotePath, as_location

__all__ = ["Format", "detect_format"]

Format = Literal["dcp", "torch", "safetensors"]

_SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_INDEX_SUFFIXES = (".bin.index.json", ".pt.index.json", ".pth.index.json")


def _looks_like_safetensors(head: bytes, size: int) -> bool:
    if len(head) < 9:
        return False
    (header_len,) = struct.unpack("<Q", head[:8])
    return 2 <= header_len <= size - 8 and head[8:9] == b"{"


def detect_format(path: str | os.PathLike[str]) -> Format:
    """``"dcp"`` for a directory with ``.metadata``, ``"torch"`` for a torch.save file (ZIP or
    legacy), ``"safetensors"`` for a safetensors file or a directory with an index; else a clear
    :class:`UnsupportedFormatError`."""
    p = as_location(path)
    if isinstance(p, RemotePath):
        return _detect_remote(p)
    if p.is_dir():
        return _detect_dir(p)
    if not p.exists():
        raise UnsupportedFormatError(f"{p}: no such file or directory")
    return _detect_file(p)


def _detect_file(p: Any) -> Format:
    if p.name.endswith(".safetensors.index.json"):
        return "safetensors"
    if p.name.endswith(TORCH_INDEX_SUFFIXES):
        return "torch"
    try:
        with open_regular(p) as f:
            size = file_size(f)
            head = f.read(512)
    except OSError as e:
        raise UnsupportedFormatError(f"{p}: cannot read ({e.strerror or e})") from e
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return "torch"
    # before the pickle test: a safetensors header of 640 bytes begins 80 02, as a pickle does (a
    # legacy torch.save's 9th byte is its magic number's, never "{")
    if _looks_like_safetensors(head, size):
        return "safetensors"
    if head[:1] == b"\x80" and len(head) > 2 and head[1] in (2, 3, 4, 5):
        return "torch"
    if len(head) >= 262 and head[257:262] == b"ustar":
        raise UnsupportedFormatError(f"{p}: a pre-1.0 tar-format torch.save file; re-save it with current torch")
    if size == 0:
        raise UnsupportedFormatError(f"{p}: empty file")
    raise UnsupportedFormatError(
        f"{p}: not a checkpoint (expected a DCP directory, a torch.save file or a safetensors file)"
    )


def _detect_dir(p: Any) -> Format:
    if (p / ".metadata").is_file():
        return "dcp"
    if any(p.glob("*.distcp")):
        raise CorruptCheckpointError(
            f"{p}: has .distcp data files but no .metadata; the save did not finish or it was removed"
        )
    if (p / _SAFETENSORS_INDEX).is_file() or any(p.glob("*.safetensors")):
        return "safetensors"
    if any(p.name.endswith(TORCH_INDEX_SUFFIXES) for p in p.iterdir()):
        return "torch"  # torch.save shards with their index (pytorch_model.bin.index.json)
    if _rank_files(p):
        return "torch"  # a per-rank shard set (model_0.pt ... model_{N-1}.pt)
    raise UnsupportedFormatError(
        f"{p}: directory holds no checkpoint (no DCP .metadata, no safetensors, no pytorch_model.bin.index.json)"
    )


_RANK_FILE = re.compile(r"^.*?\d+\.(?:pt|pth|bin)$")


def _rank_files(p: Any) -> bool:
    """Only files named ``<stem><rank>.pt`` (two or more, or one beside ``metadata.pkl``): a per-rank
    shard set, or a torchtitan ``torch_checkpointing`` folder (``model_0.pt``, ``optimizer_0.pt`` ...),
    read (and checked whole) by :mod:`dcpstudio.core.checkpoints.shardset` and ``.itemsets``."""
    names = [q.name for q in p.iterdir() if not q.name.startswith(".")]
    ranked = [n for n in names if n != "metadata.pkl"]  # torch_checkpointing's, beside its item files
    return len(ranked) >= (2 if len(ranked) == len(names) else 1) and all(_RANK_FILE.match(n) for n in ranked)


def _detect_remote(p: RemotePath) -> Format:
    """As for a local path, asking the store as little as possible: a DCP is known from one
    request for its ``.metadata``."""
    if not p.signed and not p.name.endswith(_FILE_SUFFIXES) and (p / ".metadata").is_file():
        return "dcp"
    if p.http and not p.folder and not p.signed and not p.name.endswith(_FILE_SUFFIXES):
        # HTTP has no listings: a folder given without its trailing "/" is known by an index in it
        p.folder = any((p / name).is_file() for name in (_SAFETENSORS_INDEX, "pytorch_model.bin.index.json"))
    if p.is_dir():
        return _detect_dir(p)
    if not p.exists():
        raise UnsupportedFormatError(f"{p}: not found")
    return _detect_file(p)


_FILE_SUFFIXES = (".json", ".safetensors", ".pt", ".pth", ".bin", ".ckpt", ".tar")
