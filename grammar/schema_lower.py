"""Rewrite a checked JSON schema into one xgrammar's converter turns into an exact grammar.

Measured on xgrammar 0.2.8: ``enum``/``const`` win over every sibling keyword (so
``{"type": "integer", "const": "a"}`` emits "a"); length-bounded strings admit raw control
characters, which makes the JSON unparseable; and its JSON-string regex mode drops characters
from patterns. So values are filtered here by their siblings (with ``jsonschema``), and every
string carrying ``pattern``, a pattern-backed ``format``, or a length bound is replaced by a
placeholder pattern whose grammar ``json_grammar`` supplies itself. ``patternProperties`` keys
get placeholders the same way.
"""

from __future__ import annotations

import copy
import logging
import re
from dataclasses import dataclass
from typing import Any

import jsonschema  # type: ignore[import-untyped]

from grammar.errors import GrammarError, UnsupportedSchemaFeature
from grammar.regex import to_json_string_regex
from grammar.schema_formats import FORMAT_PATTERNS, STANDARD_FORMATS
from grammar.schema_walk import iter_subschemas

logger = logging.getLogger(__name__)

PLACEHOLDER = "ARBORSTRING"
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_LOGGED_FORMATS: set[str] = set()
_STRING_KEYWORDS = ("pattern", "format", "minLength", "maxLength")
_KEEP_WITH_VALUES = frozenset({"enum", "const", "title", "description", "$comment", "default"})


@dataclass(frozen=True)
class StringRule:
    """What may stand between the quotes of one placeholder string.

    ``regex`` (over the JSON-escaped text) when set; otherwise ``min_length`` to ``max_length``
    (None: unbounded) characters that need no escaping.
    """

    regex: str | None = None
    min_length: int = 0
    max_length: int | None = None


def lower_schema(
    schema: dict[str, Any], rules: list[StringRule] | None = None
) -> tuple[dict[str, Any], list[StringRule]]:
    """A rewritten copy of a checked ``schema`` and the rules of its placeholders, by index.

    Placeholder ``i`` appears in the copy as the pattern ``^ARBORSTRING<i>$``; new rules are
    appended to ``rules`` when given (several schemas in one grammar share one list). Raises
    GrammarError if a subschema's enum/const values all violate its other keywords, or a
    pattern cannot be translated.
    """
    values = _filtered_values(schema)
    lowered = copy.deepcopy(schema)
    rules = [] if rules is None else rules
    for pointer, sub in list(iter_subschemas(lowered)):
        _drop_annotation_format(sub)
        _clamp_integer_bounds(pointer, sub)
        _default_array_items(sub)
        _drop_false_properties(pointer, sub)
        if pointer in values:
            for key in set(sub) - _KEEP_WITH_VALUES:
                if key not in ("$defs", "definitions"):
                    del sub[key]
            sub.pop("const", None)
            sub["enum"] = values[pointer]
            continue
        rule = _string_rule(pointer, sub)
        if rule is not None:
            for key in _STRING_KEYWORDS:
                sub.pop(key, None)
            sub["pattern"] = _placeholder(rules, rule)
        patterns = sub.get("patternProperties")
        if isinstance(patterns, dict):
            keys = [StringRule(_translate(k, pointer, "patternProperties")) for k in patterns]
            sub["patternProperties"] = {
                _placeholder(rules, rule): value
                for rule, value in zip(keys, patterns.values(), strict=True)
            }
    return lowered, rules


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
    appear, which the backend's strict objects already ensure unless ``additionalProperties``
    could produce it; a required one leaves no object."""
    properties = sub.get("properties")
    if not isinstance(properties, dict):
        properties = {}
    banned = [name for name, value in properties.items() if value is False]
    patterns = sub.get("patternProperties")
    if isinstance(patterns, dict) and any(v is False for v in patterns.values()):
        # Keys matching a false pattern may not appear: drop the pattern (strict objects then
        # never produce such keys) and every declared property it matches — unless another
        # pattern or additionalProperties could produce them.
        if sub.get("additionalProperties", False) is not False or not all(
            v is False for v in patterns.values()
        ):
            raise UnsupportedSchemaFeature(
                "patternProperties",
                pointer,
                "a false pattern is not enforced beside other patterns or additionalProperties",
            )
        for pattern in [k for k, v in patterns.items() if v is False]:
            del patterns[pattern]
            try:
                matcher = re.compile(pattern)
            except re.error:
                raise UnsupportedSchemaFeature(
                    "patternProperties", pointer, f"pattern {pattern!r} is not a valid regex"
                ) from None
            banned += [name for name in properties if matcher.search(name)]
        if not patterns:
            del sub["patternProperties"]
    if not banned:
        return
    required = set(sub.get("required") or ())
    if required & set(banned):
        name = sorted(required & set(banned))[0]
        raise GrammarError(
            f"JSON schema at {pointer or '/'} admits no object: property {name!r} is required "
            "but its schema is false"
        )
    if sub.get("additionalProperties", False) is not False or "patternProperties" in sub:
        raise UnsupportedSchemaFeature(
            "properties",
            pointer,
            "a property whose schema is false is not enforced beside additionalProperties "
            "or patternProperties",
        )
    for name in dict.fromkeys(banned):
        del properties[name]


def _filtered_values(schema: dict[str, Any]) -> dict[str, list[Any]]:
    """For each subschema with enum/const: the values that also satisfy its other keywords."""
    # Formats asserted, as generation enforces them (jsonschema only annotates by default).
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    result: dict[str, list[Any]] = {}
    for pointer, sub in iter_subschemas(schema):
        if "const" in sub:
            values = [sub["const"]]
        elif isinstance(sub.get("enum"), list):
            values = list(sub["enum"])
        else:
            continue
        rest = {k: v for k, v in sub.items() if k not in ("enum", "const")}
        check = validator.evolve(schema=rest)
        kept = [v for v in values if check.is_valid(v)]
        if not kept:
            raise GrammarError(
                f"JSON schema at {pointer or '/'} admits no value: none of its enum/const "
                "values satisfies its other keywords"
            )
        result[pointer] = kept
    return result


def _string_rule(pointer: str, sub: dict[str, Any]) -> StringRule | None:
    if isinstance(sub.get("pattern"), str):
        return StringRule(regex=_translate(sub["pattern"], pointer, "pattern"))
    if sub.get("format") in FORMAT_PATTERNS:
        return StringRule(regex=_translate(FORMAT_PATTERNS[sub["format"]], pointer, "format"))
    if "format" in sub or not any(k in sub for k in ("minLength", "maxLength")):
        return None  # a native format enforces itself; best-effort drops its lengths
    low, high = sub.get("minLength", 0), sub.get("maxLength")
    if high is not None and low > high:
        raise GrammarError(f"JSON schema at {pointer or '/'}: minLength {low} > maxLength {high}")
    return StringRule(min_length=low, max_length=high)


def _translate(pattern: str, pointer: str, keyword: str) -> str:
    return to_json_string_regex(pattern, what=f"pattern at {pointer}/{keyword}")


def _placeholder(rules: list[StringRule], rule: StringRule) -> str:
    rules.append(rule)
    return f"^{PLACEHOLDER}{len(rules) - 1}$"
