"""Distributed conversion (``convert --ranks N``, torchrun): the same bytes as one process, the
tensor bytes split between the ranks by size, and nothing published when a rank dies.

Outputs are compared with ``cmp`` semantics: ``$DCPSTUDIO_SAVE_ID`` fixes the random save ids,
and both conversions write the same relative destination name from folders of their own (a DCP's
``checkpoint_id`` is the destination as given)."""

from __future__ import annotations

import filecmp
import os
import signal
import subprocess
import sys
import warnings
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from dcpstudio.core import convert, open_checkpoint
from dcpstudio.core.io.crc import crc32_combine
from dcpstudio.core.ops.convert.layout import GRAIN, Layout, split_by_bytes
from dcpstudio.core.ops.integrity import check_path, digests
from dcpstudio.core.ops.integrity.manifests import read_manifest
from dcpstudio.core.ranks.convert import KILL_VARIABLE, run_convert
from dcpstudio.core.ranks.launch import LaunchError, free_port

CASES: list[tuple[str, dict[str, Any]]] = [
    ("out.pt", {"to": "torch"}),
    ("cast.pt", {"to": "torch", "dtype": "bf16"}),
    ("out_dcp", {"to": "dcp", "dtype": "fp16", "files": 2}),
    ("out.safetensors", {"to": "safetensors", "exclude": "^step$"}),
    ("shards/", {"to": "safetensors", "max_shard_size": 150_000, "exclude": "^step$", "dtype": "bf16"}),
]


def _same(a: Path, b: Path) -> bool:
    if a.is_file():
        return filecmp.cmp(a, b, shallow=False)
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*"))
    if names != sorted(p.relative_to(b).as_posix() for p in b.rglob("*")):
        return False
    return all(filecmp.cmp(a / n, b / n, shallow=False) for n in names if (a / n).is_file())


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A skewed torch.save file (one tensor is half the bytes), with a view, a value, mixed dtypes."""
    g = torch.Generator().manual_seed(0)
    sd = {
        "big": torch.randn(256, 512, generator=g),  # 512 KiB: half
        "emb": torch.randn(100, 300, generator=g).to(torch.bfloat16),
        "layers": {str(i): torch.randn(50, 40 + i, generator=g) for i in range(12)},
        "view": torch.randn(60, 70, generator=g).t(),
        "ids": torch.arange(3000, dtype=torch.int64),
        "step": 3,
    }
    path = tmp_path_factory.mktemp("src") / "src.pt"
    torch.save(sd, path)
    return path


def test_crc32_combine_is_zlibs() -> None:
    rng = __import__("random").Random(1)
    for n, m in [(0, 0), (1, 0), (0, 5), (7, 1), (1000, 4096), (3, 1 << 20), (65537, 12345)]:
        a, b = rng.randbytes(n), rng.randbytes(m)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), m) == zlib.crc32(a + b)


def _layout(sizes: list[int], unit: int = 2) -> Layout:
    return Layout(False, {"f": sum(sizes)}, [("f", 0, n, unit) for n in sizes], [], crc=True)


@pytest.mark.parametrize("world", [2, 3, 8])
def test_split_by_bytes_balances_any_layout(world: int) -> None:
    for sizes in ([1 << 30, *[1 << 20] * 1024], [6 << 30, 10, 10, 2 << 20], [4 << 20] * 7, [2 << 30] * 3):
        shares = split_by_bytes(_layout(sizes), world)
        got = [sum(p.end - p.start for p in pieces) for pieces in shares]
        assert sum(got) == sum(sizes)
        mean = sum(sizes) / world
        assert all(abs(g - mean) <= 0.1 * mean for g in got), (sizes, got)
        for pieces in shares:
            for p in pieces:
                n = sizes[p.hole]
                assert p.start % 2 == 0 and p.end % 2 == 0
                if n >= 4 * GRAIN:  # a large tensor is cut on 16 MiB multiples within it
                    assert p.start % GRAIN == 0 and (p.end % GRAIN == 0 or p.end == n)


def _whole_and_hashed(path: Path) -> None:
    """``check`` finds it whole (its files' SHA-256 as recorded), and ``hash`` gives the digests recorded."""
    m = read_manifest(path)
    assert m is not None and m.tensors and m.files, path
    assert check_path(path).whole, path
    with open_checkpoint(path) as ckpt:
        hashed = {d.fqn: d.digest for d in digests(ckpt) if d.fqn in m.tensors}
    assert hashed == {n: r["digest"] for n, r in m.tensors.items()}, path


def test_ranks_write_the_single_process_bytes(source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Manifest included: the digests and moments of tensors cut between ranks, the files' SHA-256."""
    monkeypatch.setenv("DCPSTUDIO_SAVE_ID", "test")
    warnings.simplefilter("ignore")
    one, many = tmp_path / "one", tmp_path / "many"
    one.mkdir()
    many.mkdir()
    for name, options in CASES:
        monkeypatch.chdir(one)
        convert(source, name, **options)
        monkeypatch.chdir(many)
        result, shares = run_convert(source, name, ranks=2 if name != "out_dcp" else 3, timeout=120, **options)
        assert _same(one / name, many / name), name
        assert result.tensors == 16 and sum(s.nbytes for s in shares) > 0
        total = sum(s.nbytes for s in shares)
        assert all(abs(s.nbytes - total / len(shares)) <= 0.1 * total / len(shares) for s in shares), shares
        _whole_and_hashed(many / name)
    assert torch.equal(torch.load(many / "out.pt", weights_only=True)["big"], torch.load(source)["big"])


def test_a_tensor_cut_between_ranks_on_the_piece_grid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 64 MiB tensor (4 pieces of the digest's 16 MiB) is cut between 2 ranks at 32 MiB: its digest
    and moments are combined from both ranks' pieces, as the single-process read-back computes them."""
    monkeypatch.setenv("DCPSTUDIO_SAVE_ID", "test")
    warnings.simplefilter("ignore")
    g = torch.Generator().manual_seed(1)
    src = tmp_path / "big.pt"
    huge = torch.randn(GRAIN, generator=g)  # 4 bytes each: 64 MiB
    huge[12345] = float("nan")
    torch.save({"huge": huge.reshape(4096, -1), "small": torch.randn(70, 30, generator=g)}, src)
    del huge
    for folder in ("one", "many"):
        (tmp_path / folder).mkdir()
    for name, options in (("big.safetensors", {"to": "safetensors"}), ("big_dcp", {"to": "dcp"})):
        monkeypatch.chdir(tmp_path / "one")
        convert(src, name, **options)
        monkeypatch.chdir(tmp_path / "many")
        _, shares = run_convert(src, name, ranks=2, timeout=120, **options)
        assert min(s.nbytes for s in shares) > GRAIN, shares  # both ranks wrote part of it
        assert _same(tmp_path / "one" / name, tmp_path / "many" / name), name
        m = read_manifest(tmp_path / "many" / name)
        assert m is not None and m.tensors["huge"]["nan"] == 1
        _whole_and_hashed(tmp_path / "many" / name)


def test_a_killed_rank_publishes_nothing(source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shm = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    monkeypatch.setenv(KILL_VARIABLE, "1")
    for name, options in CASES[1:3]:
        with pytest.raises(LaunchError, match="rank 1 was killed"):
            run_convert(source, tmp_path / name, ranks=2, timeout=120, **options)
        assert os.listdir(tmp_path) == []  # no output, no temporary
    if os.path.isdir("/dev/shm"):
        assert not {n for n in set(os.listdir("/dev/shm")) - shm if n.startswith("dcpstudio-layout-")}
    monkeypatch.delenv(KILL_VARIABLE)
    monkeypatch.delenv("DCPSTUDIO_SAVE_ID", raising=False)  # random save ids: the manifest records rank 0's last
    run_convert(source, tmp_path / "out_dcp", ranks=2, timeout=120, **CASES[2][1])
    _whole_and_hashed(tmp_path / "out_dcp")


def test_refused_before_any_rank_starts(source: Path, tmp_path: Path) -> None:
    (tmp_path / "taken.pt").write_bytes(b"x")
    with pytest.raises(Exception, match="already exists"):
        run_convert(source, tmp_path / "taken.pt", ranks=2, manifest=False)
    with pytest.raises(Exception, match=r"only S3 takes here \(http stores take no parts of one object"):
        run_convert(source, "http://127.0.0.1:9/out.pt", ranks=2)  # S3: tests/remote/test_remote_ranks.py
    assert sorted(os.listdir(tmp_path)) == ["taken.pt"]


@pytest.mark.timeout(240)
def test_two_nodes_under_torchrun(source: Path, tmp_path: Path) -> None:
    """``torchrun --nnodes 2`` on 127.0.0.1: two agents rendezvous, one rank each, through the CLI."""
    env = {**os.environ, "DCPSTUDIO_SAVE_ID": "test", "OMP_NUM_THREADS": "1"}
    (tmp_path / "one").mkdir()
    single = [sys.executable, "-m", "dcpstudio", "convert", str(source), "out_dcp", "--dtype", "bf16"]
    subprocess.run(single, cwd=tmp_path / "one", env=env, check=True, timeout=120)
    (tmp_path / "many").mkdir()
    port = free_port()
    run = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    rendezvous = ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    job = ["-m", "dcpstudio", "convert", str(source), "out_dcp", "--dtype", "bf16"]
    nodes = [
        subprocess.Popen(
            [*run, "--node-rank", str(node), *rendezvous, *job],
            cwd=tmp_path / "many",
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    outs = []
    try:
        for p in nodes:
            outs.append(p.communicate(timeout=180))
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in nodes] == [0, 0], [o[1][-1500:] for o in outs]
    assert "on 2 ranks" in outs[0][0] and "rank 1:" in outs[0][0]
    assert _same(tmp_path / "one" / "out_dcp", tmp_path / "many" / "out_dcp")
    _whole_and_hashed(tmp_path / "many" / "out_dcp")


def test_a_dcp_saved_by_three_ranks(multirank_dcp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors in chunks (DTensor shards, replicas): assembled whole by each rank that needs a part."""
    monkeypatch.setenv("DCPSTUDIO_SAVE_ID", "test")
    warnings.simplefilter("ignore")
    for folder in ("one", "many"):
        (tmp_path / folder).mkdir()
    cases = [("out.pt", {"to": "torch"}), ("out.safetensors", {"to": "safetensors", "dtype": "bf16"})]
    for name, options in [cases[0], (cases[1][0], {**cases[1][1], "manifest": False})]:  # with and without one
        monkeypatch.chdir(tmp_path / "one")
        convert(multirank_dcp, name, **options)
        monkeypatch.chdir(tmp_path / "many")
        run_convert(multirank_dcp, name, ranks=2, timeout=120, **options)
        assert _same(tmp_path / "one" / name, tmp_path / "many" / name), name


def test_a_mapped_conversion_on_ranks(tmp_path: Path) -> None:
    """``--mapping`` through the CLI on 2 ranks: the computed tensors (q/k permuted) and config.json."""
    from dcpstudio.cli.main import main
    from tests.core.test_mappings import _titan, _write

    src, cfg = _write(tmp_path, _titan())
    one, many = tmp_path / "one" / "hf", tmp_path / "many" / "hf"
    for out, extra in ((one, []), (many, ["--ranks", "2"])):
        out.parent.mkdir()
        argv = ["convert", str(src), str(out), "--mapping", "torchtitan-llama3", "--config", str(cfg), "-q", *extra]
        assert main(argv) == 0
    assert sorted(p.name for p in one.iterdir()) == sorted(p.name for p in many.iterdir())
    assert _same(one, many)


def test_cli_refusals(source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    """Usage errors before any rank starts: resharding, a named command under torchrun."""
    from dcpstudio.cli.main import main

    assert main(["convert", str(source), str(tmp_path / "a.pt"), "--ranks", "0", "--no-manifest"]) == 2
    capsys.readouterr()
    assert main(["convert", str(source), str(tmp_path / "d"), "--ranks", "2", "--no-manifest", "--for-ranks", "2"]) == 2
    assert "--for-ranks (resharding) runs on one process" in capsys.readouterr().err  # was ignored
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(["torch_to_dcp", str(source), str(tmp_path / "d")]) == 2
    assert "under torchrun use `convert" in capsys.readouterr().err
    assert main(["convert", str(source), str(tmp_path / "d"), "--for-ranks", "2"]) == 2  # under torchrun
    err = capsys.readouterr().err
    assert "--for-ranks (resharding) runs on one process" in err and len(err.splitlines()) == 1
    assert os.listdir(tmp_path) == []


def test_torch_free_ranks_from_the_command_line(tmp_path: Path) -> None:
    """``dcpstudio convert --ranks 2`` as a command: ranks linked by pipes, forks of the command
    (which has no torch). A float32 -> bfloat16 cast of bytes in place runs torch-free in both (a
    NaN run is left to torch); the same bytes as one process; a killed rank publishes nothing, nor
    does a command stopped by SIGTERM midway (sent by rank 1 to its parent: the command itself)."""
    env = {**os.environ, "DCPSTUDIO_SAVE_ID": "test"}
    g = torch.Generator().manual_seed(2)
    nan = torch.randn(300, 70, generator=g)
    nan[7, 7] = float("nan")
    sd = {"w": torch.randn(600, 900, generator=g), "nan": nan, "i": torch.arange(5000)}
    torch.save(sd, tmp_path / "src.pt")
    cmd = [sys.executable, "-m", "dcpstudio", "convert", str(tmp_path / "src.pt")]
    for folder, extra in (("one", []), ("many", ["--ranks", "2"])):
        (tmp_path / folder).mkdir()
        out = str(tmp_path / folder / "out.safetensors")  # the same name: the manifest holds it
        subprocess.run([*cmd, out, "--dtype", "bf16", *extra], env=env, check=True, timeout=120)
    assert filecmp.cmp(tmp_path / "one" / "out.safetensors", tmp_path / "many" / "out.safetensors", shallow=False)
    from safetensors.torch import load_file

    got = load_file(tmp_path / "many" / "out.safetensors")
    assert all(torch.equal(got[k].view(torch.int16), v.to(got[k].dtype).view(torch.int16)) for k, v in sd.items())
    killed = subprocess.run(
        [*cmd, str(tmp_path / "killed.safetensors"), "--dtype", "bf16", "--ranks", "2"],
        env={**env, KILL_VARIABLE: "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode != 0 and "rank 1 was killed" in killed.stderr, killed.stderr[-500:]
    assert sorted(os.listdir(tmp_path)) == ["many", "one", "src.pt"]
    stopped = subprocess.run(
        [*cmd, str(tmp_path / "stopped.safetensors"), "--dtype", "bf16", "--ranks", "2"],
        env={**env, KILL_VARIABLE: "1:parent"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-500:]
    assert "Traceback" not in stopped.stderr and len(stopped.stderr.strip().splitlines()) == 1, stopped.stderr
    assert sorted(os.listdir(tmp_path)) == ["many", "one", "src.pt"]
    # refused before any rank starts, as one process refuses it: one line, no rank, no type names
    missing = subprocess.run(
        [*cmd, str(tmp_path / "nowhere" / "x.safetensors"), "--ranks", "2"], capture_output=True, text=True, timeout=120
    )
    assert missing.returncode == 1 and missing.stderr.strip().splitlines() == [
        f"dcpstudio: error: cannot write {tmp_path / 'nowhere' / 'x.safetensors'}: directory "
        f"{tmp_path / 'nowhere'} does not exist"
    ], missing.stderr


def _refusing_rank(rank: int, world: int, report: Any, error: str) -> int:
    if rank == 1:
        from dcpstudio.core.errors import DCPStudioError

        raise DCPStudioError(error) if error.startswith("cannot") else ValueError(error)
    return rank


def test_a_ranks_error_reads_as_one_process_error() -> None:
    """A rank's own refusal reaches the user as one process's would, named by its rank: our errors
    in their own words, anything else with its type."""
    from dcpstudio.core.ranks.launch import PIPES, launch

    for error, shown in (
        ("cannot write /x: No space left on device", "rank 1: cannot write /x: No space left on device"),
        ("bad value", "rank 1: ValueError: bad value"),
    ):
        with pytest.raises(LaunchError) as caught:
            launch(_refusing_rank, (error,), nprocs=2, timeout=60, backend=PIPES, preload=("numpy",))
        assert str(caught.value) == shown


def test_a_fork_is_refused_under_a_qt_application_only() -> None:
    """A process that merely imported QtCore (a frozen build's Qt hook does it in every process,
    the command line's too) forks its ranks; one with a Qt application object does not."""
    pytest.importorskip("PySide6")
    probe = (
        "from PySide6.QtCore import QCoreApplication\n"
        "from dcpstudio.core.ranks.launch import can_fork_parent\n"
        "before = can_fork_parent()\n"
        "app = QCoreApplication([])\n"
        "print(before, can_fork_parent())\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["True", "False"], done.stderr[-500:]
