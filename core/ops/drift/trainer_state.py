"""A Hugging Face Trainer step's scalars: ``checkpoint-N/trainer_state.json`` beside the weights.

The Trainer keeps what torchtitan keeps in the DCP's ``train_state`` in a JSON file of its own:
``global_step``, ``epoch`` and ``log_history``, a list of what was logged (``{"step", "loss",
"learning_rate", "grad_norm", ...}``, evaluations as ``{"step", "eval_loss", ...}``). A step's row of
the values table gets ``trainer_state.global_step``, ``trainer_state.epoch`` and, for each of
:data:`LOGGED`, the value of the last log entry at or before the step that holds it (the Trainer logs
every ``logging_steps``, so the value at a checkpoint is the one logged last before it).

The file is plain JSON, read whole up to :data:`STATE_LIMIT` bytes and parsed, never executed. One that
is too large, not JSON, or not shaped as the Trainer writes it gives no values and a note saying why
(the run is still analysed); so does one whose ``global_step`` is not the step its folder is named for.
"""

from __future__ import annotations

import json
from typing import Any

from ...errors import DCPStudioError
from ...io.files import member_path, read_regular
from .run import RunStep

__all__ = ["LOGGED", "PREFIX", "STATE_LIMIT", "TRAINER_STATE", "parse_trainer_state", "trainer_values"]

TRAINER_STATE = "trainer_state.json"
STATE_LIMIT = 16 << 20
"""Bytes read of a trainer_state.json: a run of 100,000 logged steps writes about 15 MiB."""
PREFIX = "trainer_state."
LOGGED = ("learning_rate", "loss", "grad_norm", "eval_loss")
"""The logged scalars taken from ``log_history``, in the order the values table lists them."""


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return _integer(v) or isinstance(v, float)


def parse_trainer_state(data: bytes, step: int) -> dict[str, Any]:
    """The values of step ``step`` in the bytes of a trainer_state.json, named ``trainer_state.*``;
    :class:`ValueError` saying what is wrong with the file."""
    try:
        state = json.loads(data)
    except RecursionError:
        raise ValueError("nested too deeply to be a Trainer's state") from None
    except ValueError as e:  # not UTF-8, not JSON, an integer of thousands of digits
        raise ValueError(f"not JSON ({str(e).splitlines()[0][:120]})") from None
    if not isinstance(state, dict):
        raise ValueError("not a JSON object")
    out: dict[str, Any] = {}
    for key, ok, what in (("global_step", _integer, "an integer"), ("epoch", _number, "a number")):
        value = state.get(key)
        if value is not None:
            if not ok(value):
                raise ValueError(f"its {key} is not {what}")
            out[PREFIX + key] = value
    history = state.get("log_history", [])
    if not isinstance(history, list):
        raise ValueError("its log_history is not a list")
    latest: dict[str, tuple[int, Any]] = {}
    for k, logged in enumerate(history):
        if not isinstance(logged, dict) or not _integer(logged.get("step")):
            raise ValueError(f"its log_history[{k}] is not an object with an integer step")
        at = logged["step"]
        if at > step:
            continue
        for key in LOGGED:
            value = logged.get(key)
            if value is None:
                continue
            if not _number(value):
                raise ValueError(f"its log_history[{k}].{key} is not a number")
            if key not in latest or at >= latest[key][0]:
                latest[key] = (at, value)
    out.update({PREFIX + key: latest[key][1] for key in LOGGED if key in latest})
    return out


def trainer_values(step: RunStep) -> tuple[dict[str, Any], str | None]:
    """``step``'s values from its folder's trainer_state.json (none when it has none: a DCP step, a
    file) and a note when the file could not be used or disagrees with the step."""
    location, fmt = step.parts[0][1], step.parts[0][2]
    if fmt == "dcp" or not location.is_dir():
        return {}, None
    where = f"{step.name}/{TRAINER_STATE}"
    try:
        path = member_path(location, TRAINER_STATE, "trainer state")
        if not path.is_file():
            return {}, None
        values = parse_trainer_state(read_regular(path, STATE_LIMIT, where), step.step)
    except (DCPStudioError, OSError, ValueError) as e:
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        return {}, f"{where}: {text.removeprefix(where + ': ')}; its values are left out"
    told = values.get(PREFIX + "global_step")
    if told is not None and told != step.step:
        return values, f"{where}: global_step {told}, not the step {step.step} its folder is named for"
    return values, None
