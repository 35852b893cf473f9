"""From a source's entries, a mapping and a model config to the plan of every output tensor --
its name, the source entries it is computed from, the operations, its shape and dtype -- checked
whole before any byte is read or written.

The direction follows the source's names (the side whose patterns match more of them). Every
source entry must be consumed by a rule (or be training state the mapping ignores, or a name it
drops), every entry the config implies (each layer of ``ranges``, each expert of a stack) must be
there, and every shape must be the config's: else :class:`~.expr.MappingError` names the first
few, before anything is written. ``allow_unmapped`` passes unmatched entries through as they are.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...checkpoints.model import Entry
from ...dtypes import DType
from .expr import MappingError, evaluate
from .rules import _GROUP, Direction, Mapping, Rule
from .tensor_ops import Meta, Op, shape_ops

__all__ = ["Output", "Plan", "config_scope", "load_config", "plan_mapping"]

_SHOWN = 5
Binding = tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Output:
    """One destination entry: computed from ``sources`` by ``ops`` (bound to the config), the
    ``index``-th tensor the chain makes; ``key`` is shared by the outputs of one chain (computed
    together). ``value``: a non-tensor entry passed through (``allow_unmapped``)."""

    name: str
    sources: tuple[str, ...]
    ops: tuple[Op, ...]
    index: int
    key: tuple[int, Binding]
    shape: tuple[int, ...]
    dtype: DType | None
    rule: Rule | None = None
    value: bool = False

    @property
    def identity(self) -> bool:
        return not self.ops and len(self.sources) == 1 and not self.value


@dataclass
class Plan:
    """What a mapping will write, and what it leaves out."""

    mapping: Mapping
    direction: Direction
    outputs: list[Output]
    unmatched: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)

    @property
    def target(self) -> str:
        return self.mapping.target_side(self.direction)

    def notes(self) -> list[str]:
        out = []
        if self.ignored:
            out.append(
                f"left out {len(self.ignored)} {self.mapping.ignore_note} entries ({_few(self.ignored)}): "
                "only the model's entries are mapped"
            )
        if self.unmatched:
            out.append(f"passed through {len(self.unmatched)} unmatched entries unchanged: {_few(self.unmatched)}")
        if self.missing:
            out.append(f"{len(self.missing)} entries the config implies are absent: {_few(self.missing)}")
        return out

    def text(self) -> str:
        """The dry run: one line per output, ``sources -> operations -> name shape dtype``."""
        head = (
            f"{self.mapping.name}: {self.mapping.target_side('inverse' if self.direction == 'forward' else 'forward')}"
        )
        lines = [f"{head} -> {self.target} names, {len(self.outputs)} entries"]
        for o in self.outputs:
            src = o.sources[0] if len(o.sources) == 1 else f"{o.sources[0]} (+{len(o.sources) - 1})"
            ops = " ".join(op.text() for op in o.ops) or ("as is" if o.name == o.sources[0] else "rename")
            lines.append(f"  {src} -> {ops} -> {o.name} {list(o.shape)} {o.dtype.name if o.dtype else '?'}")
        lines += [f"  {n}" for n in self.notes()]
        return "\n".join(lines)


def _few(names: Sequence[str]) -> str:
    return ", ".join(names[:_SHOWN]) + (", ..." if len(names) > _SHOWN else "")


def load_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A Hugging Face ``config.json``, refused in one line when unreadable or not an object."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise MappingError(f"cannot read the config {path}: {getattr(e, 'strerror', None) or e}") from None
    if not isinstance(data, dict):
        raise MappingError(f"{path}: a config.json holds an object")
    return data


def config_scope(config: dict[str, Any], defaults: dict[str, str | int]) -> dict[str, Any]:
    """The config's integers and booleans, with the mapping's ``defaults`` for what it lacks (or
    holds as null), in order (a default may use an earlier one)."""
    scope = {k: v for k, v in config.items() if isinstance(v, (int, bool)) and not isinstance(v, float)}
    for key, expr in defaults.items():
        if scope.get(key) is None:
            scope[key] = evaluate(expr, scope)
    return scope


def _regex(pattern: str) -> re.Pattern[str]:
    out, seen, pos = [], set(), 0
    for m in _GROUP.finditer(pattern):
        out.append(re.escape(pattern[pos : m.start()]))
        name = m.group(1)
        out.append(f"(?P={name})" if name in seen else f"(?P<{name}>\\d+)")
        seen.add(name)
        pos = m.end()
    out.append(re.escape(pattern[pos:]))
    return re.compile("".join(out))


def _fmt(pattern: str, binding: dict[str, int]) -> str:
    return _GROUP.sub(lambda m: str(binding[m.group(1)]), pattern)


def _expand(patterns: Sequence[str], binding: dict[str, int], over: str | None, count: int) -> list[str]:
    out = []
    for p in patterns:
        if over is not None and f"{{{over}}}" in p:
            out += [_fmt(p, {**binding, over: i}) for i in range(count)]
        else:
            out.append(_fmt(p, binding))
    return out


def _bind(op: Op, scope: dict[str, Any]) -> Op:
    args = {
        k: (v if k == "dtype" else [evaluate(x, scope) for x in v] if isinstance(v, list) else evaluate(v, scope))
        for k, v in op.args.items()
    }
    return Op(op.kind, args)


def _matches(rules: Sequence[Rule], names: Iterable[str]) -> int:
    regexes = [_regex(p) for r in rules for p in r.src]
    return sum(1 for n in names if any(rx.fullmatch(n) for rx in regexes))


def _bindings(rule: Rule, found: set[Binding], mapping: Mapping, scope: dict[str, Any]) -> list[Binding]:
    groups = sorted(rule.groups - ({rule.over} if rule.over else set()))
    if groups and all(g in mapping.ranges for g in groups):
        spans = [range(int(evaluate(mapping.ranges[g], scope))) for g in groups]
        every: Iterable[Binding] = (tuple(zip(groups, values, strict=True)) for values in itertools.product(*spans))
    else:
        every = sorted(found)
    return [b for b in every if rule.where is None or evaluate(rule.where, {**scope, **dict(b)})]


def _expected(rule: Rule, scope: dict[str, Any], dtype: DType, count: int) -> list[tuple[int, ...]] | None:
    """The shapes the config implies for the rule's sources (an inverted rule's: its origin's outputs)."""
    base = rule.origin if rule.origin is not None else rule
    if base.shapes is None:
        return None
    shapes = [tuple(int(evaluate(d, scope)) for d in s) for s in base.shapes]
    if rule.origin is None:
        return shapes
    if base.tie is not None:
        return None
    metas: list[Meta] = [(s, dtype) for s in shapes]
    return [s for s, _ in shape_ops(metas, [_bind(op, scope) for op in base.ops])]


def plan_mapping(
    entries: dict[str, Entry], mapping: Mapping, config: dict[str, Any], *, allow_unmapped: bool = False
) -> Plan:
    """The :class:`Plan` of ``mapping`` over a source's ``entries`` with ``config`` (a Hugging
    Face config.json's contents); refuses, in one line, what it cannot map (see the module)."""
    scope = config_scope(config, mapping.defaults)
    ignore = [re.compile(p) for p in mapping.ignore]
    drop = [re.compile(p) for p in mapping.drop]
    ignored = [n for n in entries if any(rx.search(n) for rx in ignore)]
    dropped = [n for n in entries if n not in set(ignored) and any(rx.search(n) for rx in drop)]
    left = [n for n in entries if n not in set(ignored) | set(dropped)]
    tensors = [n for n in left if entries[n].kind == "tensor"]
    counts = {d: _matches(mapping.rules_for(d), tensors) for d in ("forward", "inverse")}
    direction: Direction = "forward" if counts["forward"] >= counts["inverse"] else "inverse"
    if not counts[direction]:
        raise MappingError(
            f"no entry has {mapping.sides[0]} or {mapping.sides[1]} names of mapping {mapping.name}; "
            f"names look like {_few(left)}"
        )
    rules = [r for r in mapping.rules_for(direction) if r.when is None or evaluate(r.when, scope)]
    consumed: set[str] = set()
    outputs: list[Output] = []
    missing: list[str] = []
    for k, rule in enumerate(rules):
        regexes = [_regex(p) for p in rule.src]
        found: set[Binding] = set()
        for n in tensors:
            for rx in regexes:
                m = rx.fullmatch(n)
                if m is not None:
                    found.add(tuple(sorted((g, int(v)) for g, v in m.groupdict().items() if g != rule.over)))
        count_expr = rule.count_expr()
        for binding in _bindings(rule, found, mapping, scope):
            where = {**scope, **dict(binding)}
            count = int(evaluate(count_expr, where)) if count_expr is not None else 0
            srcs = _expand(rule.src, dict(binding), rule.over, count)
            absent = [s for s in srcs if s not in entries or entries[s].kind != "tensor"]
            if absent:
                if not (rule.optional and len(absent) == len(srcs)):
                    missing += absent
                continue
            consumed.update(srcs)
            outputs += _outputs(rule, k, binding, srcs, entries, where, count)
    unmatched = [n for n in left if n not in consumed]
    if missing and not allow_unmapped:
        raise MappingError(
            f"{len(missing)} entries the config implies are missing: {_few(missing)} "
            "(a different model or config? --allow-unmapped maps what is there)"
        )
    if unmatched and not allow_unmapped:
        raise MappingError(
            f"{len(unmatched)} entries match no rule of {mapping.name}: {_few(unmatched)} "
            "(--allow-unmapped passes them through)"
        )
    for n in unmatched:
        e = entries[n]
        outputs.append(Output(n, (n,), (), 0, (-1, ()), e.shape or (), e.dtype, value=e.kind != "tensor"))
    names: dict[str, Output] = {}
    for o in outputs:
        if o.name in names:
            raise MappingError(f"{o.sources[0]} and {names[o.name].sources[0]} both become {o.name}")
        names[o.name] = o
    return Plan(mapping, direction, outputs, unmatched, missing, ignored, dropped)


def _outputs(
    rule: Rule, k: int, binding: Binding, srcs: list[str], entries: dict[str, Entry], scope: dict[str, Any], count: int
) -> list[Output]:
    metas: list[Meta] = []
    for s in srcs:
        e = entries[s]
        assert e.dtype is not None
        metas.append((e.shape or (), e.dtype))
    expected = _expected(rule, scope, metas[0][1], count)
    if expected is not None:
        for s, (shape, _), want in zip(srcs, metas, expected, strict=False):
            if shape != want:
                raise MappingError(
                    f"{s} has shape {list(shape)}, the config implies {list(want)} (another model or config?)"
                )
    if rule.tie is not None:
        return []
    ops = tuple(_bind(op, scope) for op in rule.ops)
    try:
        made = shape_ops(metas, ops)
    except MappingError as e:
        raise MappingError(f"{srcs[0]}: {e}") from None
    dsts = _expand(rule.dst, dict(binding), rule.over, count)
    if len(made) != len(dsts):
        raise MappingError(f"{rule.text()}: makes {len(made)} tensors for {len(dsts)} names")
    return [
        Output(d, tuple(srcs), ops, i, (k, binding), shape, dtype, rule)
        for i, (d, (shape, dtype)) in enumerate(zip(dsts, made, strict=True))
    ]
