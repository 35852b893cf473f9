"""DCP checkpoints whose items torch's writer compressed (``_extensions=[ZStandard()]``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from dcpstudio.core import convert, diff, open_checkpoint
from tests.conftest import assert_same, dcp_save

zstd = pytest.importorskip("torch.distributed.checkpoint._extension")


@pytest.fixture
def compressed(tmp_path: Path) -> Path:
    if not zstd.ZStandard.is_available():
        pytest.fail("zstandard is a test dependency: pip install -e '.[test]'")
    sd = {"model": {"w": torch.arange(1000.0).reshape(100, 10), "b": torch.ones(5).bfloat16()}, "step": 4}
    path = tmp_path / "zdcp"
    dcp_save(sd, storage_writer=FileSystemWriter(path, _extensions=[zstd.ZStandard()]))
    return path


@pytest.mark.filterwarnings("ignore:safetensors holds tensors only")
def test_compressed_items_are_read_in_every_path(compressed: Path, tmp_path: Path) -> None:
    with open_checkpoint(compressed) as ckpt:
        assert torch.equal(ckpt.read_tensor("model.w", [slice(3, 5)]), torch.arange(30.0, 50.0).reshape(2, 10))
        assert ckpt.read_value("step") == 4
        (chunk,) = ckpt.resolve_chunks("model.w")
        assert chunk.data_offset is None  # compressed: no raw bytes in place
        ref = ckpt.tensor_ref("model.w")
        assert ref.storage is not None and ckpt.storage_range(ref.storage) is None  # nothing to copy in place
    for target in ("torch", "safetensors"):
        out = tmp_path / f"out_{target}"
        convert(compressed, out, to=target)  # type: ignore[arg-type]
        with open_checkpoint(compressed) as a, open_checkpoint(out) as b:
            assert diff(a, b).equal
    assert_same(
        {"model": {"w": torch.arange(1000.0).reshape(100, 10), "b": torch.ones(5).bfloat16()}, "step": 4},
        torch.load(tmp_path / "out_torch", weights_only=True),
    )


def test_damaged_data_is_not_called_hostile(tmp_path: Path) -> None:
    """Garbage where a pickled value should be is a damaged checkpoint, not a refused import."""
    import io

    from dcpstudio.core import CorruptCheckpointError
    from dcpstudio.core.formats.dcp.planners import safe_torch_load

    with pytest.raises(CorruptCheckpointError):
        safe_torch_load(io.BytesIO(b"\x80\x02\x8e garbage"), "value")
