"""Reading, checking, writing and comparing manifests (:mod:`...formats.manifest`): a manifest is
found beside a checkpoint (``dcpstudio-manifest.json`` in a directory, ``<file>.manifest.json``
next to a file) or inside it (a safetensors header, a shard set's index); :func:`manifest_findings`
re-hashes the files it lists (a flipped byte, a replaced or swapped file of the same size);
:func:`write_manifest` makes one for any checkpoint (``hash --manifest``); :func:`diff_digests`
says which tensors changed from two manifests alone, reading no tensor data."""

from __future__ import annotations

import hashlib
import json
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...checkpoints.base import Checkpoint
from ...checkpoints.model import dtype_name
from ...errors import CorruptCheckpointError, DCPStudioError
from ...formats.manifest import METADATA_KEY, ZIP_RECORD, Manifest, TensorTap, sidecar_of
from ...io.blocks import BLOCK_BUDGET
from .digests import INLINE, feed_tensor, value_digest

__all__ = ["DigestDiff", "diff_digests", "manifest_findings", "read_manifest", "write_manifest"]

_PIECE = 32 << 20


def read_manifest(path: str | os.PathLike[str]) -> Manifest | None:
    """The manifest of the checkpoint at ``path``, or None; only the manifest's bytes are read."""
    p = Path(path)
    side = sidecar_of(p)
    if side.is_file():
        return Manifest.loads(side.read_text(encoding="utf-8"), str(side))
    index = p / "model.safetensors.index.json" if p.is_dir() else p if p.name.endswith(".index.json") else None
    if index is not None and index.is_file():
        try:
            meta = json.loads(index.read_text(encoding="utf-8")).get("metadata") or {}
        except (ValueError, AttributeError) as e:
            raise CorruptCheckpointError(f"{index}: not JSON ({e})") from None
        text = meta.get(METADATA_KEY) if isinstance(meta, dict) else None
        return Manifest.loads(text, str(index)) if isinstance(text, str) else None
    if p.is_file() and p.suffix == ".safetensors":
        text = _header_manifest(p)
        return Manifest.loads(text, str(p)) if isinstance(text, str) else None
    if p.is_file():
        text = _zip_manifest(p)
        return Manifest.loads(text, str(p)) if isinstance(text, str) else None
    return None


def _zip_manifest(p: Path) -> str | None:
    """Our record in a torch.save archive (under whatever folder it was written), read alone."""
    from ...formats.torchsave.zip import ZipDirectory

    with open(p, "rb") as f:
        if f.read(4) != b"PK\x03\x04":
            return None
        try:
            directory = ZipDirectory(f, str(p))
            rec = directory.find([directory.prefix + ZIP_RECORD]).get(directory.prefix + ZIP_RECORD)
        except DCPStudioError:
            return None
        if rec is None or not rec.stored or rec.size > 256 << 20:
            return None
        f.seek(rec.data_offset)
        data = f.read(rec.size)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _header_manifest(p: Path) -> str | None:
    """Our key in a safetensors header's ``__metadata__``, from the header alone (the data may be gone)."""
    with open(p, "rb") as f:
        head = f.read(8)
        size = int.from_bytes(head, "little") if len(head) == 8 else 0
        if not 0 < size <= 100 << 20:
            return None
        try:
            meta = json.loads(f.read(size)).get("__metadata__") or {}
        except (ValueError, AttributeError, UnicodeDecodeError):
            return None
    text = meta.get(METADATA_KEY) if isinstance(meta, dict) else None
    return text if isinstance(text, str) else None


def _sha256(path: Path, start: int = 0, end: int | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        left = -1 if end is None else end - start
        buf = memoryview(bytearray(_PIECE))
        while left and (n := f.readinto(buf if left < 0 else buf[: min(_PIECE, left)])):
            h.update(buf[:n])
            left -= n if left > 0 else 0
    return h.hexdigest()


def manifest_findings(path: str | os.PathLike[str], manifest: Manifest) -> list[tuple[str, str]]:
    """Every file the manifest lists, re-hashed: missing, resized or changed files are findings;
    one whose bytes are those the manifest lists for another file is named as swapped with it.
    Each is ``(file, what)``."""
    p = Path(path)
    root = p if p.is_dir() else p.parent
    found: list[tuple[str, str]] = []
    files = dict(manifest.files)
    if p.is_file() and len(files) == 1 and not sidecar_of(p).is_file():
        files = {p.name: next(iter(files.values()))}  # a file's own manifest is of it, however renamed
    shas = {(rec.get("sha256") or rec.get("data_sha256")): name for name, rec in files.items()}
    hashed: list[tuple[str, Any, Future[str]]] = []
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="dcpstudio-rehash") as pool:  # files on both cores
        for name, rec in files.items():
            f = root / name
            if not f.is_file():
                found.append((name, "listed in the manifest but missing"))
                continue
            size = f.stat().st_size
            end = rec.get("data_end")
            if ("size" in rec and size != rec["size"]) or (end is not None and size < end):
                said = rec.get("size", f"at least {end}")
                found.append((name, f"{size} bytes, the manifest says {said} (replaced or cut?)"))
                continue
            start, stop = int(rec.get("data_offset", 0)), None if end is None else int(end)
            hashed.append((name, rec.get("sha256") or rec.get("data_sha256"), pool.submit(_sha256, f, start, stop)))
        for name, want, fut in hashed:
            got = fut.result()
            if got != want:
                other = shas.get(got)
                why = "a changed byte or a replaced file"
                if other:
                    why = f"holds what the manifest lists for {other} (swapped?)"
                found.append((name, f"SHA-256 differs from the manifest: {why}"))
    return found


def write_manifest(ckpt: Checkpoint, files: list[Path], *, budget: int = BLOCK_BUDGET) -> Path:
    """Hash every entry of ``ckpt`` (digest and moments) and every one of ``files`` and write the
    manifest beside it (a checkpoint that exists is not rewritten: a safetensors file gets a
    sidecar too). Returns where it went."""
    m = Manifest()
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="dcpstudio-hash") as pool:  # as hash does
        for fqn, entry in ckpt.entries.items():
            if entry.kind != "tensor":
                m.tensors[fqn] = {"digest": value_digest(ckpt.read_value(fqn))}
                continue
            assert entry.dtype is not None
            shape = tuple(entry.shape or ())
            nbytes = math.prod(shape) * entry.dtype.itemsize
            threads = pool if nbytes > INLINE else None  # a small tensor costs more to hand off than to hash
            tap = TensorTap(dtype_name(entry.dtype) or "", shape, pool=threads, total=nbytes)
            feed_tensor(ckpt, fqn, tap.update, budget=budget)
            m.tensors[fqn] = tap.record()
    root = Path(ckpt.path) if Path(ckpt.path).is_dir() else Path(ckpt.path).parent
    for f in files:
        m.files[str(f.relative_to(root))] = {"size": f.stat().st_size, "sha256": _sha256(f)}
    out = sidecar_of(ckpt.path)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(m.dumps(), encoding="utf-8")
    os.replace(tmp, out)
    return out


@dataclass
class DigestDiff:
    """Which tensors differ between two manifests, by name."""

    changed: list[str] = field(default_factory=list)
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    same: int = 0

    @property
    def equal(self) -> bool:
        return not (self.changed or self.only_a or self.only_b)

    def lines(self) -> list[str]:
        out = [f"changed: {n}" for n in self.changed]
        out += [f"only in A: {n}" for n in self.only_a] + [f"only in B: {n}" for n in self.only_b]
        return [*out, f"{'equal' if self.equal else 'different'}: {self.same} same, {len(self.changed)} changed, "
                      f"{len(self.only_a)} only in A, {len(self.only_b)} only in B"]  # fmt: skip

    def json(self) -> dict[str, Any]:
        return {"equal": self.equal, "changed": self.changed, "only_a": self.only_a, "only_b": self.only_b,
                "same": self.same}  # fmt: skip


def diff_digests(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> DigestDiff:
    """Compare the manifests of ``a`` and ``b`` entry by entry; refused when either has none."""
    ma, mb = read_manifest(a), read_manifest(b)
    for path, m in ((a, ma), (b, mb)):
        if m is None:
            raise DCPStudioError(f"{path} has no manifest; write one with `dcpstudio hash --manifest {path}`")
    assert ma is not None and mb is not None
    d = DigestDiff()
    ta = {n: r for n, r in ma.tensors.items() if "dtype" in r}  # tensors: conversions record no values
    tb = {n: r for n, r in mb.tensors.items() if "dtype" in r}
    for name, rec in ta.items():
        other = tb.get(name)
        if other is None:
            d.only_a.append(name)
        elif other.get("digest") != rec.get("digest"):
            d.changed.append(name)
        else:
            d.same += 1
    d.only_b = [n for n in tb if n not in ta]
    return d
