"""torchtitan ``torch_checkpointing`` folders (``<item>_<rank>.pt`` per top-level item and rank,
``metadata.pkl``): one checkpoint whose groups are the items, the same through inspect, convert and
verify. The layout part is built as the package's writer lays it out (runs without the package);
the producer part is the package itself (skipped when it is absent)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from dcpstudio.cli.main import main
from dcpstudio.core.checkpoints.opening import open_checkpoint
from dcpstudio.core.errors import CorruptCheckpointError

NOTE = "metadata.pkl (torch_checkpointing's resharding metadata, a pickle) was not carried"


def _layout(root: Path) -> Path:
    """What ``CheckpointWriter.write`` leaves for items model, optimizer, step on two ranks."""
    root.mkdir()
    w = torch.arange(6.0).reshape(2, 3)
    for rank in range(2):
        torch.save({"w": w}, root / f"model_{rank}.pt")
        torch.save({"state": {0: {"exp_avg": w * 2}}, "param_groups": [{"lr": 0.1}]}, root / f"optimizer_{rank}.pt")
        torch.save(3, root / f"step_{rank}.pt")
    (root / "metadata.pkl").write_bytes(pickle.dumps({"metadata": {}, "world_size": 2, "version": "0.1.1"}))
    return root


def test_layout_opens_as_items(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _layout(tmp_path / "ck")
    with open_checkpoint(folder) as ckpt:
        assert set(ckpt.entries) == {"model.w", "optimizer.state.0.exp_avg", "optimizer.param_groups.0.lr", "step"}
        assert torch.equal(ckpt.read_tensor("optimizer.state.0.exp_avg"), torch.arange(6.0).reshape(2, 3) * 2)
        assert ckpt.read_object("step") == 3 and any(NOTE in n for n in ckpt.info["notes"])
    assert main(["inspect", str(folder)]) == 0
    assert NOTE in capsys.readouterr().out
    out = tmp_path / "o.pt"
    assert main(["convert", "-q", str(folder), str(out)]) == 0
    assert NOTE in capsys.readouterr().err
    assert main(["verify", str(folder), str(out)]) == 0
    loaded = torch.load(out, weights_only=True)
    assert loaded["step"] == 3 and torch.equal(loaded["model"]["w"], torch.arange(6.0).reshape(2, 3))


def test_item_missing_a_rank_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _layout(tmp_path / "ck")
    (folder / "optimizer_1.pt").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"item 'optimizer' .* lacks rank 1 \(optimizer_1\.pt\)"):
        open_checkpoint(folder)
    assert main(["inspect", str(folder)]) == 1
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def produced(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch_checkpointing")
    from tests.compat.torch_checkpointing_writer import save_torch_checkpointing

    path = tmp_path_factory.mktemp("tc") / "step-3"
    save_torch_checkpointing(str(path))
    return path


def test_real_producer_bit_exact(produced: Path, tmp_path: Path) -> None:
    import torch.distributed.tensor  # torch's weights_only loader then reads DTensors

    names = {p.name for p in produced.iterdir()}
    assert names == {"metadata.pkl", *(f"{i}_{r}.pt" for i in ("model", "optimizer", "step") for r in (0, 1))}
    items = ("model", "optimizer")
    ranks = {i: [torch.load(produced / f"{i}_{r}.pt", weights_only=True) for r in (0, 1)] for i in items}
    want = {f"model.{k}": torch.cat([sd[k]._local_tensor for sd in ranks["model"]]) for k in ranks["model"][0]}
    for p, st in ranks["optimizer"][0]["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            want[f"optimizer.state.{p}.{k}"] = torch.cat([sd["state"][p][k]._local_tensor for sd in ranks["optimizer"]])
        want[f"optimizer.state.{p}.step"] = st["step"]
    with open_checkpoint(produced) as ckpt:
        assert {f for f, e in ckpt.entries.items() if e.kind == "tensor"} == set(want)
        assert all(torch.equal(ckpt.read_tensor(f), t) for f, t in want.items())
        assert ckpt.read_object("step") == 3
    out = tmp_path / "o.safetensors"
    assert main(["convert", "-q", str(produced), str(out)]) == 0
    assert main(["verify", str(produced), str(out)]) == 0
