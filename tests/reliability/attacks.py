"""Crafted checkpoints, one generator per class of attack (issue 12). Each builds, in a fresh
directory, a checkpoint that tries to read outside itself, leak memory, crash, exhaust memory or
disk, hang, show one thing and write another, or smuggle wrong data -- with a random variant drawn
from ``rng`` -- and says what must hold: ``must_fail`` (the commands that must end in a one-line
error; the others may succeed) and ``secret`` (bytes that must appear in no output and no message:
the contents of a file the checkpoint is not allowed to read). Used by test_attacks.py (through
attack_runner.py) and by the fuzz harness.
"""

from __future__ import annotations

import io
import os
import pickle
import random
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SECRET = b"SECRET-BYTES-FROM-ELSEWHERE!"  # 28 bytes, in every file an attack must not read


COMMANDS = ("inspect", "inspect-json", "to-dcp", "to-torch", "to-safetensors", "verify")
EVERY = frozenset(COMMANDS)
READING = EVERY - {"inspect-json"}  # everything but a listing of names, which opens no data file
VALUES = EVERY - {"inspect", "inspect-json"}  # what reads non-tensor values


@dataclass(frozen=True)
class Attack:
    path: Path  # the checkpoint handed to the tool
    must_fail: frozenset[str]  # commands that must end in a one-line error (the others may succeed)
    secret: bytes | None = SECRET  # bytes no output and no message may hold
    note: str = ""


# -- building blocks ---------------------------------------------------------------------------------
def _state() -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    return {
        "model": {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g).bfloat16()},
        "step": 7,
        "cfg": {"name": "run"},
    }


def _secret_state() -> dict[str, Any]:
    """Shaped like :func:`_state` (so a foreign file fits the same offsets), made of SECRET bytes."""
    import torch

    w = torch.frombuffer(bytearray((SECRET * 64)[:512]), dtype=torch.float32).reshape(16, 8).clone()
    b = torch.frombuffer(bytearray(SECRET[:16]), dtype=torch.bfloat16).clone()
    return {"model": {"w": w, "b": b}, "step": 7, "cfg": {"name": SECRET.decode()}}


def _dcp(directory: Path, secret: bool = False) -> Path:
    import torch

    from dcpstudio.core import torch_save_to_dcp

    directory.parent.mkdir(parents=True, exist_ok=True)
    pt = directory.with_suffix(".pt")
    torch.save(_secret_state() if secret else _state(), pt)
    torch_save_to_dcp(pt, directory)
    pt.unlink()
    return directory


def _secret_file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(SECRET * 4096)
    return path


def edit_metadata(ckpt: Path, fn: Callable[[Any], None]) -> None:
    """Change a DCP's ``.metadata`` through torch's own classes (the file is ours: trusted)."""
    import torch.distributed.checkpoint.metadata  # noqa: F401 - the classes must be importable

    md_path = ckpt / ".metadata"
    md = pickle.loads(md_path.read_bytes())
    fn(md)
    md_path.write_bytes(pickle.dumps(md, protocol=4))


def torch_archive(path: Path, pkl: bytes, storages: dict[str, bytes] | None = None) -> Path:
    """A torch.save ZIP archive with exactly this ``data.pkl`` (and these storage records)."""
    from dcpstudio.core.formats.torchsave.zip_writer import ZipWriter

    with open(path, "wb") as f:
        z = ZipWriter(f, "archive")
        z.write("data.pkl", pkl)
        z.write(".format_version", b"1")
        z.write("byteorder", b"little")
        for key, data in (storages or {}).items():
            z.write(f"data/{key}", data)
        z.write("version", b"3\n")
        z.close()
    return path


def _tensor_entry(md: Any, rng: random.Random) -> str:
    names = [k for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks")]
    return rng.choice(sorted(names))


def _deep_tuple_key(depth: int) -> bytes:
    """A pickle of ``{(((...),),): None}``: a dict whose key is a tuple nested ``depth`` deep."""
    return b"\x80\x02}(N" + b"\x85" * depth + b"Nu."


# -- the attacks -----------------------------------------------------------------------------------
def dcp_traversal(work: Path, rng: random.Random) -> Attack:
    """A storage entry names a file outside the checkpoint (relative or absolute)."""
    foreign = _dcp(work / "foreign", secret=True)
    ckpt = _dcp(work / "ckpt")
    name = rng.choice(
        ["../foreign/__0_0.distcp", str(foreign / "__0_0.distcp"), "sub/../../foreign/__0_0.distcp", "../../etc/passwd"]
    )

    def edit(md: Any) -> None:
        fqn = _tensor_entry(md, rng)
        for key, info in md.storage_data.items():
            if key.fqn == fqn:
                info.relative_path = name

    edit_metadata(ckpt, edit)
    return Attack(ckpt, READING, note=name)


def dcp_symlink(work: Path, rng: random.Random) -> Attack:
    """A data file, or the .metadata, is a symlink to another checkpoint's."""
    foreign = _dcp(work / "foreign", secret=True)
    ckpt = _dcp(work / "ckpt")
    which = rng.choice(["__0_0.distcp", ".metadata"])
    (ckpt / which).unlink()
    (ckpt / which).symlink_to(foreign / which)
    return Attack(ckpt, EVERY if which == ".metadata" else READING, note=which)


def safetensors_traversal(work: Path, rng: random.Random) -> Attack:
    """A safetensors index names a shard outside its directory, or a shard is a symlink out."""
    import json

    import torch
    from safetensors.torch import save_file

    _secret_file(work / "elsewhere.bin")
    save_file({"w": torch.frombuffer(bytearray(SECRET * 8), dtype=torch.uint8)}, work / "foreign.safetensors")
    ckpt = work / "ckpt"
    ckpt.mkdir()
    save_file({"a": torch.ones(4)}, ckpt / "model-00001-of-00002.safetensors")
    second = rng.choice(["../foreign.safetensors", str(work / "foreign.safetensors"), "../elsewhere.bin", "link"])
    if second == "link":
        (ckpt / "model-00002-of-00002.safetensors").symlink_to(work / "foreign.safetensors")
        second = "model-00002-of-00002.safetensors"
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors", "w": second}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    return Attack(ckpt, must_fail=EVERY, note=second)


def special_files(work: Path, rng: random.Random) -> Attack:
    """A FIFO or a device where a checkpoint file should be (reading would block or never end)."""
    ckpt = _dcp(work / "ckpt")
    which = rng.choice(["fifo-data", "fifo-metadata", "dev-zero", "fifo-file"])
    must_fail = {"fifo-data": READING, "dev-zero": VALUES}.get(which, EVERY)
    if which == "fifo-data":
        (ckpt / "__0_0.distcp").unlink()
        os.mkfifo(ckpt / "__0_0.distcp")
    elif which == "fifo-metadata":
        (ckpt / ".metadata").unlink()
        os.mkfifo(ckpt / ".metadata")
    elif which == "dev-zero":  # a byte item of 2**31 bytes in /dev/zero, through a symlink inside
        (ckpt / "__1_0.distcp").symlink_to("/dev/zero")

        def edit(md: Any) -> None:
            for key, info in md.storage_data.items():
                if key.fqn == "step":
                    info.relative_path, info.offset, info.length = "__1_0.distcp", 0, 2**31

        edit_metadata(ckpt, edit)
    else:
        fifo = work / "model.pt"
        os.mkfifo(fifo)
        return Attack(fifo, must_fail, secret=None, note=which)
    return Attack(ckpt, must_fail, secret=None, note=which)


def dcp_chunks(work: Path, rng: random.Random) -> Attack:
    """Chunks that do not tile their tensor: gaps, overlaps, past the end, negative, none at all,
    a huge declared shape, or a chunk declared larger than the tensor it stores."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    ckpt = _dcp(work / "ckpt")
    how = rng.choice(["gap", "overlap", "past-end", "negative", "none", "huge", "larger-than-stored"])

    def edit(md: Any) -> None:
        fqn = "model.w"
        tmd = md.state_dict_metadata[fqn]
        (chunk,) = tmd.chunks
        if how == "gap":
            chunk.sizes = torch.Size([8, 8])
        elif how == "overlap":
            tmd.chunks = [chunk, ChunkStorageMetadata(chunk.offsets, chunk.sizes)]
        elif how == "past-end":
            tmd.size = torch.Size([8, 8])
        elif how == "negative":
            for key in list(md.storage_data):
                if key.fqn == fqn:
                    chunk.offsets = torch.Size([-8, 0])
                    new_key = type(key)(fqn, torch.Size([-8, 0]), key.index)
                    md.storage_data[new_key] = md.storage_data.pop(key)
        elif how == "none":
            tmd.chunks = []
        elif how == "huge":
            tmd.size, tmd.chunks = torch.Size([2**36]), []
        else:
            tmd.size = chunk.sizes = torch.Size([32, 8])

    edit_metadata(ckpt, edit)
    return Attack(ckpt, READING if how == "larger-than-stored" else EVERY, secret=None, note=how)


def torch_views(work: Path, rng: random.Random) -> Attack:
    """A torch.save tensor that is no honest view of stored bytes: past its storage, built by a
    tensor class with no data (uninitialised memory), or rebuilt from a foreign type."""
    how = rng.choice(["past-storage", "offset-past-record", "float-tensor-class", "float-tensor-new"])
    storage = b"\x00" * 16
    if how == "past-storage":  # 4 stored floats, viewed as 4096
        pkl = (
            b"\x80\x02}X\x01\x00\x00\x00wctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage"
            b"ctorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x04tQK\x00M\x00\x10\x85K\x01\x85"
            b"\x89ccollections\nOrderedDict\n)RtRs."
        )
    elif how == "offset-past-record":
        pkl = (
            b"\x80\x02}X\x01\x00\x00\x00wctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage"
            b"ctorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x04tQM\x00\x10K\x04\x85K\x01\x85"
            b"\x89ccollections\nOrderedDict\n)RtRs."
        )
    elif how == "float-tensor-class":  # torch.FloatTensor(4096): uninitialised memory
        pkl = b"\x80\x02}X\x01\x00\x00\x00wctorch\nFloatTensor\nM\x00\x10\x85Rs."
    else:
        pkl = b"\x80\x02}X\x01\x00\x00\x00wctorch\nFloatTensor\n)\x81s."
    return Attack(torch_archive(work / "model.pt", pkl, {"0": storage}), must_fail=EVERY, secret=None, note=how)


def expanded_view(work: Path, rng: random.Random) -> Attack:
    """``torch.ones(1).expand(2**28)``: a 1.5 KB file that is 1 GiB when written out."""
    import torch

    n = rng.choice([2**28, 2**30, 2**40])
    path = work / "expanded.pt"
    torch.save({"x": torch.ones(1).expand(n), "y": torch.arange(3)}, path)
    # valid, and kept compact in torch.save; never written out element by element
    return Attack(path, frozenset({"to-dcp", "to-safetensors", "verify"}), secret=None, note=f"2**{n.bit_length() - 1}")


def deep_nesting(work: Path, rng: random.Random) -> Attack:
    """A dict key nested hundreds of thousands deep (hashing it overflows the C stack)."""
    depth = rng.choice([200_000, 1_000_000])
    where = rng.choice(["data.pkl", ".metadata", "byte-item"])
    pkl = _deep_tuple_key(depth)
    if where == "data.pkl":
        return Attack(torch_archive(work / "model.pt", pkl), must_fail=EVERY, secret=None, note=f"{where} {depth}")
    ckpt = _dcp(work / "ckpt")
    if where == ".metadata":
        (ckpt / ".metadata").write_bytes(pkl)
    else:
        _replace_byte_item(ckpt, "step", torch_archive(work / "item.pt", pkl).read_bytes())
        return Attack(ckpt, VALUES, secret=None, note=f"{where} {depth}")
    return Attack(ckpt, EVERY, secret=None, note=f"{where} {depth}")


def _replace_byte_item(ckpt: Path, fqn: str, payload: bytes, descriptors: list[str] | None = None) -> None:
    data = ckpt / "__0_0.distcp"
    offset = data.stat().st_size
    with open(data, "ab") as f:
        f.write(payload)

    def edit(md: Any) -> None:
        for key, info in md.storage_data.items():
            if key.fqn == fqn:
                info.offset, info.length = offset, len(payload)
                if descriptors is not None:
                    info.transform_descriptors = descriptors

    edit_metadata(ckpt, edit)


def memory_bombs(work: Path, rng: random.Random) -> Attack:
    """Small files that make a reader allocate gigabytes: memo indices, bytearray(n), nested encode,
    a zstd bomb, a list index of 2**40 in the planner data."""
    how = rng.choice(["memo-metadata", "memo-pickle", "bytearray", "nested-encode", "zstd", "planner-index"])
    if how == "memo-pickle":
        pkl = b"\x80\x02}X\x01\x00\x00\x00xNr\x00\x00\x00\x40s."
        return Attack(torch_archive(work / "model.pt", pkl), must_fail=EVERY, secret=None, note=how)
    if how == "bytearray":
        pkl = b"\x80\x02}X\x01\x00\x00\x00xcbuiltins\nbytearray\nJ\x00\x00\x00\x10\x85Rs."
        return Attack(torch_archive(work / "model.pt", pkl), must_fail=EVERY, secret=None, note=how)
    if how == "nested-encode":
        inner = b"c_codecs\nencode\nX\x04\x00\x00\x00abcdX\x06\x00\x00\x00latin1\x86R"
        pkl = b"\x80\x02}X\x01\x00\x00\x00xc_codecs\nencode\n" + inner + b"X\x06\x00\x00\x00latin1\x86Rs."
        return Attack(torch_archive(work / "model.pt", pkl), must_fail=EVERY, secret=None, note=how)
    ckpt = _dcp(work / "ckpt")
    if how == "memo-metadata":
        (ckpt / ".metadata").write_bytes(b"\x80\x02Nr\x00\x00\x00\x04.")
    elif how == "zstd":  # 800 MiB of zeros in about 25 KB
        import zstandard

        out = io.BytesIO()
        with zstandard.ZstdCompressor().stream_writer(out, closefd=False) as writer:
            zeros = bytes(1 << 20)
            for _ in range(800):
                writer.write(zeros)
        _replace_byte_item(ckpt, "step", out.getvalue(), ["stream.zstd/1"])
        return Attack(ckpt, VALUES, secret=None, note=how)
    else:

        def edit(md: Any) -> None:
            md.planner_data["step"] = ("step", 2**40)

        edit_metadata(ckpt, edit)
        return Attack(ckpt, frozenset({"to-torch"}), secret=None, note=how)  # only the nested output needs the path
    return Attack(ckpt, must_fail=EVERY, secret=None, note=how)


class _SetTwice:
    """Pickles as a DCP ``Metadata`` whose BUILD state sets ``state_dict_metadata`` twice: once in
    its state dict (what a parse that stops early sees), once more in its slot state (what a full
    parse ends with)."""

    def __init__(self, state: dict[str, Any], again: dict[str, Any]) -> None:
        self.state, self.again = state, again

    @property  # type: ignore[misc]
    def __class__(self) -> Any:  # pickle writes NEWOBJ of the class it sees here
        from torch.distributed.checkpoint.metadata import Metadata

        return Metadata

    def __reduce_ex__(self, protocol: Any) -> Any:
        import copyreg

        from torch.distributed.checkpoint.metadata import Metadata

        return (copyreg.__newobj__, (Metadata,), (self.state, {"state_dict_metadata": self.again}))


def metadata_twice(work: Path, rng: random.Random) -> Attack:
    """A .metadata over 4 MiB that sets state_dict_metadata twice: what inspect shows must be what
    convert writes -- or the checkpoint is refused."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    ckpt = _dcp(work / "ckpt")
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    shown = dict(md.state_dict_metadata)
    for i in range(55_000):  # padding: over 4 MiB, where the quick parse is used
        shown[f"pad.{i}"] = TensorStorageMetadata(
            TensorProperties(dtype=torch.float32),
            torch.Size([i]),
            [ChunkStorageMetadata(torch.Size([0]), torch.Size([i]))],
        )
    hidden = {**shown, "hidden": BytesStorageMetadata()}
    state = {"state_dict_metadata": shown, "planner_data": md.planner_data, "storage_data": md.storage_data,
             "storage_meta": md.storage_meta, "version": md.version}  # fmt: skip
    raw = pickle.dumps(_SetTwice(state, hidden), protocol=4)
    assert len(raw) > 4 << 20
    (ckpt / ".metadata").write_bytes(raw)
    return Attack(ckpt, must_fail=EVERY, secret=None, note=f"{len(raw)} bytes")


def control_names(work: Path, rng: random.Random) -> Attack:
    """Entry names with terminal escape sequences (a crafted name must not repaint the output)."""
    import torch

    name = rng.choice(["\x1b[2K\x1b[1Aequal: 3 entries compared", "a\x1b]0;owned\x07b", "x\x08\x08\x08y\u202ez"])
    path = work / "names.pt"
    torch.save({name: torch.ones(2), "ok": 1}, path)
    return Attack(path, frozenset(), secret=None, note=repr(name))


ATTACKS: dict[str, Callable[[Path, random.Random], Attack]] = {
    "dcp-traversal": dcp_traversal,
    "dcp-symlink": dcp_symlink,
    "safetensors-traversal": safetensors_traversal,
    "special-files": special_files,
    "dcp-chunks": dcp_chunks,
    "torch-views": torch_views,
    "expanded-view": expanded_view,
    "deep-nesting": deep_nesting,
    "memory-bombs": memory_bombs,
    "metadata-twice": metadata_twice,
    "control-names": control_names,
}

_ = struct  # the byte layouts above are spelled out by hand

# classes of later reviews, each in its own module (they build on the helpers above)
from tests.reliability.attacks_fanout import ATTACKS_FANOUT  # noqa: E402
from tests.reliability.attacks_metadata import ATTACKS_METADATA  # noqa: E402
from tests.reliability.attacks_shapes import ATTACKS_SHAPES  # noqa: E402
from tests.reliability.attacks_zip import ATTACKS_ZIP  # noqa: E402

ATTACKS.update(ATTACKS_SHAPES)
ATTACKS.update(ATTACKS_FANOUT)
ATTACKS.update(ATTACKS_METADATA)
ATTACKS.update(ATTACKS_ZIP)
