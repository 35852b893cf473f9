"""One safetensors file written with its manifest (:mod:`...formats.manifest`) in its header:
each tensor's bytes pass through a :class:`TensorTap` on their way to the file, the data section
through SHA-256, and the header's reserved room then receives the manifest -- no second pass."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from ...dtypes import DType
from ...formats.manifest import METADATA_KEY, HashingFile, Manifest, TensorTap, tapped
from ...formats.readback import ReadBack
from ...formats.safetensors import SafetensorsWriter
from ...io.files import create_file, sync_file
from ...io.pipeline import prefetch
from ...io.raw import FileRange
from ...pickles.refs import TensorRef
from ...pickles.tensor_io import Payload
from ...progress import Reporter

__all__ = ["write_safetensors_file"]


def write_safetensors_file(
    path: Path,
    shard: Sequence[tuple[str, TensorRef]],
    metadata: dict[str, str],
    produce: Callable[[tuple[str, TensorRef]], Payload],
    reporter: Reporter,
    label: str,
) -> Manifest:
    """Write ``shard`` to ``path``; the source's ``metadata`` keys are kept and ours added beside
    (a stale manifest of ours in them is replaced). Returns the file's manifest."""
    specs = [(name, t.dtype, t.shape) for name, t in shard]
    reserve = Manifest.reserve([(n, d.name, tuple(s)) for n, d, s in specs], [path.name])
    part = Manifest()
    if isinstance(path, Path):
        return _write_read_back(path, shard, specs, metadata, reserve, produce, reporter, label)
    with create_file(path) as raw:
        f = HashingFile(raw)
        kept = {k: v for k, v in metadata.items() if k != METADATA_KEY}
        writer = SafetensorsWriter(f, specs, kept, reserve=reserve + 64)
        f.restart()
        for (name, t), data in prefetch(produce, shard):
            tap = TensorTap(t.dtype.name, tuple(t.shape))
            body = data if isinstance(data, FileRange) else data[0]
            writer.stream(name, t.nbytes, tapped(body, tap, f"{label} ({name})"))
            part.tensors[name] = tap.record()
            reporter.advance(t.nbytes, current=name)
        part.files[path.name] = {"size": f.tell(), "data_offset": f.start, "data_sha256": f.sha256()}
        writer.set_metadata(METADATA_KEY, part.dumps())
        writer.finish()
    return part


def _write_read_back(
    path: Path,
    shard: Sequence[tuple[str, TensorRef]],
    specs: list[tuple[str, DType, tuple[int, ...]]],
    metadata: dict[str, str],
    reserve: int,
    produce: Callable[[tuple[str, TensorRef]], Payload],
    reporter: Reporter,
    label: str,
) -> Manifest:
    """A local file: the bytes copied in the kernel and the manifest read back from the file
    (:class:`ReadBack`) while it is written and fsynced; then the header's room receives it."""
    part = Manifest()
    with create_file(path) as f, ReadBack() as back:
        kept = {k: v for k, v in metadata.items() if k != METADATA_KEY}
        writer = SafetensorsWriter(f, specs, kept, reserve=reserve + 64)
        file = back.file(path, start=f.tell())
        for (name, t), data in prefetch(produce, shard):
            at = f.tell()
            if isinstance(data, FileRange):
                writer.copy(name, data, f"{label} ({name})")
            else:
                writer.write(name, data[0])
            back.tensor(file, f, at, t.nbytes, TensorTap(t.dtype.name, tuple(t.shape)), part.tensors, name)
            reporter.advance(t.nbytes, current=name)
        back.advance(file, f)
        sync_file(f)  # the data on its way to the disk while it is hashed
        back.wait()
        record = back.records()[path.name]
        part.files[path.name] = {"size": f.tell(), "data_offset": file.start, "data_sha256": record["sha256"]}
        writer.set_metadata(METADATA_KEY, part.dumps())
        writer.finish()
    return part
