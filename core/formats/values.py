"""Non-tensor values in a safetensors header, which holds strings only: JSON that keeps Python's
types -- tuples stay tuples (AdamW's ``betas``), integer dict keys stay integers, NaN stays NaN.

Every container is tagged: ``{"t": [...]}`` a tuple, ``{"l": [...]}`` a list, ``{"d": {...}}`` a
dict with string keys, ``{"m": [[key, value], ...]}`` any other dict, ``{"f": "nan"}`` a
non-finite float; numbers, strings, booleans and None are themselves. A value of another type
(bytes, tensors, objects) cannot be stored. Headers written before tagging (plain JSON, no
``ENCODING_KEY``) are still read.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..errors import CorruptCheckpointError

__all__ = ["ENCODING", "ENCODING_KEY", "VALUES_KEY", "decode_values", "encode_value"]

VALUES_KEY = "dcpstudio.values"
ENCODING_KEY = "dcpstudio.values.encoding"
ENCODING = "tagged-1"
_MAX_DEPTH = 64


class NotStorable(ValueError):
    """The value holds something JSON cannot carry."""


def encode_value(value: Any, depth: int = 0) -> Any:
    """``value`` as tagged JSON data; :class:`NotStorable` if it holds anything else."""
    if depth > _MAX_DEPTH:
        raise NotStorable("nested too deeply")
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"f": repr(value)}
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return {"t": [encode_value(v, depth + 1) for v in value]}
    if isinstance(value, list):
        return {"l": [encode_value(v, depth + 1) for v in value]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {"d": {k: encode_value(v, depth + 1) for k, v in value.items()}}
        return {"m": [[encode_value(k, depth + 1), encode_value(v, depth + 1)] for k, v in value.items()]}
    raise NotStorable(type(value).__name__)


def _decode(data: Any, depth: int = 0) -> Any:
    if depth > _MAX_DEPTH:
        raise ValueError("nested too deeply")
    if not isinstance(data, dict):
        return data
    if len(data) != 1:
        raise ValueError("a tagged value has one key")
    ((tag, body),) = data.items()
    if tag == "t":
        return tuple(_decode(v, depth + 1) for v in body)
    if tag == "l":
        return [_decode(v, depth + 1) for v in body]
    if tag == "d":
        return {str(k): _decode(v, depth + 1) for k, v in body.items()}
    if tag == "m":
        return {_decode(k, depth + 1): _decode(v, depth + 1) for k, v in body}
    if tag == "f" and body in ("nan", "inf", "-inf"):
        return float(body)
    raise ValueError(f"unknown tag {tag!r}")


def decode_values(meta: dict[str, str], label: str) -> dict[str, Any]:
    """The values stored in a safetensors header's metadata (tagged, or plain JSON from before)."""
    raw = meta.get(VALUES_KEY)
    if raw is None:
        return {}
    try:
        values = json.loads(raw)
        if not isinstance(values, dict):
            raise ValueError("not a JSON object")
        if meta.get(ENCODING_KEY) == ENCODING:
            values = {str(k): _decode(v) for k, v in values.items()}
        elif ENCODING_KEY in meta:
            raise ValueError(f"unknown encoding {meta[ENCODING_KEY][:40]!r}")
    except (ValueError, TypeError, AttributeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{label}: damaged {VALUES_KEY} metadata ({type(e).__name__}: {e})") from e
    return values
