"""One safetensors file written with its manifest (:mod:`...formats.manifest`) in its header: the
bytes copied in the kernel, read back from the page cache on worker threads for each tensor's
digest and moments and the data section's SHA-256 (:class:`...formats.readback.ReadBack`), and the
header's reserved room then receives the manifest -- no second pass over the source."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from ...dtypes import DType
from ...formats.manifest import METADATA_KEY, Manifest
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
) -> Manifest | None:
    """Write ``shard`` to ``path``; the source's ``metadata`` keys are kept and ours added beside
    (a stale manifest of ours in them is replaced). Returns the file's manifest -- None for a
    remote object: its header goes first and an upload cannot seek back to fill it in, and
    knowing the digests before the bytes would take a second pass (``hash --manifest`` writes one)."""
    specs = [(name, t.dtype, t.shape) for name, t in shard]
    kept = {k: v for k, v in metadata.items() if k != METADATA_KEY}
    if isinstance(path, Path):
        reserve = Manifest.reserve([(n, d.name, tuple(s)) for n, d, s in specs], [path.name])
        return _write_read_back(path, shard, specs, kept, reserve, produce, reporter, label)
    with create_file(path) as f:
        writer = SafetensorsWriter(f, specs, kept)
        for (name, t), data in prefetch(produce, shard):
            if isinstance(data, FileRange):
                writer.copy(name, data, f"{label} ({name})")
            else:
                writer.write(name, data[0])
            reporter.advance(t.nbytes, current=name)
        writer.finish()
    return None


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
        writer = SafetensorsWriter(f, specs, metadata, reserve=reserve + 64)
        file = back.file(path, start=f.tell())
        for (name, t), data in prefetch(produce, shard):
            at = f.tell()
            if isinstance(data, FileRange):
                writer.copy(name, data, f"{label} ({name})")
            else:
                writer.write(name, data[0])
            back.tensor(file, f, at, t.nbytes, t.dtype.name, tuple(t.shape), part.tensors, name)
            reporter.advance(t.nbytes, current=name)
        back.advance(file, f)
        sync_file(f)  # the data on its way to the disk while it is hashed
        back.wait()
        record = back.records()[path.name]
        part.files[path.name] = {"size": f.tell(), "data_offset": file.start, "data_sha256": record["sha256"]}
        writer.set_metadata(METADATA_KEY, part.dumps())
        writer.finish()
    return part
