"""Arithmetic over a model's config: the sizes and conditions a mapping's rules write as text
(``"num_key_value_heads * head_dim"``, ``"layer >= first_k_dense_replace"``).

A mapping may come from a user's TOML file, so its expressions are parsed with :mod:`ast` and
evaluated over a whitelist (names, integers, booleans, ``+ - * // %``, comparisons, ``and or
not``): never ``eval``. A name that is neither a config key nor a captured group is refused with
the names that exist.
"""

from __future__ import annotations

import ast
import functools
import operator
from collections.abc import Callable, Mapping
from typing import Any

from ...errors import DCPStudioError

__all__ = ["MappingError", "evaluate", "names_in"]

_BIN: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_CMP: dict[type, Callable[[Any, Any], Any]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}


class MappingError(DCPStudioError):
    """A mapping that cannot apply to this source or config: a bad rule, an unmatched or missing
    tensor, a shape the config contradicts."""


@functools.lru_cache(maxsize=512)
def _parse(text: str) -> ast.expr:
    try:
        return ast.parse(text, mode="eval").body
    except SyntaxError as e:
        raise MappingError(f"invalid expression {text!r}: {e.msg}") from None


def _eval(node: ast.expr, scope: Mapping[str, Any], text: str) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, bool)):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in scope or scope[node.id] is None:
            known = ", ".join(sorted(k for k, v in scope.items() if isinstance(v, (int, bool))))
            raise MappingError(f"{text!r} needs {node.id!r}, which the config does not give (it has {known})")
        return scope[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        left, right = _eval(node.left, scope, text), _eval(node.right, scope, text)
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
            raise MappingError(f"{text!r} divides by zero with this config")
        return _BIN[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
        value = _eval(node.operand, scope, text)
        return (not value) if isinstance(node.op, ast.Not) else -value
    if isinstance(node, ast.BoolOp):
        values = [_eval(v, scope, text) for v in node.values]
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.Compare) and all(type(op) in _CMP for op in node.ops):
        left = _eval(node.left, scope, text)
        for op, comparator in zip(node.ops, node.comparators, strict=True):
            right = _eval(comparator, scope, text)
            if not _CMP[type(op)](left, right):
                return False
            left = right
        return True
    raise MappingError(f"{text!r}: only names, integers, + - * // %, comparisons and and/or/not are allowed")


def evaluate(text: str | int | bool, scope: Mapping[str, Any]) -> Any:
    """The value of ``text`` (an int or bool is itself) with ``scope``'s names."""
    if isinstance(text, (int, bool)):
        return text
    return _eval(_parse(text), scope, text)


def names_in(text: str | int | bool) -> set[str]:
    """The names an expression uses."""
    if isinstance(text, (int, bool)):
        return set()
    return {n.id for n in ast.walk(_parse(text)) if isinstance(n, ast.Name)}
