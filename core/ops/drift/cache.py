"""Drift sums cached per step, beside the index cache (:mod:`...io.index_cache`: the same folder,
0600 files in a 0700 folder, other users' files not read, written atomically, bounded, safe to delete).

A step's record holds every tensor's :class:`~.metrics.StepSums` at that step and its values row.
Those depend on the step's checkpoint and on the ones it is compared with -- the previous step, the
one before it and the run's first step -- so the record's key is a digest of all four checkpoints'
identities: every file of each, by the status :func:`~...io.index_cache.identity` takes (resolved
path, size, modification and change times, inode, device; a remote object's URL, size, time and
ETag). A changed checkpoint changes the key of its own record and of the records that compare with
it, and only those are computed again. The record is stored under the step's main file (a DCP's
``.metadata``), in the slot the index cache keeps for a content digest, which here is the digest of
everything the record depends on.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from ...io import index_cache
from .metrics import SAMPLE, StepSums
from .run import RunStep

__all__ = ["load_step", "step_identity", "store_step"]

_KIND = "drift-step"
_VERSION = 5  # 5: float32 chunk sums (equal values must have equal norms across steps)


def _files(location: Any) -> list[Any]:
    if not location.is_dir():
        return [location]
    if isinstance(location, Path):
        found = []
        for folder, dirs, names in os.walk(location):
            dirs.sort()
            found += [Path(folder) / n for n in sorted(names)]
        return found
    return sorted(p for p in location.iterdir() if p.is_file())


def _main_file(step: RunStep) -> Any:
    location = step.parts[0][1]
    if location.is_dir():
        metadata = location / ".metadata"
        if metadata.is_file():
            return metadata
        files = _files(location)
        return files[0] if files else None
    return location


def step_identity(step: RunStep) -> str | None:
    """A digest of every file of the step's checkpoints by status; None when one cannot be known
    (a remote object without a strong ETag): that step is never cached."""
    found = []
    for prefix, location, fmt in step.parts:
        for f in _files(location):
            ident = index_cache.identity(f, _KIND)
            if ident is None:
                return None
            found.append([prefix, fmt, ident])
    return hashlib.sha256(json.dumps(found, sort_keys=True).encode()).hexdigest()


def _key(step: RunStep, depends: list[str | None]) -> tuple[Any, dict[str, Any]] | None:
    main = _main_file(step)
    if main is None or any(d is None for d in depends):
        return None
    ident = index_cache.identity(main, _KIND)
    if ident is None:
        return None
    digest = hashlib.sha256(json.dumps([_VERSION, SAMPLE, depends]).encode()).hexdigest()
    return main, {**ident, "sha256": digest}


def load_step(step: RunStep, depends: list[str | None]) -> tuple[dict[str, StepSums], dict[str, Any]] | None:
    """The cached sums and values of ``step`` computed against checkpoints of identities ``depends``
    (its own, the previous, the one before, the first), or None."""
    key = _key(step, depends)
    if key is None:
        return None
    got = index_cache.load(key[1])
    if got is None:
        return None
    try:
        data = json.loads(bytes(got[1]))
        sums = {name: StepSums.from_json(dict(v)) for name, v in data["sums"].items()}
        return sums, dict(data["values"])
    except (ValueError, KeyError, TypeError):
        return None


def store_step(step: RunStep, depends: list[str | None], sums: dict[str, StepSums], values: dict[str, Any]) -> bool:
    key = _key(step, depends)
    if key is None:
        return False
    payload = json.dumps({"sums": {n: s.json() for n, s in sums.items()}, "values": values}, separators=(",", ":"))
    return index_cache.store(key[0], key[1], payload.encode(), {"what": "drift sums of one step"})
