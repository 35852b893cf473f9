"""How :mod:`.fast` takes a DCP ``.metadata`` pickle apart: the byte patterns of its records
(learnt from the stream), the runs of them cut out, and the remainder -- with a placeholder and an id
where each run was -- unpickled restricted and checked to be the real parse (see :mod:`.fast`)."""

from __future__ import annotations

import os
import pickle
import re
import sys
from itertools import accumulate, chain, repeat
from operator import methodcaller
from typing import Any

from ...dtypes import DType
from ...pickles.guard import YieldingStream, lands_on, run_with_stack, scan
from ...pickles.unpicklers import LIGHT_METADATA_GLOBALS, Restricted, protocol4_frames

__all__ = ["INT", "LONG1", "PLANNER_KEY", "Cut", "NotFast", "RunToken", "learn", "unframed", "unpickled"]


MD = "torch.distributed.checkpoint.metadata"
_B = rb"[\x00-\xff]"
_REF = rb"(?:h[\x00-\xff]|j[\x00-\xff]{4})"
LONG1 = b"|".join(rb"\x8a" + re.escape(bytes([n])) + _B + b"{%d}" % n for n in range(1, 9))
INT = rb"(?:K[\x00-\xff]|M[\x00-\xff]{2}|J[\x00-\xff]{4}|" + LONG1 + rb")"
# an integer tuple: EMPTY_TUPLE; MARK ... TUPLE; or 1-3 integers, TUPLE1-3 (factored: no integer is
# matched twice), then MEMOIZE
_TUP = rb"(?:\)|\((?:" + INT + rb")+t\x94|" + INT + rb"(?:\x85\x94|" + INT + rb"(?:\x86\x94|" + INT + rb"\x87\x94)))"
_NEW = rb"\)\x81\x94\}\x94\("  # EMPTY_TUPLE NEWOBJ MEMOIZE EMPTY_DICT MEMOIZE MARK
_NEW_RAW = b")\x81\x94}\x94("
_SIZE_TAIL = rb"\x85\x94R\x94"  # TUPLE1 MEMOIZE REDUCE MEMOIZE: torch.Size(tuple)
# a name written in place, up to the first MEMOIZE byte (checked against its length afterwards; a
# name holding that byte makes its record no match: it is parsed with the remainder)
_NAME = rb"\x8c" + _B + rb"[^\x94]*+\x94"
# one record of each kind with its references captured: where the patterns are learnt
LEARN_PATTERNS = {
    "chunk": re.compile(
        b"(" + _REF + b")" + _NEW + b"(" + _REF + b")(" + _REF + b")" + _TUP + _SIZE_TAIL
        + b"(" + _REF + b")(" + _REF + b")" + _TUP + _SIZE_TAIL + b"ub"
    ),
    "item": re.compile(
        b"(" + _REF + b")" + _NEW + b"(" + _REF + rb")(?:" + _REF + b"|" + _NAME + b")(" + _REF + rb")(?:N|" + INT
        + b")(" + _REF + b")(" + _REF + b")" + _TUP + _SIZE_TAIL + b"ub(" + _REF + b")" + _NEW + b"(" + _REF + b")"
        + _REF + b"(" + _REF + b")" + INT + b"(" + _REF + b")" + INT + b"ub"
    ),
    "entry": re.compile(
        _NAME + b"(" + _REF + b")" + _NEW + b"(" + _REF + b")(" + _REF + rb")\)\x81\x94\(" + _REF + _REF
        + rb"[\x88\x89]" + _REF + rb"[\x88\x89]t\x94b(" + _REF + b")(" + _REF + b")" + _TUP + _SIZE_TAIL + b"("
        + _REF + rb")\]\x94"
    ),
}  # fmt: skip
_LEARN_AFTER = {
    "chunk": b"\x14ChunkStorageMetadata\x94",
    "item": b"\x0c_StorageInfo\x94",
    "entry": b"\x15TensorStorageMetadata\x94",
}
_RUN_LIMIT = {"entry": 512, "item": 4096}  # records per run: bounds what one run's parse holds
_LIGHT = {name: LIGHT_METADATA_GLOBALS[(MD, name)] for name in ("ChunkStorageMetadata", "MetadataIndex")}
_WANT = (  # what the learnt references must name, in Patterns.refs order
    _LIGHT["ChunkStorageMetadata"], "offsets", tuple, "sizes", tuple,
    _LIGHT["MetadataIndex"], "fqn", "index", "offset", tuple,
    LIGHT_METADATA_GLOBALS[("torch.distributed.checkpoint.filesystem", "_StorageInfo")], "relative_path", "offset",
    "length",
    LIGHT_METADATA_GLOBALS[(MD, "TensorStorageMetadata")], "properties",
    LIGHT_METADATA_GLOBALS[(MD, "TensorProperties")], "size", tuple, "chunks",
)  # fmt: skip


class NotFast(Exception):
    pass


class _Placeholder:
    """What the memo holds where a run's records were."""


class RunToken:
    """Stands for one cut-out run in the unpickled remainder."""

    __slots__ = ("k", "seen")

    def __init__(self, k: int) -> None:
        self.k = k
        self.seen = 0


class _Unpickler(Restricted):
    def __init__(self, stream: Any, label: str, ids: dict[str, Any]) -> None:
        super().__init__(stream, label, LIGHT_METADATA_GLOBALS)
        self._ids = ids

    def persistent_load(self, pid: Any) -> Any:
        found = self._ids.get(pid) if type(pid) is str else None
        if found is None:
            raise pickle.UnpicklingError("not a run of this parse")
        if type(found) is RunToken:
            found.seen += 1
        return found


def _memo_of_sizes(col: list[bytes]) -> int:
    """Memo stores of ``torch.Size`` values written with these tuples (an empty tuple is not stored)."""
    return 3 * len(col) - col.count(b")")


def _record_memo(offsets: bytes, sizes: bytes) -> int:
    return 6 + (offsets != b")") + (sizes != b")")


class Patterns:
    """This stream's record patterns (its references as learnt), capturing and for finding runs."""

    def __init__(self, chunk: tuple[bytes, ...], item: tuple[bytes, ...] | None, entry: tuple[bytes, ...]) -> None:
        """``item`` None: no storage items are looked for (the head of a stream)."""
        self.refs = [*chunk, *(item or ()), *entry]  # the references learnt, and what each must name:
        self.want = [*_WANT[:5], *(_WANT[5:14] if item else ()), *_WANT[14:]]
        item = item or (b"\x00",) * 9
        cls, k_offsets, size, k_sizes, size2 = (re.escape(b) for b in chunk)
        mi, k_fqn, k_index, k_offset, size3, si, k_path, k_offset2, k_length = (re.escape(b) for b in item)
        tsm, k_props, props, k_size, size4, k_chunks = (re.escape(b) for b in entry)
        self.empty_size = chunk[2] + b")\x85\x94R"  # a record's torch.Size of no dimensions
        self.head = {
            "chunk": chunk[0] + _NEW_RAW + chunk[1],
            "item": item[0] + _NEW_RAW + item[1],
            "entry": entry[0] + _NEW_RAW + entry[1],
        }

        def rec(g: bytes) -> bytes:  # g: b"(" to capture, b"(?:" not to
            tup = g + _TUP + b")"
            return cls + _NEW + k_offsets + size + tup + _SIZE_TAIL + k_sizes + size2 + tup + _SIZE_TAIL + b"ub"

        def split(g: bytes) -> bytes:  # an integer's argument in one of three groups (see _int_column)
            if g == b"(?:":
                return INT
            return rb"(?:K([\x00-\xff])|M([\x00-\xff]{2})|J([\x00-\xff]{4})|(" + LONG1 + b"))"

        def item_(g: bytes) -> bytes:
            fqn = rb"(?:" + g + _REF + rb")|\x8c" + g + _B + b")" + g + rb"[^\x94]*+)\x94)"
            return (
                mi + _NEW + k_fqn + fqn + k_index + g + b"N|" + INT + b")" + k_offset + size3 + g + _TUP + b")"
                + _SIZE_TAIL + b"ub" + si + _NEW + k_path + g + _REF + b")" + k_offset2 + split(g) + k_length + split(g)
                + b"ub"
            )  # fmt: skip

        plain = rec(b"(?:")
        chunks = rb"(?:\(" + plain + rb"(?:(?:e\()?" + plain + rb")*+e|" + plain + b"a)?+"

        def entry_(g: bytes) -> bytes:
            return (
                rb"\x8c" + g + _B + b")" + g + rb"[^\x94]*+)\x94" + tsm + _NEW + k_props + props + rb"\)\x81\x94\("
                + g + _REF + b")" + g + _REF + rb")[\x88\x89]" + g + _REF + rb")[\x88\x89]t\x94b" + k_size + size4
                + g + _TUP + b")" + _SIZE_TAIL + k_chunks + rb"\]\x94" + g + chunks + b")ub"
            )  # fmt: skip

        self.chunk = re.compile(rec(b"("))
        self.item = re.compile(item_(b"("))
        self.entry = re.compile(entry_(b"("))
        one = {"item": item_(b"(?:"), "entry": entry_(b"(?:")}
        self.runs = {
            kind: re.compile(one[kind] + b"(?:(?:u\\()?" + one[kind] + b"){0,%d}" % (_RUN_LIMIT[kind] - 1))
            for kind in ("entry", "item")
        }


def learn(s: bytes, kinds: tuple[str, ...] = ("chunk", "item", "entry")) -> Patterns | None:
    found: dict[str, tuple[bytes, ...] | None] = {"item": None}
    for kind in kinds:
        at = s.find(_LEARN_AFTER[kind])
        m = LEARN_PATTERNS[kind].search(s, at) if at >= 0 else None
        if m is None:
            return None
        found[kind] = m.groups()
    try:
        return Patterns(found["chunk"], found["item"], found["entry"])  # type: ignore[arg-type]
    except re.error:
        return None


def unframed(data: bytes, upto: bytes | None = None) -> tuple[bytes, list[int]] | None:
    """The stream without its FRAME opcodes, and where each frame began in it; with ``upto``, only the
    stream before the first occurrence of those bytes (inside one frame)."""
    frames = protocol4_frames(data)
    if frames is None:
        return None
    end = len(data)
    if upto is not None:
        end = data.find(upto)
        cut = next(((a, b) for a, b in frames if a + 9 <= end and end + len(upto) <= b), None)
        if end < 0 or cut is None:
            return None
        frames = [(a, min(b, end)) for a, b in frames if a < end]
    starts, at = [], 2
    for a, b in frames:
        starts.append(at)
        at += b - a - 9
    view = memoryview(data)
    return data[:2] + b"".join([view[a + 9 : b] for a, b in frames]), starts


def _pid(pid: str) -> bytes:
    raw = pid.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


class Cut:
    """The runs cut out of the stream, what each held, and the remainder with their ids."""

    def __init__(self, s: bytes, frame_starts: list[int], pats: Patterns) -> None:
        self.s, self.pats = s, pats
        nonce = os.urandom(12).hex()
        self.nonce = nonce
        self.placeholder = _Placeholder()
        self.ids: dict[str, Any] = {f"{nonce}:p": self.placeholder}
        self.fill = _pid(f"{nonce}:p") + b"Q"
        self.marks: list[RunToken] = []
        self.tokens: list[RunToken] = []
        self.runs: list[tuple[str, Any]] = []
        self.pieces: list[bytes] = []
        self.refs: dict[str, set[bytes]] = {"fqn": set(), "path": set(), "dtype": set(), "other": set()}
        self.head_only = False  # the stream up to its planner data: entries only, no storage items
        self._kept = 0  # the stream is taken up to here
        self.frame_starts = frame_starts
        self._frames = iter(frame_starts)
        self._next_frame = next(self._frames, len(s))

    def keep(self, a: int, b: int) -> None:
        """Keep ``s[a:b]``, with an id at each frame start in it."""
        s = self.s
        while self._next_frame < b:
            if self._next_frame < a:
                raise NotFast
            mark = RunToken(-1)
            pid = f"{self.nonce}:f{len(self.marks)}"
            self.marks.append(mark)
            self.ids[pid] = mark
            self.pieces.append(s[a : self._next_frame] + _pid(pid) + b"Q0")
            a = self._next_frame
            self._next_frame = next(self._frames, len(s))
        self.pieces.append(s[a:b])

    def _skip_frames(self, b: int) -> None:
        """Step past a frame start at a run's first byte (runs lie within frames: :meth:`all_runs`)."""
        while self._next_frame < b:
            self._next_frame = next(self._frames, len(self.s))

    def cut(self, kind: str, a: int, b: int) -> None:
        s, pats = self.s, self.pats
        self._skip_frames(b)
        if kind == "entry":
            groups = pats.entry.findall(s, a, b)
            lists = [g[6] for g in groups]
            counts = list(map(methodcaller("count", pats.head["chunk"]), lists))
            if len(groups) != s.count(pats.head["entry"], a, b) or sum(counts) != s.count(pats.head["chunk"], a, b):
                raise NotFast
            sizes = [g[5] for g in groups]
            if self.head_only:  # no record decoded: their memo stores counted from their empty sizes;
                # nothing after the entries refers to what they stored
                empty = list(map(methodcaller("count", pats.empty_size), lists))
                memo = sum(8 + (z != b")") + 8 * n - e for z, n, e in zip(sizes, counts, empty, strict=True))
                body = b"\x94" * memo
                offs: list[bytes] = []
                boxes: list[bytes] = []
            else:
                # the run's chunk heads are all in its chunk lists (counted above): a match of a whole
                # record starts at each of them, and only there -- as in the lists alone, with no copy
                records = pats.chunk.findall(s, a, b)
                if sum(counts) != len(records):
                    raise NotFast
                offs, boxes = [r[0] for r in records], [r[1] for r in records]
                # the memo stores each entry makes: its name first (stored for real: the planner data
                # refers to it), then 5 objects and its size's, then each record's 2 and its two sizes'
                at_end = list(accumulate(map(_record_memo, offs, boxes), initial=0))
                ends = list(accumulate(counts, initial=0))
                rest = [
                    7 + (z != b")") + at_end[e1] - at_end[e0] for z, e0, e1 in zip(sizes, ends, ends[1:], strict=False)
                ]
                names = [b"\x8c" + g[0] + g[1] + b"\x94" for g in groups]  # pushed, stored, popped
                body = b"".join(chain.from_iterable(zip(names, repeat(b"0"), [b"\x94" * n for n in rest])))
            self.refs["dtype"].update(g[2] for g in groups)
            self.refs["other"].update(chain((g[3] for g in groups), (g[4] for g in groups)))
            held: Any = (groups, counts, offs, boxes)
        else:
            groups = pats.item.findall(s, a, b)
            self.refs["fqn"].update(g[0] for g in groups)
            self.refs["path"].update(g[5] for g in groups)
            memo = 4 * len(groups) + sum(1 for g in groups if not g[0]) + _memo_of_sizes([g[4] for g in groups])
            body = b"\x94" * memo
            held = groups
        k = len(self.runs)
        self.runs.append((kind, held))
        pid = f"{self.nonce}:{k}"
        self.tokens.append(RunToken(k))
        self.ids[pid] = self.tokens[-1]
        self.pieces.append(self.fill + body + b"0" + _pid(pid) + b"QN")

    def remainder(self) -> tuple[bytes, list[bytes]]:
        """The stream as cut, ending with the probes (a tuple of every reference the runs used)."""
        self.keep(self._kept, len(self.s) - 1)
        if self._next_frame != len(self.s):
            raise NotFast
        self.refs["fqn"].discard(b"")
        probes = [*self.pats.refs, *chain.from_iterable(sorted(v) for v in self.refs.values())]
        self.pieces.append(b"(" + b"".join(probes) + b"t\x86.")
        out = b"".join(self.pieces)
        self.pieces = []
        return out, probes

    def all_runs(self) -> None:
        """Cut out every run. Runs are found by searching the raw stream, which also finds
        record-shaped bytes where the unpickler never executes them: inside an argument (a
        ``BINBYTES`` whose length covers them) or across a frame's end. So runs are looked for within
        frames only, and a run is taken only when a walk of the opcodes between runs, from the
        stream's start, lands on its first byte -- and on every frame start on the way. A run's
        pattern is whole opcodes, so from a proven start it is read as the unpickler reads it, and its
        end is an opcode start too."""
        kinds = ("entry",) if self.head_only else ("entry", "item")
        s, runs, frames = self.s, self.pats.runs, self.frame_starts
        spans = []
        for a, b in zip([0, *frames], [*frames, len(s)], strict=True):
            spans += [(m.start(), m.end(), kind) for kind in kinds for m in runs[kind].finditer(s, a, b)]
        spans.sort()
        at, next_frame = 0, 0
        for a, b, kind in spans:
            if a < self._kept:
                raise NotFast
            first = next_frame
            while next_frame < len(frames) and frames[next_frame] <= a:
                next_frame += 1
            if not lands_on(s, [*frames[first:next_frame], a], at):
                raise NotFast
            self.keep(self._kept, a)
            self.cut(kind, a, b)
            self._kept = at = b
        if not lands_on(s, frames[next_frame:], at):
            raise NotFast


def _load(reduced: bytes, info: Any, label: str, ids: dict[str, Any]) -> Any:
    return run_with_stack(info, label, lambda: _Unpickler(YieldingStream(reduced), label, ids).load())


def unpickled(cut: Cut, label: str) -> tuple[Any, dict[bytes, Any]]:
    """The remainder unpickled, every check of the cuts passed, and what each reference names."""
    cut.all_runs()
    reduced, probes = cut.remainder()
    info = scan(reduced, label)
    if info.end != len(reduced) or info.puts:
        raise NotFast
    ids, cut.ids = cut.ids, {}
    result = _load(reduced, info, label, ids)
    del reduced, ids
    if type(result) is not tuple or len(result) != 2 or type(result[1]) is not tuple:
        raise NotFast
    md, got = result
    del result
    if len(got) != len(probes) or any(m.seen != 1 for m in cut.marks) or any(t.seen != 1 for t in cut.tokens):
        raise NotFast
    # what the remainder built may hold no placeholder, and each run once (none reached through a memo
    # reference): counted by references -- the cut's own, the argument's, and one in the result
    unused = [RunToken(-1)]  # held as the runs are, in nothing else: the baseline count
    base = next(sys.getrefcount(t) for t in unused)
    if sys.getrefcount(cut.placeholder) != sys.getrefcount(unused[0]) or any(
        n != base + 1 for n in [sys.getrefcount(t) for t in cut.tokens]
    ):
        raise NotFast
    if any(type(g) is not type(w) or g != w for g, w in zip(got, cut.pats.want, strict=False)):
        raise NotFast
    resolved = dict(zip(probes, got, strict=True))
    del got
    if not all(type(resolved[r]) is str for r in chain(cut.refs["fqn"], cut.refs["path"])):
        raise NotFast
    if not all(isinstance(resolved[r], DType) for r in cut.refs["dtype"]):
        raise NotFast
    return md, resolved


PLANNER_KEY = b"\x8c\x0cplanner_data\x94"  # SHORT_BINUNICODE "planner_data", MEMOIZE: after the entries
