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
from dataclasses import dataclass
from typing import Any

import jsonschema  # type: ignore[import-untyped]

from grammar.errors import GrammarError
from grammar.regex import to_json_string_regex
from grammar.schema_formats import FORMAT_PATTERNS
from grammar.schema_walk import iter_subschemas

PLACEHOLDER = "ARBORSTRING"
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
