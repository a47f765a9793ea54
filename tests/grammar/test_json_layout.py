"""JSON layouts: aligned (the default: what a pretty-printer writes, every run bounded), compact
(no whitespace), and grammar_max_whitespace's runs; the compact fallback when a grammar cannot
be aligned."""

from __future__ import annotations

import json
from typing import Any

import pytest

import grammar.json_grammar
from grammar import GrammarBackend, GrammarOptions, GrammarSpec
from grammar.json_layout import INDENT_MAX, AlignmentUnavailable, align_whitespace

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "home": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age"],
}
VALUE = {"name": "Maria Lopez", "age": 34, "tags": ["a", "b"], "home": {"city": "Lyon", "zip": 1}}
PRETTY = [
    json.dumps(VALUE, indent=2),
    json.dumps(VALUE, indent=4),
    json.dumps(VALUE, indent="\t"),
    json.dumps(VALUE),
    json.dumps(VALUE, separators=(",", ":")),
    '{ "name": "Maria Lopez", "age": 34 }',
]
# Whitespace no pretty-printer writes, or more than a run may hold.
NOT_ALIGNED = [
    '{"name" : "Maria Lopez", "age": 34}',
    '{"name": "Maria Lopez" , "age": 34}',
    '{"name":  "Maria Lopez", "age": 34}',
    '{"name":\n"Maria Lopez", "age": 34}',
    '{\n\n  "name": "Maria Lopez", "age": 34}',
    '{  "name": "Maria Lopez", "age": 34}',
    "{\n" + " " * (INDENT_MAX + 1) + '"name": "Maria Lopez", "age": 34}',
    '{"name": "Maria Lopez", "age": 34}\n',
    ' {"name": "Maria Lopez", "age": 34}',
]


def _accepts(backend: GrammarBackend, spec: GrammarSpec, text: str) -> bool:
    """Whether the grammar takes ``text`` whole and may then end."""
    matcher = backend.compile(spec).new_matcher()
    for token in backend.tokenizer.encode(text, add_special_tokens=False):
        if not matcher.accept_token(token):
            return False
    return any(matcher.accept_token(stop) for stop in list(backend.stop_token_ids)[:1])


def _spec(fmt: str | None = None, whitespace: int | None = None, schema: Any = PERSON) -> Any:
    params = {"json_schema": schema, "json_format": fmt, "grammar_max_whitespace": whitespace}
    return GrammarSpec.from_sampling_params(params)


def test_the_default_is_aligned() -> None:
    assert GrammarOptions().json_layout == "aligned"
    assert _spec().options.json_layout == "aligned"
    assert _spec("compact").options.json_layout == 0
    assert _spec(whitespace=3).options.json_layout == 3


@pytest.mark.parametrize("text", PRETTY)
def test_aligned_accepts_what_pretty_printers_write(backend: GrammarBackend, text: str) -> None:
    assert _accepts(backend, _spec(), text)


@pytest.mark.parametrize("text", NOT_ALIGNED)
def test_aligned_refuses_other_and_longer_whitespace(backend: GrammarBackend, text: str) -> None:
    assert not _accepts(backend, _spec(), text)


def test_aligned_indentation_is_bounded(backend: GrammarBackend) -> None:
    for indent, accepted in ((INDENT_MAX, True), (INDENT_MAX + 1, False)):
        text = "{\n" + " " * indent + '"name": "A",\n' + '"age": 1\n}'
        assert _accepts(backend, _spec(), text) == accepted


def test_aligned_json_object_nests(backend: GrammarBackend) -> None:
    spec = GrammarSpec.from_sampling_params({"json_object": True})
    nested = {"a": [1, {"b": [], "c": {}}], "d": {"e": [True, None, "x"]}}
    for indent in (2, 4, None):
        assert _accepts(backend, spec, json.dumps(nested, indent=indent))
    assert not _accepts(backend, spec, '{"a": [1 , 2]}')
    assert not _accepts(backend, spec, "{\n" + " " * (INDENT_MAX + 1) + '"a": 1}')


def test_compact_refuses_whitespace(backend: GrammarBackend) -> None:
    compact = _spec("compact")
    assert _accepts(backend, compact, json.dumps(VALUE, separators=(",", ":")))
    for text in PRETTY[:4]:
        assert not _accepts(backend, compact, text)


def test_max_whitespace_keeps_its_runs(backend: GrammarBackend) -> None:
    """grammar_max_whitespace, when given, governs as before json_format existed."""
    runs = _spec(whitespace=2)
    assert _accepts(backend, runs, '{"name" :  "A",  "age":1}')
    assert not _accepts(backend, runs, '{"name":   "A", "age": 1}')
    assert not _accepts(backend, _spec(whitespace=0), '{"name": "A", "age": 1}')


def test_aligned_schema_is_still_enforced(backend: GrammarBackend) -> None:
    spec = _spec()
    assert not _accepts(backend, spec, '{\n  "name": "A",\n  "age": "34"\n}')
    assert not _accepts(backend, spec, '{\n  "age": 34\n}')


def test_aligned_unique_items_rule(backend: GrammarBackend) -> None:
    """Rules of ours (unique items of an enum) take the aligned layout too."""
    schema = {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True}
    spec = _spec(schema=schema)
    assert _accepts(backend, spec, '[\n  "a",\n  "b"\n]')
    assert _accepts(backend, spec, '["a","c"]')
    assert not _accepts(backend, spec, '["a" , "b"]')
    assert not _accepts(backend, spec, '[\n  "a",\n  "a"\n]')


def test_tool_call_arguments_are_aligned(backend: GrammarBackend) -> None:
    tools = [{"name": "weather", "parameters": PERSON}]
    call = '<tool_call>{"name": "weather", "arguments": %s}</tool_call>'
    pretty = call % json.dumps({"name": "A", "age": 3}, indent=2)
    aligned = GrammarSpec.for_tool_calls(tools)
    compact = GrammarSpec.for_tool_calls(tools, options=GrammarOptions(json_format="compact"))
    assert _accepts(backend, aligned, pretty)
    assert not _accepts(backend, compact, pretty)
    assert _accepts(backend, compact, call % '{"name":"A","age":3}')


def test_unbounded_whitespace_cannot_be_aligned() -> None:
    with pytest.raises(AlignmentUnavailable):
        align_whitespace('root ::= "{" [ \\n\\r\\t]* "}"')
    with pytest.raises(AlignmentUnavailable):
        align_whitespace('root ::= "{" ws* "}"\nws ::= ("" | ([ \\n\\r\\t]))')


def test_a_schema_that_cannot_be_aligned_falls_back_to_compact(
    backend: GrammarBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fallback keeps the schema whole (never weaker) and says why in its notes."""

    def refuse(ebnf: str, extra: frozenset[str] = frozenset()) -> str:
        raise AlignmentUnavailable("a test refused it")

    monkeypatch.setattr(grammar.json_grammar, "align_whitespace", refuse)
    lowered = backend.lower(_spec())
    assert lowered.spec.options.json_layout == 0
    assert lowered.notes and "a test refused it" in lowered.notes[0]
    assert "compact" in lowered.notes[0]
    compiled = backend.compile_lowered(lowered)
    for text, accepted in (
        ('{"name":"A","age":3}', True),
        ('{"name": "A", "age": 3}', False),
        ('{"name":"A","age":"3"}', False),
    ):
        matcher = compiled.new_matcher()
        tokens = backend.tokenizer.encode(text, add_special_tokens=False)
        taken = all(matcher.accept_token(t) for t in tokens)
        assert (taken and matcher.accept_token(list(backend.stop_token_ids)[0])) == accepted


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="json_format"):
        GrammarOptions(json_format="pretty")
    with pytest.raises(ValueError, match="grammar_max_whitespace"):
        GrammarOptions(max_whitespace=65)
