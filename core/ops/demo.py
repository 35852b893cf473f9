"""Synthetic checkpoints: the demo shown to new users and the benchmark's llama-like model.

Neither writing the demo nor finding it needs PyTorch (seconds to import): it is written by our
own torch.save and DCP writers, once; later, the window opens it from its folder when
:func:`written_demo` finds it unchanged since :func:`write_demo` stamped it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["demo_dir", "llama_like_state_dict", "write_demo", "written_demo"]

DEMO_VERSION = 2  # raise when _demo_state_dict changes: stamps of another version are rewritten
_STAMP = ".demo-stamp.json"


def demo_dir() -> Path:
    """Where ``dcpstudio demo`` writes its files: ``$XDG_DATA_HOME/dcpstudio/demo``."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "dcpstudio" / "demo"


def _llama_sizes(total_bytes: int, layers: int = 12) -> tuple[int, int, int]:
    """Layers, width and MLP width of a llama-like model of about ``total_bytes`` in bf16."""
    # per layer: 4 attention d*d + 3 mlp d*(8d/3) (bf16) = 12 d^2 * 2 bytes; plus 2 d^2 for emb/out
    dim = max(64, int((total_bytes / (2 * (12 * layers + 4))) ** 0.5) // 64 * 64)
    return layers, dim, dim * 8 // 3 // 64 * 64 or 64


def _llama_model(
    layers: int, dim: int, hidden: int, mat: Callable[[int, int], Any], ones: Callable[[int], Any]
) -> dict[str, Any]:
    """A llama-like model's entries but its output matrix, in order: matrices made by ``mat(rows,
    cols)`` (drawn in this order: the layout of :func:`llama_like_state_dict` and of the demo),
    norms by ``ones(n)``. The vocabulary is ``dim`` wide."""
    model: dict[str, Any] = {"tok_embeddings.weight": mat(dim, dim)}
    for i in range(layers):
        p = f"layers.{i}."
        for name in ("wq", "wk", "wv", "wo"):
            model[p + f"attention.{name}.weight"] = mat(dim, dim)
        model[p + "feed_forward.w1.weight"] = mat(hidden, dim)
        model[p + "feed_forward.w2.weight"] = mat(dim, hidden)
        model[p + "feed_forward.w3.weight"] = mat(hidden, dim)
        model[p + "attention_norm.weight"] = ones(dim)
        model[p + "ffn_norm.weight"] = ones(dim)
    model["norm.weight"] = ones(dim)
    return model


def llama_like_state_dict(total_bytes: int, *, seed: int = 0) -> dict[str, Any]:
    """A training checkpoint shaped like a small llama: bf16 matrices, fp32 norms, step counter.

    Layer width is chosen so the whole is about ``total_bytes`` with ~100 tensors (8 per layer
    plus embeddings); the largest tensor is the embedding / output matrix.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    layers, dim, hidden = _llama_sizes(total_bytes)
    vocab = dim

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen, dtype=torch.float32).to(torch.bfloat16)

    model = _llama_model(layers, dim, hidden, mat, torch.ones)
    model["output.weight"] = mat(vocab, dim)
    return {"model": model, "step": 1000, "config": {"dim": dim, "layers": layers, "name": "llama-like"}}


def _demo_state_dict(seed: int = 0) -> tuple[dict[str, Any], dict[int, bytes]]:
    """The demo as torch.save would pickle it, built without torch: a small llama's shapes (those of
    ``llama_like_state_dict(8 MiB)``), normal bf16 weights, fp32 norms, a step counter and Adam-like
    optimizer state for four weights; the output matrix tied to the embedding (one storage). Returns
    the object of :class:`TensorRef` s and each storage's bytes (by ``id`` of its StorageRef).

    Weights are windows at random offsets into one pool of normal samples (truncated to bf16): a
    per-element Python loop over the 2.3 M values would take seconds, this takes a tenth."""
    import random
    import sys
    from array import array

    from ..dtypes import DTYPES
    from ..pickles.refs import StorageRef, TensorRef

    rng = random.Random(seed)
    pool = array("f", [rng.gauss(0.0, 1.0) for _ in range(1 << 16)]).tobytes()
    high = (2, 3) if sys.byteorder == "little" else (0, 1)  # the upper half of each float32: its bf16
    normal = bytearray(len(pool) // 2)
    normal[0::2], normal[1::2] = pool[high[0] :: 4], pool[high[1] :: 4]
    normal *= 2  # a window may wrap around
    data: dict[int, bytes] = {}

    def tensor(dtype: str, shape: tuple[int, ...], raw: bytes) -> TensorRef:
        numel = 1
        for n in shape:
            numel *= n
        ref = StorageRef.for_tensor("", DTYPES[dtype], numel, None)
        data[id(ref)] = raw
        return TensorRef.contiguous(ref, DTYPES[dtype], shape)

    def mat(rows: int, cols: int) -> TensorRef:
        start = 2 * rng.randrange(len(normal) // 4)
        return tensor("bfloat16", (rows, cols), bytes(normal[start : start + 2 * rows * cols]))

    def floats(shape: tuple[int, ...], value: float) -> TensorRef:
        count = 1
        for n in shape:
            count *= n
        return tensor("float32", shape, array("f", [value]).tobytes() * count)

    layers, dim, hidden = _llama_sizes(8 << 20)
    model = _llama_model(layers, dim, hidden, mat, lambda n: floats((n,), 1.0))
    model["output.weight"] = model["tok_embeddings.weight"]  # tied, one shared storage
    weights = list(model.values())[:4]
    optim = {
        "state": {i: {"step": floats((), 10.0), "exp_avg": floats(w.shape, 0.0)} for i, w in enumerate(weights)},
        "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, "params": [0, 1, 2, 3]}],
    }
    sd = {"model": model, "step": 1000, "config": {"dim": dim, "layers": layers, "name": "llama-like"}}
    return {**sd, "optim": optim}, data


def write_demo(directory: Path | None = None, *, overwrite: bool = True) -> tuple[Path, Path]:
    """Write ``demo.pt`` (torch.save) and ``demo_dcp/`` (DCP) for a first look, and stamp them;
    returns both paths. Our own writers do it, without torch (a first launch of the window shows
    the demo without waiting seconds for torch's import); torch reads both as it reads its own."""
    from ..formats.torchsave.writer import TorchSaveWriter, archive_name
    from .convert.convert import torch_save_to_dcp

    directory = directory or demo_dir()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / _STAMP).unlink(missing_ok=True)  # until both are rewritten, they are not the stamped ones
    pt = directory / "demo.pt"
    tmp = directory / ".demo.pt.partial"
    obj, data = _demo_state_dict()
    try:
        with open(tmp, "wb") as f:
            writer = TorchSaveWriter(f, archive_name(pt))
            for key, ref in writer.write_pickle(obj):
                writer.write_storage(key, data[id(ref)])
            writer.finish()
        os.replace(tmp, pt)
    finally:
        tmp.unlink(missing_ok=True)  # nothing left behind (after the rename, nothing is there)
    dcp_dir = directory / "demo_dcp"
    torch_save_to_dcp(pt, dcp_dir, overwrite=overwrite)
    tmp = directory / f".{_STAMP}.partial"
    tmp.write_text(json.dumps({"version": DEMO_VERSION, "files": _listing(pt, dcp_dir)}))
    os.replace(tmp, directory / _STAMP)
    return pt, dcp_dir


def _listing(pt: Path, dcp_dir: Path) -> list[list[Any]]:
    """What the stamp records of the demo's files: name, size and modification time of each, so a
    file changed, added or removed since (a user's experiment) is seen with a few ``stat`` calls."""
    files = [pt, *sorted(dcp_dir.iterdir())]
    return [[f.relative_to(pt.parent).as_posix(), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def written_demo(directory: Path | None = None) -> tuple[Path, Path] | None:
    """The demo's two paths when :func:`write_demo` wrote them (this version) and nothing changed
    them since; None when it must be written (again). Imports no torch."""
    directory = directory or demo_dir()
    pt, dcp_dir = directory / "demo.pt", directory / "demo_dcp"
    try:
        stamp = json.loads((directory / _STAMP).read_text())
        current = _listing(pt, dcp_dir)
    except (OSError, ValueError):
        return None
    if not isinstance(stamp, dict) or stamp.get("version") != DEMO_VERSION or stamp.get("files") != current:
        return None
    return pt, dcp_dir
