"""Forty-odd JSON schemas constrained generation must always satisfy, and the validator to check.

Reusable by the end-to-end Engine tests: ``SCHEMAS`` is a list of (name, schema), and
``validate_output(schema, text)`` parses text strictly (no NaN, no raw control characters)
and validates it with ``jsonschema`` with format checking on, including date-time and time,
which this environment's ``jsonschema`` would otherwise skip, and ``multipleOf`` decided on
exact decimals (``grammar.validate.validator_class``). Strings are mostly length-
bounded so that a random-weight model finishes within a few hundred tokens.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import jsonschema  # type: ignore[import-untyped]

from grammar.validate import validator_class

_FORMATS = jsonschema.FormatChecker(
    formats=list(jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers)
)


@_FORMATS.checks("date-time", raises=ValueError)
def _is_date_time(value: object) -> bool:
    if not isinstance(value, str):
        return True
    if "T" not in value or not (value.endswith("Z") or value[-6] in "+-"):
        raise ValueError(f"{value!r} is not an RFC 3339 date-time")
    datetime.datetime.fromisoformat(value)
    return True


@_FORMATS.checks("time", raises=ValueError)
def _is_time(value: object) -> bool:
    if not isinstance(value, str):
        return True
    if not (value.endswith("Z") or value[-6] in "+-"):
        raise ValueError(f"{value!r} has no UTC offset")
    datetime.time.fromisoformat(value)
    return True


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def validate_output(schema: dict[str, Any], text: str) -> Any:
    """The parsed value; raises if text is not strict JSON or violates the schema."""
    value = json.loads(text, parse_constant=_reject_constant)
    # 2020-12 with multipleOf on exact decimals (grammar.validate explains why).
    validator_class({})(schema, format_checker=_FORMATS).validate(value)
    return value


_NAME = {"type": "string", "minLength": 1, "maxLength": 12}
_ADDRESS = {
    "type": "object",
    "properties": {
        "street": {"type": "string", "maxLength": 16},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "country": {"enum": ["NL", "DE", "FR"]},
    },
    "required": ["street", "zip", "country"],
}

SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("integer", {"type": "integer"}),
    ("integer_bounds", {"type": "integer", "minimum": -5, "maximum": 17}),
    ("integer_exclusive", {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}),
    ("integer_multiple_of", {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}),
    ("number_bounds", {"type": "number", "minimum": -1.5, "maximum": 2.25}),
    ("number_exclusive", {"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
    ("boolean", {"type": "boolean"}),
    ("null", {"type": "null"}),
    ("string_lengths", {"type": "string", "minLength": 2, "maxLength": 6}),
    ("string_min_only", {"type": "string", "minLength": 3}),
    ("string_pattern", {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}),
    ("pattern_optional_group", {"type": "string", "pattern": "^v[0-9](?:\\.[0-9]{1,2})?$"}),
    ("pattern_escapes", {"type": "string", "pattern": '^["\\\\a-c]{1,4}$'}),
    ("pattern_alternation", {"type": "string", "pattern": "^(red|green|blue)(-dark)?$"}),
    ("format_date", {"type": "string", "format": "date"}),
    ("format_date_time", {"type": "string", "format": "date-time"}),
    ("format_time", {"type": "string", "format": "time"}),
    ("format_uuid", {"type": "string", "format": "uuid"}),
    ("format_email", {"type": "string", "format": "email"}),
    ("format_ipv4", {"type": "string", "format": "ipv4"}),
    ("format_ipv6", {"type": "string", "format": "ipv6"}),
    ("enum_strings", {"enum": ["low", "medium", "high"]}),
    ("enum_mixed", {"enum": [1, "one", None, True, {"n": [1, 2]}]}),
    ("enum_filtered_by_type", {"type": "string", "enum": ["a", 1, "bb", None]}),
    ("const_object", {"const": {"kind": "point", "xy": [1, 2]}}),
    ("type_union", {"type": ["integer", "null"], "minimum": 0, "maximum": 9}),
    ("nullable_string", {"type": ["string", "null"], "maxLength": 4}),
    ("anyof_scalars", {"anyOf": [{"type": "boolean"}, {"type": "integer", "maximum": 3}]}),
    (
        "oneof_disjoint",
        {
            "oneOf": [
                {
                    "type": "object",
                    "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
                    "required": ["kind", "lives"],
                },
                {
                    "type": "object",
                    "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
                    "required": ["kind", "good"],
                },
            ]
        },
    ),
    ("array_bounds", {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3}),
    ("array_exact", {"type": "array", "items": {"enum": [0, 1]}, "minItems": 3, "maxItems": 3}),
    (
        "array_tuple",
        {
            "type": "array",
            "prefixItems": [{"type": "integer", "minimum": 0}, {"type": "string", "maxLength": 3}],
            "items": False,
        },
    ),
    (
        "array_of_objects",
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1}, "ok": {"type": "boolean"}},
                "required": ["id", "ok"],
            },
            "maxItems": 2,
        },
    ),
    ("array_empty", {"type": "array", "maxItems": 0}),
    (
        "object_required",
        {
            "type": "object",
            "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0}},
            "required": ["name", "age"],
        },
    ),
    (
        "object_optional",
        {
            "type": "object",
            "properties": {
                "a": {"type": "boolean"},
                "b": {"type": "integer", "maximum": 9},
                "c": {"type": "null"},
            },
            "required": ["b"],
        },
    ),
    (
        "object_all_optional",
        {"type": "object", "properties": {"x": {"type": "boolean"}, "y": {"type": "null"}}},
    ),
    (
        "object_additional",
        {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 2},
    ),
    (
        "object_pattern_properties",
        {
            "type": "object",
            "patternProperties": {"^k[0-9]$": {"type": "boolean"}},
            "additionalProperties": False,
            "maxProperties": 2,
        },
    ),
    (
        "object_property_names",
        {
            "type": "object",
            "propertyNames": {"pattern": "^[a-c]{1,2}$"},
            "additionalProperties": {"type": "null"},
            "maxProperties": 2,
        },
    ),
    (
        "nested_objects",
        {
            "type": "object",
            "properties": {
                "person": {
                    "type": "object",
                    "properties": {"name": _NAME, "home": _ADDRESS},
                    "required": ["name", "home"],
                }
            },
            "required": ["person"],
        },
    ),
    (
        "defs_ref",
        {
            "$defs": {"address": _ADDRESS},
            "type": "object",
            "properties": {
                "home": {"$ref": "#/$defs/address"},
                "work": {"$ref": "#/$defs/address"},
            },
            "required": ["home"],
        },
    ),
    (
        "recursive_tree",
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "v": {"type": "integer", "minimum": 0, "maximum": 9},
                        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                    },
                    "required": ["v"],
                }
            },
            "$ref": "#/$defs/node",
        },
    ),
    (
        "recursive_root",
        {
            "type": "object",
            "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
            "required": ["next"],
        },
    ),
    (
        "long_fixed_keys",
        {
            "type": "object",
            "properties": {
                "customer_identification_number": {"type": "integer", "minimum": 0, "maximum": 99},
                "preferred_communication_channel": {"enum": ["email", "phone"]},
                "subscription_renewal_is_enabled": {"type": "boolean"},
            },
            "required": [
                "customer_identification_number",
                "preferred_communication_channel",
                "subscription_renewal_is_enabled",
            ],
        },
    ),
    (
        "event",
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "format": "uuid"},
                "at": {"type": "string", "format": "date-time"},
                "host": {"type": "string", "format": "ipv4"},
                "owner": {"type": "string", "format": "email"},
                "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
            },
            "required": ["id", "at", "host", "tags"],
        },
    ),
    (
        "unicode_keys_and_values",
        {
            "type": "object",
            "properties": {"naïve café": {"const": "crème brûlée"}, "ключ": {"type": "boolean"}},
            "required": ["naïve café", "ключ"],
        },
    ),
]
