"""The ``dcpstudio`` command: no arguments opens the window (``--demo``: on a generated demo
checkpoint); subcommands serve scripts and CI.

Every subcommand calls the same ``dcpstudio.core`` functions as the window. Failures print one
line (``dcpstudio: error: ...``) and exit non-zero; set ``DCPSTUDIO_DEBUG=1`` for a traceback.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import warnings
from collections.abc import Sequence
from typing import Any

from .commands import COMMANDS, EXIT_CANCELLED, EXIT_ERROR, EXIT_USAGE, TerminalProgress
from .drift import run_drift
from .integrity import run_check, run_diff_digests, run_hash
from .parser import build_parser

__all__ = ["TerminalProgress", "build_parser", "main"]


def _show_warning(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
    print(f"dcpstudio: warning: {message}", file=sys.stderr)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP: unwinds like Ctrl-C, so every temporary output is removed."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _on_signal(signum: int, frame: Any) -> None:
    raise Terminated(signum)


def _catch_termination() -> None:
    if threading.current_thread() is threading.main_thread():
        for name in ("SIGTERM", "SIGHUP"):
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), _on_signal)


def _error(text: object) -> None:
    from dcpstudio.core.checkpoints.model import printable

    lines = str(text).splitlines() or [""]
    print(f"dcpstudio: error: {printable(lines[0])}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.process_is_command = argv is None  # this process runs one command and ends (not a test, not a script)
    warnings.showwarning = _show_warning
    from dcpstudio.core.errors import CancelledError, DCPStudioError

    debug = bool(os.environ.get("DCPSTUDIO_DEBUG"))
    compares = args.command in ("verify", "compare")
    failed = EXIT_USAGE if compares else EXIT_ERROR  # 1 means "different" for verify and compare
    try:
        if args.command is None or args.command == "open":
            from dcpstudio.window.main import run

            return run([args.path] if args.command == "open" else [], demo=args.demo, quit_after=args.quit_after)
        _catch_termination()
        commands = {
            **COMMANDS,
            "check": run_check,
            "hash": run_hash,
            "diff-digests": run_diff_digests,
            "drift": run_drift,
        }
        return commands[args.command](args)
    except CancelledError:
        print("dcpstudio: cancelled; nothing was written", file=sys.stderr)
        return EXIT_CANCELLED
    except Terminated as e:
        print(f"\ndcpstudio: terminated ({signal.Signals(e.signum).name}); nothing was written", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("\ndcpstudio: interrupted; nothing was written", file=sys.stderr)
        return EXIT_CANCELLED
    except BrokenPipeError:  # the reader went away (| head): end quietly, like other tools
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except (DCPStudioError, ValueError, KeyError) as e:
        if debug:
            raise
        _error(e.args[0] if isinstance(e, KeyError) and e.args else e)
        usage = isinstance(e, ValueError) and not isinstance(e, DCPStudioError)  # our flags, not the input
        return EXIT_USAGE if usage and not compares else failed
    except RecursionError:
        if debug:
            raise
        _error("the checkpoint nests its values too deeply to be read")
        return failed
    except MemoryError:
        if debug:
            raise
        _error("not enough memory for this checkpoint")
        return failed
    except Exception as e:
        if debug:
            raise
        if isinstance(e, RuntimeError) and "allocate" in str(e):  # torch's allocator: a plain lack of memory
            _error("not enough memory for this checkpoint")
            return failed
        first = str(e).splitlines()[0] if str(e) else ""
        _error(f"unexpected {type(e).__name__}: {first} (set DCPSTUDIO_DEBUG=1 for details)")
        return failed
