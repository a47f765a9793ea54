"""Rewrite a checked JSON schema into one xgrammar's converter turns into an exact grammar.

Measured on xgrammar 0.2.8: ``enum``/``const`` win over every sibling keyword (so
``{"type": "integer", "const": "a"}`` emits "a"); length-bounded strings admit raw control
characters, which makes the JSON unparseable; and its JSON-string regex mode drops characters
from patterns. So values are filtered here by their siblings (with ``jsonschema``), and every
string carrying ``pattern``, a pattern-backed ``format``, or a length bound is replaced by a
placeholder pattern whose grammar ``json_grammar`` supplies itself. ``patternProperties`` keys
get placeholders the same way. Values whose language we build as an automaton (``multipleOf``,
``uniqueItems`` over listed items, strings under a pattern and lengths, planned object keys)
get theirs from ``schema_numbers``, ``schema_unique``, ``schema_lengths`` and ``schema_names``.
"""

from __future__ import annotations

import copy
import logging
import re
from typing import Any

import jsonschema  # type: ignore[import-untyped]

from grammar.automaton import to_ebnf
from grammar.errors import GrammarError
from grammar.regex import to_json_string_regex
from grammar.schema_formats import STANDARD_FORMATS
from grammar.schema_lengths import StringTooComplex, string_patterns, string_rule_ebnf
from grammar.schema_names import KeysUnsupported, plan_keys
from grammar.schema_numbers import StepTooLarge, multiple_of_ebnf
from grammar.schema_rewrite import BY_TYPE, COMBINATORS, DEFS
from grammar.schema_rules import (
    VALUE_PLACEHOLDER,
    Rule,
    StringRule,
    ValueRule,
    string_placeholder,
    value_placeholder,
)
from grammar.schema_unique import unique_array_ebnf, unique_array_problem, unique_item_values
from grammar.schema_walk import iter_subschemas

logger = logging.getLogger(__name__)

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_LOGGED_FORMATS: set[str] = set()
_STRING_KEYWORDS = ("pattern", "format", "minLength", "maxLength")
_KEEP_WITH_VALUES = frozenset({"enum", "const", "title", "description", "$comment", "default"})
# A subschema with any of these is not replaced by a value rule of ours (best effort only: the
# checked rewrite leaves no combinator beside constraining keywords).
_NOT_REPLACEABLE = frozenset({*COMBINATORS, "$ref", "not", "if", "then", "else"})
_NUMERIC = frozenset({"integer", "number"})
_RESERVED = re.compile(f"{VALUE_PLACEHOLDER}[0-9]+")


def lower_schema(
    schema: dict[str, Any], rules: list[Rule] | None = None
) -> tuple[dict[str, Any], list[Rule]]:
    """A rewritten copy of a checked ``schema`` and the rules of its placeholders, by index.

    Placeholder ``i`` appears in the copy as the pattern ``^ARBORSTRING<i>$`` or the const
    ``"ARBORVALUE<i>"``; new rules are appended to ``rules`` when given (several schemas in one
    grammar share one list). Raises GrammarError if a subschema's enum/const values all violate
    its other keywords, a pattern cannot be translated, or a subschema admits no value.
    """
    lowered = copy.deepcopy(schema)
    # Subschemas are tracked by identity: a pointer may name two of them (a reference target
    # and what a merge made where it was written), see schema_refs.
    subschemas = list(iter_subschemas(lowered))
    values = _filtered_values(schema, subschemas)
    rules = [] if rules is None else rules
    spelled: set[int] = set()  # subschemas inside values that rules of ours now spell whole
    for pointer, sub in subschemas:
        if id(sub) not in spelled:
            try:
                _lower_here(schema, pointer, sub, rules, values, spelled)
            except _AdmitsNothing as exc:
                raise GrammarError(f"JSON schema at {pointer or '/'} {exc}") from None
    return lowered, rules


class _AdmitsNothing(Exception):
    """A subschema admits no value of any of its types (the message says which part)."""


def _lower_here(
    root: dict[str, Any],
    pointer: str,
    sub: dict[str, Any],
    rules: list[Rule],
    values: dict[int, list[Any]],
    spelled: set[int],
) -> None:
    """Lower one subschema in place (the walk reaches its subschemas later)."""
    _drop_annotation_format(sub)
    _clamp_integer_bounds(pointer, sub)
    _default_array_items(sub)
    if id(sub) in values:
        for key in set(sub) - _KEEP_WITH_VALUES:
            if key not in ("$defs", "definitions"):
                del sub[key]
        sub.pop("const", None)
        sub["enum"] = values[id(sub)]
        return
    taken, rest = _lower_multiple_of(sub, rules)
    if not taken:
        inside = {key: sub[key] for key in ("items", "prefixItems", "contains") if key in sub}
        taken, rest = _lower_unique_items(root, sub, rules)
        if taken:
            spelled.update(id(inner) for _, inner in iter_subschemas(inside))
    if taken:
        if rest is not None and rest is not sub:  # the value's other JSON types, as they were
            try:
                _lower_here(root, pointer, rest, rules, values, spelled)
            except _AdmitsNothing:  # only ours are left
                (only,) = [branch for branch in sub.pop("anyOf") if branch is not rest]
                sub.update(only)
        elif rest is sub:
            _lower_here(root, pointer, sub, rules, values, spelled)
        return
    rule = _string_rule(pointer, sub)
    if rule is not None:
        for key in _STRING_KEYWORDS:
            sub.pop(key, None)
        sub["pattern"] = string_placeholder(rules, rule)
    _lower_keys(root, pointer, sub, rules)
    _drop_false_properties(pointer, sub)


def _lower_keys(root: dict[str, Any], pointer: str, sub: dict[str, Any], rules: list[Rule]) -> None:
    """``patternProperties`` keys as placeholders, planned with ``propertyNames``
    (``schema_names``); best effort keeps what has no exact plan as the backend takes it."""
    try:
        plan = plan_keys(root, sub, pointer)
    except KeysUnsupported:
        plan = None
    if plan is not None:
        properties = sub.get("properties")
        if isinstance(properties, dict):
            for name in plan.dropped:
                properties.pop(name, None)
        sub.pop("propertyNames", None)
        if plan.closed:
            sub["additionalProperties"] = False
        sub.pop("patternProperties", None)
        entries: list[tuple[Any, Any]] = plan.patterns
    elif isinstance(sub.get("patternProperties"), dict):
        entries = list(sub["patternProperties"].items())
    else:
        return
    keyed = {}
    for key, value in entries:
        if isinstance(key, str):
            rule = StringRule(_translate(key, pointer, "patternProperties"))
        else:
            rule = StringRule(ebnf=to_ebnf(key, json_string=True))
        keyed[string_placeholder(rules, rule)] = value
    if keyed:
        sub["patternProperties"] = keyed


def _lower_multiple_of(
    sub: dict[str, Any], rules: list[Rule]
) -> tuple[bool, dict[str, Any] | None]:
    """Numbers with ``multipleOf`` as a value rule of ours (``schema_numbers``): whether it
    took them over, and the branch of ``sub``'s other types (``_take_over``). Best effort
    leaves a step whose automaton is too large to the backend."""
    types = _declared_types(sub)
    if "multipleOf" not in sub or not types & _NUMERIC or _NOT_REPLACEABLE & set(sub):
        return False, None
    try:
        ebnf = multiple_of_ebnf(sub, integer="number" not in types)
    except StepTooLarge:
        return False, None
    except ValueError as exc:
        return True, _take_over(sub, _NUMERIC, None, f"admits no number: {exc}")
    return True, _take_over(sub, _NUMERIC, value_placeholder(rules, ValueRule(ebnf)), "")


def _lower_unique_items(
    root: dict[str, Any], sub: dict[str, Any], rules: list[Rule]
) -> tuple[bool, dict[str, Any] | None]:
    """Arrays with ``uniqueItems`` over listed items as a value rule of ours
    (``schema_unique``); as ``_lower_multiple_of``."""
    types = _declared_types(sub)
    if sub.get("uniqueItems") is not True or "array" not in types or _NOT_REPLACEABLE & set(sub):
        return False, None
    if unique_array_problem(root, sub) is not None:
        return False, None
    values = unique_item_values(root, sub)
    assert values is not None
    arrays = frozenset({"array"})
    try:
        ebnf = unique_array_ebnf(values, sub)
    except ValueError as exc:
        return True, _take_over(sub, arrays, None, f"admits no array: {exc}")
    return True, _take_over(sub, arrays, value_placeholder(rules, ValueRule(ebnf)), "")


def _declared_types(sub: dict[str, Any]) -> set[str]:
    types = sub.get("type")
    if isinstance(types, str):
        return {types}
    return set(types) if isinstance(types, list) else set()


def _take_over(
    sub: dict[str, Any], kinds: frozenset[str], placeholder: str | None, empty: str
) -> dict[str, Any] | None:
    """Rewrite ``sub`` so that values of the JSON types ``kinds`` are the placeholder's (None:
    there are none) and values of its other types stay as they were; returns the branch of
    those other types (None without them), which the caller still has to lower."""
    others = sorted(_declared_types(sub) - kinds)
    typed = {k for kind in kinds for k in BY_TYPE["number" if kind == "integer" else kind]}
    rest = {k: v for k, v in sub.items() if k not in typed and k not in DEFS}
    kept = {k: v for k, v in sub.items() if k in DEFS}
    branches: list[dict[str, Any]] = []
    if placeholder is not None:
        branches.append({"const": placeholder})
    if others:
        branches.append({**rest, "type": others[0] if len(others) == 1 else others})
    if not branches:
        raise _AdmitsNothing(empty)
    sub.clear()
    sub.update(branches[0] if len(branches) == 1 else {"anyOf": branches})
    sub.update(kept)
    if not others:
        return None
    return sub if placeholder is None else sub["anyOf"][-1]  # type: ignore[no-any-return]


def _drop_annotation_format(sub: dict[str, Any]) -> None:
    """A format the specification does not define only annotates: the backend must not see it."""
    name = sub.get("format")
    if isinstance(name, str) and name not in STANDARD_FORMATS:
        if name not in _LOGGED_FORMATS:
            _LOGGED_FORMATS.add(name)
            logger.info("JSON schema format %r is not a standard format: not enforced", name)
        del sub["format"]


def _clamp_integer_bounds(pointer: str, sub: dict[str, Any]) -> None:
    """Integer bounds beyond int64 (which the backend refuses) narrowed to int64's range, where
    every generated integer lies anyway; a range wholly beyond it admits nothing we can write."""
    types = sub.get("type")
    if types != "integer" and types != ["integer"]:
        return
    for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        value = sub.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        lower = key in ("minimum", "exclusiveMinimum")
        if lower and value > _INT64_MAX or not lower and value < _INT64_MIN:
            raise GrammarError(
                f"JSON schema at {pointer or '/'}: {key} {value} leaves no 64-bit integer"
            )
        if lower and value < _INT64_MIN:
            sub.pop(key)
            sub["minimum"] = max(sub.get("minimum", _INT64_MIN), _INT64_MIN)
        elif not lower and value > _INT64_MAX:
            sub.pop(key)
            sub["maximum"] = min(sub.get("maximum", _INT64_MAX), _INT64_MAX)


def _default_array_items(sub: dict[str, Any]) -> None:
    """An array schema without ``items``/``prefixItems`` allows any items; the backend's strict
    mode would allow none (and refuse ``minItems``), so say so."""
    types = sub.get("type")
    is_array = types == "array" or (isinstance(types, list) and "array" in types)
    if is_array and "items" not in sub and "prefixItems" not in sub:
        sub["items"] = {}


def _drop_false_properties(pointer: str, sub: dict[str, Any]) -> None:
    """``properties`` entries that are ``false`` (the backend refuses them): the name may not
    appear. Strict objects write no undeclared key, and planned keys (``_lower_keys``, before:
    pattern keys and additional keys as a pattern entry) keep out of every declared name, so
    leaving it out is exact; a required one leaves no object. (Best effort without a key plan
    may then write the name as an additional key.)"""
    properties = sub.get("properties")
    if not isinstance(properties, dict):
        return
    banned = [name for name, value in properties.items() if value is False]
    if not banned:
        return
    required = set(sub.get("required") or ())
    if required & set(banned):
        name = sorted(required & set(banned))[0]
        raise GrammarError(
            f"JSON schema at {pointer or '/'} admits no object: property {name!r} is required "
            "but its schema is false"
        )
    for name in banned:
        del properties[name]


def _filtered_values(
    schema: dict[str, Any], subschemas: list[tuple[str, dict[str, Any]]]
) -> dict[int, list[Any]]:
    """For each of ``subschemas`` (of a copy of ``schema``) with enum/const, by identity: the
    values that also satisfy its other keywords (references resolve in ``schema``)."""
    # Formats asserted, as generation enforces them (jsonschema only annotates by default).
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    result: dict[int, list[Any]] = {}
    for pointer, sub in subschemas:
        if "const" in sub:
            values = [sub["const"]]
        elif isinstance(sub.get("enum"), list):
            values = list(sub["enum"])
        else:
            continue
        if any(isinstance(v, str) and _RESERVED.fullmatch(v) for v in values):
            raise GrammarError(
                f"JSON schema at {pointer or '/'}: the strings {VALUE_PLACEHOLDER}<n> are "
                "reserved for the grammar compiler"
            )
        rest = {k: v for k, v in sub.items() if k not in ("enum", "const")}
        check = validator.evolve(schema=rest)
        kept = [v for v in values if check.is_valid(v)]
        if not kept:
            raise GrammarError(
                f"JSON schema at {pointer or '/'} admits no value: none of its enum/const "
                "values satisfies its other keywords"
            )
        result[id(sub)] = kept
    return result


def _string_rule(pointer: str, sub: dict[str, Any]) -> StringRule | None:
    patterns = string_patterns(sub)
    has_lengths = any(k in sub for k in ("minLength", "maxLength"))
    low, high = sub.get("minLength", 0), sub.get("maxLength")
    if high is not None and low > high:
        raise GrammarError(f"JSON schema at {pointer or '/'}: minLength {low} > maxLength {high}")
    if patterns and (has_lengths or len(patterns) > 1):
        try:
            return StringRule(ebnf=string_rule_ebnf(tuple(patterns), low, high))
        except StringTooComplex:
            pass  # best effort: the pattern alone (the checker refused this in exact mode)
        except GrammarError as exc:
            raise GrammarError(f"JSON schema at {pointer or '/'} admits no string: {exc}") from None
    if isinstance(sub.get("pattern"), str):
        return StringRule(regex=_translate(sub["pattern"], pointer, "pattern"))
    if patterns:
        return StringRule(regex=_translate(patterns[0], pointer, "format"))
    if "format" in sub or not has_lengths:
        return None  # a native format enforces itself; best-effort drops its lengths
    return StringRule(min_length=low, max_length=high)


def _translate(pattern: str, pointer: str, keyword: str) -> str:
    return to_json_string_regex(pattern, what=f"pattern at {pointer}/{keyword}")
