"""Fail closed: features xgrammar would drop are rejected, naming the keyword and its pointer."""

from __future__ import annotations

from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest

from grammar import (
    GrammarBackend,
    GrammarError,
    GrammarOptions,
    GrammarService,
    GrammarSpec,
    UnsupportedSchemaFeature,
)
from tests.grammar.decoder import ConstrainedDecoder, sample_random
from tests.grammar.schema_corpus import validate_output

BEST_EFFORT = GrammarOptions(best_effort=True)

# (keyword, pointer of the subschema holding it, schema)
REJECTED: list[tuple[str, str, dict[str, Any]]] = [
    (
        "maxLength",
        "/properties/slug",
        {
            "type": "object",
            "properties": {
                "slug": {"type": "string", "pattern": "^[a-z]+(-[a-z]+)*$", "maxLength": 1000}
            },
        },
    ),  # the pattern-and-length automaton would have about 2,000 states
    ("maxLength", "", {"type": "string", "format": "email", "maxLength": 20}),
    ("pattern", "", {"type": "string", "format": "email", "pattern": "^a"}),
    ("multipleOf", "", {"type": "number", "minimum": 0, "maximum": 1e6, "multipleOf": 0.0123}),
    ("multipleOf", "", {"type": "integer", "minimum": 0, "multipleOf": 1000}),
    ("const", "", {"const": 9223372036854775809}),
    ("enum", "/items", {"type": "array", "items": {"enum": [1, {"a": [-(2**64)]}]}}),
    ("minimum", "", {"type": "number", "minimum": 1.1328125, "maximum": 1.1328125}),
    (
        "minimum",
        "/properties/a",
        {
            "type": "object",
            "properties": {
                "a": {"type": "number", "exclusiveMinimum": 0.5, "exclusiveMaximum": 0.5000005}
            },
        },
    ),  # fmt: skip
    (
        "uniqueItems",
        "/properties/tags",
        {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
    ),
    (
        "uniqueItems",
        "",
        {"type": "array", "items": {"enum": list(range(12))}, "uniqueItems": True},
    ),  # 2^12 sets of used values
    ("contains", "", {"type": "array", "contains": {"const": 3}}),
    ("maxContains", "", {"type": "array", "maxContains": 1}),
    ("if", "", {"if": {"type": "integer"}, "then": {"minimum": 0}}),
    ("then", "/items", {"type": "array", "items": {"then": {"minimum": 0}}}),
    ("not", "/anyOf/1", {"anyOf": [{"type": "null"}, {"not": {"const": 0}}]}),
    ("$ref", "", {"$ref": "https://example.com/schemas/thing.json"}),
    (
        "format",
        "/properties/host",
        {"properties": {"host": {"type": "string", "format": "hostname"}}},
    ),
    ("format", "", {"type": "string", "format": "uri-template"}),
    ("format", "", {"type": "string", "format": "json-pointer"}),
    (
        "oneOf",
        "",
        {"oneOf": [{"type": "integer", "maximum": 5}, {"type": "integer", "minimum": 3}]},
    ),
    (
        "dependentRequired",
        "",
        {"type": "object", "additionalProperties": True, "dependentRequired": {"a": ["b"]}},
    ),
    ("dependentSchemas", "", {"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}),
    ("required", "", {"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}),
    (
        "propertyNames",
        "",
        {"type": "object", "additionalProperties": {}, "propertyNames": {"not": {"const": "a"}}},
    ),
    ("$ref", "", {"$defs": {"a": {"$anchor": "here", "type": "integer"}}, "$ref": "#here"}),
    (
        "$id",
        "/$defs/a",
        {"$defs": {"a": {"$id": "https://x.org/a", "type": "integer"}}, "$ref": "#/$defs/a"},
    ),
]


@pytest.mark.parametrize(("keyword", "pointer", "schema"), REJECTED)
def test_rejected_with_keyword_and_pointer(
    keyword: str, pointer: str, schema: dict[str, Any]
) -> None:
    with pytest.raises(UnsupportedSchemaFeature) as info:
        GrammarSpec.for_json_schema(schema)
    assert (info.value.keyword, info.value.pointer) == (keyword, pointer)
    assert f"{pointer}/{keyword}" in str(info.value)
    assert isinstance(info.value, ValueError)


# Best effort compiles them all; a reference it does not follow admits anything there.
@pytest.mark.parametrize(("keyword", "pointer", "schema"), REJECTED)
def test_best_effort_compiles_anyway(
    keyword: str, pointer: str, schema: dict[str, Any], service: GrammarService
) -> None:
    service.compile(GrammarSpec.for_json_schema(schema, BEST_EFFORT))


# Schemas where ignoring the keyword shows up as invalid output: the evidence for the rules.
# (The evidence for the keywords we now enforce with automata of our own is in
# test_schema_automata.py.)
EVIDENCE = [
    ("no 6-digit decimal", {"type": "number", "minimum": 1.1328125, "maximum": 1.1328126}),
    (
        "uniqueItems over objects",
        {
            "type": "array",
            "items": {"type": "object", "properties": {"k": {"enum": [0, 1]}}, "required": ["k"]},
            "minItems": 2,
            "maxItems": 2,
            "uniqueItems": True,
        },
    ),
    (
        "contains",
        {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2, "contains": {"const": 3}},
    ),
    ("not", {"type": "integer", "minimum": 0, "maximum": 1, "not": {"const": 0}}),
    (
        "if/then",
        {
            "type": "object",
            "properties": {"a": {"type": "boolean"}, "b": {"type": "boolean"}},
            "required": ["a"],
            "if": {"required": ["a"]},
            "then": {"required": ["b"]},
        },
    ),
    (
        "oneOf",
        {
            "oneOf": [
                {"type": "integer", "minimum": 0, "maximum": 5},
                {"type": "integer", "minimum": 3, "maximum": 9},
            ]
        },
    ),
    ("required", {"type": "object", "properties": {"a": {"type": "null"}}, "required": ["a", "b"]}),
]


@pytest.mark.parametrize(("name", "schema"), EVIDENCE, ids=[e[0] for e in EVIDENCE])
def test_rejected_features_are_really_dropped_by_the_backend(
    name: str, schema: dict[str, Any], backend: GrammarBackend, decoder: ConstrainedDecoder
) -> None:
    """Best-effort output violates each schema for some seed: the rejection is not overcautious."""
    compiled = backend.compile(GrammarSpec.for_json_schema(schema, BEST_EFFORT))
    violations = 0
    for seed in range(40):
        tokens, done = sample_random(compiled, decoder.vocab_size, seed, 64, 4.0 * decoder.closing)
        if done:
            try:
                validate_output(schema, decoder.tokenizer.decode(tokens[:-1]))
            except (ValueError, jsonschema.ValidationError):
                violations += 1
    assert violations > 0, f"{name}: the backend now enforces it; the rejection can go"


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "strnig"}, "invalid JSON schema at /type"),
        ({"properties": {"a": {"minimum": "0"}}}, "invalid JSON schema at /properties/a/minimum"),
        ({"$ref": "#/$defs/missing"}, "points nowhere"),
        ({"type": "integer", "const": "a"}, "admits no value"),
        ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength 5 > maxLength 2"),
        ({"type": "string", "pattern": "(?<=a)b"}, "lookbehind"),
        ({"type": "string", "pattern": "[unclosed"}, "is not a 'regex'"),
        ("{not json", "not valid JSON"),
        ([1, 2], "must be an object"),
    ],
)
def test_invalid_schemas_are_errors(schema: Any, message: str) -> None:
    with pytest.raises(GrammarError, match=message.replace("[", r"\[")):
        GrammarSpec.for_json_schema(schema)
    with pytest.raises(GrammarError):
        GrammarSpec.for_json_schema(schema, BEST_EFFORT)


def test_accepted_features() -> None:
    accepted = [
        {"allOf": [{"type": "integer"}]},
        # Combined into one exact schema (grammar/schema_merge.py), no longer refused:
        {"allOf": [{"type": "integer", "maximum": 5}, {"type": "integer", "minimum": 3}]},
        {"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n", "maximum": 3},
        {
            "type": "object",
            "properties": {"a": {"type": "boolean"}, "b": {"type": "boolean"}},
            "required": ["a"],
            "dependentRequired": {"a": ["b"]},
        },
        {"type": "integer", "multipleOf": 3},
        {"type": "array", "uniqueItems": False},
        {"type": "string", "minLength": 1, "maxLength": 3},
        {"oneOf": [{"type": "string"}, {"type": "integer"}]},
        {"oneOf": [{"const": "a"}, {"enum": ["b", "c"]}]},
        {"$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a", "description": "annotated"},
        {"type": "object", "properties": {"ab": {}}, "propertyNames": {"maxLength": 2}},
    ]
    for schema in accepted:
        GrammarSpec.for_json_schema(schema)
