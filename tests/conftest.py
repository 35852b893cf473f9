from __future__ import annotations

import collections
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The user cache folder (index caches) under a temporary directory, never the user's."""
    where = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("XDG_CACHE_HOME", str(where))
    return where


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Deep equality of checkpoint trees: tensors bit-exact with equal dtype and shape; dict keys
    compared as strings (DCP stores every key as a string, as torch's converters do)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: {type(b).__name__} instead of a tensor"
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), f"{path}: values differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict), f"{path}: {type(b).__name__} instead of a dict"
        assert sorted(map(str, a)) == sorted(map(str, b)), (
            f"{path}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        )
        bs = {str(k): v for k, v in b.items()}
        for k, v in a.items():
            assert_same(v, bs[str(k)], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{path}: {b!r} != {a!r}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def rich_state_dict() -> dict[str, Any]:
    """Every kind of content a torch.save checkpoint carries in practice."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    return {
        "model": {
            "w": base,
            "w_t": base.t(),  # non-contiguous view of a shared storage
            "w_slice": base[1:4, 2:7],  # view with a storage offset
            "w_tied": base,  # the same tensor twice
            "bf16": torch.randn(5, 3, generator=g).bfloat16(),
            "fp16": torch.randn(7, generator=g).half(),
            "f8": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
            "i64": torch.arange(10),
            "u8": torch.arange(9, dtype=torch.uint8),
            "u16": torch.arange(5).to(torch.uint16),
            "bool": torch.tensor([True, False, True]),
            "c64": torch.randn(3, dtype=torch.complex64, generator=g),
            "empty": torch.zeros(0, 3),
            "scalar": torch.tensor(3.5),
            "channels_last": torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
        },
        "optim": {
            "state": {
                0: {
                    "step": torch.tensor(3.0),
                    "exp_avg": torch.ones(6, 8),
                    "exp_avg_sq": torch.full((6, 8), 0.5),
                }
            },
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": [0]}],
        },
        "step": 12,
        "name": "run-7",
        "ratio": 0.25,
        "flags": None,
        "layers": [torch.ones(2), torch.zeros(3)],
        "pair": (0.5, 3),  # a tuple holding a tensor cannot go to safetensors: tests/core/test_unflattened_dcp.py
        "ordered": collections.OrderedDict(a=1, b=2),
    }


@pytest.fixture
def rich_pt(tmp_path: Path) -> Path:
    path = tmp_path / "rich.pt"
    torch.save(rich_state_dict(), path)
    return path


def _single_process(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``dcp.save``/``dcp.load`` in one process: ``no_dist=True`` where torch has it (2.7+); older
    releases decide that by themselves when no process group exists."""
    import inspect

    if "no_dist" in inspect.signature(fn).parameters:
        kwargs.setdefault("no_dist", True)
    return fn(*args, **kwargs)


def dcp_save(state: Any, **kwargs: Any) -> Any:
    import torch.distributed.checkpoint as dcp

    return _single_process(dcp.save, state, **kwargs)


def dcp_load(state: Any, **kwargs: Any) -> Any:
    import torch.distributed.checkpoint as dcp

    return _single_process(dcp.load, state, **kwargs)


def on_thread(fn: Any) -> tuple[threading.Thread, list[BaseException | None]]:
    """``fn()`` started on a thread; the list gets None when it returns, or what it raised."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            outcome.append(None)
        except BaseException as e:  # handed to the test thread
            outcome.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def leftovers(directory: Path) -> list[str]:
    """Hidden temporaries our atomic writer might have left."""
    return sorted(p.name for p in directory.iterdir() if ".dcpstudio-tmp-" in p.name)


@pytest.fixture(scope="session")
def multirank_dcp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DCP checkpoint written by torch's dcp.save from 3 gloo ranks (see tests/_ranks.py)."""
    from tests import _ranks

    out = tmp_path_factory.mktemp("multirank") / "ckpt"
    _ranks.save_multirank(out, world=3)
    return out


@pytest.fixture(scope="session")
def training_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Real tiny training runs on the CPU (tests/_runs.py), made once per session: ``faulty`` (DCP
    ``step-N``: layer 1 frozen from step 4, a flipped mantissa bit in step 7's
    ``model.layers.0.attention.wq.weight``, a NaN in ``model.output.weight`` from step 10, a tensor
    added at step 9), ``healthy`` (Hugging Face Trainer ``checkpoint-N``; None without safetensors),
    ``resumed`` (DCP, step 9 resumed from step 3's state), with what each was made from (``healthy_log``:
    what its training logged, in its ``trainer_state.json``)."""
    from tests import _runs

    root = tmp_path_factory.mktemp("runs")
    faulty = _runs.train(12, freeze=("layers.1.", 4))
    flip = _runs.Flip(7, "model.layers.0.attention.wq.weight", 20 * 32 + 4)  # row 20: its third chunk
    out: dict[str, Any] = {
        "faulty": _runs.save_titan_run(
            root / "titan", faulty, flip, poison=(10, "model.output.weight", 5), extra=(9, "model.extra")
        ),
        "faulty_trained": faulty,
        "flip": flip,
        "resumed": _runs.save_titan_run(root / "resumed", _runs.train(12, resume=(9, 3))),
        "healthy": None,
    }
    try:
        import safetensors  # noqa: F401
    except ImportError:
        return out
    log: list[dict[str, Any]] = []
    out["healthy"] = _runs.save_hf_run(root / "hf", _runs.train(12, seed=5, log=log), log)
    out["healthy_log"] = log
    return out
