"""A trusted pickle's tensor subclasses (torchao's ``Float8Tensor``…) turned into plain entries.

Two readings, both under ``--trust-pickle`` only (the second runs the package's code):

* by default, the subclass's inner tensors under its name: ``W.qdata``, ``W.scale`` -- the
  stored bytes as they are, each the file's own view (:class:`~..pickles.refs.TensorRef`);
* with ``dequantize``, ``W`` itself as the tensor its ``dequantize()`` gives, in the outer dtype
  and shape the pickle declares, held as a one-tensor in-memory archive so every reader and writer
  treats it as any other entry.

Untrusted, a subclass stays one listed entry that is refused by name where its value is needed.
"""

from __future__ import annotations

import io
from typing import Any

from ..errors import CorruptCheckpointError, DCPStudioError, UnsupportedFormatError
from ..formats.torchsave.archive import TorchSaveFile
from ..pickles.subclass import SubclassRef
from ..pickles.tensor_io import materialize
from .base import _read

__all__ = ["Item", "dcp_subclass", "expand_subclass", "refuse_subclass"]

Item = tuple[str, Any, tuple[str | int, ...], TorchSaveFile | None]


def expand_subclass(
    fqn: str, ref: SubclassRef, path: tuple[str | int, ...], dequantize: bool, label: str
) -> list[Item]:
    """The entries that stand for ``ref`` (named ``fqn`` at ``path``): ``(name, value, path, file)``;
    ``file`` None means the value is the source file's own."""
    if ref.cls is None:
        return [(fqn, ref, path, None)]
    if not dequantize:
        return [(f"{fqn}.{k}", t, (*path[:-1], f"{path[-1]}.{k}"), None) for k, t in ref.tensors()]
    import torch

    values = {k: materialize(t).clone() for k, t in ref.tensors()}
    try:
        dense = ref.dequantize(values)
    except DCPStudioError as e:
        raise UnsupportedFormatError(f"{label}: {fqn!r} is {e}") from e
    except Exception as e:  # trusted code: anything
        text = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise CorruptCheckpointError(f"{label}: {fqn!r} ({ref.kind}) could not be dequantized: {text}") from e
    buf = io.BytesIO()
    torch.save({"t": dense}, buf)
    archive = TorchSaveFile(io.BytesIO(buf.getvalue()), label=f"{label} ({fqn!r} dequantized)")
    return [(fqn, archive.obj["t"], path, archive)]


def dcp_subclass(raw: bytes, label: str, trust: bool) -> str | None:
    """What a DCP tensor item holds when it stores fewer bytes than its metadata declares: torch's
    writer ``torch.save``s each tensor item as it is, so a subclass's item is an archive of its inner
    tensors under the outer dtype and shape (``dcp.load`` copies it only into a like-quantized model).
    A one-line refusal naming the subclass, or None when the item is no subclass (damage)."""
    try:
        obj = TorchSaveFile(io.BytesIO(raw), trust_pickle=trust, label=label).obj
    except (CorruptCheckpointError, UnsupportedFormatError):
        return None
    if not isinstance(obj, SubclassRef):
        return None
    return (
        f"{label} is {obj.reason}, which DCP stores as its inner tensors under the declared "
        f"{obj.dtype.name} {list(obj.shape)}; dcp.load reads it only into a {obj.kind.split()[0]}-quantized model "
        "(convert its torch.save form instead), or leave it out with --exclude"
    )


def refuse_subclass(files: Any, path: Any, fqn: str, c: Any, trust: bool) -> None:
    """A DCP chunk ``c`` shorter than declared that is a tensor subclass's archive is refused by
    name (:func:`dcp_subclass`), not as damage; ``files``: the checkpoint's open data files."""
    label, offset, length = f"{path / (c.file or '')} ({fqn!r})", c.offset or 0, c.length or 0
    if offset + length <= files.size(c.file or ""):
        raw = bytes(_read(files.get(c.file or ""), offset, length, label))
        if (message := dcp_subclass(raw, label, trust)) is not None:
            raise UnsupportedFormatError(message)
