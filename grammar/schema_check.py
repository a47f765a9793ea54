"""Fail closed: reject JSON-schema features the backend would silently drop or weaken.

Each rule below was measured against xgrammar 0.2.8 (docs/grammar.md lists the evidence):
compiling a schema with the keyword and sampling from it produced output that the
``jsonschema`` validator rejects, because the keyword was ignored. Such a schema is refused
with ``UnsupportedSchemaFeature`` naming the keyword and the JSON pointer of its subschema,
unless the request opts into best-effort compilation. Invalid schemas (the metaschema check)
are refused either way.
"""

from __future__ import annotations

from decimal import ROUND_CEILING, Decimal, InvalidOperation
from typing import Any

import jsonschema  # type: ignore[import-untyped]

from grammar.errors import GrammarError, UnsupportedSchemaFeature
from grammar.schema_formats import FORMAT_PATTERNS, STANDARD_FORMATS, SUPPORTED_FORMATS
from grammar.schema_lengths import StringTooComplex, string_dfa, string_patterns
from grammar.schema_merge import distribute_combinators
from grammar.schema_names import KeysUnsupported, plan_keys
from grammar.schema_numbers import StepTooLarge, multiple_of_ebnf
from grammar.schema_refs import follow_refs, hoist_refs
from grammar.schema_rewrite import DEFS, canonical, listed_values
from grammar.schema_unique import unique_array_problem
from grammar.schema_vocabulary import read_as_own_draft
from grammar.schema_walk import escape_pointer, iter_subschemas

# Keywords the backend ignores outright, with the reason users see.
_IGNORED = {
    "not": "negation is not enforced",
    "if": "conditional subschemas are not enforced",
    "then": "conditional subschemas are not enforced",
    "else": "conditional subschemas are not enforced",
    "contains": "'contains' is not enforced",
    "minContains": "'contains' is not enforced",
    "maxContains": "'contains' is not enforced",
    "dependentRequired": "property dependencies are not enforced",
    "dependentSchemas": "property dependencies are not enforced",
    "dependencies": "property dependencies are not enforced",
    "$dynamicRef": "dynamic references are not supported",
    "$recursiveRef": "recursive references are not supported",
}
_LENGTHS = ("minLength", "maxLength")
# Bounded numbers are written as plain decimals with at most this many fraction digits.
_FRACTION_STEP = Decimal("0.000001")
# Keywords that only annotate: harmless next to a $ref.
_ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$schema",
        "$id",
        "$defs",
        "definitions",
    }
)


def check_schema(schema: Any, best_effort: bool = False) -> dict[str, Any]:
    """Raise GrammarError if ``schema`` is invalid, UnsupportedSchemaFeature if it uses a feature
    the backend cannot enforce (skipped when ``best_effort``). Returns the schema to lower: a
    copy with every combinator's sibling keywords combined into it (``schema_merge``)."""
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    if not isinstance(schema.get("$schema", ""), str):
        raise GrammarError("invalid JSON schema at /$schema: it must be a URI string")
    # Every reference target into one table, before anything looks at the schema, so each
    # pass sees the same targets (schema_refs); definitions no reference reaches are left
    # out: a feature there cannot shape a value (and checking them cost 0.3 s on the biggest
    # SchemaStore schemas).
    schema = hoist_refs(schema, best_effort)
    validator_class = jsonschema.validators.validator_for(
        schema, default=jsonschema.Draft202012Validator
    )
    try:
        validator_class.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = _error_pointer(list(exc.path))
        raise GrammarError(f"invalid JSON schema at {where}: {exc.message}") from None
    read_as_own_draft(schema, best_effort)
    try:
        schema = distribute_combinators(schema)
    except UnsupportedSchemaFeature:
        if not best_effort:
            raise
    if not best_effort:
        for pointer, sub in iter_subschemas(schema):
            _check_subschema(schema, pointer, sub)
    return schema  # type: ignore[no-any-return]


def _error_pointer(path: list[Any]) -> str:
    """The JSON pointer of a metaschema error's path in a hoisted schema."""
    if len(path) >= 2 and path[0] in DEFS and str(path[1]).startswith("/"):
        pointer, path = str(path[1]), path[2:]  # a table entry: named by its own pointer
    else:
        pointer = ""
    return pointer + "".join(f"/{escape_pointer(str(p))}" for p in path) or "/"


def _check_subschema(root: dict[str, Any], pointer: str, sub: dict[str, Any]) -> None:
    def reject(keyword: str, reason: str) -> UnsupportedSchemaFeature:
        return UnsupportedSchemaFeature(keyword, pointer, reason)

    for keyword, reason in _IGNORED.items():
        if keyword in sub:
            raise reject(keyword, reason)
    all_of = sub.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        raise reject("allOf", "several subschemas are not enforced (the value is unconstrained)")
    if sub.get("uniqueItems") is True and "array" in (_declared(sub) or {"array"}):
        problem = unique_array_problem(root, sub)
        if problem is not None:
            raise reject("uniqueItems", problem)
    for keyword in ("const", "enum"):
        if keyword in sub and _has_huge_int(sub[keyword]):
            raise reject(
                keyword,
                "integers beyond 64 bits are written as inexact floats by the backend; "
                "pass them as strings",
            )
    if "multipleOf" in sub:
        _check_multiple_of(sub, reject)
    elif _no_short_decimal(sub) and "number" in (_types(root, sub) or ()):
        raise reject(
            "minimum",
            "no number with at most 6 fraction digits (what the backend writes) lies within "
            "the bounds; widen them",
        )
    _check_string(pointer, sub, reject)
    if isinstance(sub.get("$ref"), str):
        siblings = sorted(set(sub) - _ANNOTATIONS - {"$ref"})
        if siblings:
            raise reject("$ref", f"keywords next to '$ref' are ignored: {', '.join(siblings)}")
    _check_object(root, pointer, sub, reject)
    one_of = sub.get("oneOf")
    if isinstance(one_of, list) and len(one_of) > 1:
        for i, a in enumerate(one_of):
            for b in one_of[i + 1 :]:
                if not _disjoint(root, a, b):
                    raise reject(
                        "oneOf",
                        "its subschemas may overlap and only 'anyOf' is enforced; make them "
                        "disjoint (different types, a required property with distinct const, "
                        "or objects each requiring a property the other does not declare)",
                    )


def _check_multiple_of(sub: dict[str, Any], reject: Any) -> None:
    types = _declared(sub)
    if types is None:
        raise reject("multipleOf", "'multipleOf' without a 'type' is not enforced")
    if not types & {"integer", "number"}:
        return  # it constrains numbers only
    try:
        multiple_of_ebnf(sub, integer="number" not in types)
    except StepTooLarge as exc:
        reason = f"a step this fine over this range is not enforced: {exc}"
        raise reject("multipleOf", reason) from None
    except ValueError:
        pass  # the lowering reports a number part that admits nothing


def _check_string(pointer: str, sub: dict[str, Any], reject: Any) -> None:
    """Lengths, a pattern and a format together: enforced when their automaton is small."""
    fmt = sub.get("format") if sub.get("format") in STANDARD_FORMATS else None
    if fmt is not None and fmt not in SUPPORTED_FORMATS:
        supported = ", ".join(sorted(SUPPORTED_FORMATS))
        raise reject("format", f"format {fmt!r} is not enforced (enforced: {supported})")
    lengths = [k for k in _LENGTHS if k in sub]
    pattern = sub.get("pattern")
    if fmt is not None and fmt not in FORMAT_PATTERNS and (lengths or pattern is not None):
        keyword = lengths[0] if lengths else "pattern"
        raise reject(keyword, f"'{keyword}' is not enforced beside format {fmt!r}")
    patterns = string_patterns(sub)
    if not patterns or not (lengths or len(patterns) > 1):
        return
    low, high = sub.get("minLength", 0), sub.get("maxLength")
    if high is not None and low > high:
        return  # the lowering reports the empty range
    try:
        string_dfa(tuple(patterns), low, high)
    except StringTooComplex as exc:
        keyword = lengths[0] if lengths else "format"
        reason = f"'{keyword}' beside a pattern is enforced by an automaton: {exc}"
        raise reject(keyword, reason) from None
    except GrammarError as exc:
        raise GrammarError(f"JSON schema at {pointer or '/'} admits no string: {exc}") from None


def _check_object(root: dict[str, Any], pointer: str, sub: dict[str, Any], reject: Any) -> None:
    declared = sub.get("properties")
    properties: dict[str, Any] = declared if isinstance(declared, dict) else {}
    required = sub.get("required")
    if isinstance(required, list):
        missing = [name for name in required if name not in properties]
        if missing:
            raise reject(
                "required",
                f"required properties missing from 'properties' are never generated:"
                f" {', '.join(map(repr, missing))}",
            )
    try:
        plan_keys(root, sub, pointer)
    except KeysUnsupported as exc:
        raise reject(exc.keyword, exc.reason) from None


def _no_short_decimal(sub: dict[str, Any]) -> bool:
    """Whether ``sub`` has a lower and an upper bound with no multiple of 1e-6 between them
    (the backend then writes an empty number: ``{"a":}``)."""
    lows = _bounds(sub, ("minimum", "exclusiveMinimum"))
    highs = _bounds(sub, ("maximum", "exclusiveMaximum"))
    if not lows or not highs:
        return False
    low, low_key = max(lows)
    high, high_key = min(highs)
    if low > high:
        return False  # the backend refuses an empty range itself
    first = (low / _FRACTION_STEP).to_integral_value(rounding=ROUND_CEILING) * _FRACTION_STEP
    if first == low and low_key == "exclusiveMinimum":
        first += _FRACTION_STEP
    return first > high or (first == high and high_key == "exclusiveMaximum")


def _has_huge_int(value: Any) -> bool:
    """Whether ``value`` (JSON data) holds an integer outside int64 anywhere."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, int) and not isinstance(item, bool):
            if not -(2**63) <= item < 2**63:
                return True
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return False


def _bounds(sub: dict[str, Any], keys: tuple[str, ...]) -> list[tuple[Decimal, str]]:
    found = [(_decimal(sub[key]), key) for key in keys if key in sub]
    return [(value, key) for value, key in found if value is not None]


def _decimal(value: Any) -> Decimal | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        exact = Decimal(repr(value))
    except InvalidOperation:
        return None
    return exact if exact.is_finite() else None


def _types(root: dict[str, Any], sub: Any, hops: int = 0) -> set[str] | None:
    """The JSON types ``sub`` admits as declared (number implies integer), None if unknown
    (a reference chain longer than MAX_REF_HOPS, e.g. a cycle, is unknown)."""
    sub, hops = follow_refs(root, sub, hops)
    if not isinstance(sub, dict):
        return None
    values = listed_values(sub)
    if values is not None:
        return {_json_type(v) for v in values}
    declared = sub.get("type")
    branches = sub.get("anyOf", sub.get("oneOf"))
    if declared is None and isinstance(branches, list) and branches:
        # No type of its own: the union of its branches' types, when each is known.
        union: set[str] = set()
        for branch in branches:
            types = _types(root, branch, hops + 1)
            if types is None:
                return None
            union |= types
        return union
    if declared is None:
        return None
    types = {declared} if isinstance(declared, str) else set(declared)
    return types | {"integer"} if "number" in types else types


def _declared(sub: dict[str, Any]) -> set[str] | None:
    """The types ``sub`` itself declares (None: no ``type``)."""
    declared = sub.get("type")
    if declared is None:
        return None
    return {declared} if isinstance(declared, str) else set(declared)


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    return {str: "string", list: "array", dict: "object", type(None): "null"}[type(value)]


def _disjoint(root: dict[str, Any], a: Any, b: Any, hops: int = 0) -> bool:
    """Whether no JSON value can satisfy both ``a`` and ``b`` (a sufficient, not exact, test;
    past MAX_REF_HOPS references, e.g. arrays of themselves, it answers no)."""
    a, hops = follow_refs(root, a, hops)
    b, hops = follow_refs(root, b, hops)
    if not isinstance(a, dict) or not isinstance(b, dict):
        return a is False or b is False
    types_a, types_b = _types(root, a), _types(root, b)
    if types_a is not None and types_b is not None:
        if not types_a & types_b:
            return True
    values_a, values_b = listed_values(a), listed_values(b)
    if values_a is not None and values_b is not None:
        return not {canonical(v) for v in values_a} & {canonical(v) for v in values_b}
    if _misses_required(root, a, b) and _misses_required(root, b, a):
        return True
    if types_a == types_b == {"array"} and _nonempty(a) and _nonempty(b):
        items_a, items_b = a.get("items"), b.get("items")
        if isinstance(items_a, dict) and isinstance(items_b, dict):
            if _disjoint(root, items_a, items_b, hops + 1):  # their first items differ
                return True
    props_a, props_b = a.get("properties") or {}, b.get("properties") or {}
    for name in set(a.get("required") or ()) & set(b.get("required") or ()):
        va, vb = listed_values(props_a.get(name) or {}), listed_values(props_b.get(name) or {})
        if va is not None and vb is not None:
            if not {canonical(v) for v in va} & {canonical(v) for v in vb}:
                return True
    return False


def _nonempty(sub: dict[str, Any]) -> bool:
    """Whether an array schema requires at least one item (and has no tuple prefix)."""
    low = sub.get("minItems", 0)
    return isinstance(low, int) and low >= 1 and "prefixItems" not in sub


def _misses_required(root: dict[str, Any], made: dict[str, Any], other: dict[str, Any]) -> bool:
    """Whether every object generated from ``made`` lacks a property ``other`` requires, so
    fails ``other``: generated objects hold only their declared properties (strict mode) unless
    ``additionalProperties`` or ``patternProperties`` can add more."""
    if _types(root, made) != {"object"} or "patternProperties" in made:
        return False
    if made.get("additionalProperties", False) is not False:
        return False
    declared = made.get("properties") or {}
    return any(name not in declared for name in other.get("required") or ())
