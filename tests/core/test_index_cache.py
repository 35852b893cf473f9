"""The DCP index cache: an unchanged ``.metadata`` re-opens from the user cache, with the same
entries and chunk tables as from its pickle; anything else -- another file, a changed one, a damaged
cache, a cache folder that cannot be written -- falls back to the pickle, with every check intact."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from dcpstudio.core import CorruptCheckpointError, UnsafePickleError, open_checkpoint, read_metadata
from dcpstudio.core.checkpoints.dcp import checkpoint as dcp_module
from dcpstudio.core.checkpoints.dcp import children as dcp_children
from dcpstudio.core.checkpoints.dcp import metadata as dcp_metadata
from dcpstudio.core.formats.dcp.index import DCPIndex
from dcpstudio.core.io import index_cache as _index_cache
from tests._chunked import ChunkedPlanner, split
from tests.conftest import assert_same, dcp_save, on_thread


def key(path: Path, kind: str = "dcp-metadata") -> dict[str, Any] | None:
    """The cache key of the file at ``path`` as it is now (its bytes and status)."""
    return _index_cache.source_key(path, kind, path.read_bytes())


@pytest.fixture(autouse=True)
def cache_every_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small test checkpoints are cached as large ones are."""
    monkeypatch.setattr(dcp_metadata, "CACHE_ABOVE", 0)


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each time a ``.metadata`` pickle is unpickled, its label."""
    calls: list[str] = []
    real = dcp_module.load_light_metadata

    def spy(data: bytes, label: str, **kwargs: Any) -> Any:
        calls.append(label)
        return real(data, label, **kwargs)

    monkeypatch.setattr(dcp_module, "load_light_metadata", spy)
    return calls


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.w": torch.randn(6, 8, generator=g),
        "model.b": torch.randn(7, generator=g).bfloat16(),
        "model.grid": torch.arange(60, dtype=torch.int32).reshape(3, 4, 5),
        "scalar": torch.tensor(2.5),
        "step": 12,
        "name": "run-7",
    }


class _WithValues(ChunkedPlanner):
    """Tensors in the given chunks, other values as DCP byte items."""

    def create_local_plan(self) -> SavePlan:
        values = {k: v for k, v in self.state_dict.items() if not isinstance(v, torch.Tensor)}
        tensors = {k: v for k, v in self.state_dict.items() if isinstance(v, torch.Tensor)}
        self.state_dict = tensors
        plan = super().create_local_plan()
        self.state_dict = {**tensors, **values}
        items = [WriteItem(index=MetadataIndex(k), type=WriteItemType.BYTE_IO) for k in values]
        self.plan = SavePlan([*plan.items, *items], planner_data=self.mappings)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            return DefaultSavePlanner.resolve_data(self, write_item)
        return super().resolve_data(write_item)


@pytest.fixture
def chunked(tmp_path: Path) -> Path:
    state = _state()
    boxes = {
        "model.w": split((6, 8), {0: [2, 4], 1: [3]}),
        "model.b": split((7,), {0: [3]}),
        "model.grid": split((3, 4, 5), {1: [1], 2: [2, 4]}),
    }
    ckpt = tmp_path / "ckpt"
    dcp_save(state, checkpoint_id=ckpt, planner=_WithValues(boxes))
    return ckpt


def _cache_files() -> list[Path]:
    where = _index_cache.cache_dir()
    return sorted(where.glob("*.idx")) if where.is_dir() else []


def _summary(path: Path) -> dict[str, Any]:
    """Everything the model says about a checkpoint's structure, and its values."""
    with open_checkpoint(path) as ckpt:
        totals = ckpt.tree.totals  # byte items' sizes are known once the storage index is
        entries = {k: (e.kind, str(e.dtype), e.shape, e.byte_size) for k, e in ckpt.entries.items()}
        return {
            "entries": entries,
            "chunks": {k: ckpt.chunks(k) for k in ckpt.entries},
            "counts": {k: ckpt.chunk_count(k) for k in ckpt.entries},
            "paths": ckpt.paths(),
            "totals": totals,
            "values": {k: ckpt.read_value(k) for k in ckpt.entries},
            "version": ckpt.info.get("version"),
        }


def test_unchanged_metadata_reopens_from_the_cache(chunked: Path, parses: list[str]) -> None:
    first = _summary(chunked)
    assert len(parses) == 1 and len(_cache_files()) == 1
    again = _summary(chunked)
    assert len(parses) == 1, "the second open read the pickle"
    assert {k: v for k, v in again.items() if k != "values"} == {k: v for k, v in first.items() if k != "values"}
    assert_same(first["values"], again["values"])
    assert_same(first["values"], {k: v for k, v in _state().items()})
    assert len(again["chunks"]["model.w"]) == 6 and len(again["chunks"]["model.grid"]) == 6


def test_cache_holds_no_pickle_and_says_what_it_is_for(chunked: Path) -> None:
    _summary(chunked)
    (path,) = _cache_files()
    data = path.read_bytes()
    assert b"\x80\x04" not in data and b"\x80\x05" not in data and b"torch.distributed" not in data
    header, payload = _index_cache.load(key(chunked / ".metadata")) or (None, None)
    assert header is not None and header["key"]["path"] == str((chunked / ".metadata").resolve())
    assert DCPIndex.from_bytes(payload).names == list(_state())  # type: ignore[arg-type]


def test_a_changed_key_rebuilds(chunked: Path, parses: list[str]) -> None:
    _summary(chunked)
    md = chunked / ".metadata"
    st = md.stat()
    os.utime(md, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    _summary(chunked)
    assert len(parses) == 2
    _summary(chunked)
    assert len(parses) == 2  # stored again under the new key
    assert len(_cache_files()) == 1  # same file name: the stale entry was replaced
    os.utime(md, ns=(st.st_atime_ns, st.st_mtime_ns))  # back to the old time: the change time still differs
    _summary(chunked)
    assert len(parses) == 3


def test_a_copy_is_another_file(chunked: Path, tmp_path: Path, parses: list[str]) -> None:
    _summary(chunked)
    import shutil

    shutil.copytree(chunked, tmp_path / "copy")
    assert _summary(tmp_path / "copy")["chunks"] == _summary(chunked)["chunks"]
    assert len(parses) == 2 and len(_cache_files()) == 2


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[: len(b) // 2],  # truncated
        lambda b: b[:-1] + bytes([b[-1] ^ 1]),  # one bit of the payload
        lambda b: b"XXXXXXXX" + b[8:],  # magic
        lambda b: b[:14] + b"!" + b[15:],  # header
        lambda b: b"",
    ],
    ids=["truncated", "payload-bit", "magic", "header", "empty"],
)
def test_a_damaged_cache_is_ignored_and_rebuilt(chunked: Path, parses: list[str], damage: Any) -> None:
    first = _summary(chunked)
    (path,) = _cache_files()
    path.write_bytes(damage(path.read_bytes()))
    again = _summary(chunked)
    assert len(parses) == 2
    assert again["chunks"] == first["chunks"] and again["entries"] == first["entries"]
    _summary(chunked)
    assert len(parses) == 2  # rebuilt and stored: intact again


def test_an_inconsistent_index_is_ignored(chunked: Path, parses: list[str]) -> None:
    """A cache whose framing and CRC are intact but whose arrays disagree (another writer's bug)."""
    _summary(chunked)
    md = chunked / ".metadata"
    _, payload = _index_cache.load(key(md)) or (None, None)
    assert payload is not None
    index = DCPIndex.from_bytes(payload)
    index.chunk_start[-1] += 1
    _index_cache.store(md, key(md), index.to_bytes())
    assert _summary(chunked)["counts"]["model.w"] == 6
    assert len(parses) == 2


@pytest.mark.parametrize(
    "payload",
    [b"\x05\x00", (200_000).to_bytes(8, "little") + b"[" * 200_000 + bytes(88)],
    ids=["short", "deeply-nested-head"],
)
def test_a_crafted_payload_in_an_intact_frame_is_ignored(chunked: Path, parses: list[str], payload: bytes) -> None:
    """Right key, length and CRC, but a payload no index reads (struct.error, RecursionError inside):
    ignored and rebuilt, never a crash."""
    first = _summary(chunked)
    assert _index_cache.store(chunked / ".metadata", key(chunked / ".metadata"), payload)
    assert _summary(chunked)["chunks"] == first["chunks"]
    assert len(parses) == 2


def test_the_child_never_imports_from_the_working_directory(
    chunked: Path, tmp_path: Path, in_child: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stray json.py / zlib.py where the user stands (a downloaded model folder) is not imported
    by the child that parses a large .metadata."""
    marker = tmp_path / "RAN"
    here = tmp_path / "downloads"
    here.mkdir()
    for module in ("json", "zlib", "struct", "array"):
        (here / f"{module}.py").write_text(f"open({str(marker)!r}, 'a').write({module!r})\n")
    monkeypatch.chdir(here)
    first = _open_summary(chunked, full_index=True)
    assert not marker.exists(), marker.read_text()
    assert first["entries"] and len(_cache_files()) == 1  # parsed by the child, and cached


def test_an_unwritable_cache_folder_still_opens(chunked: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "cache"))  # cannot be created, even by root
    first = _summary(chunked)
    assert _summary(chunked)["chunks"] == first["chunks"]
    assert not _cache_files()


def test_the_cache_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sources = []
    for i in range(5):
        src = tmp_path / f"src{i}"
        src.write_bytes(b"x")
        sources.append(src)
        assert _index_cache.store(src, key(src, "test"), bytes(1000))
    size = max(p.stat().st_size for p in _index_cache.cache_dir().iterdir())
    monkeypatch.setattr(_index_cache, "MAX_BYTES", 3 * size + 100)  # room for three
    for i, src in enumerate(sources):
        st = os.stat(_index_cache._file_for(key(src, "test") or {}))
        os.utime(_index_cache._file_for(key(src, "test") or {}), ns=(st.st_atime_ns, i * 10**9))
    assert _index_cache.load(key(sources[0], "test")) is not None  # used just now: kept
    new = tmp_path / "new"
    new.write_bytes(b"y")
    assert _index_cache.store(new, key(new, "test"), bytes(1000))
    total = sum(p.stat().st_size for p in _index_cache.cache_dir().iterdir())
    assert total <= 3 * size + 100
    kept = [_index_cache.load(key(s, "test")) is not None for s in sources]
    assert kept[0] and not kept[1] and kept[-1]
    assert _index_cache.load(key(new, "test")) is not None


def test_deleting_the_cache_is_safe(chunked: Path, parses: list[str]) -> None:
    first = _summary(chunked)
    for path in _cache_files():
        path.unlink()
    assert _summary(chunked)["chunks"] == first["chunks"]
    assert len(parses) == 2


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def test_a_crafted_metadata_is_refused_with_a_cache_present(chunked: Path, tmp_path: Path) -> None:
    _summary(chunked)
    assert len(_cache_files()) == 1
    md_path = chunked / ".metadata"
    st = md_path.stat()
    md = read_metadata(chunked)
    marker = tmp_path / "PAYLOAD_RAN"
    md.planner_data = {**md.planner_data, "x": Payload(marker)}
    data = pickle.dumps(md)
    with open(md_path, "r+b") as f:  # in place: the same inode, then the same size and times
        f.truncate(0)
        f.write(data)
    os.utime(md_path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(UnsafePickleError, match=r"builtins\.exec"):
        open_checkpoint(chunked)
    assert not marker.exists()


def _edit_metadata(ckpt: Path, edit: Any) -> None:
    md = read_metadata(ckpt)
    edit(md)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda md: md.state_dict_metadata["model.w"].chunks.pop(), "leave gaps"),
        (
            lambda md: md.storage_data.pop(next(k for k in md.storage_data if k.fqn == "model.b")),
            "no storage entry for 'model.b'",
        ),
        (lambda md: setattr(md.state_dict_metadata["model.w"].chunks[0], "sizes", torch.Size([9, 9])), "outside"),
        (lambda md: setattr(md.state_dict_metadata["model.w"].chunks[0], "offsets", "x"), "damaged metadata"),
    ],
    ids=["gap", "no-storage", "outside", "damaged"],
)
def test_chunk_checks_hold_from_the_cache(chunked: Path, parses: list[str], edit: Any, message: str) -> None:
    _edit_metadata(chunked, edit)
    name = "model.b" if "model.b" in message else "model.w"
    for _ in range(2):  # from the pickle, then from the cache
        with open_checkpoint(chunked) as ckpt:
            assert ckpt.tree.totals.count == 6  # the rest opens
            with pytest.raises(CorruptCheckpointError, match=message):
                ckpt.chunks(name)
            assert ckpt.chunks("model.grid")
    assert len(parses) == 1


# -- a large .metadata parsed in a child process -----------------------------------------------------
@pytest.fixture
def in_child(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dcp_metadata, "CHILD_ABOVE", 0)


def _open_summary(path: Path, **options: Any) -> dict[str, Any]:
    with open_checkpoint(path, **options) as ckpt:
        totals = ckpt.tree.totals
        return {
            "entries": {k: (e.kind, str(e.dtype), e.shape, e.byte_size) for k, e in ckpt.entries.items()},
            "chunks": {k: ckpt.chunks(k) for k in ckpt.entries},
            "paths": ckpt.paths(),
            "totals": totals,
        }


@pytest.mark.parametrize("full_index", [True, False], ids=["at-open", "on-first-use"])
def test_a_child_process_indexes_the_same(
    chunked: Path, monkeypatch: pytest.MonkeyPatch, parses: list[str], full_index: bool
) -> None:
    monkeypatch.setattr(dcp_metadata, "CACHE_ABOVE", 1 << 40)  # nothing cached: each open parses
    here = _open_summary(chunked)
    monkeypatch.setattr(dcp_metadata, "CHILD_ABOVE", 0)
    assert _open_summary(chunked, full_index=full_index) == here
    assert len(parses) == (1 if full_index else 2)  # the child's parse is not seen here


def test_a_child_parse_is_cached(chunked: Path, in_child: None, parses: list[str]) -> None:
    first = _open_summary(chunked, full_index=True)
    assert len(_cache_files()) == 1
    assert _open_summary(chunked, full_index=True) == first
    assert parses == []


def test_a_child_refuses_a_crafted_metadata_the_same_way(chunked: Path, tmp_path: Path, in_child: None) -> None:
    md = read_metadata(chunked)
    marker = tmp_path / "PAYLOAD_RAN"
    md.planner_data = {**md.planner_data, "x": Payload(marker)}
    (chunked / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafePickleError, match=r"builtins\.exec") as refused:
        open_checkpoint(chunked, full_index=True)
    assert refused.value.what == "builtins.exec" and refused.value.source.endswith(".metadata")
    assert not marker.exists() and not _cache_files()


def test_damage_found_in_a_child_is_reported(chunked: Path, in_child: None) -> None:
    (chunked / ".metadata").write_bytes((chunked / ".metadata").read_bytes()[:-20])
    with pytest.raises(CorruptCheckpointError, match="damaged pickle"):
        open_checkpoint(chunked, full_index=True)


def test_a_child_that_dies_is_reported(chunked: Path, in_child: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dcp_children.sys, "executable", "/bin/false")
    with pytest.raises(CorruptCheckpointError, match="parsing its metadata failed"):
        open_checkpoint(chunked, full_index=True)


def test_without_a_child_it_parses_here(chunked: Path, in_child: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """No interpreter to start a child with (a frozen app): the parse happens in-process."""
    expected = _open_summary(chunked)
    monkeypatch.setattr(dcp_children.sys, "executable", "/nonexistent/python")
    assert _open_summary(chunked, full_index=True) == expected


def test_a_window_closing_stops_the_child_parse(tmp_path: Path, in_child: None) -> None:
    """``stop_index_children`` (the window's close) stops a child parse at once: the open raises
    CancelledError instead of making the closing window wait, and no child is left running."""
    import time

    from dcpstudio.core import CancelledError, stop_index_children
    from tests.perf import big_metadata

    (tmp_path / "big").mkdir()
    big_metadata.write_metadata(tmp_path / "big" / ".metadata", 20_000, 4)  # ~14 MiB: seconds to parse
    worker, outcome = on_thread(lambda: open_checkpoint(tmp_path / "big", full_index=True))
    deadline = time.monotonic() + 30
    while not dcp_children._CHILDREN and time.monotonic() < deadline:
        time.sleep(0.01)
    children = list(dcp_children._CHILDREN)
    assert children, "no child process was started"
    started = time.monotonic()
    stop_index_children()
    worker.join(30)
    assert time.monotonic() - started < 5
    assert len(outcome) == 1 and isinstance(outcome[0], CancelledError), outcome
    assert all(child.poll() is not None for child in children) and not dcp_children._CHILDREN
    assert not dcp_children._STOPPED
