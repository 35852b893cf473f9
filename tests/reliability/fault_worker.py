"""Child process for test_faults.py: converts under a file-size limit (a full disk), or slowly so
that the parent can SIGKILL it mid-write. Usage:
    python -m tests.reliability.fault_worker fsize SRC TARGET WORKDIR LIMIT...
    python -m tests.reliability.fault_worker slow SRC DST TARGET
"""

from __future__ import annotations

import json
import resource
import signal
import sys
import time
import warnings
from pathlib import Path


def main() -> int:
    mode = sys.argv[1]
    from dcpstudio.core import DCPStudioError, convert

    if mode == "fsize":
        src, target, work = sys.argv[2], sys.argv[3], Path(sys.argv[4])
        limits = [int(x) for x in sys.argv[5:]]
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
        results = []
        for limit in limits:
            for overwrite in (False, True):
                dst = work / ("existing" if overwrite else f"out_{limit}")
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        convert(src, dst, to=target, overwrite=overwrite)  # type: ignore[arg-type]
                    outcome, message = "ok", ""
                except DCPStudioError as e:
                    outcome, message = "domain-error", str(e)
                except BaseException as e:
                    outcome, message = "other-error", f"{type(e).__name__}: {e}"
                finally:
                    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
                results.append({"limit": limit, "overwrite": overwrite, "outcome": outcome, "message": message[:300]})
        print(json.dumps(results))
        return 0
    src, dst, target = sys.argv[2], sys.argv[3], sys.argv[4]
    print("started", flush=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert(src, dst, to=target, overwrite=True, progress=lambda p: time.sleep(0.01))  # type: ignore[arg-type]
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
