"""The generic tool-call format's grammar: under tool_choice required or named the output is
a generic call (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``) whose arguments
follow the tool's schema — the call the server's own prompt describes."""

from __future__ import annotations

from typing import Any

from grammar import GrammarService, GrammarSpec
from runtime.server.generic_tools import generic_call_text

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"name": "get_weather", "parameters": CITY},
    {"name": "get_population", "parameters": {"type": "object", "properties": {}}},
]


def _admits(service: GrammarService, spec: GrammarSpec, tokenizer: Any, text: str) -> bool:
    """Whether ``text`` followed by EOS is a whole output the grammar allows."""
    matcher = service.compile(spec).new_matcher()
    ids = [*tokenizer(text, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    return all(matcher.accept_token(t) for t in ids) and matcher.is_terminated()


def test_required_admits_schema_valid_calls_only(service: GrammarService, tokenizer: Any):
    spec = GrammarSpec.for_tool_calls(TOOLS, "required", parallel=False, format="generic")
    assert _admits(service, spec, tokenizer, generic_call_text("get_weather", '{"city":"Oslo"}'))
    assert _admits(service, spec, tokenizer, generic_call_text("get_population", "{}"))
    rejected = [
        generic_call_text("get_weather", '{"town":"Oslo"}'),  # not in the schema
        generic_call_text("get_weather", '{"city":7}'),  # wrong type
        generic_call_text("get_weather", "{}"),  # city is required
        generic_call_text("get_weather", '{"city":"Llanfairpwllgwyngyll"}'),  # too long
        generic_call_text("get_time", "{}"),  # no such tool
        '{"tool_call": {"name": "get_weather", "arguments": {"city":"Oslo"}}}',  # no tags
        "It is sunny.",  # required: a call, not an answer
        generic_call_text("get_weather", '{"city":"Oslo"}') * 2,  # parallel off: one call
    ]
    for text in rejected:
        assert not _admits(service, spec, tokenizer, text), text


def test_named_and_parallel(service: GrammarService, tokenizer: Any):
    named = GrammarSpec.for_tool_calls(TOOLS, "named", "get_weather", False, format="generic")
    assert _admits(service, named, tokenizer, generic_call_text("get_weather", '{"city":"Rome"}'))
    assert not _admits(service, named, tokenizer, generic_call_text("get_population", "{}"))
    parallel = GrammarSpec.for_tool_calls(TOOLS, "required", parallel=True, format="generic")
    two = generic_call_text("get_weather", '{"city":"Rome"}') + generic_call_text(
        "get_population", "{}"
    )
    assert _admits(service, parallel, tokenizer, two)
