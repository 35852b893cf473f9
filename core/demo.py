"""Synthetic checkpoints: the demo shown to new users and the benchmark's llama-like model.

Writing the demo needs PyTorch (seconds to import); finding one written before does not: the
window opens the demo from its folder when :func:`written_demo` finds it unchanged since
:func:`write_demo` stamped it, and shows its tree without waiting for torch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["demo_dir", "llama_like_state_dict", "write_demo", "written_demo"]

DEMO_VERSION = 1  # raise when _demo_state_dict changes: stamps of another version are rewritten
_STAMP = ".demo-stamp.json"


def demo_dir() -> Path:
    """Where ``dcpstudio demo`` writes its files: ``$XDG_DATA_HOME/dcpstudio/demo``."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "dcpstudio" / "demo"


def llama_like_state_dict(total_bytes: int, *, seed: int = 0) -> dict[str, Any]:
    """A training checkpoint shaped like a small llama: bf16 matrices, fp32 norms, step counter.

    Layer width is chosen so the whole is about ``total_bytes`` with ~100 tensors (8 per layer
    plus embeddings); the largest tensor is the embedding / output matrix.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    layers = 12
    # per layer: 4 attention d*d + 3 mlp d*(8d/3) (bf16) = 12 d^2 * 2 bytes; plus 2 d^2 for emb/out
    dim = max(64, int((total_bytes / (2 * (12 * layers + 4))) ** 0.5) // 64 * 64)
    hidden = dim * 8 // 3 // 64 * 64 or 64
    vocab = dim

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen, dtype=torch.float32).to(torch.bfloat16)

    model: dict[str, Any] = {"tok_embeddings.weight": mat(vocab, dim)}
    for i in range(layers):
        p = f"layers.{i}."
        for name in ("wq", "wk", "wv", "wo"):
            model[p + f"attention.{name}.weight"] = mat(dim, dim)
        model[p + "feed_forward.w1.weight"] = mat(hidden, dim)
        model[p + "feed_forward.w2.weight"] = mat(dim, hidden)
        model[p + "feed_forward.w3.weight"] = mat(hidden, dim)
        model[p + "attention_norm.weight"] = torch.ones(dim)
        model[p + "ffn_norm.weight"] = torch.ones(dim)
    model["norm.weight"] = torch.ones(dim)
    model["output.weight"] = mat(vocab, dim)
    return {"model": model, "step": 1000, "config": {"dim": dim, "layers": layers, "name": "llama-like"}}


def _demo_state_dict() -> dict[str, Any]:
    import torch

    sd = llama_like_state_dict(8 << 20)
    weights = list(sd["model"].items())[:4]
    sd["optim"] = {
        "state": {
            i: {"step": torch.tensor(10.0), "exp_avg": torch.zeros_like(w, dtype=torch.float32)}
            for i, (_, w) in enumerate(weights)
        },
        "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, "params": [0, 1, 2, 3]}],
    }
    sd["model"]["output.weight"] = sd["model"]["tok_embeddings.weight"]  # tied, one shared storage
    return sd


def write_demo(directory: Path | None = None, *, overwrite: bool = True) -> tuple[Path, Path]:
    """Write ``demo.pt`` (torch.save) and ``demo_dcp/`` (DCP) for a first look, and stamp them;
    returns both paths."""
    import torch

    from .convert import torch_save_to_dcp

    directory = directory or demo_dir()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / _STAMP).unlink(missing_ok=True)  # until both are rewritten, they are not the stamped ones
    pt = directory / "demo.pt"
    tmp = directory / ".demo.pt.partial"
    torch.save(_demo_state_dict(), tmp)
    os.replace(tmp, pt)
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
