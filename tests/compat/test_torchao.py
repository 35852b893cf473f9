"""torchao tensor subclasses (``Float8Tensor``, ``Int8Tensor``): named by class and inner tensors
without running their code; with --trust-pickle converted as their inner tensors or dequantised,
checked against torch's own loaders. The first tests need no torchao (a subclass pickled under
torchao's names); the producer tests run when torchao is installed."""

from __future__ import annotations

import enum
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from dcpstudio.cli.main import main
from dcpstudio.core.checkpoints.opening import open_checkpoint
from dcpstudio.core.errors import UnsafePickleError, UnsupportedFormatError
from dcpstudio.core.ops.convert.convert import convert

FLOAT8 = r"a torchao Float8Tensor \(a tensor subclass: qdata float8_e4m3fn \[4, 8\], scale float32 \[4, 1\]\)"


class Pref(enum.Enum):
    AUTO = "auto"


class Float8Tensor(torch.Tensor):
    """A wrapper subclass pickled as torchao's is: the outer dtype and shape, then its ``__dict__``."""

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor) -> Any:
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=torch.float32)

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor) -> None:
        self.qdata, self.scale, self.block_size, self.kernel_preference = qdata, scale, [1, 8], Pref.AUTO

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError


def _save_as_torchao(obj: Any, path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.save ``obj`` with the classes above named ``torchao.quantization.*`` (as torchao's are)."""
    fake = types.ModuleType("torchao.quantization")
    for cls in (Float8Tensor, Pref):
        monkeypatch.setattr(cls, "__module__", fake.__name__)
        setattr(fake, cls.__name__, cls)
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    torch.save(obj, path)
    monkeypatch.undo()


def _fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: Any = None) -> Path:
    w = Float8Tensor(torch.arange(32.0).reshape(4, 8).to(torch.float8_e4m3fn), torch.ones(4, 1))
    src = tmp_path / "f8.pt"
    _save_as_torchao({"w": w, "b": torch.arange(3.0), **(extra or {})}, src, monkeypatch)
    return src


def test_subclass_named_without_torchao(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _fake(tmp_path, monkeypatch)
    with open_checkpoint(src) as ckpt:
        assert ckpt.entries["b"].kind == "tensor"
        assert repr(ckpt.entries["w"].value) == f"<{FLOAT8.replace(chr(92), '')}>"
    with pytest.raises(UnsupportedFormatError, match=rf"f8\.pt: 'w' is {FLOAT8}; with --trust-pickle .*'w\.qdata'"):
        convert(src, tmp_path / "out.safetensors", to="safetensors")
    convert(src, tmp_path / "b.pt", to="torch", exclude="^w$")
    assert torch.equal(torch.load(tmp_path / "b.pt", weights_only=True)["b"], torch.arange(3.0))
    assert main(["convert", str(src), str(tmp_path / "d.pt"), "--dequantize", "-q"]) == 2  # needs --trust-pickle


def test_torchao_value_outside_a_subclass_still_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _fake(tmp_path, monkeypatch, {"pref": Pref.AUTO})
    with pytest.raises(UnsafePickleError, match=r"refused to load 'torchao\.quantization\.Pref'"):
        open_checkpoint(src)


def _quantized(kind: str) -> torch.nn.Module:
    tq = pytest.importorskip("torchao.quantization")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 16))
    tq.quantize_(model, tq.Float8WeightOnlyConfig() if kind == "float8" else tq.Int8WeightOnlyConfig())
    return model


@pytest.mark.parametrize("kind", ["float8", "int8"])
def test_torchao_torch_save(tmp_path: Path, kind: str) -> None:
    src = tmp_path / "q.pt"
    torch.save(_quantized(kind).state_dict(), src)
    ref = torch.load(src, weights_only=True)
    name = "Float8Tensor" if kind == "float8" else "Int8Tensor"
    with pytest.raises(UnsupportedFormatError, match=rf"'0\.weight' is a torchao {name} \(a tensor subclass: qdata"):
        convert(src, tmp_path / "x.safetensors", to="safetensors")
    with pytest.warns(UserWarning, match="trusting pickles"):
        convert(src, tmp_path / "inner.pt", to="torch", trust_pickle=True)
    inner = torch.load(tmp_path / "inner.pt", weights_only=True)
    w = ref["0.weight"]
    assert torch.equal(inner["0.weight.qdata"].view(torch.uint8), w.qdata.view(torch.uint8))
    assert torch.equal(inner["0.weight.scale"], w.scale) and torch.equal(inner["0.bias"], ref["0.bias"])
    assert main(["convert", str(src), str(tmp_path / "d.safetensors"), "--trust-pickle", "--dequantize", "-q"]) == 0
    from safetensors.torch import load_file

    dense = load_file(tmp_path / "d.safetensors")
    assert sorted(dense) == sorted(ref) and torch.equal(dense["1.weight"], ref["1.weight"].dequantize())


def test_torchao_dcp_named_and_excluded(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    model = _quantized("float8")
    dcp.save(model.state_dict(), checkpoint_id=tmp_path / "ckpt", no_dist=True)
    with pytest.raises(UnsupportedFormatError, match=r"\('0\.weight'\) is a torchao Float8Tensor \(a tensor subclass"):
        convert(tmp_path / "ckpt", tmp_path / "x.pt", to="torch")
    convert(tmp_path / "ckpt", tmp_path / "rest.pt", to="torch", exclude="weight")
    loaded = _quantized("float8").state_dict()
    dcp.load(loaded, checkpoint_id=tmp_path / "ckpt", no_dist=True)  # torch's reader, into a quantized model
    rest = torch.load(tmp_path / "rest.pt", weights_only=True)
    assert sorted(rest) == ["0.bias", "1.bias"] and all(torch.equal(rest[k], loaded[k]) for k in rest)
