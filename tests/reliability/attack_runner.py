"""Child process for test_attacks.py: runs every ``dcpstudio`` command on one crafted checkpoint,
each under a time limit, and reports exit codes, output and the process's peak RSS as JSON.
Usage: python -m tests.reliability.attack_runner CHECKPOINT OUTDIR
"""

from __future__ import annotations

import contextlib
import io
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

SECONDS = 30


class Hang(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise Hang()


def commands(path: str, out: Path) -> dict[str, list[str]]:
    return {
        "inspect": ["inspect", path, "--chunks"],
        "inspect-json": ["inspect", path, "--json"],
        "to-dcp": ["convert", path, str(out / "out_dcp"), "--to", "dcp", "-q"],
        "to-torch": ["convert", path, str(out / "out.pt"), "--to", "torch", "-q"],
        "to-safetensors": ["convert", path, str(out / "out.safetensors"), "--to", "safetensors", "-q"],
        "verify": ["verify", path, path, "-q"],
    }


def main() -> int:
    path, out = sys.argv[1], Path(sys.argv[2])
    from dcpstudio.cli.main import main as cli

    signal.signal(signal.SIGALRM, _alarm)
    report: dict[str, Any] = {}
    for name, argv in commands(path, out).items():
        stdout, stderr = io.StringIO(), io.StringIO()
        start = time.monotonic()
        signal.alarm(SECONDS)
        try:
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                code: Any = cli(argv)
        except Hang:
            code = "hang"
        except BaseException as e:  # the CLI must turn everything into an exit code
            code = f"raised {type(e).__name__}: {e}"
        finally:
            signal.alarm(0)
        report[name] = {
            "code": code,
            "stdout": stdout.getvalue()[-4000:],
            "stderr": stderr.getvalue()[-4000:],
            "seconds": round(time.monotonic() - start, 2),
        }
    hwm = [line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:")]
    report["peak_rss"] = int(hwm[0].split()[1]) * 1024 if hwm else 0
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
