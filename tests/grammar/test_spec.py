"""GrammarSpec: reading sampling params, one constraint per request, canonical cache keys."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pydantic
import pytest

from grammar import GrammarError, GrammarOptions, GrammarSpec, UnsupportedSchemaFeature


def test_no_constraint_is_none() -> None:
    assert GrammarSpec.from_sampling_params({}) is None
    assert GrammarSpec.from_sampling_params({"json_object": False, "regex": None}) is None


@pytest.mark.parametrize(
    ("params", "kind"),
    [
        ({"json_schema": {"type": "integer"}}, "json_schema"),
        ({"json_schema": '{"type": "integer"}'}, "json_schema"),
        ({"regex": "[0-9]+"}, "regex"),
        ({"ebnf": 'root ::= "a" | "b"'}, "ebnf"),
        ({"choice": ["a", "b"]}, "choice"),
        ({"choices": ("a", "b")}, "choice"),
        ({"json_object": True}, "json_object"),
        (
            {
                "structural_tag": {
                    "type": "structural_tag",
                    "format": {"type": "const_string", "value": "hi"},
                }
            },
            "structural_tag",
        ),
    ],
)
def test_each_kind_from_params(params: dict[str, Any], kind: str) -> None:
    spec = GrammarSpec.from_sampling_params(params)
    assert spec is not None and spec.kind == kind


def test_at_most_one_constraint() -> None:
    with pytest.raises(
        GrammarError, match="at most one constraint per request; got json_schema, regex"
    ):
        GrammarSpec.from_sampling_params({"json_schema": {}, "regex": "a"})
    with pytest.raises(GrammarError, match="at most one"):
        GrammarSpec.from_sampling_params({"choice": ["a"], "json_object": True})


def test_params_as_object_and_options() -> None:
    @dataclass
    class Params:
        json_schema: Any = None
        grammar_best_effort: bool = False
        grammar_max_whitespace: int = 0

    spec = GrammarSpec.from_sampling_params(
        Params(
            json_schema={"type": "array", "uniqueItems": True},
            grammar_best_effort=True,
            grammar_max_whitespace=2,
        )
    )
    assert spec is not None
    assert spec.options == GrammarOptions(best_effort=True, max_whitespace=2)
    with pytest.raises(GrammarError, match="uniqueItems"):
        GrammarSpec.from_sampling_params(Params(json_schema={"type": "array", "uniqueItems": True}))


def test_equal_schemas_share_a_key_but_property_order_does_not() -> None:
    a = {
        "type": "object",
        "required": ["x"],
        "properties": {"x": {"type": "integer"}, "y": {"type": "string"}},
    }
    b = json.dumps(
        {
            "properties": {"x": {"type": "integer"}, "y": {"type": "string"}},
            "required": ["x"],
            "type": "object",
        },
        indent=2,
    )
    swapped = {
        "type": "object",
        "required": ["x"],
        "properties": {"y": {"type": "string"}, "x": {"type": "integer"}},
    }
    assert GrammarSpec.for_json_schema(a) == GrammarSpec.for_json_schema(b)
    assert hash(GrammarSpec.for_json_schema(a)) == hash(GrammarSpec.for_json_schema(b))
    assert GrammarSpec.for_json_schema(a) != GrammarSpec.for_json_schema(swapped)
    assert GrammarSpec.for_json_schema(a) != GrammarSpec.for_json_schema(
        a, GrammarOptions(max_whitespace=1)
    )


def test_const_object_data_keeps_its_key_order() -> None:
    spec = GrammarSpec.for_json_schema({"const": {"b": 1, "a": 2}})
    assert '{"b":1,"a":2}' in spec.spec


def test_pydantic_class() -> None:
    class Point(pydantic.BaseModel):
        x: int
        y: int

    spec = GrammarSpec.for_json_schema(Point)
    assert json.loads(spec.spec)["required"] == ["x", "y"]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"regex": 5}, "regex must be a non-empty string"),
        ({"regex": "(?<=a)b"}, "lookbehind"),
        ({"ebnf": "root ::= "}, "invalid EBNF grammar"),
        ({"ebnf": 'start ::= "a"'}, "invalid EBNF grammar"),
        ({"choice": []}, None),
        ({"choice": "yes"}, "non-empty list of strings"),
        ({"choice": ["a", ""]}, "non-empty string"),
        ({"json_schema": 3}, "must be an object"),
        ({"structural_tag": "{"}, "not valid JSON"),
        ({"regex": "a", "grammar_max_whitespace": -1}, "max_whitespace"),
    ],
)
def test_invalid_params(params: dict[str, Any], message: str | None) -> None:
    if message is None:  # an empty list counts as "not given"
        assert GrammarSpec.from_sampling_params(params) is None
        return
    with pytest.raises(GrammarError, match=message):
        GrammarSpec.from_sampling_params(params)


def test_tool_call_specs() -> None:
    tools = [
        {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
        {"name": "b", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
    ]
    assert GrammarSpec.for_tool_calls(tools).kind == "tool_calls"
    with pytest.raises(GrammarError, match="not among the tools"):
        GrammarSpec.for_tool_calls(tools, "named", name="c")
    with pytest.raises(GrammarError, match="'required', 'named' or 'auto'"):
        GrammarSpec.for_tool_calls(tools, "any")
    with pytest.raises(GrammarError, match="the generic format's reply envelope"):
        GrammarSpec.for_tool_calls(tools, "auto")  # hermes has no envelope
    bad = [{"name": "t", "parameters": {"type": "array", "uniqueItems": True}}]
    with pytest.raises(GrammarError, match="/tools/0/function/parameters/uniqueItems"):
        GrammarSpec.for_tool_calls(bad)
    with pytest.raises(GrammarError, match="unknown tool-call format 'qwen'"):
        GrammarSpec.for_tool_calls(tools, format="qwen")  # aliases are the server's business
    tag = {"tools": tools, "mode": "required", "name": None, "parallel": False}
    hermes = GrammarSpec.from_sampling_params({"structural_tag": tag})
    assert hermes == GrammarSpec.for_tool_calls(tools, parallel=False)
    mistral = GrammarSpec.from_sampling_params({"structural_tag": {**tag, "format": "mistral"}})
    assert mistral == GrammarSpec.for_tool_calls(tools, parallel=False, format="mistral")
    assert mistral != hermes


def test_unknown_kind() -> None:
    with pytest.raises(GrammarError, match="unknown grammar kind"):
        GrammarSpec("yaml", "")


def test_structural_tag_schemas_are_checked() -> None:
    def tag(content: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "structural_tag",
            "format": {"type": "tag", "begin": "<a>", "content": content, "end": "</a>"},
        }

    unique = {"type": "json_schema", "json_schema": {"type": "array", "uniqueItems": True}}
    with pytest.raises(UnsupportedSchemaFeature, match="uniqueItems"):
        GrammarSpec.for_structural_tag(tag(unique))
    GrammarSpec.for_structural_tag(tag(unique), GrammarOptions(best_effort=True))
    xml = {"type": "json_schema", "json_schema": {"type": "object"}, "style": "qwen_xml"}
    with pytest.raises(GrammarError, match="style 'qwen_xml' is not supported"):
        GrammarSpec.for_structural_tag(tag(xml))
