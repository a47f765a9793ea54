"""``$ref`` resolution (``grammar.schema_refs``): RFC 6901 pointers of any depth, escapes,
percent-encoding and ``$id`` base URIs, resolved exactly as the ``jsonschema`` validators do;
every pass sees the hoisted targets, recursion stays a reference, and refusals name the
keyword and the pointer in our words."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import jsonschema  # type: ignore[import-untyped]
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from referencing import Registry
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012, specification_with

from grammar import GrammarError, GrammarService, GrammarSpec, UnsupportedSchemaFeature
from grammar.json_grammar import json_schema_ebnf
from grammar.schema_check import check_schema
from grammar.schema_lower import lower_schema
from grammar.schema_refs import backend_refs, hoist_refs, resolve_ref
from grammar.schema_walk import escape_pointer, iter_subschemas
from tests.grammar.decoder import ConstrainedDecoder

SEEDS = (0, 1, 2, 3)
BIAS = 4.0  # see decoder.py: helps a random model finish; the mask alone decides validity

_OBJ = {
    "type": "object",
    "additionalProperties": False,
    "required": ["version"],
    "properties": {"version": {"type": "string", "maxLength": 4}},
}


def _versions(ref: str) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["version"],
        "oneOf": [
            {"allOf": [{"properties": {"version": {"const": "2"}}}, {"$ref": ref}]},
            {"allOf": [{"properties": {"version": {"const": "1"}}}, {"$ref": ref}]},
        ],
    }


# The issue's schemas: each was widened to any JSON or refused with the backend's message.
ENFORCED: list[tuple[str, dict[str, Any]]] = [
    (
        "pointers two segments deep",  # was enforced as any JSON: false, 7, ...
        {
            "$ref": "#/definitions/root/full",
            "definitions": {
                "root": {"full": _versions("#/definitions/a/full")},
                "a": {"full": _OBJ},
            },
        },
    ),
    (
        "escaped and percent-encoded names",  # was refused with "Cannot find field r~1s"
        {
            "type": "object",
            "properties": {
                "slash": {"$ref": "#/definitions/r~1s"},
                "tilde": {"$ref": "#/$defs/t~0u"},
                "space": {"$ref": "#/$defs/p%20q"},
            },
            "required": ["slash", "tilde", "space"],
            "definitions": {"r/s": {"type": "integer", "minimum": 3, "maximum": 9}},
            "$defs": {"t~u": {"enum": ["x", "y"]}, "p q": {"type": "boolean"}},
        },
    ),
    (
        "draft-07 with $id, a reference to a reference",
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "$id": "https://example.com/schemas/order.json",
            "type": "object",
            "properties": {
                "a": {"$ref": "#/definitions/a"},
                "b": {"$ref": "order.json#/definitions/b"},
                "c": {"$ref": "https://example.com/schemas/order.json#/definitions/c"},
            },
            "required": ["a", "b", "c"],
            "additionalProperties": False,
            "definitions": {
                "a": {"$ref": "#/definitions/b", "type": "string"},  # the sibling is ignored
                "b": {"type": "object", "properties": {"n": {"$ref": "#/definitions/c"}}},
                "c": {"type": "integer", "minimum": 0, "maximum": 99},
            },
        },
    ),
    (
        "recursion through the root from inside definitions",  # was a RecursionError
        {
            "$schema": "http://json-schema.org/draft-04/schema#",
            "id": "https://example.com/ans/story.json",
            "type": "object",
            "properties": {
                "type": {"enum": ["list"]},
                "items": {
                    "type": "array",
                    "maxItems": 2,
                    "items": {"$ref": "#/definitions/element"},
                },
            },
            "required": ["type"],
            "additionalProperties": False,
            "definitions": {
                "element": {
                    "type": "object",
                    "allOf": [{"$ref": "#"}, {"properties": {"type": {"enum": ["list"]}}}],
                },
            },
        },
    ),
    (
        "a recursive reference with siblings (2020-12)",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 3},
                "child": {"$ref": "#", "required": ["name"]},
            },
            "additionalProperties": False,
        },
    ),
    (
        "draft-07 whose root a rule of ours takes over",  # lowering drops its $schema
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "type": ["integer", "object"],
            "multipleOf": 3,
            "minimum": 0,
            "maximum": 30,
            "properties": {"a": {"$ref": "#/definitions/x"}},
            "additionalProperties": False,
            "definitions": {"x": {"type": "string", "maxLength": 3}},
        },
    ),
    (
        "a reference into an array of subschemas",
        {
            "type": "object",
            "properties": {
                "kind": {"anyOf": [{"type": "null"}, {"type": "integer", "maximum": 5}]},
                "again": {"$ref": "#/properties/kind/anyOf/1"},
            },
            "required": ["again"],
            "additionalProperties": False,
        },
    ),
]


@pytest.mark.parametrize(("name", "schema"), ENFORCED, ids=[name for name, _ in ENFORCED])
def test_referenced_schemas_are_enforced(
    decoder: ConstrainedDecoder, service: GrammarService, name: str, schema: dict[str, Any]
) -> None:
    compiled = service.compile(GrammarSpec.for_json_schema(schema))
    validator = jsonschema.validators.validator_for(schema)(schema)
    finished = 0
    outputs = decoder.generate([compiled] * len(SEEDS), SEEDS, 96, 1.0, BIAS)
    for seed, result in zip(SEEDS, outputs, strict=True):
        if result.terminated:
            finished += 1
            error = jsonschema.exceptions.best_match(validator.iter_errors(json.loads(result.text)))
            assert error is None, f"seed {seed}: {result.text!r} breaks {name}: {error}"
    assert finished, f"{name}: nothing finished"


def test_each_target_is_checked_where_it_is_written() -> None:
    # Before, a target reached only through a deep pointer was never checked: its overlapping
    # oneOf went to the backend, which enforces it as anyOf.
    schema = {
        "$ref": "#/definitions/x/full",
        "definitions": {"x": {"full": {"oneOf": [{"type": "integer"}, {"minimum": 3}]}}},
    }
    with pytest.raises(UnsupportedSchemaFeature) as caught:
        GrammarSpec.for_json_schema(schema)
    assert (caught.value.keyword, caught.value.pointer) == ("oneOf", "/definitions/x/full")


@pytest.mark.parametrize(
    ("schema", "keyword", "pointer", "message"),
    [
        (
            {"properties": {"a": {"$ref": "other.json#/x"}}},
            "$ref",
            "/properties/a",
            "points outside this document",
        ),
        (
            {"$id": "https://a.example/s.json", "items": {"$ref": "https://b.example/s.json"}},
            "$ref",
            "/items",
            "points outside this document",
        ),
        ({"anyOf": [{"$ref": "#node"}]}, "$ref", "/anyOf/0", "names an anchor"),
        (
            {
                "properties": {"a": {"$ref": "#/$defs/a"}},
                "$defs": {"a": {"$id": "https://b.example/a.json", "type": "integer"}},
            },
            "$id",
            "/$defs/a",
            "nested base URI",
        ),
    ],
)
def test_references_we_do_not_follow_are_refused_by_name(
    schema: dict[str, Any], keyword: str, pointer: str, message: str
) -> None:
    with pytest.raises(UnsupportedSchemaFeature, match=message) as caught:
        GrammarSpec.for_json_schema(schema)
    assert (caught.value.keyword, caught.value.pointer) == (keyword, pointer)


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"items": {"$ref": "#/$defs/nope"}}, r"at /items/\$ref: '#/\$defs/nope' points nowhere"),
        ({"items": {"$ref": "#/$defs/a~2"}, "$defs": {}}, "bad '~' escape"),
        ({"items": {"$ref": "#/type"}, "type": "array"}, "points at a str"),
        ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#"}}}, "cycle of references"),
        (  # validators would loop: the reference applies the root to the root's own value
            {"type": "object", "anyOf": [{"$ref": "#/$defs/a"}], "$defs": {"a": {"$ref": "#"}}},
            "at /anyOf/0/[$]ref: it leads back to the subschema at / without entering",
        ),
        (  # the error inside a target names the target where it is written
            {"$ref": "#/$defs/s/full", "$defs": {"s": {"full": {"type": "strin"}}}},
            "at /[$]defs/s/full/type",
        ),
        (
            {"$ref": "#/$defs/s/full", "$defs": {"s": {"full": {"minLength": 3, "maxLength": 1}}}},
            "at /[$]defs/s/full",
        ),
    ],
)
def test_broken_references_are_refused_in_our_words(schema: dict[str, Any], message: str) -> None:
    with pytest.raises(GrammarError, match=message):
        GrammarSpec.for_json_schema(schema)


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (
            {
                "type": "object",
                "properties": {"m": {"type": "integer", "minimum": 2, "maximum": 1}},
            },
            "at /properties/m cannot be enforced: it admits no number",
        ),
        ({"type": "array", "minItems": 3, "maxItems": 1}, "minItems 3 > maxItems 1"),
        (
            {
                "type": "array",
                "items": {"$ref": "#/$defs/t"},
                "$defs": {"t": {"type": "array", "prefixItems": [False]}},
            },
            "at /[$]defs/t cannot be enforced: it admits no array",
        ),
        (  # draft 4's boolean bounds: xgrammar said "Value must be a number"
            {
                "$schema": "http://json-schema.org/draft-04/schema#",
                "minimum": 5,
                "exclusiveMinimum": True,
            },
            None,
        ),
    ],
)
def test_what_the_backend_refuses_is_said_in_our_words(
    schema: dict[str, Any], message: str | None
) -> None:
    if message is None:
        json_schema_ebnf(schema, best_effort=False, layout=0)
        return
    with pytest.raises(GrammarError, match=message) as caught:
        json_schema_ebnf(schema, best_effort=False, layout=0)
    assert "server log" not in str(caught.value)


def test_the_backend_reads_plain_references_only() -> None:
    schema = {
        "type": "array",
        "items": {"$ref": "#/definitions/r~1s%25"},
        "definitions": {"r/s%": {"type": "array", "items": {"$ref": "#/definitions/r~1s%25"}}},
    }
    lowered = backend_refs(lower_schema(check_schema(schema))[0])
    refs = {sub["$ref"] for _, sub in iter_subschemas(lowered) if "$ref" in sub}
    assert refs == {"#/$defs/ref0"}
    assert set(lowered["$defs"]) == {"ref0"}


def test_unreachable_and_ignored_parts_are_left_out() -> None:
    schema = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "$ref": "#/definitions/a",
        "type": "string",  # ignored beside $ref in draft 7
        "definitions": {"a": {"type": "integer"}, "unused": {"not": {}}},
    }
    assert hoist_refs(schema, best_effort=False) == {
        "$ref": "#/definitions/~1definitions~1a",
        "$schema": "http://json-schema.org/draft-07/schema#",
        "definitions": {"/definitions/a": {"type": "integer"}},
    }


# ---- the resolver agrees with the one the jsonschema validators use --------------------------

_NAMES = st.sampled_from(["a", "b", "r/s", "t~u", "~1", "p q", "50%", "ü", "", "0", "$defs"])
_LEAVES = st.sampled_from([True, False, {}, {"type": "integer"}, {"const": 1}, 3, "x", None])
_DOCUMENTS = st.recursive(
    _LEAVES,
    lambda inner: st.dictionaries(_NAMES, inner, max_size=4) | st.lists(inner, max_size=3),
    max_leaves=12,
)
_BASES = st.sampled_from([None, "https://example.com/a/root.json", "urn:example:root"])


def _locations(node: Any, tokens: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = [tokens]
    if isinstance(node, dict | list):
        for key, child in node.items() if isinstance(node, dict) else enumerate(node):
            found += _locations(child, (*tokens, str(key)))
    return found


def _spellings(tokens: tuple[str, ...], base: str | None) -> list[str]:
    pointer = "".join(f"/{escape_pointer(t)}" for t in tokens)
    spelled = [f"#{pointer}", f"#{quote(pointer, safe='/~')}"]
    if base is not None and base.startswith("https:"):
        spelled += [f"root.json#{pointer}", f"{base}#{quote(pointer, safe='/~')}"]
    return spelled


@settings(max_examples=150, deadline=None)
@given(body=st.dictionaries(_NAMES, _DOCUMENTS, max_size=4), base=_BASES, data=st.data())
def test_targets_are_the_validators_targets(
    body: dict[str, Any], base: str | None, data: st.DataObject
) -> None:
    document = {**body, "$id": base} if base is not None else body
    tokens = data.draw(st.sampled_from(_locations(document)))
    ref = data.draw(st.sampled_from(_spellings(tokens, base)))
    registry: Registry[Any] = Registry()
    resolver = registry.resolver_with_root(
        specification_with("", DRAFT202012).create_resource(document)
    )
    try:
        expected = resolver.lookup(ref).contents
    except Unresolvable:
        expected = Unresolvable
    except (AttributeError, TypeError):  # a non-schema where a schema goes: no valid schema
        assume(False)
    try:
        found = resolve_ref(document, ref).schema
    except GrammarError:
        assert expected is Unresolvable or not isinstance(expected, dict | bool), ref
        return
    assert expected is not Unresolvable, ref
    assert found is expected or (isinstance(found, bool) and found == expected), ref
