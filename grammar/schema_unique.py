"""``uniqueItems: true`` for arrays whose items take a few listed values, exactly.

xgrammar 0.2.8 ignores ``uniqueItems`` (measured: ``[0,0,1]`` for items ``enum: [0, 1]``).
When the items can only be a few values (an ``enum``, a ``const``, ``boolean``, ``null``, or a
union of those, possibly behind ``$ref``s), the arrays without repeats are a regular language:
a grammar whose state is the set of values used so far. Each state allows ``]`` once at least
``minItems`` values are used, and ``,`` followed by any unused value while fewer than
``maxItems`` are. The number of states is the number of such sets, sum over i <= maxItems of
C(n, i); beyond ``MAX_STATES`` the keyword is refused (validate-and-retry enforces it).

Values that JSON Schema counts as equal (1 and 1.0) are one value; each is written as its
compact JSON text.
"""

from __future__ import annotations

import json
import math
from typing import Any

import jsonschema  # type: ignore[import-untyped]

from grammar.schema_refs import follow_refs
from grammar.schema_rewrite import canonical, listed_values

# The most value sets (grammar states) an array's rules may track. Measured compile cost on
# xgrammar 0.2.8: about 0.3 ms per state at a 4k vocabulary.
MAX_STATES = 256
# Array keywords the construction accounts for; any other beside uniqueItems keeps it refused.
_HANDLED = frozenset({"type", "items", "minItems", "maxItems", "uniqueItems"})
_ARRAY_KEYWORDS = frozenset(
    {"items", "prefixItems", "additionalItems", "contains", "minContains", "maxContains",
     "unevaluatedItems", "minItems", "maxItems", "uniqueItems"}
)  # fmt: skip
# Listed values considered at most (before the validator filters them).
_MAX_VALUES = 64
# The whitespace between tokens, substituted when the rules are spliced into a grammar.
WHITESPACE = "arbor_ws"


def unique_array_problem(root: dict[str, Any], sub: dict[str, Any]) -> str | None:
    """Why ``sub``'s ``uniqueItems`` cannot be enforced exactly; None when it can."""
    extra = (set(sub) & _ARRAY_KEYWORDS) - _HANDLED
    if extra:
        return f"item uniqueness is not enforced beside {', '.join(sorted(extra))}"
    values = unique_item_values(root, sub)
    if values is None:
        return (
            "item uniqueness is enforced only for items with a few listed values (enum, "
            "const, boolean, null)"
        )
    states = _state_count(len(values), sub)
    if states > MAX_STATES:
        return (
            f"item uniqueness over {len(values)} values needs {states} grammar states (at most "
            f"{MAX_STATES}); lower maxItems or the number of values"
        )
    return None


def unique_item_values(root: dict[str, Any], sub: dict[str, Any]) -> list[Any] | None:
    """The distinct values an item of array ``sub`` may take, when they are few and listed
    (checked against the whole item schema with the root's validator); None otherwise."""
    items = sub.get("items", True)
    candidates = _candidates(root, items, 0)
    if candidates is None or len(candidates) > _MAX_VALUES:
        return None
    cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
    check = cls(root, format_checker=cls.FORMAT_CHECKER).evolve(schema=items)
    distinct: dict[str, Any] = {}
    for value in candidates:
        if canonical(value) not in distinct and check.is_valid(value):
            distinct[canonical(value)] = value
    return list(distinct.values())


def unique_array_ebnf(values: list[Any], sub: dict[str, Any]) -> str:
    """EBNF rules (start ``root``) for the arrays of distinct ``values`` that ``sub``'s
    minItems/maxItems allow; ``arbor_ws`` stands for the whitespace between tokens. Raises
    ValueError when no array qualifies."""
    low, high = _item_bounds(len(values), sub)
    if low > high:
        raise ValueError(f"no array of distinct items has {low} items ({len(values)} values)")
    spelled = [_literal(json.dumps(v, ensure_ascii=False, separators=(",", ":"))) for v in values]
    names: dict[int, str] = {0: "root"}

    def name(used: int) -> str:
        if used not in names:
            names[used] = f"root_{len(names)}"
        return names[used]

    lines, pending, done = [], [0], set()
    while pending:
        used = pending.pop()
        if used in done:
            continue
        done.add(used)
        count = used.bit_count()
        alternatives = []
        if count >= low:
            alternatives.append(f'{WHITESPACE} "]"')
        if count < high:
            comma = '"["' if used == 0 else f'{WHITESPACE} ","'
            for index, literal in enumerate(spelled):
                if not used & (1 << index):
                    nxt = used | (1 << index)
                    pending.append(nxt)
                    alternatives.append(f"{comma} {WHITESPACE} {literal} {name(nxt)}")
        if used == 0 and low == 0:
            alternatives[0] = f'"[" {WHITESPACE} "]"'
        lines.append(f"{name(used)} ::= {' | '.join(alternatives)}")
    return "\n".join(lines)


def _item_bounds(count: int, sub: dict[str, Any]) -> tuple[int, int]:
    low = sub.get("minItems", 0)
    high = sub.get("maxItems", count)
    return int(low), int(min(high, count))


def _state_count(count: int, sub: dict[str, Any]) -> int:
    low, high = _item_bounds(count, sub)
    return sum(math.comb(count, i) for i in range(high + 1)) if low <= high else 0


def _candidates(root: dict[str, Any], schema: Any, hops: int) -> list[Any] | None:
    """Values that include every value ``schema`` admits, when they are finitely listed (None
    past MAX_REF_HOPS references)."""
    schema, hops = follow_refs(root, schema, hops)
    if schema is False:
        return []
    if not isinstance(schema, dict):
        return None
    values = listed_values(schema)
    if values is not None:
        return values
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            union: list[Any] = []
            for branch in schema[key]:
                found = _candidates(root, branch, hops + 1)
                if found is None:
                    return None
                union += found
            return union
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types
    if isinstance(types, list) and types and set(types) <= {"boolean", "null"}:
        return [v for t in types for v in ((True, False) if t == "boolean" else (None,))]
    return None


def _literal(text: str) -> str:
    """An EBNF string literal for ``text`` (xgrammar reads JSON string escapes)."""
    return json.dumps(text, ensure_ascii=False)
