"""The fast ``.metadata`` parser (:mod:`dcpstudio.core.checkpoints.dcp.fast`) must give exactly what the
generic restricted parse gives -- the same entries and the same index, byte for byte -- or nothing
(the generic parse then runs): on torch's own saves, on streams gathered from many ranks, on damaged
streams, and on streams built to fool it."""

from __future__ import annotations

import pickle
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import save as dcp_save

from dcpstudio.core import open_checkpoint
from dcpstudio.core.checkpoints.dcp import children as dcp_children
from dcpstudio.core.checkpoints.dcp import metadata as dcp_metadata
from dcpstudio.core.checkpoints.dcp.fast import fast_head, fast_index, same_head
from dcpstudio.core.checkpoints.dcp.metadata import entries_from_metadata
from dcpstudio.core.errors import CorruptCheckpointError, DCPStudioError
from dcpstudio.core.formats.dcp.index import DCPIndex
from dcpstudio.core.pickles.unpicklers import gc_paused, load_light_metadata
from tests.perf import big_metadata


def generic(data: bytes) -> tuple[DCPIndex, dict[str, Any]]:
    md = load_light_metadata(data, "x")
    entries = entries_from_metadata(md, "x")
    rows = [(e.fqn, e.dtype.name if e.dtype else None, e.shape) for e in entries.values()]
    with gc_paused():
        return DCPIndex.from_metadata(md, rows), entries


def described(entries: dict[str, Any]) -> list[tuple[str, str, Any, Any]]:
    return [(k, e.kind, e.dtype, e.shape) for k, e in entries.items()]


def assert_same(data: bytes, *, fast_expected: bool = True) -> None:
    """The fast parse gives the generic result (and, when ``fast_expected``, does not fall back)."""
    found = fast_index(data, "x")
    head = fast_head(data, "x")
    try:
        index, entries = generic(data)
    except DCPStudioError:  # refused: never parsed the fast way (its head may read, the whole cannot)
        assert found is None
        return
    if fast_expected:
        assert found is not None and head is not None
    if found is not None:
        assert found[0].to_bytes() == index.to_bytes()
        assert described(found[1]) == described(entries)
    if head is not None:
        assert same_head(head, entries, index)


def varied_state_dict() -> dict[str, Any]:
    """Every kind of entry torch writes, three or more of each (records come in runs)."""
    sd: dict[str, Any] = {}
    for i in range(4):
        sd[f"layers.{i}.weight"] = torch.zeros(8, 4, dtype=torch.bfloat16)
        sd[f"layers.{i}.bias"] = torch.zeros(8)
        sd[f"layers.{i}.step"] = torch.tensor(i)
        sd[f"layers.{i}.mask"] = torch.zeros(2, 3, 4, dtype=torch.bool)
        sd[f"layers.{i}.big"] = torch.zeros(1, 2, 1, 2, 1, dtype=torch.float16)
        sd[f"layers.{i}.empty"] = torch.zeros(0, 4)
        sd[f"layers.{i}.count"] = i
        sd[f"extra.{i}.name"] = f"layer {i}"
    sd["héllo.wörld"] = torch.ones(3)
    sd["\u0454\u0454"] = torch.ones(3)  # UTF-8 d1 94: the MEMOIZE byte inside a name
    sd["x" * 300] = torch.ones(3)  # a name over 255 bytes (BINUNICODE)
    sd["nested"] = {"a": {"b": torch.ones(2)}, "c": [torch.ones(1), 7]}
    return sd


def test_torch_saves_parse_the_same(tmp_path: Path) -> None:
    dcp_save(varied_state_dict(), checkpoint_id=tmp_path / "one")
    assert_same((tmp_path / "one" / ".metadata").read_bytes())


def test_a_multi_rank_torch_save_parses_the_same(multirank_dcp: Path) -> None:
    assert_same((multirank_dcp / ".metadata").read_bytes())


@pytest.mark.parametrize(("ranks", "protocol"), [(1, 4), (2, 4), (4, 4), (2, 5)])
def test_torch_pickled_metadata_parses_the_same(ranks: int, protocol: int) -> None:
    """torch's own classes pickled as FileSystemWriter pickles them (protocol 5: Python 3.14's
    default), names gathered from each rank."""
    assert_same(pickle.dumps(big_metadata.torch_metadata(40, ranks), protocol=protocol))


@pytest.mark.parametrize(("ranks", "rows", "cols"), [(4, 16, 64), (3, 1024, 1 << 20)])
def test_generated_metadata_parses_the_same(tmp_path: Path, ranks: int, rows: int, cols: int) -> None:
    """As the benchmark writes them; with chunks of 2 GiB, file offsets past 2**31 (LONG1)."""
    md = tmp_path / ".metadata"
    big_metadata.write_metadata(md, 600, ranks, rows=rows, cols=cols)
    assert_same(md.read_bytes())


def test_damaged_streams_never_parse_differently(tmp_path: Path) -> None:
    md = tmp_path / ".metadata"
    big_metadata.write_metadata(md, 30, 2, rows=16, cols=64)
    base = md.read_bytes()
    rng = random.Random(5)
    taken = 0
    for _ in range(250):
        data = bytearray(base)
        kind = rng.random()
        if kind < 0.15:
            data = data[: rng.randrange(len(data))]
        elif kind < 0.3:  # bytes cut out: a frame then claims more than the stream holds
            at = rng.randrange(len(data))
            del data[at : at + rng.randint(1, 40)]
        else:
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        assert_same(bytes(data), fast_expected=False)  # None, or the generic result
        taken += fast_index(bytes(data), "x") is not None
    assert taken > 0  # some flips land where they change nothing the parse sees


def test_records_inside_a_value_are_not_taken_for_records() -> None:
    """Bytes that look like a run of chunk records, inside a planner value: cut there, the runs'
    ids would be read as part of the value, never loaded -- the generic parse takes over."""
    md = big_metadata.torch_metadata(20, 2)
    data = pickle.dumps(md)
    start = data.index(b"\x14ChunkStorageMetadata")
    fake = data[start : start + 2000]
    md.planner_data["model.layers.0.block.0.weight"] = (fake, "model")
    assert_same(pickle.dumps(md), fast_expected=False)


def framed(payload: bytes) -> bytes:
    return b"\x80\x04\x95" + len(payload).to_bytes(8, "little") + payload


@pytest.mark.parametrize("child", [False, True])
def test_entries_set_twice_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, child: bool) -> None:
    """A stream whose Metadata sets its entries again after the storage index: its head says one
    thing, the whole stream another -- refused, not shown as either."""
    data = pickle.dumps(big_metadata.torch_metadata(30, 2))
    payload = b"".join(data[a + 9 : b] for a, b in _frames(data))
    assert payload.endswith(b"ub.")
    twice = framed(payload[:-3] + b"\x8c\x13state_dict_metadata}u" + b"b.")
    assert fast_head(twice, "x") is not None
    folder = tmp_path / "twice"
    folder.mkdir()
    (folder / ".metadata").write_bytes(twice)
    monkeypatch.setattr(dcp_metadata, "HEAD_ONLY_ABOVE", 0)
    monkeypatch.setattr(dcp_metadata, "CHILD_ABOVE", 0 if child else 1 << 40)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ckpt = open_checkpoint(folder)
    assert ckpt._head is not None  # type: ignore[attr-defined]  # opened from its head, the fast way
    with pytest.raises(CorruptCheckpointError, match="set twice"):
        ckpt.chunks(next(iter(ckpt.entries)))


def _frames(data: bytes) -> list[tuple[int, int]]:
    from dcpstudio.core.pickles.unpicklers import protocol4_frames

    found = protocol4_frames(data)
    assert found is not None
    return found


@pytest.mark.parametrize("child", [False, True])
def test_a_large_checkpoint_opens_the_fast_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, child: bool) -> None:
    """Opened from its head; its storage index parsed here or in a child process -- each the fast
    way -- and both what the generic parse gives."""
    folder = tmp_path / "big"
    folder.mkdir()
    big_metadata.write_metadata(folder / ".metadata", 12_000, 4, rows=16, cols=64)  # ~8 MiB
    data = (folder / ".metadata").read_bytes()
    assert len(data) > dcp_metadata.HEAD_ONLY_ABOVE
    index, entries = generic(data)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(dcp_metadata, "CHILD_ABOVE", 0 if child else 1 << 40)
    ckpt = open_checkpoint(folder)
    assert ckpt._head is not None  # type: ignore[attr-defined]
    assert described(ckpt.entries) == described(entries)
    name = big_metadata.name(777)
    assert ckpt.paths()[name] == tuple(name.split(".", 1))  # the planner data, read with the index
    assert ckpt.chunk_count(name) == 4
    assert ckpt._storage().to_bytes() == index.to_bytes()  # type: ignore[attr-defined]
    assert [c.offsets for c in ckpt.chunks(name)] == [(r * 16, 0) for r in range(4)]


def test_the_index_is_parsed_by_a_child_while_the_head_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A large checkpoint opened from its head has a child process parsing its storage index from the
    start; its result is what the index is, and a checkpoint closed, dropped or failing to open
    before asking for it leaves no child running."""
    import gc

    folder = tmp_path / "big"
    folder.mkdir()
    big_metadata.write_metadata(folder / ".metadata", 12_000, 4, rows=16, cols=64)  # ~8 MiB
    index, _ = generic((folder / ".metadata").read_bytes())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(dcp_metadata, "CHILD_ABOVE", 0)

    def started(ckpt: Any) -> Any:
        child = ckpt._child
        assert child is not None and child in dcp_children._CHILDREN
        return child

    ckpt = open_checkpoint(folder)
    child = started(ckpt)
    assert ckpt._storage().to_bytes() == index.to_bytes()  # type: ignore[attr-defined]
    assert child.returncode == 0 and ckpt._child is None  # type: ignore[attr-defined]  # taken from it
    for drop in ("close", "gc"):
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / f"cache-{drop}"))  # not opened from the cache
        ckpt = open_checkpoint(folder)
        child = started(ckpt)
        if drop == "close":
            ckpt.close()
        else:
            del ckpt
            gc.collect()
        assert child.poll() is not None and child not in dcp_children._CHILDREN
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache-damaged"))
    children: list[Any] = []
    real_start = dcp_children.start_child
    monkeypatch.setattr(
        dcp_children, "start_child", lambda data, label: children.append(real_start(data, label)) or children[-1]
    )
    data = (folder / ".metadata").read_bytes()
    (folder / ".metadata").write_bytes(data[: len(data) // 2])  # its head parse fails
    with pytest.raises(CorruptCheckpointError):
        open_checkpoint(folder)
    assert len(children) == 1 and children[0].poll() is not None and not dcp_children._CHILDREN


def test_a_frame_claiming_more_than_the_stream_holds_is_not_read_short() -> None:
    """One whole storage item cut out of a one-frame stream: what is left parses as records, but the
    frame says more bytes follow than do -- the unpickler refuses the stream, and so must this."""
    from dcpstudio.core.checkpoints.dcp.fast_cut import learn, unframed

    data = pickle.dumps(big_metadata.torch_metadata(8, 2))
    assert len(_frames(data)) == 1
    found = unframed(data)
    assert found is not None
    pats = learn(found[0])
    assert pats is not None
    items = list(pats.item.finditer(data))
    assert len(items) > 3
    a, b = items[-1].span()  # the last: nothing after it refers to what it stored
    cut = data[:a] + data[b:]
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        generic(cut)
    assert fast_index(cut, "x") is None


def test_a_refused_checkpoint_is_freed_and_refused_the_same_each_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refusal is kept and given again (a fresh error, no growing traceback), and nothing it
    raised through keeps the checkpoint -- and its metadata bytes -- alive once dropped."""
    import gc
    import weakref

    data = pickle.dumps(big_metadata.torch_metadata(30, 2))
    payload = b"".join(data[a + 9 : b] for a, b in _frames(data))
    folder = tmp_path / "twice"
    folder.mkdir()
    (folder / ".metadata").write_bytes(framed(payload[:-3] + b"\x8c\x13state_dict_metadata}u" + b"b."))
    monkeypatch.setattr(dcp_metadata, "HEAD_ONLY_ABOVE", 0)
    monkeypatch.setattr(dcp_metadata, "CHILD_ABOVE", 0)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ckpt = open_checkpoint(folder)
    name = next(iter(ckpt.entries))
    depths = []
    for _ in range(5):
        with pytest.raises(CorruptCheckpointError, match="set twice") as info:
            ckpt.chunks(name)
        tb, depth = info.value.__traceback__, 0
        while tb is not None:
            tb, depth = tb.tb_next, depth + 1
        depths.append(depth)
    assert len(set(depths[1:])) == 1  # the same each time, not growing
    ref = weakref.ref(ckpt)
    ckpt.close()
    del ckpt, info
    gc.collect()
    assert ref() is None


def test_closing_stops_a_child_another_thread_waits_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint closed while a thread waits for its index (the window opening another one): the
    child is stopped at once and the waiting thread told it was cancelled."""
    import time

    from dcpstudio.core import CancelledError
    from tests.conftest import on_thread

    folder = tmp_path / "big"
    folder.mkdir()
    big_metadata.write_metadata(folder / ".metadata", 40_000, 4)  # ~28 MiB: seconds to parse
    monkeypatch.setattr(dcp_metadata, "CHILD_ABOVE", 0)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ckpt = open_checkpoint(folder)
    child = ckpt._child  # type: ignore[attr-defined]
    assert child is not None
    waiter, outcome = on_thread(ckpt.wait_index)
    deadline = time.monotonic() + 30
    while ckpt._taken is None and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.005)
    started = time.monotonic()
    ckpt.close()
    waiter.join(30)
    assert time.monotonic() - started < 5 and child.poll() is not None
    assert len(outcome) == 1 and isinstance(outcome[0], CancelledError), outcome
    assert not dcp_children._CHILDREN and not dcp_children._STOPPED
    # whoever asks next (a preview job that waited behind it) is told the same, and starts no parse
    started_children: list[Any] = []
    monkeypatch.setattr(dcp_children, "start_child", lambda *a: started_children.append(a))
    with pytest.raises(CancelledError):
        ckpt.wait_index()
    assert started_children == []


def test_a_metadata_over_the_size_read_is_refused_as_too_large_not_damaged(tmp_path: Path) -> None:
    """A 1,024-rank run's .metadata can pass the size this tool reads: said so, not called damage."""
    from dcpstudio.core.errors import UnsupportedFormatError
    from dcpstudio.core.formats.dcp.files import METADATA_LIMIT

    folder = tmp_path / "huge"
    folder.mkdir()
    with open(folder / ".metadata", "wb") as f:
        f.truncate(METADATA_LIMIT + (1 << 30))  # sparse: nothing written
    with pytest.raises(UnsupportedFormatError, match=r"3\.0 GiB, more than the 2\.0 GiB DCP Studio reads"):
        open_checkpoint(folder)
