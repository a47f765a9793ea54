"""Keywords read as the schema's own draft reads them (``grammar.schema_vocabulary``)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest

from grammar import GrammarService, GrammarSpec, UnsupportedSchemaFeature
from grammar.schema_check import check_schema
from tests.grammar.decoder import ConstrainedDecoder

DRAFT4 = "http://json-schema.org/draft-04/schema#"
SEEDS = tuple(range(6))


def test_a_keyword_the_draft_lacks_does_not_make_branches_disjoint() -> None:
    # Draft 4 has no const: -3 satisfies both later branches, so oneOf fails on it. Read as
    # 2020-12 the branches looked disjoint and outputs like [-3] broke the schema.
    schema = {
        "$schema": DRAFT4,
        "type": "array",
        "items": {"oneOf": [{"type": "object"}, {"const": True}, {"enum": [-3]}]},
    }
    assert jsonschema.Draft4Validator(schema).is_valid([True])
    assert not jsonschema.Draft4Validator(schema).is_valid([-3])
    with pytest.raises(UnsupportedSchemaFeature) as caught:
        GrammarSpec.for_json_schema(schema)
    assert (caught.value.keyword, caught.value.pointer) == ("oneOf", "/items")


@pytest.mark.parametrize(
    ("schema", "read"),
    [
        (
            {
                "$schema": DRAFT4,
                "type": "integer",
                "minimum": 0,
                "maximum": 3,
                "exclusiveMaximum": True,
            },
            {"$schema": DRAFT4, "type": "integer", "minimum": 0, "exclusiveMaximum": 3},
        ),
        (  # 2020-12 has no dependencies (dependentRequired replaced it)
            {"type": "object", "properties": {"a": {}}, "dependencies": {"a": ["b"]}},
            {"type": "object", "properties": {"a": {}}},
        ),
        (  # an unknown annotation, different on both sides of allOf, no longer refuses it
            {
                "allOf": [
                    {"markdownDescription": "a", "type": "integer"},
                    {"markdownDescription": "b"},
                ]
            },
            {"type": "integer"},
        ),
        (  # an anchor nothing refers to changes nothing
            {"$defs": {"a": {"$anchor": "here", "type": "null"}}, "$ref": "#/$defs/a"},
            {"$ref": "#/$defs/~1$defs~1a", "$defs": {"/$defs/a": {"type": "null"}}},
        ),
    ],
)
def test_keywords_are_read_as_the_draft_reads_them(
    schema: dict[str, Any], read: dict[str, Any]
) -> None:
    assert check_schema(schema) == read


def test_draft_4_exclusive_bounds_are_enforced(
    decoder: ConstrainedDecoder, service: GrammarService
) -> None:
    schema = {
        "$schema": DRAFT4,
        "type": "integer",
        "minimum": 1,
        "maximum": 3,
        "exclusiveMaximum": True,
    }
    compiled = service.compile(GrammarSpec.for_json_schema(schema))
    outputs = decoder.generate([compiled] * len(SEEDS), SEEDS, 8, 1.0)
    assert {json.loads(o.text) for o in outputs if o.terminated} <= {1, 2}


def test_draft_3_is_refused_by_name() -> None:
    schema = {"$schema": "http://json-schema.org/draft-03/schema#", "type": "object"}
    with pytest.raises(UnsupportedSchemaFeature, match="draft 3 is not supported"):
        GrammarSpec.for_json_schema(schema)
