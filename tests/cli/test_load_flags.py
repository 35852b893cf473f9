"""``load``'s own flags are checked by us, each fault in its own one-line usage error naming the flag,
before any rank starts: no silent default for ``--ranks 0``, no torch message for ``--ranks -1``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dcpstudio.cli.main import main


@pytest.mark.parametrize(
    ("flags", "expected", "absent"),
    [
        (["--ranks", "0"], "--ranks 0: needs at least 1 rank", "nprocs"),
        (["--ranks", "-1"], "--ranks -1: needs at least 1 rank", "nprocs"),
        (["--ranks", "2", "--mesh", "3x3"], "--mesh 3x3 needs 9 ranks but --ranks is 2", "dimensions"),
        (["--ranks", "4", "--mesh", "2x2x1"], "--mesh 2x2x1: at most 2 dimensions (got 3)", "needs"),
        (["--ranks", "2", "--mesh", "0x2"], "--mesh 0x2: every dimension needs at least 1 rank", "needs 0"),
        (["--mesh", "two"], "--mesh 'two': expected sizes joined by x", "invalid mesh"),
    ],
)
def test_bad_flags_are_usage_errors_before_any_rank_starts(
    rich_pt: Path,
    flags: list[str],
    expected: str,
    absent: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import dcpstudio.core.ranks.load as load

    monkeypatch.setattr(load, "run_load", lambda *a, **k: pytest.fail("ranks started"))
    assert main(["load", str(rich_pt), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err and absent not in err, err


def test_mesh_without_ranks_sets_the_rank_count(rich_pt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import dcpstudio.core.ranks.load as load

    asked: dict[str, Any] = {}
    monkeypatch.setattr(load, "run_load", lambda path, **kw: asked.update(kw) or [])
    assert main(["load", str(rich_pt), "--mesh", "2x3"]) == 0
    assert asked["ranks"] == 6 and asked["mesh"] == "2x3"
    assert main(["load", str(rich_pt)]) == 0
    assert asked["ranks"] == 2
