"""Runs mutated checkpoints through every reading path in one child process (see test_fuzz.py).

Each case must end in success or a DCPStudioError within its time limit; anything else (another
exception, a hang, a memory blow-up under the address-space limit) is recorded as a failure.
Usage: python -m tests.reliability.fuzz_worker SEED CASES WORKDIR  -> JSON summary on stdout.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import struct
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

CASE_SECONDS = 10


class Hang(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise Hang()


def make_bases(work: Path) -> dict[str, Path]:
    import torch
    from safetensors.torch import save_file

    from dcpstudio.core import torch_save_to_dcp

    g = torch.Generator().manual_seed(0)
    sd = {
        "model": {
            "w": torch.randn(8, 4, generator=g),
            "b": torch.randn(4, generator=g).bfloat16(),
            "t": torch.arange(6),
        },
        "step": 3,
        "cfg": {"name": "x", "lr": 0.5},
    }
    bases = {}
    bases["torch_zip"] = work / "base.pt"
    torch.save(sd, bases["torch_zip"])
    bases["torch_legacy"] = work / "legacy.pt"
    torch.save(sd, bases["torch_legacy"], _use_new_zipfile_serialization=False)
    torch_save_to_dcp(bases["torch_zip"], work / "base_dcp")
    bases["dcp_metadata"] = work / "base_dcp" / ".metadata"
    bases["dcp_data"] = next((work / "base_dcp").glob("*.distcp"))
    bases["safetensors"] = work / "base.safetensors"
    save_file({"w": sd["model"]["w"], "b": sd["model"]["b"]}, bases["safetensors"], metadata={"format": "pt"})
    return bases


def boundaries(kind: str, data: bytes) -> list[int]:
    """Structural boundaries: ZIP headers and directory entries, the safetensors header end."""
    points = {0, 1, 4, 8, len(data) // 2, len(data) - 1, len(data)}
    if kind in ("torch_zip", "dcp_data"):
        for sig in (b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06", b"PK\x06\x06", b"PK\x06\x07"):
            start = data.find(sig)
            while start >= 0:
                points.update({start, start + 4, start + 30, start + 46})
                start = data.find(sig, start + 1)
    if kind == "safetensors":
        (n,) = struct.unpack("<Q", data[:8])
        points.update({8, 8 + n // 2, 8 + n, 8 + n + 1})
    return sorted(p for p in points if 0 <= p <= len(data))


def mutate(kind: str, data: bytes, rng: random.Random) -> tuple[str, bytes]:
    choice = rng.randrange(6)
    b = bytearray(data)
    if choice == 0:  # truncate at a structural boundary
        cut = rng.choice(boundaries(kind, data))
        return f"truncate@{cut}", bytes(b[:cut])
    if choice == 1:  # flip a few random bytes
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        return "flip", bytes(b)
    if choice == 2:  # overwrite an integer field near a structure with an extreme value
        i = rng.choice(boundaries(kind, data)[:-1] or [0])
        i = min(max(0, i + rng.randrange(0, 40)), max(0, len(b) - 8))
        b[i : i + 8] = struct.pack("<Q", rng.choice([0, 1, 2**31 - 1, 2**32 - 1, 2**40, 2**63 - 1]))
        return f"int@{i}", bytes(b)
    if choice == 3 and kind == "safetensors":  # rewrite the header with hostile numbers
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        name = rng.choice([k for k in header if k != "__metadata__"])
        field = rng.choice(["shape", "data_offsets", "dtype"])
        header[name][field] = rng.choice([[2**40, 2**40], [-1, 4], [0, 2**62], "F128", [3], []])
        raw = json.dumps(header).encode()
        return f"header:{name}.{field}", struct.pack("<Q", len(raw)) + raw + data[8 + n :]
    if choice == 4:  # splice a random chunk of the file elsewhere
        i, j = sorted(rng.randrange(len(b)) for _ in range(2))
        k = rng.randrange(len(b))
        return "splice", bytes(b[:k] + b[i:j] + b[k:])
    return "zero-run", bytes(b[: (i := rng.randrange(len(b)))] + b"\0" * rng.randint(1, 64) + b[i + 64 :])


def exercise(path: Path, out: Path) -> None:
    from dcpstudio.core import convert, open_checkpoint

    with open_checkpoint(path) as ckpt:
        for fqn, entry in ckpt.entries.items():
            if entry.kind == "tensor":
                ckpt.read_tensor(fqn)
                ckpt.chunks(fqn)
                ckpt.resolve_chunks(fqn)
            else:
                ckpt.read_value(fqn)
        fmt = ckpt.format
    for target in ("dcp", "torch", "safetensors"):
        if target != fmt:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                convert(path, out / f"converted_{target}", to=target)  # type: ignore[arg-type]


def main() -> int:
    seed, cases, work = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))  # a blow-up fails fast instead of swapping
    signal.signal(signal.SIGALRM, _alarm)

    from tests.reliability.attacks import ATTACKS

    bases = make_bases(work)
    rng = random.Random(seed)
    summary: dict[str, Any] = {"cases": 0, "ok": 0, "domain_errors": 0, "failures": [], "by_kind": {}}
    for n in range(cases):
        case = work / f"case{n}"
        case.mkdir()
        if rng.random() < ATTACK_SHARE:  # a crafted checkpoint of a random class and variant
            kind = "attack:" + rng.choice(sorted(set(ATTACKS) - SLOW_ATTACKS))
            attack = ATTACKS[kind.split(":", 1)[1]](case, random.Random(rng.randrange(1 << 30)))
            path, how = attack.path, attack.note
        else:
            kind, path, how = _mutated(bases, case, rng)
        summary["cases"] += 1
        summary["by_kind"][kind] = summary["by_kind"].get(kind, 0) + 1
        _run_case(n, kind, how, path, case, summary)
    print(json.dumps(summary))
    return 0


ATTACK_SHARE = 0.1
# seconds to build (metadata-twice, 16 MiB x 1,024 fan-outs, 40k shared-row chunks) or run (ZIP bombs inflate
# 256 MiB, walk 1M entries): test_attacks.py runs each of them in full
SLOW_ATTACKS = {
    "metadata-twice",
    "zip-storage-bomb",
    "zip-directory-bomb",
    "dcp-zstd-bomb",
    "torch-fanout",
    "dcp-fanout",
    "dcp-shared-rows",
}


def _mutated(bases: dict[str, Path], case: Path, rng: random.Random) -> tuple[str, Path, str]:
    """A base checkpoint with one of its files mutated."""
    kind = rng.choice(list(bases))
    data = bases[kind].read_bytes()
    how, mutated = mutate(kind, data, rng)
    if kind.startswith("dcp"):
        shutil.copytree(bases[kind].parent, case / "ckpt")
        (case / "ckpt" / bases[kind].name).write_bytes(mutated)
        return kind, case / "ckpt", how
    path = case / bases[kind].name
    path.write_bytes(mutated)
    return kind, path, how


def _run_case(n: int, kind: str, how: str, path: Path, case: Path, summary: dict[str, Any]) -> None:
    from dcpstudio.core import DCPStudioError

    signal.alarm(CASE_SECONDS)
    try:
        exercise(path, case)
        summary["ok"] += 1
    except DCPStudioError:
        summary["domain_errors"] += 1
    except Hang:
        summary["failures"].append({"case": n, "kind": kind, "mutation": how, "error": "hang"})
    except BaseException as e:
        summary["failures"].append(
            {
                "case": n,
                "kind": kind,
                "mutation": how,
                "error": f"{type(e).__name__}: {str(e)[:200]}",
                "where": traceback.format_exc().splitlines()[-3][:200],
            }
        )
    finally:
        signal.alarm(0)
        leftover = [p.name for p in case.rglob("*") if ".dcpstudio-tmp-" in p.name]
        if leftover:
            summary["failures"].append({"case": n, "kind": kind, "mutation": how, "error": f"left {leftover}"})
        shutil.rmtree(case, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    raise SystemExit(main())
