"""The rule language: a mapping is data -- a list of rules, each taking one or more source
entries, matched by name patterns with captured groups (``layers.{layer}.…``, ``experts.{expert}``),
to one or more destination entries through a chain of :mod:`.tensor_ops` -- read from a TOML
table (a user's file) or a Python dict of the same shape (the built-ins), checked when read.

A mapping is written in one direction (``sides[0]`` names to ``sides[1]`` names); the other
direction is derived rule by rule (:meth:`Mapping.rules`): sources and destinations swap and the
chain is inverted, so a table is written once. A rule with a one-way operation (``cast``,
``dequant_fp8``), or marked ``only``, serves one direction. See the README's "Model mappings".
"""

from __future__ import annotations

import re
from collections.abc import Mapping as AnyMapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .expr import MappingError, names_in
from .tensor_ops import OPS, Op, inverse_ops

__all__ = ["Direction", "Mapping", "Rule", "parse_mapping"]

Direction = Literal["forward", "inverse"]
_GROUP = re.compile(r"\{([A-Za-z_]\w*)\}")
_RULE_KEYS = {"src", "dst", "ops", "shape", "shapes", "when", "where", "optional", "tie", "only"}
_MAPPING_KEYS = {"name", "description", "sides", "ignore", "drop", "ignore_note"}


@dataclass(frozen=True)
class Rule:
    """``src`` patterns -> ``ops`` -> ``dst`` patterns. ``over``: the group a ``stack`` gathers
    (in ``src`` only) or an ``unstack`` spreads (in ``dst`` only). ``shapes``: the sources'
    shapes the config implies (expressions per dimension). ``when``: a config condition;
    ``where``: one on the captured groups too (``layer >= first_k_dense_replace``). ``optional``:
    its sources may be absent. ``tie``: the destination name of the tensor this one is tied to
    (written as nothing; the other direction writes it as a copy of that one). ``origin``: the
    rule this one inverts (its expected shapes are the origin's outputs)."""

    src: tuple[str, ...]
    dst: tuple[str, ...]
    ops: tuple[Op, ...] = ()
    shapes: tuple[tuple[str | int, ...], ...] | None = None
    when: str | None = None
    where: str | None = None
    optional: bool = False
    tie: str | None = None
    only: Direction | None = None
    origin: Rule | None = field(default=None, compare=False)

    @property
    def groups(self) -> set[str]:
        return {g for p in self.src for g in _GROUP.findall(p)}

    @property
    def over(self) -> str | None:
        """The group only one side has (experts gathered or spread), if any."""
        src = {g for p in self.src for g in _GROUP.findall(p)}
        dst = {g for p in self.dst for g in _GROUP.findall(p)}
        extra = (src - dst) | (dst - src) if self.dst else set()
        return next(iter(extra)) if extra else None

    def count_expr(self) -> str | int | None:
        """The number of items ``over`` ranges over: the ``count`` of the stack/unstack."""
        for op in self.ops:
            if op.kind in ("stack", "unstack"):
                return op.args.get("count")
        return None

    def text(self) -> str:
        return " -> ".join([", ".join(self.src), *(op.text() for op in self.ops), ", ".join(self.dst) or "(none)"])

    def inverse(self) -> Rule | None:
        if self.tie is not None:
            return Rule(
                (self.tie,), self.src, (), when=self.when, where=self.where, optional=self.optional, origin=self
            )
        ops = inverse_ops(self.ops)
        if ops is None or not self.dst:
            return None
        return Rule(self.dst, self.src, tuple(ops), None, self.when, self.where, self.optional, origin=self)


@dataclass(frozen=True)
class Mapping:
    """A named list of rules, plus what the source may hold that no rule maps: ``ignore``
    (training state -- optimizer, dataloader...: left out, said in one line) and ``drop``
    (entries of either side that have no counterpart, such as ``rotary_emb.inv_freq``).
    ``defaults``: config values derived when the config lacks them; ``ranges``: how many values
    a group takes (``layer = "num_hidden_layers"``), so missing layers are found up front."""

    name: str
    rules: tuple[Rule, ...]
    sides: tuple[str, str] = ("source", "destination")
    description: str = ""
    ignore: tuple[str, ...] = ()
    ignore_note: str = "training state"
    drop: tuple[str, ...] = ()
    defaults: dict[str, str | int] = field(default_factory=dict)
    ranges: dict[str, str | int] = field(default_factory=dict)

    def rules_for(self, direction: Direction) -> list[Rule]:
        """The rules oriented for ``direction`` (``forward``: as written)."""
        if direction == "forward":
            return [r for r in self.rules if r.only in (None, "forward")]
        out = [r for r in self.rules if r.only == "inverse"]
        for r in self.rules:
            inv = r.inverse() if r.only is None else None
            if inv is not None:
                out.append(inv)
        return out

    def target_side(self, direction: Direction) -> str:
        return self.sides[1] if direction == "forward" else self.sides[0]


def _strings(value: Any, what: str) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
        raise MappingError(f"{what} must be a name pattern or a list of them")
    return tuple(items)


def _op(value: Any, where: str) -> Op:
    if isinstance(value, str):
        value = {"op": value}
    if not isinstance(value, AnyMapping) or not isinstance(value.get("op"), str):
        raise MappingError(f"{where}: an operation is a name or a table with op = NAME")
    kind = value["op"]
    if kind not in OPS:
        raise MappingError(f"{where}: unknown operation {kind!r} (known: {', '.join(sorted(OPS))})")
    args = {k: v for k, v in value.items() if k != "op"}
    for k, v in args.items():
        for item in v if isinstance(v, list) else [v]:
            if not isinstance(item, (str, int)):
                raise MappingError(f"{where}: {kind} {k} must be an expression, a number or a list of them")
            if isinstance(item, str) and k != "dtype":
                names_in(item)  # a bad expression is refused when the mapping is read
    return Op(kind, args)


def _rule(raw: Any, k: int) -> Rule:
    where = f"rule {k + 1}"
    if not isinstance(raw, AnyMapping):
        raise MappingError(f"{where}: a rule is a table")
    unknown = set(raw) - _RULE_KEYS
    if unknown:
        raise MappingError(
            f"{where}: unknown key(s) {', '.join(sorted(unknown))} (known: {', '.join(sorted(_RULE_KEYS))})"
        )
    src = _strings(raw.get("src"), f"{where}: src")
    dst = _strings(raw.get("dst", []), f"{where}: dst")
    ops = tuple(_op(v, where) for v in raw.get("ops", []))
    shapes = raw.get("shapes", [raw["shape"]] if "shape" in raw else None)
    rule = Rule(
        src,
        dst,
        ops,
        tuple(tuple(s) for s in shapes) if shapes is not None else None,
        raw.get("when"),
        raw.get("where"),
        bool(raw.get("optional", False)),
        raw.get("tie"),
        raw.get("only"),
    )
    if not src:
        raise MappingError(f"{where}: src names no entry")
    if rule.only not in (None, "forward", "inverse"):
        raise MappingError(f"{where}: only must be 'forward' or 'inverse'")
    for p in (*src, *dst):
        if "{" in _GROUP.sub("", p) or "}" in _GROUP.sub("", p):
            raise MappingError(f"{where}: bad pattern {p!r}: braces hold a group name, e.g. {{layer}}")
    dst_groups = {g for p in dst for g in _GROUP.findall(p)}
    if dst and len((rule.groups - dst_groups) | (dst_groups - rule.groups)) > 1:
        raise MappingError(f"{where}: at most one group may differ between src and dst")
    if rule.over is not None and rule.count_expr() is None:
        raise MappingError(f"{where}: group {rule.over!r} is on one side only; a stack or unstack must gather it")
    if rule.shapes is not None and len(rule.shapes) != len(src):
        raise MappingError(f"{where}: {len(rule.shapes)} shapes for {len(src)} sources")
    return rule


def parse_mapping(raw: AnyMapping[str, Any], default_name: str = "custom") -> Mapping:
    """A mapping from its TOML/dict form: ``[mapping]`` (name, sides, ignore, drop), ``[defaults]``,
    ``[ranges]`` and ``[[rule]]`` tables."""
    head = raw.get("mapping", {})
    if not isinstance(head, AnyMapping) or set(head) - _MAPPING_KEYS:
        raise MappingError(f"[mapping] takes {', '.join(sorted(_MAPPING_KEYS))}")
    rules = raw.get("rule", [])
    if not isinstance(rules, list) or not rules:
        raise MappingError("a mapping needs at least one [[rule]]")
    unknown = set(raw) - {"mapping", "defaults", "ranges", "rule"}
    if unknown:
        raise MappingError(f"unknown table(s) {', '.join(sorted(unknown))} (known: mapping, defaults, ranges, rule)")
    sides = tuple(head.get("sides", ("source", "destination")))
    if len(sides) != 2:
        raise MappingError("sides names the two sides, e.g. ['torchtitan', 'hf']")
    for pattern in (*head.get("ignore", []), *head.get("drop", [])):
        try:
            re.compile(pattern)
        except re.error as e:
            raise MappingError(f"invalid pattern {pattern!r}: {e}") from None
    return Mapping(
        name=str(head.get("name", default_name)),
        rules=tuple(_rule(r, k) for k, r in enumerate(rules)),
        sides=(str(sides[0]), str(sides[1])),
        description=str(head.get("description", "")),
        ignore=tuple(head.get("ignore", [])),
        ignore_note=str(head.get("ignore_note", "training state")),
        drop=tuple(head.get("drop", [])),
        defaults=dict(raw.get("defaults", {})),
        ranges=dict(raw.get("ranges", {})),
    )
