"""The generic tool-call format's grammar: under tool_choice required or named the output is
a generic call (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``) whose arguments
follow the tool's schema — the call the server's own prompt describes."""

from __future__ import annotations

from typing import Any

import pytest

from grammar import GrammarError, GrammarOptions, GrammarService, GrammarSpec
from runtime.chat.generic_tools import generic_call_text

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


def _envelope(*calls: tuple[str, str], key: str = "tool_call") -> str:
    objects = [f'{{"name": "{name}", "arguments": {arguments}}}' for name, arguments in calls]
    value = objects[0] if key == "tool_call" else f"[{', '.join(objects)}]"
    return f'{{"{key}": {value}}}'


def test_auto_is_the_reply_envelope(service: GrammarService, tokenizer: Any):
    """tool_choice auto in the generic format: one JSON object holding a call or a response
    (the shape the prompt describes), its arguments held to the tool's schema."""
    spec = GrammarSpec.for_tool_calls(TOOLS, "auto", parallel=False, format="generic")
    admitted = [
        _envelope(("get_weather", '{"city": "Oslo"}')),
        '{\n  "tool_call": {\n    "name": "get_weather",\n    "arguments": {\n'
        '      "city": "Oslo"\n    }\n  }\n}',  # as a pretty-printer writes it
        _envelope(("get_population", "{}")),
        '{"response": "It is sunny."}',
        '{\n  "response": "Hi \\"there\\""\n}',
    ]
    for text in admitted:
        assert _admits(service, spec, tokenizer, text), text
    rejected = [
        _envelope(("get_weather", '{"town": "Oslo"}')),  # not in the schema
        _envelope(("get_time", "{}")),  # no such tool
        _envelope(("get_weather", '{"city": "Oslo"}'), ("get_population", "{}"), key="tool_calls"),
        '{"response": 42}',  # a text answer is a string
        '{"response": "a", "tool_call": 1}',
        "It is sunny.",  # the reply is the envelope
        generic_call_text("get_weather", '{"city":"Oslo"}'),
        '{"response": "a"}{"response": "b"}',
    ]
    for text in rejected:
        assert not _admits(service, spec, tokenizer, text), text


def test_auto_envelope_parallel_and_answer_format(service: GrammarService, tokenizer: Any):
    parallel = GrammarSpec.for_tool_calls(TOOLS, "auto", parallel=True, format="generic")
    two = _envelope(("get_weather", '{"city": "Rome"}'), ("get_population", "{}"), key="tool_calls")
    assert _admits(service, parallel, tokenizer, two)
    assert not _admits(service, parallel, tokenizer, _envelope(("get_population", "{}")))
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    formatted = GrammarSpec.for_tool_calls(
        TOOLS, "auto", parallel=False, format="generic", answer=answer
    )
    assert _admits(service, formatted, tokenizer, '{"response": {"ok": true}}')
    assert not _admits(service, formatted, tokenizer, '{"response": "ok"}')
    compact = GrammarSpec.for_tool_calls(
        TOOLS,
        "auto",
        parallel=False,
        options=GrammarOptions(json_format="compact"),
        format="generic",
    )
    assert _admits(
        service, compact, tokenizer, '{"tool_call":{"name":"get_population","arguments":{}}}'
    )
    assert not _admits(service, compact, tokenizer, '{"response": "a"}')  # compact: no spaces


def test_auto_envelope_is_the_generic_format_only():
    with pytest.raises(GrammarError, match="reply envelope"):
        GrammarSpec.for_tool_calls(TOOLS, "auto", format="hermes")


def test_auto_envelope_held_to_the_decided_branch(service: GrammarService, tokenizer: Any):
    """The server's decision (runtime/server/tool_decision.py) holds the envelope to one side;
    the structural tag carries it, and only mode auto takes one."""
    call = _envelope(("get_weather", '{"city": "Oslo"}'))
    answer = '{"response": "It is sunny."}'
    for branch, admitted, refused in (("call", call, answer), ("answer", answer, call)):
        tag = {"tools": TOOLS, "mode": "auto", "parallel": False, "format": "generic"}
        spec = GrammarSpec.from_sampling_params({"structural_tag": tag | {"branch": branch}})
        assert spec is not None
        assert _admits(service, spec, tokenizer, admitted), branch
        assert not _admits(service, spec, tokenizer, refused), branch
    parallel = GrammarSpec.for_tool_calls(TOOLS, "auto", format="generic", branch="call")
    two = _envelope(("get_weather", '{"city": "Rome"}'), ("get_population", "{}"), key="tool_calls")
    assert _admits(service, parallel, tokenizer, two)
    for mode, branch in (("required", "call"), ("auto", "maybe")):
        with pytest.raises(GrammarError, match="branch"):
            GrammarSpec.for_tool_calls(TOOLS, mode, format="generic", branch=branch)
