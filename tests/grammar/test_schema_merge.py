"""Keywords beside allOf / anyOf / oneOf / $ref are combined into the grammar, never dropped:
every finished output of a compiled schema validates against the original schema."""

from __future__ import annotations

import os
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grammar import GrammarError, GrammarService, GrammarSpec, UnsupportedSchemaFeature
from grammar.schema_check import check_schema
from grammar.schema_refs import resolve_ref
from tests.grammar.decoder import ConstrainedDecoder
from tests.grammar.schema_corpus import validate_output

SEEDS = (0, 1, 2, 3)
BIAS = 4.0  # see decoder.py: helps a random model finish; the mask alone decides validity

# The probes that found siblings dropped (xgrammar kept only the combinator's subschemas).
PROBES: list[tuple[str, dict[str, Any]]] = [
    ("type beside anyOf", {"type": "integer", "anyOf": [{"minimum": 0}, {"maximum": -10}]}),
    ("formats in anyOf", {"type": "string", "anyOf": [{"format": "ipv4"}, {"format": "ipv6"}]}),
    (
        "object beside allOf",
        {
            "type": "object",
            "properties": {"x": {"type": "integer"}},
            "required": ["x"],
            "allOf": [{"properties": {"y": {"type": "string", "maxLength": 5}}, "required": ["y"]}],
        },
    ),
    ("bound beside anyOf", {"maximum": 3, "anyOf": [{"type": "integer"}, {"type": "number"}]}),
    (
        "several allOf",
        {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"a": {"minimum": 10, "maximum": 20}}},
                {"properties": {"b": {"enum": ["x", "y", 3]}}, "required": ["b"]},
                {"properties": {"b": {"type": "string"}}},
            ]
        },
    ),
    (
        "ref beside keywords (2020-12)",
        {
            "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}}}},
            "$ref": "#/$defs/point",
            "properties": {"x": {"maximum": 5}, "tag": {"const": "p"}},
            "required": ["x", "tag"],
            "additionalProperties": False,
        },
    ),
    (
        "oneOf with a shared discriminator beside",
        {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["id", "kind"],
            "oneOf": [
                {"properties": {"kind": {"const": "a"}, "a": {"type": "boolean"}}},
                {"properties": {"kind": {"const": "b"}, "b": {"type": "null"}}},
            ],
        },
    ),
    (  # the fail-closed property test found null written: the folded allOf kept its anyOf
        "allOf around a combinator with siblings",
        {
            "allOf": [
                {
                    "type": "object",
                    "anyOf": [
                        {"const": None},
                        {"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                    ],
                }
            ]
        },
    ),
    (
        "required in a branch names a parent property",
        {
            "type": "object",
            "properties": {"p": {"type": "integer"}, "q": {"type": "string", "maxLength": 4}},
            "anyOf": [{"required": ["p"]}, {"required": ["q"]}],
        },
    ),
]


def _outputs_validate(
    decoder: ConstrainedDecoder, service: GrammarService, schema: dict[str, Any]
) -> int:
    compiled = service.compile(GrammarSpec.for_json_schema(schema))
    finished = 0
    for seed, result in zip(
        SEEDS, decoder.generate([compiled] * len(SEEDS), SEEDS, 96, 1.0, BIAS), strict=True
    ):
        if not result.terminated:
            continue
        finished += 1
        try:
            validate_output(schema, result.text)
        except (ValueError, jsonschema.ValidationError) as exc:
            pytest.fail(f"seed {seed}: {result.text!r} violates {schema}: {exc}")
    return finished


@pytest.mark.parametrize(("name", "schema"), PROBES, ids=[name for name, _ in PROBES])
def test_probe_outputs_validate(
    decoder: ConstrainedDecoder, service: GrammarService, name: str, schema: dict[str, Any]
) -> None:
    assert _outputs_validate(decoder, service, schema) >= 1, f"{name}: nothing finished"


def test_siblings_are_merged_into_the_branches() -> None:
    lowered = check_schema({"type": "integer", "anyOf": [{"minimum": 0}, {"maximum": -10}]})
    assert lowered == {
        "anyOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": -10}]
    }
    # A branch the siblings contradict is dropped; none left: the schema admits no value.
    lowered = check_schema({"type": "string", "anyOf": [{"type": "integer"}, {"maxLength": 2}]})
    assert lowered == {"type": "string", "maxLength": 2}
    with pytest.raises(GrammarError, match="admits no value"):
        check_schema({"type": "string", "allOf": [{"type": "integer"}]})
    # anyOf beside oneOf: both hold, each oneOf branch within each anyOf branch.
    lowered = check_schema({"anyOf": [{"type": "integer"}], "oneOf": [{"minimum": 1}]})
    assert lowered == {"type": "integer", "minimum": 1}


def test_old_drafts_ignore_a_references_siblings() -> None:
    schema = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "definitions": {"n": {"type": "integer"}},
        "$ref": "#/definitions/n",
        "maximum": 3,
    }
    lowered = check_schema(schema)
    assert "maximum" not in lowered
    assert resolve_ref(lowered, lowered["$ref"]).schema == {"type": "integer"}


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"allOf": [{"pattern": "^a"}, {"pattern": "b$"}]}, "pattern"),
        ({"allOf": [{"format": "ipv4"}, {"format": "email"}]}, "format"),
        (
            {
                "allOf": [
                    {"patternProperties": {"^a": {}}},
                    {"properties": {"b": {}}, "additionalProperties": False},
                ]
            },
            "patternProperties",
        ),
        ({"allOf": [{"prefixItems": [{"type": "integer"}]}, {"prefixItems": [{}]}]}, "prefixItems"),
    ],
)
def test_what_cannot_be_combined_is_refused_by_name(schema: dict[str, Any], keyword: str) -> None:
    with pytest.raises(UnsupportedSchemaFeature) as info:
        check_schema(schema)
    assert info.value.keyword == keyword


# ---- property test: generated schemas mixing siblings with combinators --------------------

_LEAVES = st.sampled_from(
    [
        {"type": "integer"},
        {"type": "number"},
        {"type": "string"},
        {"type": "boolean"},
        {"type": ["integer", "string"]},
        {"minimum": 0},
        {"maximum": 5},
        {"minimum": -3, "maximum": 40},
        {"maxLength": 3},
        {"minLength": 1},
        {"enum": [1, 2, "a", True, None]},
        {"enum": ["a", "b", 7]},
        {"const": 2},
        {"format": "date"},
        {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]},
        {"type": "object", "properties": {"k": {"maximum": 1}, "m": {"type": "boolean"}}},
        {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
        # Keywords enforced by automata of ours (test_schema_automata.py), mixed in too.
        {"type": "integer", "multipleOf": 3},
        {"multipleOf": 0.5},
        {"type": "array", "items": {"enum": ["a", "b", 1]}, "uniqueItems": True},
        {"type": "string", "pattern": "^[ab]+$", "maxLength": 3},
        {
            "type": "object",
            "propertyNames": {"maxLength": 1},
            "additionalProperties": {"type": "integer"},
            "maxProperties": 2,
        },
    ]
)


def _combined(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    branches = st.lists(children, min_size=1, max_size=3)
    return st.builds(
        lambda sibling, key, subs: {**sibling, key: subs},
        _LEAVES,
        st.sampled_from(["anyOf", "allOf", "oneOf"]),
        branches,
    )


SCHEMA_STRATEGY = st.recursive(_LEAVES, _combined, max_leaves=6)


@settings(
    max_examples=int(os.environ.get("ARBOR_SCHEMA_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(schema=SCHEMA_STRATEGY)
def test_generated_combinations_validate_or_are_refused(
    decoder: ConstrainedDecoder, service: GrammarService, schema: dict[str, Any]
) -> None:
    try:
        GrammarSpec.for_json_schema(schema)
    except GrammarError:
        return  # refused with a reason: allowed
    _outputs_validate(decoder, service, schema)


# ---- satisfiable schemas the backend refused, and formats the specification leaves free ------

ACCEPTED_NOW: list[tuple[str, dict[str, Any]]] = [
    (
        "unknown format",
        {
            "type": "object",
            "properties": {"n": {"type": "string", "format": "int32"}},
            "required": ["n"],
        },
    ),
    ("array without items", {"type": "array", "minItems": 1, "maxItems": 2}),
    (
        "false property",
        {"type": "object", "properties": {"a": False, "b": {"type": "integer"}}, "required": ["b"]},
    ),
    (
        "false pattern",
        {
            "type": "object",
            "properties": {"xa": {"type": "integer"}, "b": {"type": "boolean"}},
            "patternProperties": {"^x": False},
            "required": ["b"],
        },
    ),
    ("bound beyond int64", {"type": "integer", "minimum": -1e30, "maximum": 9223372036854776000}),
    (
        "dependentRequired",
        {
            "type": "object",
            "properties": {
                "card": {"type": "string", "maxLength": 4},
                "billing": {"type": "string", "maxLength": 4},
                "n": {"type": "integer"},
            },
            "required": ["n"],
            "dependentRequired": {"card": ["billing"], "billing": ["n"]},
        },
    ),
    (
        "if/then/else on an enum property",
        {
            "type": "object",
            "properties": {
                "country": {"enum": ["US", "NL", "DE"]},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "postcode": {"type": "string", "maxLength": 7},
            },
            "required": ["country"],
            "if": {"properties": {"country": {"const": "US"}}, "required": ["country"]},
            "then": {"required": ["zip"]},
            "else": {"required": ["postcode"]},
        },
    ),
    (
        "if on an optional boolean",
        {
            "type": "object",
            "properties": {"gift": {"type": "boolean"}, "note": {"type": "string", "maxLength": 6}},
            "if": {"properties": {"gift": {"const": True}}, "required": ["gift"]},
            "then": {"required": ["note"]},
        },
    ),
    (
        "format within the pattern",
        {"type": "string", "format": "date", "pattern": "^\\d{4}-\\d{2}-\\d{2}$"},
    ),
    (
        "pattern within the format",
        {"type": "string", "format": "ipv4", "pattern": "^10\\.0\\.0\\.[0-9]$"},
    ),
    ("lengths implied by the pattern", {"type": "string", "pattern": "^[A-Z]{2}$", "maxLength": 2}),
    ("lengths on a repeated class", {"type": "string", "pattern": "^[a-z0-9-]+$", "maxLength": 4}),
    (
        "oneOf of objects told apart by a required key",
        {
            "oneOf": [
                {"type": "object", "properties": {"run": {"type": "string"}}, "required": ["run"]},
                {
                    "type": "object",
                    "properties": {"uses": {"type": "string"}, "id": {"type": "integer"}},
                    "required": ["uses"],
                },
            ]
        },
    ),
    (
        "oneOf of non-empty arrays with disjoint items",
        {
            "oneOf": [
                {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
                {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2},
            ]
        },
    ),
    (
        "oneOf whose branch is itself a union",
        {"oneOf": [{"oneOf": [{"type": "boolean"}, {"type": "integer"}]}, {"type": "null"}]},
    ),
    (
        "allOf of objects with patterns",
        {
            "allOf": [
                {"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
                {
                    "properties": {"xa": {"maximum": 3}, "b": {"type": "null"}},
                    "patternProperties": {"^x": {"minimum": 0}, "^y": {"type": "boolean"}},
                },
            ],
            "maxProperties": 3,
        },
    ),
    (
        "draft-07 dependencies",
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "type": "object",
            "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}},
            "dependencies": {"a": ["b"]},
        },
    ),
]


@pytest.mark.parametrize(("name", "schema"), ACCEPTED_NOW, ids=[n for n, _ in ACCEPTED_NOW])
def test_satisfiable_schemas_compile_and_validate(
    decoder: ConstrainedDecoder, service: GrammarService, name: str, schema: dict[str, Any]
) -> None:
    assert _outputs_validate(decoder, service, schema) >= 1, f"{name}: nothing finished"


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "string", "format": "hostname"}, "format 'hostname' is not enforced"),
        ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "admits no object"),
        ({"type": "integer", "minimum": 1e30}, "leaves no 64-bit integer"),
        (
            {
                "properties": {"a": {}, "b": {}},
                "additionalProperties": True,
                "dependentRequired": {"a": ["b"]},
            },
            "property dependencies are not enforced",
        ),
        (
            {"type": "string", "pattern": "^(ab)+$", "maxLength": 5000},
            "maxLength' beside a pattern is enforced by an automaton",
        ),
        (
            {
                "oneOf": [
                    {"type": "object", "properties": {"a": {}}, "required": ["a"]},
                    {"type": "object", "required": ["b"], "additionalProperties": True},
                ]
            },
            "may overlap",
        ),
        (
            {"oneOf": [{"type": "array", "items": {"type": "integer"}}, {"type": "array"}]},
            "may overlap",
        ),
        ({"oneOf": [{"const": 1}, {"const": 1.0}]}, "may overlap"),  # equal JSON numbers
        ({"$schema": 5, "type": "integer"}, "must be a URI string"),
        (
            {
                "properties": {"n": {"type": "integer"}},
                "if": {"properties": {"n": {"const": 1}}},
                "then": {"required": ["n"]},
            },
            "conditional subschemas are not enforced",
        ),
    ],
)
def test_what_stays_refused_says_why_in_our_words(schema: dict[str, Any], message: str) -> None:
    with pytest.raises(GrammarError, match=message):
        GrammarSpec.for_json_schema(schema)


def test_unused_definitions_do_not_refuse_a_schema() -> None:
    defs = {"used": {"type": "integer"}, "unused": {"not": {"type": "string"}}}
    lowered = check_schema({"$defs": defs, "$ref": "#/$defs/used"})
    assert set(lowered["$defs"]) == {"/$defs/used"}  # hoisted: named by where it is written
    with pytest.raises(UnsupportedSchemaFeature, match="not"):
        check_schema(
            {"$defs": defs, "anyOf": [{"$ref": "#/$defs/used"}, {"$ref": "#/$defs/unused"}]}
        )
    # A reference through a definition reaches its target (a reference that only refers on
    # is followed to the end); drafts 4-7 ignore $ref siblings.
    chained = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "definitions": {"a": {"$ref": "#/definitions/b"}, "b": {"type": "null"}, "c": {"not": {}}},
        "$ref": "#/definitions/a",
        "properties": {"x": {"$ref": "#/definitions/c"}},
    }
    assert set(check_schema(chained)["definitions"]) == {"/definitions/b"}


def test_a_reference_to_the_root_does_not_stop_the_walk() -> None:
    schema = {
        "type": "object",
        "properties": {"self": {"$ref": "#"}, "x": {"$ref": "#/definitions/a"}},
        "definitions": {"a": {"items": {"$ref": "#/definitions/b"}}, "b": {"type": "null"}},
    }
    assert set(check_schema(schema)["$defs"]) == {"/definitions/a", "/definitions/b"}
