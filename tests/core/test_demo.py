"""The demo checkpoints, written by our own writers without torch (so that a first launch of the
window shows them at once): torch reads them as the checkpoint they describe -- torch.load of the
torch.save file, and torch's own DCP reader of the directory, give the same tensors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from dcpstudio.core.ops.demo import write_demo


def test_writing_the_demo_imports_no_torch(tmp_path: Path) -> None:
    code = "import sys; from dcpstudio.core.ops.demo import write_demo; write_demo(); print('torch' in sys.modules)"
    env = {"XDG_DATA_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"]
    assert (tmp_path / "dcpstudio" / "demo" / "demo_dcp" / ".metadata").is_file()


def test_torch_reads_the_demo_as_described(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    pt, dcp_dir = write_demo(tmp_path)
    sd = torch.load(pt, weights_only=True)
    assert list(sd) == ["model", "step", "config", "optim"]
    assert sd["step"] == 1000 and sd["config"] == {"dim": 128, "layers": 12, "name": "llama-like"}
    model = sd["model"]
    assert len(model) == 12 * 9 + 3
    emb, w2 = model["tok_embeddings.weight"], model["layers.11.feed_forward.w2.weight"]
    assert emb.dtype == torch.bfloat16 and emb.shape == (128, 128) and w2.shape == (128, 320)
    assert model["output.weight"].data_ptr() == emb.data_ptr()  # tied: one storage, as torch.save keeps it
    for name, t in model.items():
        if "norm" in name:
            assert t.dtype == torch.float32 and torch.equal(t, torch.ones(128)), name
        else:
            assert torch.isfinite(t).all() and 0.9 < t.float().std() < 1.1, name
    assert not torch.equal(model["layers.0.attention.wq.weight"], model["layers.0.attention.wk.weight"])
    state = sd["optim"]["state"]
    assert sorted(state) == [0, 1, 2, 3] and torch.equal(state[0]["step"], torch.tensor(10.0))
    assert state[3]["exp_avg"].shape == (128, 128) and not state[3]["exp_avg"].any()
    assert sd["optim"]["param_groups"] == [
        {"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, "params": [0, 1, 2, 3]}
    ]
    dcp_to_torch_save(dcp_dir, tmp_path / "back.pt")  # torch's own reader of the directory
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    flat = {f"model.{k}": v for k, v in model.items()}
    flat |= {f"optim.state.{i}.{k}": v for i, s in state.items() for k, v in s.items()}
    got = {f"model.{k}": v for k, v in back["model"].items()}
    got |= {f"optim.state.{i}.{k}": v for i, s in back["optim"]["state"].items() for k, v in s.items()}
    assert sorted(got) == sorted(flat)
    for key, t in flat.items():
        assert got[key].dtype == t.dtype and torch.equal(got[key], t), key
    assert back["step"] == 1000 and back["config"] == sd["config"]
