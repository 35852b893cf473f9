"""One number style (issue 25, item 14): a magnitude is exact below its first unit, then one decimal
and a unit; a count a user checks is exact, in thousands -- in every pane and on the terminal."""

from __future__ import annotations

from pathlib import Path

import torch

from dcpstudio.core import open_checkpoint
from dcpstudio.core.ops.report import checkpoint_text, exact_count, human_bytes, human_count, plural


def test_magnitudes_have_one_decimal_after_their_first_unit() -> None:
    assert [human_count(n) for n in (0, 913, 999, 1000, 3200, 65_536, 2_290_000, 2_300_000)] == [
        "0", "913", "999", "1.0 K", "3.2 K", "65.5 K", "2.3 M", "2.3 M",
    ]  # fmt: skip
    assert human_count(999_960) == "1.0 M" and human_count(7_240_000_000) == "7.2 B"
    assert [human_bytes(n) for n in (913, 1229, 65.5 * 2**20, 2**30)] == ["913 B", "1.2 KiB", "65.5 MiB", "1.0 GiB"]
    assert human_bytes(1024 * 1024 - 1) == "1.0 MiB"  # not "1024.0 KiB"


def test_counts_are_exact_in_thousands_on_the_terminal_too(tmp_path: Path) -> None:
    assert exact_count(1_374_862) == "1,374,862"
    assert plural(1, "entry") == "1 entry" and plural(3200, "entry") == "3,200 entries"
    assert plural(1200, "other value") == "1,200 other values"
    torch.save({f"t{i}": torch.zeros(1) for i in range(1200)}, tmp_path / "m.pt")
    text = checkpoint_text(open_checkpoint(tmp_path / "m.pt"))
    assert "1,200 tensors" in text.splitlines()[0]
    assert any(line.split()[:2] == ["float32", "1,200"] for line in text.splitlines())
