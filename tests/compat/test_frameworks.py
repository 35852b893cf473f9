"""Checkpoints from training frameworks (tests/compat/frameworks.py), when installed: every tensor and
value bit-exact against the framework's own loader, through every format and back, verified both
ways, loaded on ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dcpstudio.core import convert, diff, open_checkpoint
from dcpstudio.core.ops.compare.values import objects_equal
from dcpstudio.core.ranks.load import run_load
from tests.compat import frameworks

pytestmark = pytest.mark.filterwarnings("ignore")


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _everywhere(ckpt: Path, tmp: Path, expected: dict[str, Any]) -> None:
    """Each expected entry (a tensor bit for bit, a value equal) in the checkpoint and in its
    conversion to each format; each conversion verifies equal from both sides."""
    outs = [ckpt]
    for target in ("torch", "dcp", "safetensors"):
        outs.append(tmp / f"as_{target}")
        convert(ckpt, outs[-1], to=target)  # type: ignore[arg-type]
    for out in outs:
        with open_checkpoint(out) as c:
            for fqn, want in expected.items():
                if isinstance(want, torch.Tensor):
                    assert _bits(c.read_tensor(fqn), want), (out, fqn)
                elif fqn in c.entries:
                    assert objects_equal(c.read_value(fqn), want), (out, fqn)
                else:  # a byte item of a list: torch.save's subtree (compared by verify below); no JSON in safetensors
                    assert out.name == "as_safetensors" or any(k.startswith(f"{fqn}.") for k in c.entries), (out, fqn)
    for out in outs[1:3]:
        with open_checkpoint(ckpt) as a, open_checkpoint(out) as b:
            assert diff(a, b).equal and diff(b, a).equal, out


def test_megatron_core_torch_dist(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core.dist_checkpointing")
    pytest.importorskip("psutil")  # megatron's async writer needs it, without declaring it
    ckpt = frameworks.megatron_torch_dist(tmp_path / "iter_0000007")
    ref = torch.load(tmp_path / "reference.pt", weights_only=False)
    full = frameworks._full()
    assert _bits(ref["model"]["decoder.weight"], full["decoder.weight"])  # megatron's reader agrees with the save
    expected: dict[str, Any] = {
        "decoder.weight": ref["model"]["decoder.weight"],
        "decoder.bias": ref["model"]["decoder.bias"],
        "rng_state/shard_0_2": [ref["rng_state"]],  # as dcp.load reads the item; megatron unwraps the list
        "common.iteration": ref["iteration"],
        "common.args.lr": ref["args"]["lr"],
        "common.extra_tensor": ref["extra_tensor"],
        "metadata.sharded_backend": "torch_dist",
    }
    with open_checkpoint(ckpt) as c:
        assert "rng_state/shard_1_2" in c.entries and not c.info["notes"]
    _everywhere(ckpt, tmp_path, expected)
    reports = run_load(ckpt, ranks=2, timeout=240)
    assert all(r.ok for r in reports), [r.mismatches for r in reports]


def test_lightning_fabric_sharded(tmp_path: Path) -> None:
    pytest.importorskip("lightning.fabric")
    ckpt = frameworks.lightning_sharded(tmp_path / "fabric.ckpt")
    ref = torch.load(tmp_path / "reference.pt", weights_only=False)
    expected = {k: v for k, v in ref.items() if k.startswith("model.")}
    expected.update({"meta.step": ref["step"], "meta.hparams.lr": ref["hparams"]["lr"], "meta.t": ref["t"]})
    assert len(expected) == 5
    _everywhere(ckpt, tmp_path, expected)
