"""The pickle scan steps over runs of plain opcodes with one regular expression; it must walk every
stream exactly as the opcode-by-opcode walk it replaces: same end, same nesting bound, same refusal."""

from __future__ import annotations

import pickle
import random
from typing import Any

import pytest

from dcpstudio.core.errors import CorruptCheckpointError
from dcpstudio.core.pickles import guard as g


def _walk(data: bytes, label: str, start: int = 0) -> g.StreamInfo:
    """The opcode-by-opcode scan (the previous implementation), as the reference."""
    n, i, puts = len(data), start, 0
    while i < n:
        s = g._STEP[data[i]]
        if s:
            i += s
            continue
        op = data[i]
        i += 1
        kind = g._KIND[op]
        if kind == g._SIZED:
            width = g._LEN[op]
            size = int.from_bytes(data[i : i + width], "little", signed=op in g._SIGNED)
            if size < 0:
                raise g._damaged(label, "negative length")
            i += width + size
        elif kind == g._PUT:
            puts += 1
            width = g._LEN[op]
            g._check_memo(int.from_bytes(data[i : i + width], "little"), i - start, label)
            i += width
        elif kind == g._STOP:
            return g.StreamInfo(i, sum(data.count(code, start, i) for code in g._NESTING_OPS), puts)
        elif kind in (g._LINES, g._PUT_LINE):
            for _ in range(2 if op in g._TWO_LINES else 1):
                end = data.find(b"\n", i)
                if end < 0:
                    raise g._damaged(label, "unterminated text argument")
                if kind == g._PUT_LINE:
                    puts += 1
                    text = data[i:end]
                    if not text.isdigit():
                        raise g._damaged(label, "bad memo index")
                    g._check_memo(int(text), i - start, label)
                i = end + 1
        else:
            raise g._damaged(label, f"unknown or unsupported opcode 0x{op:02x} at byte {i - 1}")
    raise g._damaged(label, "it ends before its STOP opcode; truncated?")


def _outcome(fn: Any, data: bytes) -> Any:
    try:
        return fn(data, "x")
    except CorruptCheckpointError as e:
        return str(e)


def _values(rng: random.Random, depth: int = 0) -> Any:
    pick = rng.randrange(9 if depth < 4 else 6)
    if pick == 0:
        return rng.randrange(-(2**70), 2**70)
    if pick == 1:
        return rng.random() * 10 ** rng.randrange(-300, 300)
    if pick == 2:
        return "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.choice([0, 1, 5, 255, 256, 300])))
    if pick == 3:
        return bytes(rng.randrange(256) for _ in range(rng.choice([0, 3, 255, 256, 70000])))
    if pick == 4:
        return rng.choice([None, True, False, 0, -1, 255, 256, 65535, 2**31])
    if pick == 5:
        return rng.randrange(-(2**40), 2**40)
    kids = [_values(rng, depth + 1) for _ in range(rng.randrange(6))]
    if pick == 6:
        return kids
    if pick == 7:
        return tuple(kids)
    return {str(k): v for k, v in enumerate(kids)}


@pytest.mark.parametrize("protocol", [0, 1, 2, 3, 4, 5])
def test_scan_walks_like_the_opcode_walk(protocol: int) -> None:
    rng = random.Random(protocol)
    for _ in range(60):
        value = _values(rng)
        shared = [value, value]  # memo gets and puts
        data = pickle.dumps(shared, protocol=protocol)
        assert g.scan(data, "x") == _walk(data, "x") and g.scan(data, "x").end == len(data)
        for cut in {rng.randrange(len(data)) for _ in range(8)} | {len(data) - 1, 1}:
            assert _outcome(g.scan, data[:cut]) == _outcome(_walk, data[:cut])
        for _ in range(8):
            flipped = bytearray(data)
            flipped[rng.randrange(len(data))] = rng.randrange(256)
            assert _outcome(g.scan, bytes(flipped)) == _outcome(_walk, bytes(flipped))
        tail = data + b"garbage after STOP"
        assert g.scan(tail, "x") == _walk(tail, "x")


def test_scan_steps_over_long_runs_a_window_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs of plain opcodes longer than one window (a large .metadata's memo stores; so that no
    single match holds the GIL for long) walk the same, wherever a window ends: inside an opcode's
    argument, on a boundary, just before a truncation."""
    rng = random.Random(7)
    monkeypatch.setattr(g, "_WINDOW", 64)
    for _ in range(40):
        items = [rng.choice([1, 300, 70000, 2**40, None, True, -5]) for _ in range(rng.randrange(50, 400))]
        data = pickle.dumps([items, items[:7], "x" * rng.randrange(300)], protocol=rng.choice([2, 4, 5]))
        assert g.scan(data, "x") == _walk(data, "x") and g.scan(data, "x").end == len(data)
        for cut in {rng.randrange(len(data)) for _ in range(12)}:
            assert _outcome(g.scan, data[:cut]) == _outcome(_walk, data[:cut])
    body = b"\x80\x04N" + b"\x94" * (3 << 20) + b"."  # memo stores over three 1 MiB windows
    monkeypatch.setattr(g, "_WINDOW", 1 << 20)
    assert g.scan(body, "x") == _walk(body, "x") and g.scan(body, "x").end == len(body)
    assert _outcome(g.scan, body[:-1]) == _outcome(_walk, body[:-1])
