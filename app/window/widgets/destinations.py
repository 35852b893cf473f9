"""Where a conversion's output goes when the user is asked: a free name beside its source."""

from __future__ import annotations

from pathlib import Path

from ..locations import Location, is_remote, name_of

__all__ = ["SUFFIX", "suggest_destination"]

SUFFIX = {"dcp": "_dcp", "torch": ".pt", "safetensors": ".safetensors", "hf": "_hf"}
"""What a suggested destination ends with; ``hf``: a mapped safetensors output, a Hugging Face folder
(its shards, index and config.json), not one file."""


def suggest_destination(target: str, src: Location, local_dir: str | None = None) -> Path:
    """A free name beside ``src`` for its conversion to ``target`` (never ``src`` itself). A remote
    source gets a local name, in ``local_dir`` (the last local folder; home when not given): the
    store is not asked anything, and a download is what converting from it usually means."""
    if is_remote(src):
        name = name_of(src)
        stem = name.split(".")[0] or name or "checkpoint"
        folder = Path(local_dir).expanduser() if local_dir else Path.home()
    else:
        src = Path(src)
        stem = src.name.split(".")[0] if src.is_file() else src.name
        folder = src.parent
    candidate = folder / (stem + SUFFIX[target])
    n = 1
    while candidate.exists() or candidate == src:
        candidate = folder / f"{stem}-{n}{SUFFIX[target]}"
        n += 1
    return candidate
