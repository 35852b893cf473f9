"""Walking the nested containers of a state dict (dicts, lists, tuples, named tuples), and
flattening it to DCP's keys exactly as ``torch.distributed.checkpoint`` does -- without torch.

Tensors are :class:`~.refs.TensorRef` descriptions or real ``torch.Tensor`` objects.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..errors import CorruptCheckpointError
from .refs import is_tensor

__all__ = ["check_depth", "flatten_state_dict", "iter_tensors", "map_tensors", "set_element"]

MAX_DEPTH = 200


def check_depth(obj: Any, label: str, limit: int = MAX_DEPTH) -> None:
    """Refuse values nested deeper than ``limit`` (an iterative walk: it cannot overflow). Deeper
    nesting is no state dict, and would overflow the recursion of everything that walks it --
    hashing a tuple nested a million deep crashes the interpreter."""
    stack: list[tuple[Any, int]] = [(obj, 0)]
    seen: set[int] = set()
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            raise CorruptCheckpointError(f"{label}: values nested deeper than {limit} levels")
        if isinstance(value, (str, bytes, bytearray, int, float, complex, bool)) or value is None:
            continue
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, dict):
            stack.extend((k, depth + 1) for k in value)
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend((v, depth + 1) for v in value)
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            stack.extend((v, depth + 1) for v in vars(value).values())


Path = tuple[str | int, ...]


def iter_tensors(obj: Any) -> Iterator[Any]:
    """Every tensor inside ``obj``, depth first, in container order."""
    if is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from iter_tensors(value)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for value in obj:
            yield from iter_tensors(value)


def map_tensors(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """A copy of ``obj`` with ``fn`` applied to every tensor; containers keep their types."""
    if is_tensor(obj):
        return fn(obj)
    if isinstance(obj, dict):
        out = obj.copy()
        for key, value in obj.items():
            out[key] = map_tensors(value, fn)
        return out
    if isinstance(obj, list):
        return [map_tensors(v, fn) for v in obj]
    if isinstance(obj, tuple):
        items = [map_tensors(v, fn) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def _is_terminal(value: Any) -> bool:
    """torch's ``traverse_state_dict``: a list is a leaf unless it holds a tensor, a mapping or a
    non-leaf list; anything that is neither a mapping nor a list is a leaf."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    for entry in value:
        if isinstance(entry, (Mapping, list)) and not _is_terminal(entry):
            return False
        if is_tensor(entry):
            return False
    return True


def flatten_state_dict(state_dict: Mapping[Any, Any]) -> tuple[dict[str, Any], dict[str, Path]]:
    """``torch.distributed.checkpoint._nested_dict.flatten_state_dict``: nested dicts and lists to
    ``{"a.b.0": value}`` with each key's path (``("a", "b", 0)``). Raises ValueError on a duplicate
    flattened key, like torch. Empty dicts vanish, as with torch."""
    flat: dict[str, Any] = {}
    paths: dict[str, Path] = {}
    stack: list[tuple[Path, Any]] = [((str(k),), v) for k, v in reversed(list(state_dict.items()))]
    while stack:
        path, value = stack.pop()
        if isinstance(value, Mapping):
            stack.extend(((*path, str(k)), v) for k, v in reversed(list(value.items())))
        elif _is_terminal(value):
            fqn = ".".join(map(str, path))
            if fqn in flat:
                raise ValueError(f"duplicated flatten key {fqn}")
            flat[fqn] = value
            paths[fqn] = path
        elif isinstance(value, (list, tuple)):
            stack.extend(((*path, i), v) for i, v in reversed(list(enumerate(value))))
    return flat, paths


def set_element(root: dict[str, Any], path: Path, value: Any, *, max_index: int) -> None:
    """torch's ``set_element``: put ``value`` at ``path`` in nested dicts and lists, creating them
    (a list grows with None up to an index). Indices above ``max_index`` are refused: a crafted
    path must not make a list of a trillion Nones."""
    if not path:
        raise CorruptCheckpointError("empty path in planner data")
    for key in path:
        if type(key) is int and not 0 <= key <= max_index:
            raise CorruptCheckpointError(f"planner data names list index {key} (at most {max_index} expected)")
        if type(key) not in (str, int):
            raise CorruptCheckpointError(f"planner data holds a {type(key).__name__} key")
    container: Any = root
    for prev, key in itertools.pairwise(path):
        default: Any = {} if type(key) is str else []
        if isinstance(container, dict):
            if type(prev) is not str:
                raise CorruptCheckpointError(f"planner data indexes a dict with {prev!r}")
            container = container.setdefault(prev, default)
        elif isinstance(container, list) and type(prev) is int:
            container.extend([None] * (prev + 1 - len(container)))
            if container[prev] is None:
                container[prev] = default
            container = container[prev]
        else:
            raise CorruptCheckpointError(f"planner data path {path!r} runs through a {type(container).__name__}")
    last = path[-1]
    if isinstance(container, list) and type(last) is int:
        container.extend([None] * (last + 1 - len(container)))
        container[last] = value
    elif isinstance(container, dict) and type(last) is str:
        container[last] = value
    else:
        raise CorruptCheckpointError(f"planner data path {path!r} does not fit the state dict")
