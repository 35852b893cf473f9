"""TreeIndex.select: the fast paths (one dtype/shape test per group, totals counted per size
group, or taken off each node's totals when most entries match) agree with a plain walk."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from dcpstudio.core.checkpoints.model import Entry, Node, build_tree
from dcpstudio.core.dtypes import dtype_of
from dcpstudio.window.tree_filter import Aggregate, EntryFilter, TreeIndex


def _tree() -> Node:
    rng = random.Random(0)
    entries = {}
    for i in range(600):
        fqn = f"model.layers.{i // 20}.{rng.choice(['attn', 'mlp'])}.w{i % 20}"
        dtype = dtype_of(rng.choice(["float32", "bfloat16"]))
        entries[fqn] = Entry(fqn, "tensor", dtype, rng.choice([(4, 8), (8,), (), (2, 3, 4)]))
    entries["model"] = Entry("model", "bytes", byte_size=10)  # a node that is an entry and has children
    entries["step"] = Entry("step", "bytes", byte_size=7)
    return build_tree(entries, "ckpt")


def _plain(index: TreeIndex, spec: EntryFilter) -> tuple[set[int], dict[int, Aggregate]]:
    accept = spec.compile()
    matched, totals = set(), {}
    for node in index.entries:
        e = node.entry
        assert e is not None
        if not accept(e):
            continue
        matched.add(id(node))
        params, nbytes = (e.numel, e.nbytes) if e.kind == "tensor" else (0, 0)
        walk: Node | None = node
        while walk is not None:
            agg = totals.setdefault(id(walk), Aggregate())
            agg.entries += 1
            agg.params += params
            agg.nbytes += nbytes
            walk = index.parent.get(id(walk))
    return matched, totals


@pytest.mark.parametrize(
    "spec",
    [
        EntryFilter(text="attn"),
        EntryFilter(text="LAYERS.1"),
        EntryFilter(text="model"),  # nearly everything: totals taken off the whole
        EntryFilter(text=r"w1\d$", regex=True),
        EntryFilter(dtype="bfloat16"),
        EntryFilter(dtype="value"),
        EntryFilter(shape="4x*"),
        EntryFilter(shape="scalar", text="mlp"),
        EntryFilter(dtype="float32", shape="8"),
        EntryFilter(text="nothing-matches"),
    ],
    ids=repr,
)
def test_select_agrees_with_a_plain_walk(spec: EntryFilter) -> None:
    index = TreeIndex(_tree())
    got = index.select(spec)
    matched, totals = _plain(index, spec)
    assert got.matched == matched
    assert dict(got.totals) == totals
    for key in index.nodes:
        assert (key in got.totals) == (key in totals)
        assert got.totals.get(key) == totals.get(key)


def test_filtering_100k_names_is_fast(tmp_path: Path) -> None:

    entries = {
        f"model.layers.{i // 10}.block.{i % 10}.weight": Entry(
            f"model.layers.{i // 10}.block.{i % 10}.weight", "tensor", dtype_of("bfloat16"), (64, 64)
        )
        for i in range(100_000)
    }
    index = TreeIndex(build_tree(entries, "big"))
    for spec in (EntryFilter(text="block.3"), EntryFilter(text="weight"), EntryFilter(dtype="bfloat16", shape="*x64")):
        best = min(_timed(index, spec) for _ in range(3))
        assert best < 0.25, f"{spec}: {best * 1000:.0f} ms"  # target 100 ms; slack for a loaded test machine


def _timed(index: TreeIndex, spec: EntryFilter) -> float:
    import time

    t0 = time.perf_counter()
    index.select(spec)
    return time.perf_counter() - t0
