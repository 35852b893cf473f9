"""The floor under every converter: what a conversion returns, where it may write, and the three
streaming writers -- torch.save, DCP, safetensors -- fed with :class:`~...pickles.refs.TensorRef` tensors.

Each writer computes the next tensor's bytes on a helper thread while the current one is written,
copies bytes that lie verbatim in a source file inside the kernel, reports progress per tensor,
and writes into an atomic temporary (see :mod:`...io.atomic`): the destination appears only complete
and fsynced. None of this imports torch; a cast or a non-contiguous view does, when met.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

from ...errors import DCPStudioError, DestinationExistsError
from ...formats.dcp.files import DCPItem, SelfWritten, write_dcp
from ...formats.manifest import MANIFEST_FILE, METADATA_KEY, Manifest
from ...formats.readback import ReadBack
from ...formats.torchsave.writer import archive_name
from ...io.atomic import atomic_into, atomic_output, check_parent, refuse_bucket
from ...io.files import create_file, sync_file
from ...io.raw import Hole
from ...io.remote.locations import RemotePath
from ...pickles.refs import StorageRef, TensorRef
from ...pickles.tensor_io import Payload, tensor_bytes
from ...progress import Reporter
from .computed import castable
from .transform import Transform
from .writers import FileCasts, write_safetensors_file, write_torch_save_file

__all__ = [
    "INDEX_FILE",
    "SUFFIX_TARGETS",
    "TRUST_WARNING",
    "ConversionResult",
    "PayloadHook",
    "Writers",
    "check_paths",
    "check_replaceable",
    "destination_kind",
    "io_error",
    "output_context",
    "storage_payload",
    "write_dcp_output",
    "write_safetensors_output",
    "write_torch_save_output",
    "writes_into",
]

TRUST_WARNING = "trusting pickles in {}: code embedded in the checkpoint can run"
INDEX_FILE = "model.safetensors.index.json"
Target = Literal["dcp", "torch", "safetensors"]
PayloadHook = Callable[[TensorRef], "Payload | Hole"]
"""What a writer takes a tensor's bytes from instead of reading them itself: a distributed
conversion's layout pass returns a :class:`~...io.raw.Hole` for each (and its manifest comes from a
stand-in reader, :class:`~.replay.Replay`, given the ranks' digests)."""


@dataclass(frozen=True)
class ConversionResult:
    """What a conversion wrote."""

    src: Path
    dst: Path
    target: Target
    tensors: int
    values: int
    tensor_bytes: int
    notes: tuple[str, ...] = ()  # what the user should know (also issued as warnings)
    transform: Transform = field(
        default_factory=Transform
    )  # what was kept, renamed and cast: what verifying it looks through


SUFFIX_TARGETS: dict[str, Target] = {
    ".pt": "torch",
    ".pth": "torch",
    ".bin": "torch",
    ".safetensors": "safetensors",
}


def destination_kind(dst: str | os.PathLike[str]) -> Target | Literal["directory", "bare"] | None:
    """What the destination's name asks for: the format its suffix names (:data:`SUFFIX_TARGETS`),
    ``"directory"`` for a trailing separator, ``"bare"`` for a name without a suffix, None for a
    suffix that names no format (``llama-3.1``). Works on URLs too: only the text's last component
    counts."""
    text = os.fspath(dst)
    if text.endswith((os.sep, "/")):
        return "directory"
    suffix = Path(text.replace(os.sep, "/").rsplit("/", 1)[-1]).suffix.lower()
    if not suffix:
        return "bare"
    return SUFFIX_TARGETS.get(suffix)


_KINDS = {"dcp": "a DCP checkpoint", "torch": "a torch.save file", "safetensors": "a safetensors checkpoint"}


def check_paths(src: Any, dst: Any, target: Target | None = None, *, src_format: str | None = None) -> None:
    """The output may not replace or delete the source. It may lie inside a DCP source folder
    (a DCP is the files its ``.metadata`` names: another one there changes nothing), unless it
    is one of them; and a DCP may be written into the folder that holds its source file
    (:func:`writes_into`). Anything else that is, is inside or contains the source is refused.
    ``src_format``: the source's format, as its caller detected it (``None``: not a checkpoint)."""
    s, d = src.resolve(), dst.resolve()
    if s == d:
        raise DCPStudioError(f"destination {dst} is the source; choose another path")
    if s in d.parents and not (src_format == "dcp" and _beside_dcp_files(src, dst)):
        raise DCPStudioError(f"destination {dst} is inside the source {src}; choose another path")
    if d in s.parents and not writes_into(src, dst, target):
        raise DCPStudioError(
            f"destination {dst} contains the source {src}; only a DCP checkpoint can be written into it "
            "(its files added beside the source); choose another path"
        )


def writes_into(src: Any, dst: Any, target: Target | None) -> bool:
    """Whether the output is a DCP written into the existing local folder that holds its source
    file, as torch's ``torch_save_to_dcp(d / "model.pt", d)`` does: files added, none replaced."""
    if target != "dcp" or isinstance(src, RemotePath) or isinstance(dst, RemotePath):
        return False
    return dst.is_dir() and not dst.is_symlink() and dst.resolve() in src.resolve().parents


def _beside_dcp_files(src: Any, dst: Any) -> bool:
    """``dst``, inside the local folder ``src`` (a DCP checkpoint), is none of the files (or their
    folders) that ``src`` consists of."""
    from ...formats.dcp.files import METADATA_FILE, read_light_metadata

    if isinstance(src, RemotePath) or isinstance(dst, RemotePath):
        return False
    d = dst.resolve()
    used = [src / METADATA_FILE]
    if dst.exists() or dst.is_symlink():
        md = read_light_metadata(src)
        used += [src / str(getattr(info, "relative_path", "")) for info in md.storage_data.values()]
    return not any(p.resolve() == d or d in p.resolve().parents for p in used)


def check_replaceable(dst: Path, target: Target, overwrite: bool, src: Any = None) -> None:
    """An existing destination is replaced only with ``overwrite``, and only when it is a checkpoint
    of the target's kind (or an empty folder): never an arbitrary file or folder. A folder that a
    DCP is written into (:func:`writes_into`) is not replaced: ``overwrite`` is needed only when it
    already holds a DCP checkpoint, whose files are then replaced by the new one's. A new local
    output's folder must exist and take files (refused here, before anything is read)."""
    refuse_bucket(dst)
    if src is not None and writes_into(src, dst, target):
        if (dst / ".metadata").exists() and not overwrite:
            raise DestinationExistsError(f"{dst} already holds a DCP checkpoint; pass --overwrite to replace it")
        return
    if not (dst.exists() or dst.is_symlink()):
        if not isinstance(dst, RemotePath):
            check_parent(dst)
        return
    if not overwrite:
        raise DestinationExistsError(f"{dst} already exists; pass --overwrite to replace it")
    if dst.is_dir() and not dst.is_symlink() and not any(dst.iterdir()):
        return
    from ...formats.detect import detect_format

    try:
        found = detect_format(dst)
    except DCPStudioError:
        found = None
    if found != target:
        what = _KINDS[found] if found else "not a checkpoint"
        raise DCPStudioError(
            f"refusing to replace {dst}: it is {what}, not {_KINDS[target]}; remove it yourself or choose another path"
        )


def io_error(dst: Path, e: OSError) -> DCPStudioError:
    return DCPStudioError(f"cannot write {dst}: {e.strerror or e}" + (f" ({e.filename})" if e.filename else ""))


def storage_payload(ref: StorageRef) -> Payload:
    """A whole storage's bytes for a ZIP record: in place with its CRC, or in memory with it."""
    if ref.archive is None:
        raise DCPStudioError(f"storage {ref.key} has no data to write")
    where = ref.archive.storage_range(ref)
    if where is not None and where.crc is not None and where.nbytes == ref.nbytes:
        return where
    whole = TensorRef(ref, ref.dtype, (ref.numel,), (1,))
    return tensor_bytes(whole, need_crc=True)


def output_context(
    dst: Path, overwrite: bool, at: Path | None = None, source: Any = None
) -> AbstractContextManager[Any]:
    """Where a writer writes: ``at`` when its caller publishes the output itself, else an atomic
    temporary beside ``dst`` -- moved into the existing folder ``dst`` when a DCP is written into
    the folder that holds its ``source`` (:func:`writes_into`)."""
    if at is not None:
        return nullcontext(at)
    if source is not None and writes_into(source, dst, "dcp"):
        return atomic_into(dst, overwrite=overwrite, keep=source, sidecars=(MANIFEST_FILE,))
    return atomic_output(dst, overwrite=overwrite)


def _no_manifest(payload: PayloadHook | None, manifest: bool, reader: Callable[[], ReadBack]) -> None:
    if payload is not None and manifest and reader is ReadBack:
        raise ValueError("an output laid out with its tensors' bytes left out cannot be read back for its manifest")


def write_torch_save_output(
    dst: Path,
    overwrite: bool,
    obj: Any,
    reporter: Reporter,
    label: str,
    names: dict[int, str],
    tensors: Sequence[tuple[str, TensorRef]] = (),
    manifest: bool = True,
    *,
    payload: PayloadHook | None = None,
    at: Path | None = None,
    reader: Callable[[], ReadBack] = ReadBack,
) -> None:
    """Stream ``obj`` as a torch.save file: the pickle, then each storage's record -- copied in
    the kernel when its bytes lie in place, else written from memory -- and, for a local file with
    ``manifest``, the digests of ``tensors`` (name, tensor) in a record of its own. ``names`` maps a
    storage's ``id`` to the entry name shown in progress reports. ``payload`` supplies each
    storage's bytes (as a whole tensor over it) instead; ``at``: write there, not atomically at
    ``dst`` (both: a distributed conversion's layout); ``reader``: what reads a local output back
    for its manifest (a layout's stand-in, :class:`~.replay.Replay`, knows what the ranks computed)."""
    _no_manifest(payload, manifest, reader)

    def produce(item: tuple[str, StorageRef]) -> Payload | Hole | TensorRef:
        reporter.check()
        ref = item[1]
        whole = TensorRef(ref, ref.dtype, (ref.numel,), (1,))
        if payload:
            return payload(whole)
        if not isinstance(dst, RemotePath) and castable(whole):
            return whole  # a cast: computed block by block as it is written
        return storage_payload(ref)

    try:
        with output_context(dst, overwrite, at) as tmp, create_file(tmp) as f:
            local = tmp if manifest and isinstance(tmp, Path) else None
            write_torch_save_file(f, local, archive_name(dst), obj, tensors, produce, reporter, label, names, reader)
            sync_file(f)
    except OSError as e:
        raise io_error(dst, e) from e


def write_dcp_output(
    dst: Path,
    overwrite: bool,
    items: Sequence[DCPItem],
    reporter: Reporter,
    label: str,
    *,
    files: int | None = None,
    max_file_size: int | None = None,
    source: Any = None,
    manifest: bool = True,
    payload: PayloadHook | None = None,
    at: Path | None = None,
    reader: Callable[[], ReadBack] = ReadBack,
) -> None:
    """Write ``items`` as a single-process DCP checkpoint at ``dst`` (in ``files`` data files, or
    files of at most ``max_file_size``; one by default) -- into ``dst`` beside ``source`` when
    :func:`writes_into` says so. ``payload``, ``at``: as for :func:`write_torch_save_output`."""
    _no_manifest(payload, manifest, reader)
    casts = FileCasts(reporter)

    def produce(t: TensorRef) -> Payload | Hole | SelfWritten:
        reporter.check()
        if payload:
            return payload(t)
        if not isinstance(dst, RemotePath) and castable(t):  # computed block by block as it is written
            return partial(casts.write, t)
        return tensor_bytes(t, need_crc=True)

    def on_item(item: DCPItem) -> None:
        reporter.advance(item.tensor.nbytes if item.tensor is not None else 0, current=item.fqn)

    try:
        with output_context(dst, overwrite, at, source) as tmp, casts:
            write_dcp(
                tmp,
                items,
                produce,  # type: ignore[arg-type]
                checkpoint_id=str(dst),
                on_item=on_item,
                label=label,
                files=files,
                max_file_size=max_file_size,
                manifest=Manifest() if manifest else None,
                reader=reader,
            )
    except OSError as e:
        raise io_error(dst, e) from e


def write_safetensors_output(
    dst: Path,
    overwrite: bool,
    shards: Sequence[Sequence[tuple[str, TensorRef]]],
    metadata: dict[str, str],
    reporter: Reporter,
    label: str,
    *,
    single_file: bool,
    manifest: bool = True,
    payload: PayloadHook | None = None,
    at: Path | None = None,
    reader: Callable[[], ReadBack] = ReadBack,
) -> None:
    """One safetensors file (``single_file``), or a directory of shards with
    ``model.safetensors.index.json``; each shard is ``(name, tensor)`` in order. ``payload``,
    ``at``: as for :func:`write_torch_save_output`."""
    _no_manifest(payload, manifest, reader)

    def produce(item: tuple[str, TensorRef]) -> Payload | Hole | TensorRef:
        reporter.check()
        if payload:
            return payload(item[1])
        if not isinstance(dst, RemotePath) and castable(item[1]):
            return item[1]  # a cast: computed block by block as it is written
        return tensor_bytes(item[1], need_crc=False)

    try:
        with output_context(dst, overwrite, at) as tmp:
            if single_file:
                files = [(tmp, shards[0])]
            else:
                tmp.mkdir()
                n = len(shards)
                files = [
                    (tmp / ("model.safetensors" if n == 1 else f"model-{k:05d}-of-{n:05d}.safetensors"), s)
                    for k, s in enumerate(shards, 1)
                ]
            whole: Manifest | None = Manifest() if manifest else None
            for path, shard in files:
                part = write_safetensors_file(
                    path, shard, metadata, produce, reporter, label, manifest=manifest, reader=reader
                )
                if whole is not None and part is not None:
                    whole.tensors.update(part.tensors)
                    whole.files.update(part.files)
                else:
                    whole = None
            if not single_file:
                total = sum(t.nbytes for shard in shards for _, t in shard)
                index = {
                    "metadata": {"total_size": total, **({METADATA_KEY: whole.dumps()} if whole is not None else {})},
                    "weight_map": {name: path.name for path, shard in files for name, _ in shard},
                }
                with create_file(tmp / INDEX_FILE) as index_file:
                    index_file.write(json.dumps(index, indent=2).encode())
                    sync_file(index_file)
    except OSError as e:
        raise io_error(dst, e) from e


@dataclass(frozen=True)
class Writers:
    """Where a conversion's output goes: the three writers :func:`~.convert.convert` hands what it
    planned. The default writes it; a distributed conversion passes its own (it lays the output out
    once, then its ranks write the bytes)."""

    torch_save: Callable[..., None] = write_torch_save_output
    dcp: Callable[..., None] = write_dcp_output
    safetensors: Callable[..., None] = write_safetensors_output
