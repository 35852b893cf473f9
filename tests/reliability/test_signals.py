"""The command line ends cleanly however it is stopped: SIGTERM and SIGHUP mid-conversion leave
nothing behind (like Ctrl-C), and a reader that closes the pipe early ends it quietly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import leftovers

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def big_pt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dcpstudio.core.ops.demo import llama_like_state_dict

    path = tmp_path_factory.mktemp("signals") / "big.pt"
    torch.save(llama_like_state_dict(64 << 20), path)
    return path


SLOW = r"""
import sys, time
from dcpstudio.core import progress
real = progress.Reporter.advance
calls = []
def slow(self, *a, **k):
    if not calls:
        print("started", flush=True)  # the conversion is under way: bytes are being written
    calls.append(1)
    time.sleep(0.25)
    return real(self, *a, **k)
progress.Reporter.advance = slow
from dcpstudio.cli.main import main
raise SystemExit(main(sys.argv[1:]))
"""


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_signals_mid_conversion_leave_nothing(big_pt: Path, tmp_path: Path, signum: int) -> None:
    for target, dst in (("dcp", tmp_path / "out_dcp"), ("torch", tmp_path / "out.pt")):
        proc = subprocess.Popen(
            [sys.executable, "-c", SLOW, "convert", str(big_pt), str(dst), "--to", target, "-q"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            # a shell running us in the background (nohup, `&` in a script) ignores SIGINT, and children
            # inherit that: give the child the terminal's default, as a user at a prompt has it
            preexec_fn=_default_sigint,
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
        time.sleep(0.1)
        os.kill(proc.pid, signum)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode in (128 + signum, 130), (proc.returncode, err)
        assert "nothing was written" in err and "Traceback" not in err
        assert not dst.exists() and leftovers(tmp_path) == []


def test_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    many = tmp_path / "many.safetensors"  # an inspect listing of ~2 MB: far more than a pipe holds
    save_file({f"layers.{i}.w{'x' * 40}": torch.zeros(1) for i in range(20_000)}, many)
    shell = f"{sys.executable} -m dcpstudio inspect {many} --chunks | head -n 2"
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", shell], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert len(proc.stdout.splitlines()) == 2
    assert proc.stderr == "", proc.stderr
