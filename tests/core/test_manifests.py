"""Manifests written while converting: they match a later hash, let check find a flipped byte and
swapped shards, and let diff-digests answer without the tensors' data."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dcpstudio.core import open_checkpoint
from dcpstudio.core.ops.convert.convert import convert
from dcpstudio.core.ops.integrity import check_path, digests
from dcpstudio.core.ops.integrity.manifests import diff_digests, read_manifest


def _source(tmp_path: Path) -> Path:
    src = tmp_path / "m.pt"
    torch.save({"a": torch.arange(4096, dtype=torch.float32).reshape(64, 64), "b": torch.ones(4096)}, src)
    return src


def test_manifest_matches_hash_and_check_finds_a_flipped_byte(tmp_path: Path) -> None:
    src = _source(tmp_path)
    for dst, to in ((tmp_path / "d", "dcp"), (tmp_path / "s.safetensors", "safetensors")):
        convert(src, dst, to=to)  # type: ignore[arg-type]
        m = read_manifest(dst)
        assert m is not None
        with open_checkpoint(dst) as ckpt:
            assert {d.fqn: d.digest for d in digests(ckpt)} == {n: r["digest"] for n, r in m.tensors.items()}
        assert m.tensors["a"]["max"] == 4095.0 and m.tensors["b"]["std"] == 0.0
        assert check_path(dst).whole
        data = next(p for p in ([dst] if dst.is_file() else dst.glob("*.distcp")))
        raw = bytearray(data.read_bytes())
        raw[-200] ^= 1  # inside b's ones (or the ZIP directory): no NaN, nothing a reader refuses
        data.write_bytes(raw)
        report = check_path(dst)
        assert not report.whole and any("SHA-256" in f.what for f in report.findings)


def test_swapped_same_size_shards_are_found(tmp_path: Path) -> None:
    dst = tmp_path / "hf"
    convert(_source(tmp_path), dst, to="safetensors", max_shard_size=16384)
    one, two = sorted(dst.glob("model-*.safetensors"))
    a, b = one.read_bytes(), two.read_bytes()
    assert len(a) == len(b)
    one.write_bytes(b)
    two.write_bytes(a)
    report = check_path(dst)
    assert any("swapped" in f.what for f in report.findings), report.text()


def test_diff_digests_reads_no_tensor_data(tmp_path: Path) -> None:
    src = _source(tmp_path)
    convert(src, tmp_path / "a")
    sd = torch.load(src)
    sd["b"][7] = 2.0
    torch.save(sd, src)
    convert(src, tmp_path / "b.safetensors", to="safetensors")
    for f in (tmp_path / "a").glob("*.distcp"):
        f.unlink()
    st = tmp_path / "b.safetensors"
    st.write_bytes(st.read_bytes()[: 8 + int.from_bytes(st.read_bytes()[:8], "little")])  # the header alone
    d = diff_digests(tmp_path / "a", st)
    assert d.changed == ["b"] and d.same == 1
    assert json.loads(json.dumps(d.json()))["equal"] is False


def test_a_cancelled_conversion_ends_its_read_back_threads_and_leaves_nothing(tmp_path: Path) -> None:
    import threading

    import pytest

    from dcpstudio.core import CancelledError, CancelToken

    src = _source(tmp_path)
    for dst, to in ((tmp_path / "d", "dcp"), (tmp_path / "s.safetensors", "safetensors")):
        token = CancelToken()
        with pytest.raises(CancelledError):
            convert(src, dst, to=to, cancel=token, progress=lambda p, t=token: t.cancel())  # type: ignore[arg-type]
        assert not dst.exists() and [p.name for p in tmp_path.iterdir()] == ["m.pt"]
        assert not [t.name for t in threading.enumerate() if t.name.startswith(("dcpstudio-digest", "dcpstudio-sha"))]


def test_a_renamed_safetensors_file_is_still_whole(tmp_path: Path) -> None:
    """A file's own manifest describes that file whatever it is called now (it named it as written)."""
    convert(_source(tmp_path), tmp_path / "s.safetensors", to="safetensors")
    (tmp_path / "s.safetensors").rename(tmp_path / "renamed.safetensors")
    assert check_path(tmp_path / "renamed.safetensors").whole


def test_a_torch_save_output_carries_its_manifest_which_torch_ignores(tmp_path: Path) -> None:
    """DCP -> torch.save: the manifest is a record of the archive (torch.load reads the same
    tensors), matches a later hash, and check finds a flipped byte in a storage with it."""
    src = _source(tmp_path)
    convert(src, tmp_path / "d", manifest=False)
    assert read_manifest(tmp_path / "d") is None and not (tmp_path / "d" / "dcpstudio-manifest.json").exists()
    out = tmp_path / "back.pt"
    convert(tmp_path / "d", out)
    m = read_manifest(out)
    assert m is not None and set(m.tensors) == {"a", "b"}
    loaded = torch.load(out, weights_only=True)
    assert torch.equal(loaded["a"], torch.load(src)["a"]) and set(loaded) == {"a", "b"}
    with open_checkpoint(out) as ckpt:
        assert {d.fqn: d.digest for d in digests(ckpt)} == {n: r["digest"] for n, r in m.tensors.items()}
    assert check_path(out).whole
    raw = bytearray(out.read_bytes())
    at = raw.index(torch.ones(4096).numpy().tobytes()[:64])  # inside b's storage: a reader takes it as it is
    raw[at + 100] ^= 0x01
    out.write_bytes(raw)
    report = check_path(out)
    assert not report.whole and any("SHA-256" in f.what for f in report.findings), report.text()
