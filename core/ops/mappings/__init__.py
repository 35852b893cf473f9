"""Model mappings: a checkpoint of one model definition written as another's (torchtitan <->
Hugging Face), streaming, one output tensor at a time.

It owns the rule language (:mod:`.rules`: patterns with groups, a chain of operations per rule,
both directions from one table; :mod:`.expr`: the config arithmetic rules use), the operations
(:mod:`.tensor_ops`), the plan and its refusals (:mod:`.plan`), the source seen through a plan
(:mod:`.mapped`), the built-in tables (:mod:`.builtins`) and the operations users call
(:mod:`.run`: convert, verify, dry run). It sits above :mod:`..ops` and may import it (the
converter's writers, the comparison) and every floor below; nothing in ``core`` imports it.
"""

from __future__ import annotations

from .expr import MappingError
from .plan import Plan, plan_mapping
from .rules import Mapping, Rule, parse_mapping
from .run import list_mappings, load_mapping, map_convert, map_verify, plan_for

__all__ = [
    "Mapping",
    "MappingError",
    "Plan",
    "Rule",
    "list_mappings",
    "load_mapping",
    "map_convert",
    "map_verify",
    "parse_mapping",
    "plan_for",
    "plan_mapping",
]
