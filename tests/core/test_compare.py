"""compare(): per-entry rows whose metrics agree with a float64 reference over whole tensors,
whatever the block size; statuses, live rows, cancellation, tolerances, formats and casts."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from dcpstudio.core import (
    CancelledError,
    CancelToken,
    Progress,
    compare,
    convert,
    diff,
    open_checkpoint,
    torch_save_to_dcp,
)
from dcpstudio.core.ops.compare.diff import DiffReport, EntryComparison
from dcpstudio.core.ops.report import diff_json, diff_text


def _reference(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> dict[str, Any]:
    """The metrics of the module docstring, computed plainly on whole tensors."""
    wide = torch.complex128 if a.is_complex() or b.is_complex() else torch.float64
    x, y = a.to(wide).reshape(-1), b.to(wide).reshape(-1)
    finite = torch.isfinite(x) & torch.isfinite(y)
    bad = ~torch.isclose(x, y, rtol=rtol, atol=atol, equal_nan=True)
    nonfinite = int((bad & ~finite).sum())
    xf, yf = x[finite], y[finite]
    d, bb = (xf - yf).abs(), yf.abs()
    nz = bb != 0
    max_rel = float((d[nz] / bb[nz]).max()) if bool(nz.any()) else 0.0
    if bool((~nz & (d > atol)).any()):
        max_rel = math.inf
    na, nb, nd = (float(torch.linalg.vector_norm(v)) for v in (xf, yf, xf - yf))
    inner = float((xf.conj() * yf).real.sum())
    first = None
    if bool(bad.any()):
        flat = int(torch.nonzero(bad)[0])
        first = tuple(int(v) for v in torch.unravel_index(torch.tensor(flat), a.shape)) if a.dim() else ()
    return {
        "first_index": first,
        "count": x.numel(),
        "mismatched": int(bad.sum()),
        "nonfinite": nonfinite,
        "max_abs": math.inf if nonfinite else float(d.max()) if d.numel() else 0.0,
        "max_rel": max_rel,
        "rel_l2": nd / na if na else (0.0 if nd == 0 else math.inf),
        "cosine": None if na == 0 or nb == 0 else inner / (na * nb),
    }


def _pairs() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    f = torch.randn(97, 13, generator=g) * 3
    f2 = f + torch.randn(97, 13, generator=g) * 1e-3
    f2[:40] = f[:40]  # bitwise-equal leading blocks, then differing ones
    f2[50, 3] = 0.0  # B is 0 where A is not
    nan = f.clone()
    nan[1, 1], nan[2, 2], nan[3, 3] = math.nan, math.inf, -math.inf
    nan2 = nan * (1 + 1e-4)
    nan2[4, 4] = math.nan  # NaN against a number
    i = torch.randint(-50, 50, (200,), generator=g)
    c = torch.randn(61, dtype=torch.complex64, generator=g)
    sp = torch.randn(40, 100, generator=g)
    sp[0, 7], sp[0, 8] = math.nan, math.inf  # the same NaN and infinity on both sides: matching pairs
    sp2 = sp.clone()
    sp2[1, 0] += 1e-3  # a few pairs differ: compared on those alone
    sp2[20, 0], sp2[30, 0], sp2[39, 99] = 0.0, math.nan, -sp2[39, 99]
    big = torch.randint(-(2**40), 2**40, (3000,), generator=g)
    inf_b = torch.tensor([1.0, 2.0, 3.0, 4.0])
    return {
        "inf_against_finite": (inf_b, torch.tensor([1.0, math.inf, 3.0, -math.inf])),
        "sparse": (sp, sp2),
        "sparse_i64": (big, torch.where(torch.arange(3000) % 1000 == 999, big + 1, big)),
        "f32": (f, f2),
        "f32_equal": (f, f.clone()),
        "bf16": (f.bfloat16(), f2.bfloat16()),
        "f16": (f.half(), f2.half()),
        "f64": (f.double(), f2.double() + 1e-9),
        "nonfinite": (nan, nan2),
        "i64": (i, torch.where(i % 7 == 0, i + 1, i)),
        "u8": (i.abs().to(torch.uint8), (i.abs() + (i > 40)).to(torch.uint8)),
        "bool": (i > 0, i > 3),
        "c64": (c, c * (1 + 1e-3j)),
        "scalar": (torch.tensor(2.5), torch.tensor(2.75)),
        "scalar_zero": (torch.tensor(0.0), torch.tensor(1e-7)),
        "empty": (torch.zeros(0, 5), torch.zeros(0, 5)),
        "zeros": (torch.zeros(33), torch.zeros(33)),
        "cast": (f, f2.bfloat16()),
        "opposite": (f, -f),
    }


def _check(row: EntryComparison, ref: dict[str, Any]) -> None:
    for key in ("count", "mismatched", "nonfinite", "first_index"):
        assert getattr(row, key) == ref[key], (row.fqn, key)
    for key in ("max_abs", "max_rel", "rel_l2", "cosine"):
        got, want = getattr(row, key), ref[key]
        if want is None or math.isinf(want):
            assert got == want, (row.fqn, key, got, want)
        else:
            assert got == pytest.approx(want, rel=1e-9, abs=1e-15), (row.fqn, key)


@pytest.mark.parametrize("tol", [(0.0, 0.0), (1e-3, 1e-5)])
@pytest.mark.parametrize("budget", [64, 1 << 20])
def test_metrics_match_float64_reference(tmp_path: Path, budget: int, tol: tuple[float, float]) -> None:
    pairs = _pairs()
    torch.save({k: a for k, (a, _) in pairs.items()}, tmp_path / "a.pt")
    torch.save({k: b for k, (_, b) in pairs.items()}, tmp_path / "b.pt")
    rtol, atol = tol
    with open_checkpoint(tmp_path / "a.pt") as a, open_checkpoint(tmp_path / "b.pt") as b:
        rows = compare(a, b, rtol=rtol, atol=atol, budget=budget)
    assert [r.fqn for r in rows] == list(pairs)
    for row in rows:
        x, y = pairs[row.fqn]
        _check(row, _reference(x, y, rtol, atol))
        status = "dtype" if x.dtype != y.dtype else "different" if row.mismatched else "equal"
        assert row.status == status, row.fqn
        assert (row.dtype_a, row.shape_a) == (str(x.dtype).removeprefix("torch."), tuple(x.shape))
    by = {r.fqn: r for r in rows}
    assert by["f32_equal"].cosine == 1.0 and by["f32_equal"].rel_l2 == 0.0 and by["f32_equal"].max_abs == 0.0
    assert by["zeros"].cosine is None and by["zeros"].rel_l2 == 0.0
    assert by["scalar_zero"].rel_l2 == math.inf and by["scalar_zero"].max_rel == 1.0
    assert by["f32"].max_rel == math.inf  # B is 0 where A is not: no rtol covers it
    assert by["opposite"].cosine == -1.0
    assert by["nonfinite"].max_abs == math.inf and by["nonfinite"].rel_l2 is not None
    assert math.isfinite(by["nonfinite"].rel_l2) and by["nonfinite"].nonfinite == 1


def test_block_streaming_equals_whole_tensors(tmp_path: Path) -> None:
    pairs = _pairs()
    torch.save({k: a for k, (a, _) in pairs.items()}, tmp_path / "a.pt")
    torch.save({k: b for k, (_, b) in pairs.items()}, tmp_path / "b.pt")
    with open_checkpoint(tmp_path / "a.pt") as a, open_checkpoint(tmp_path / "b.pt") as b:
        small = compare(a, b, budget=64)
        whole = compare(a, b, budget=1 << 30)
    for s, w in zip(small, whole, strict=True):
        assert (s.status, s.count, s.mismatched, s.nonfinite, s.max_abs, s.max_rel) == (
            w.status,
            w.count,
            w.mismatched,
            w.nonfinite,
            w.max_abs,
            w.max_rel,
        )
        for key in ("rel_l2", "cosine"):
            got, want = getattr(s, key), getattr(w, key)
            assert got == want or got == pytest.approx(want, rel=1e-12), (s.fqn, key)


def test_nan_and_inf_pairs(tmp_path: Path) -> None:
    nan, inf = math.nan, math.inf
    a = torch.tensor([nan, 1.0, inf, -inf, inf, 2.0, -inf])
    b = torch.tensor([nan, nan, inf, inf, 3.0, 2.0, -inf])
    torch.save({"t": a}, tmp_path / "a.pt")
    torch.save({"t": b}, tmp_path / "b.pt")
    with open_checkpoint(tmp_path / "a.pt") as x, open_checkpoint(tmp_path / "b.pt") as y:
        (row,) = compare(x, y, budget=8)
        report = diff(x, y, budget=8)
    # matching: both NaN, the same infinity twice, 2 == 2; NaN vs 1, -inf vs inf, inf vs 3 do not
    assert (row.status, row.count, row.mismatched, row.nonfinite) == ("different", 7, 3, 3)
    assert row.max_abs == inf and row.max_rel == 0.0 and row.rel_l2 == 0.0 and row.cosine == 1.0
    assert [(v.mismatched, v.nonfinite, v.max_abs) for v in report.values] == [(3, 3, inf)]
    torch.save({"t": torch.tensor([inf, 1.0, -inf])}, tmp_path / "a.pt")
    torch.save({"t": torch.tensor([inf, 3.0, -inf])}, tmp_path / "b.pt")
    with open_checkpoint(tmp_path / "a.pt") as x, open_checkpoint(tmp_path / "b.pt") as y:
        (row,) = compare(x, y)
    assert (row.mismatched, row.nonfinite, row.max_abs, row.max_rel) == (1, 0, 2.0, 2 / 3)  # equal infinities match


def test_statuses(tmp_path: Path) -> None:
    base = {
        "same": torch.arange(10.0),
        "values": torch.ones(100),
        "dtype": torch.ones(3),
        "dtype_values": torch.ones(3),
        "shape": torch.ones(4),
        "kind": torch.ones(1),
        "obj": 0.1,
        "obj_same": "x",
        "only_a": torch.ones(1),
    }
    other = dict(base)
    other.update(
        values=torch.ones(100).index_fill(0, torch.tensor([7]), 2.0),
        dtype=torch.ones(3, dtype=torch.float64),
        dtype_values=torch.full((3,), 2, dtype=torch.float64),
        shape=torch.ones(2, 2),
        kind=7,
        obj=0.2,
    )
    del other["only_a"]
    other["only_b"] = torch.zeros(2)
    torch.save(base, tmp_path / "a.pt")
    torch.save(other, tmp_path / "b.pt")
    with open_checkpoint(tmp_path / "a.pt") as a, open_checkpoint(tmp_path / "b.pt") as b:
        rows = {r.fqn: r for r in compare(a, b)}
    assert {k: r.status for k, r in rows.items()} == {
        "same": "equal",
        "values": "different",
        "dtype": "dtype",
        "dtype_values": "dtype",
        "shape": "shape",
        "kind": "kind",
        "obj": "different",
        "obj_same": "equal",
        "only_a": "only_a",
        "only_b": "only_b",
    }
    assert rows["dtype"].mismatched == 0 and rows["dtype"].rel_l2 == 0.0 and rows["dtype"].cosine == 1.0
    assert rows["dtype_values"].mismatched == 3 and rows["dtype_values"].rel_l2 == pytest.approx(1.0)
    assert (rows["dtype"].dtype_a, rows["dtype"].dtype_b) == ("float32", "float64")
    assert (rows["shape"].shape_a, rows["shape"].shape_b, rows["shape"].max_abs) == ((4,), (2, 2), None)
    assert (rows["kind"].kind_a, rows["kind"].kind_b) == ("tensor", "object")
    assert rows["obj"].max_abs is None and rows["obj"].count == 0
    assert (rows["only_a"].kind_b, rows["only_b"].kind_a, rows["only_b"].shape_b) == (None, None, (2,))
    assert (rows["values"].mismatched, rows["values"].max_abs, rows["values"].max_rel) == (1, 1.0, 0.5)


def test_rows_arrive_one_by_one_in_order(tmp_path: Path) -> None:
    torch.save({"z": torch.ones(3), "a": torch.ones(3), "m": 1}, tmp_path / "a.pt")
    torch.save({"b_only": torch.ones(1), "m": 1, "a": torch.ones(3), "z": torch.zeros(3)}, tmp_path / "b.pt")
    seen: list[EntryComparison] = []
    with open_checkpoint(tmp_path / "a.pt") as a, open_checkpoint(tmp_path / "b.pt") as b:
        rows = compare(a, b, on_entry=seen.append)
    assert seen == rows
    assert [(r.fqn, r.status) for r in rows] == [
        ("z", "different"),
        ("a", "equal"),
        ("m", "equal"),
        ("b_only", "only_b"),
    ]


def test_only_one_entry_or_module(tmp_path: Path) -> None:
    """``only``: the entry of that name or those under it (a module, not a name that merely starts the
    same), only-in-A/B included; only their bytes are read; the rows equal the whole comparison's."""
    a = {"layers.1.w": torch.ones(4), "layers.1.b": torch.ones(2), "layers.10.w": torch.ones(3), "lr": 0.1,
         "layers.1.gone": torch.ones(1)}  # fmt: skip
    b = {**a, "layers.1.w": torch.full((4,), 2.0), "layers.1.new": torch.ones(1)}
    del b["layers.1.gone"]
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    seen: list[Progress] = []
    with open_checkpoint(tmp_path / "a.pt") as x, open_checkpoint(tmp_path / "b.pt") as y:
        whole = {r.fqn: r for r in compare(x, y)}
        module = compare(x, y, only="layers.1", progress=seen.append)
        one = compare(x, y, only="layers.10.w")
        none = compare(x, y, only="layers.2")
    assert [(r.fqn, r.status) for r in module] == [
        ("layers.1.w", "different"),
        ("layers.1.b", "equal"),
        ("layers.1.gone", "only_a"),
        ("layers.1.new", "only_b"),
    ]
    assert all(r == whole[r.fqn] for r in module)
    assert max(p.total_bytes for p in seen) == 2 * (4 + 2) * 4  # A's and B's bytes of the module only
    assert [r.fqn for r in one] == ["layers.10.w"] and none == []


def test_cancel_midway(tmp_path: Path) -> None:
    sd = {f"t{i}": torch.randn(100) for i in range(5)}
    torch.save(sd, tmp_path / "a.pt")
    torch.save({k: v + 1 for k, v in sd.items()}, tmp_path / "b.pt")
    token = CancelToken()
    seen: list[EntryComparison] = []

    def on_entry(row: EntryComparison) -> None:
        seen.append(row)
        if len(seen) == 2:
            token.cancel()

    with (
        open_checkpoint(tmp_path / "a.pt") as a,
        open_checkpoint(tmp_path / "b.pt") as b,
        pytest.raises(CancelledError),
    ):
        compare(a, b, cancel=token, on_entry=on_entry, budget=64)
    assert [r.fqn for r in seen] == ["t0", "t1"]


def test_tolerance_changes_mismatched_only(tmp_path: Path) -> None:
    a = torch.linspace(1, 2, 1000)
    b = a.clone()
    b[:10] += 1e-6  # within rtol 1e-5
    b[10:13] += 1e-2  # beyond it
    torch.save({"w": a}, tmp_path / "a.pt")
    torch.save({"w": b}, tmp_path / "b.pt")
    with open_checkpoint(tmp_path / "a.pt") as x, open_checkpoint(tmp_path / "b.pt") as y:
        exact, loose, looser = (compare(x, y, rtol=r, budget=256)[0] for r in (0.0, 1e-5, 1e-1))
    assert (exact.mismatched, loose.mismatched, looser.mismatched) == (13, 3, 0)
    assert (looser.status, exact.status) == ("equal", "different")
    assert exact.max_abs == loose.max_abs == looser.max_abs and exact.rel_l2 == looser.rel_l2


def test_large_integers_compare_exactly(tmp_path: Path) -> None:
    a = torch.tensor([2**60, 5], dtype=torch.int64)
    torch.save({"seed": a}, tmp_path / "a.pt")
    torch.save({"seed": a + torch.tensor([1, 0])}, tmp_path / "b.pt")  # equal in float64
    with open_checkpoint(tmp_path / "a.pt") as x, open_checkpoint(tmp_path / "b.pt") as y:
        assert compare(x, y)[0].mismatched == 1
        assert not diff(x, y).equal


def _model(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(1)
    sd = {
        "model": {"w": torch.randn(64, 32, generator=g), "b": torch.zeros(32), "n": torch.randn(7).double()},
        "step": 3,
    }
    torch.save(sd, tmp_path / "m.pt")
    return tmp_path / "m.pt"


def test_formats_compare_equal(tmp_path: Path) -> None:
    src = _model(tmp_path)
    torch_save_to_dcp(src, tmp_path / "dcp")
    with open_checkpoint(src) as a, open_checkpoint(tmp_path / "dcp") as b:
        rows = {r.fqn: r for r in compare(a, b, budget=512)}
    assert {r.status for r in rows.values()} == {"equal"}
    for fqn in ("model.w", "model.n"):
        assert (rows[fqn].cosine, rows[fqn].rel_l2, rows[fqn].max_abs, rows[fqn].mismatched) == (1.0, 0.0, 0.0, 0)
    assert rows["model.b"].cosine is None and rows["model.b"].rel_l2 == 0.0  # all zeros: no direction


def test_bf16_cast_shows_dtype_and_small_change(tmp_path: Path) -> None:
    src = _model(tmp_path)
    convert(src, tmp_path / "bf16", to="dcp", dtype="bf16")
    with open_checkpoint(src) as a, open_checkpoint(tmp_path / "bf16") as b:
        rows = {r.fqn: r for r in compare(a, b)}
    w = rows["model.w"]
    assert (w.status, w.dtype_a, w.dtype_b) == ("dtype", "float32", "bfloat16")
    assert w.mismatched > 0 and 0 < w.rel_l2 < 1e-2 and w.cosine > 0.9999 and 0 < w.max_rel <= 2**-8
    assert rows["step"].status == "equal"


def test_report_prints_readable_numbers(tmp_path: Path) -> None:
    a = {"zero_b": torch.tensor([1.0, 2.0, 3.0]), "nan": torch.tensor([1.0, math.nan]), "ok": torch.ones(4)}
    b = {"zero_b": torch.tensor([0.0, 2.0, 3.5]), "nan": torch.tensor([1.0, 1.0]), "ok": torch.ones(4) * 1.001}
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    with open_checkpoint(tmp_path / "a.pt") as x, open_checkpoint(tmp_path / "b.pt") as y:
        report = diff(x, y)
    text = diff_text(report)
    assert "e+300" not in text and "e+3" not in text
    assert "zero_b, first at [0]: 2/3 elements, max abs 1, max rel inf (B is 0 where A is not), rel L2 0.2988" in text
    assert "nan, first at [1]: 1/2 elements, max abs inf (1 NaN/Inf against a different value)" in text
    assert "rel L2 0 over the finite pairs" in text
    assert "ok, first at [0]: 4/4 elements, max abs 0.001" in text
    data = json.loads(json.dumps(diff_json(report)))
    assert [v["nonfinite"] for v in data["values"]] == [1 if v["fqn"] == "nan" else 0 for v in data["values"]]


def test_reads_bounded_blocks_and_reads_again_only_what_it_must(tmp_path: Path) -> None:
    a = torch.randn(100, 10)
    b = a.clone()
    b[95:] += 1  # the last blocks differ: the earlier, equal ones are needed again for ||a||
    torch.save({"same": a, "late": a}, tmp_path / "a.pt")
    torch.save({"same": a, "late": b}, tmp_path / "b.pt")
    with open_checkpoint(tmp_path / "a.pt") as x, open_checkpoint(tmp_path / "b.pt") as y:
        reads: list[tuple[str, str, int]] = []
        for ckpt, side in ((x, "a"), (y, "b")):
            real = ckpt.read_tensor

            def spy(fqn: str, region: Any = None, real: Any = real, side: str = side) -> torch.Tensor:
                out = real(fqn, region)
                reads.append((side, fqn, out.numel()))
                return out

            ckpt.read_tensor = spy  # type: ignore[method-assign]
        seen: list[Progress] = []
        rows = compare(x, y, budget=400, progress=seen.append)  # blocks of 10 rows
        compare_reads = list(reads)
        reads.clear()
        diff(x, y, budget=400)
    assert all(n * 4 <= 400 for _, _, n in compare_reads + reads)
    assert sum(n for s, f, n in compare_reads if (s, f) == ("a", "same")) == 1000  # equal: read once
    assert sum(n for s, f, n in compare_reads if (s, f) == ("b", "late")) == 1000
    assert sum(n for s, f, n in compare_reads if (s, f) == ("a", "late")) == 1000 + 900  # rows 0-89 again
    assert sum(n for _, _, n in reads) == 4000 + 900  # diff's rel_l2 needs ||a|| too: A's equal blocks again
    _check(rows[1], _reference(a, b, 0.0, 0.0))
    assert seen[-1].fraction == 1.0 and seen[-1].done_items == 2


def test_first_differing_index_and_quick_stop(tmp_path: Path) -> None:
    """Every report says where a tensor starts to differ; ``quick`` reads each tensor only up to its
    first differing block and says its counts are partial."""
    a = {
        "early": torch.randn(100, 10),
        "late": torch.randn(4, 50, 5),
        "ints": torch.arange(1000),
        "same": torch.ones(50),
    }
    b = {k: v.clone() for k, v in a.items()}
    b["early"][3, 7] += 1
    b["early"][60:] += 1
    b["late"][3, 41, 2] = math.nan
    b["ints"][999] = -1
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    with open_checkpoint(tmp_path / "a.pt") as x, open_checkpoint(tmp_path / "b.pt") as y:
        full = {v.fqn: v for v in diff(x, y, budget=400).values}
        reads: list[tuple[str, int]] = []
        real = x.read_tensor
        x.read_tensor = lambda fqn, region=None: reads.append((fqn, (t := real(fqn, region)).numel())) or t  # type: ignore[method-assign]
        quick = {v.fqn: v for v in diff(x, y, budget=400, quick=True).values}
        quick_reads = sum(n for f, n in reads if f == "early")
        rows = {r.fqn: r for r in compare(x, y, budget=400)}
    assert {f: v.first_index for f, v in full.items()} == {"early": (3, 7), "late": (3, 41, 2), "ints": (999,)}
    assert full["early"].mismatched == 1 + 400 and not full["early"].partial
    assert full["early"].rel_l2 == pytest.approx(float((a["early"] - b["early"]).norm() / a["early"].norm()))
    assert rows["early"].first_index == (3, 7) and rows["same"].first_index is None
    assert {f: v.first_index for f, v in quick.items()} == {f: v.first_index for f, v in full.items()}
    assert quick["early"].partial and quick["early"].mismatched == 1 and quick["early"].rel_l2 is None
    assert quick_reads == 100  # its first block of 10 rows, nothing after
    assert "first at [3, 7]" in diff_text(DiffReport("a", "b", values=[full["early"]]))
