"""The generic tool-call format's prompt side: which chat templates render tools, and how
tools, earlier calls and tool results are written for a template that does not."""

from __future__ import annotations

import json
from typing import Any

import pytest
from transformers import AutoTokenizer

from runtime.chat.generic_tools import (
    ReplyEnvelope,
    call_names,
    generic_call_text,
    generic_messages,
    generic_system_text,
    template_renders_tools,
)
from runtime.chat.tool_call_envelope import EnvelopeParser
from runtime.chat.tool_call_events import (
    ToolCallArguments,
    ToolCallDropped,
    ToolCallEnd,
    ToolCallStart,
)
from runtime.chat.tool_calls import calls_or_answer, parse_tool_calls
from runtime.model_files import builtin_model_path, load_tokenizer
from runtime.test_model import cached_test_model

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
}


class CountingTokenizer:
    """A tokenizer whose template ignores tools, counting its renders."""

    chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

    def __init__(self) -> None:
        self.renders = 0

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        self.renders += 1
        return "".join(m["content"] for m in messages)


def test_detection_by_template():
    chatml = AutoTokenizer.from_pretrained(cached_test_model("tiny", "llama"))
    plain = AutoTokenizer.from_pretrained(cached_test_model("tiny", "llama", chat_template="plain"))
    assert template_renders_tools(chatml)  # writes the tools in a system turn
    assert not template_renders_tools(plain)


def test_smollm2_template_does_not_render_tools():
    try:
        path = builtin_model_path()
    except Exception as exc:  # the built-in model is an install step of its own
        pytest.skip(f"no built-in model: {exc}")
    assert not template_renders_tools(load_tokenizer(path))


def test_the_answer_is_cached_per_template():
    first, second = CountingTokenizer(), CountingTokenizer()
    assert not template_renders_tools(first)
    assert first.renders == 2  # with and without tools
    assert not template_renders_tools(second)  # same class and template: no render at all
    assert second.renders == 0
    second.chat_template = "{{ messages }}"  # another template is probed again
    assert not template_renders_tools(second) and second.renders == 2


def test_tools_lead_the_system_turn():
    text = generic_system_text([WEATHER])
    lines = text.splitlines()
    assert json.loads(lines[1]) == {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
    assert "<tool_call>" in lines[-1] and '"arguments"' in lines[-1]
    with_system = generic_messages(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], [WEATHER]
    )
    assert with_system[0] == {"role": "system", "content": text + "\n\nBe brief."}
    without = generic_messages([{"role": "user", "content": "Hi"}], [WEATHER])
    assert without == [{"role": "system", "content": text}, {"role": "user", "content": "Hi"}]
    assert generic_messages([{"role": "user", "content": "Hi"}], None) == [
        {"role": "user", "content": "Hi"}
    ]


def test_calls_and_results_of_earlier_turns():
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL, CALL | {"id": "call_2"}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "assistant", "content": "Sunny, then rain."},
        {"role": "tool", "tool_call_id": "unknown", "content": "late"},
    ]
    rendered = generic_messages(messages, None)
    call = '<tool_call>{"name": "get_weather", "arguments": {"city":"Paris"}}</tool_call>'
    assert rendered[1] == {"role": "assistant", "content": call * 2}
    # Results that follow each other share one user turn, each naming its tool.
    assert rendered[2] == {
        "role": "user",
        "content": "Result of tool get_weather: sunny\nResult of tool get_weather: rain",
    }
    assert rendered[3] == messages[4]
    assert rendered[4] == {"role": "user", "content": "Tool result: late"}
    # The call text is what the parser reads back, arguments verbatim.
    content, calls = parse_tool_calls(rendered[1]["content"], {"get_weather"}, fmt="generic")
    assert (
        content is None
        and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city":"Paris"}')] * 2
    )
    assert (
        generic_call_text("f", {"a": 1})
        == '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    )


def test_a_plain_template_renders_the_generic_conversation():
    tok = AutoTokenizer.from_pretrained(cached_test_model("tiny", "llama", chat_template="plain"))
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    text = tok.apply_chat_template(generic_messages(messages, [WEATHER]), tokenize=False)
    assert text.index('"get_weather", "description"') < text.index("Weather?")
    assert "<|im_start|>assistant\n<tool_call>" in text
    assert "<|im_start|>user\nResult of tool get_weather: sunny" in text


def test_results_name_tools_whose_calls_are_elsewhere():
    """A continued Responses turn renders the previous answer as a marker: its calls' names
    come from ``call_names`` of the real answer."""
    answer = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    assert call_names([answer]) == {"call_1": "get_weather"}
    probe = [
        {"role": "assistant", "content": "MARK"},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    rendered = generic_messages(probe, None, call_names([answer]))
    assert rendered[1]["content"] == "Result of tool get_weather: sunny"


ENVELOPE_CALL = (
    '{\n  "tool_call": {\n    "name": "get_weather",\n    "arguments": {\n'
    '      "city": "Pa\\"ris"\n    }\n  }\n}'
)


def _events(text: str, step: int) -> tuple[list[Any], Any]:
    parser = EnvelopeParser({"get_weather"}, None)
    events: list[Any] = []
    for i in range(0, len(text), step):
        events += parser.feed(text[i : i + step])
    return events + parser.finish(), parser


def _content(events: list[Any]) -> str:
    return "".join(e for e in events if isinstance(e, str))


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_the_envelope_is_read_as_it_streams(step: int):
    """Under tool_choice auto the reply is the envelope: a call comes out as call events
    (its arguments as written, fragment by fragment), a response as its unescaped text."""
    events, parser = _events(ENVELOPE_CALL, step)
    arguments = '{\n      "city": "Pa\\"ris"\n    }'
    assert [(c.name, c.arguments) for c in parser.calls] == [("get_weather", arguments)]
    assert isinstance(events[0], ToolCallStart) and events[0].name == "get_weather"
    fragments = [e.fragment for e in events if isinstance(e, ToolCallArguments)]
    assert "".join(fragments) == arguments and _content(events) == ""
    assert isinstance(events[-1], ToolCallEnd) and parser.saw_markup
    text = '{"response": "Caf\\u00e9 \\ud83d\\ude00 \\"ok\\"\\nbye"}'
    events, parser = _events(text, step)
    assert _content(events) == 'Café \U0001f600 "ok"\nbye' and not parser.calls
    if step == 1:  # the answer streams: one piece per character
        assert len([e for e in events if isinstance(e, str)]) > 10


def test_envelope_calls_lists_unknown_tools_and_cuts():
    text = (
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "A"}}, '
        '{"name": "nope", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "B}"}}]}'
    )
    content, calls = parse_tool_calls(text, {"get_weather"}, fmt="generic")
    assert content is None
    assert [c.arguments for c in calls] == ['{"city": "A"}', '{"city": "B}"}']
    # Cut inside the arguments (max tokens): the call started, then is dropped.
    events, parser = _events('{"tool_call": {"name": "get_weather", "arguments": {"city": "Pa', 2)
    assert isinstance(events[0], ToolCallStart) and isinstance(events[-1], ToolCallDropped)
    assert not parser.calls
    # A response in a response format's JSON is its JSON text.
    assert parse_tool_calls('{"response": {"a": [1, 2]}}', {"get_weather"}, fmt="generic") == (
        '{"a": [1, 2]}',
        [],
    )


def test_a_reply_that_is_no_envelope_is_read_in_the_call_syntax():
    """A request with a grammar of its own gets no envelope: its free text is read as before."""
    call = generic_call_text("get_weather", '{"city":"Oslo"}')
    content, calls = parse_tool_calls(f"Sure. {call}", {"get_weather"}, fmt="generic")
    assert content == "Sure." and [c.arguments for c in calls] == ['{"city":"Oslo"}']
    assert parse_tool_calls("It is sunny.", {"get_weather"}, fmt="generic") == ("It is sunny.", [])


def test_the_prompt_describes_the_envelope():
    single, several = ReplyEnvelope(parallel=False), ReplyEnvelope(parallel=True)
    line = generic_system_text([WEATHER], single).splitlines()[-1]
    assert '{"tool_call": {"name": <tool name>, "arguments": <arguments object>}}' in line
    assert '{"response": <your answer as a string>}' in line and "<tool_call>" not in line
    assert '{"tool_calls": [{"name"' in several.instruction()
    assert "<your answer as JSON>" in ReplyEnvelope(False, text_answer=False).instruction()
    # Earlier calls are written in the envelope, and read back by its parser.
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
    ]
    turn = generic_messages(messages, [WEATHER], envelope=single)[2]["content"]
    assert turn == '{"tool_call": {"name": "get_weather", "arguments": {"city":"Paris"}}}'
    assert [c.arguments for c in parse_tool_calls(turn, {"get_weather"}, fmt="generic")[1]] == [
        '{"city":"Paris"}'
    ]
    two = generic_messages([messages[1] | {"tool_calls": [CALL, CALL]}], None, envelope=single)
    assert json.loads(two[0]["content"])["tool_calls"][1]["name"] == "get_weather"


def test_auto_asks_for_the_envelope_only_when_told():
    tools = [WEATHER["function"]]
    tag = calls_or_answer(tools, False, "generic", {}, envelope=True)
    assert tag is not None and tag["mode"] == "auto" and "answer" not in tag
    formatted = calls_or_answer(tools, False, "generic", {"json_object": True}, envelope=True)
    assert formatted is not None and formatted["answer"] == {"type": "object"}
    assert calls_or_answer(tools, False, "generic", {}) is None  # free text, as before


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_a_repeated_call_is_dropped_without_a_trace(step: int):
    """A call equal in name and arguments to an earlier one of the reply (in any layout) sends
    no event at all; a call that only starts like one goes out whole, in order."""
    paris = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    text = (
        '{"tool_calls": [' + paris + ', {"name": "get_weather", "arguments": {"city":"Paris"}},'
        ' {"name": "get_weather", "arguments": {"city": "Paris Nord"}}]}'
    )
    events, parser = _events(text, step)
    assert [c.arguments for c in parser.calls] == ['{"city": "Paris"}', '{"city": "Paris Nord"}']
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [s.index for s in starts] == [0, 1]
    fragments = [e for e in events if isinstance(e, ToolCallArguments)]
    assert "".join(f.fragment for f in fragments if f.index == 1) == '{"city": "Paris Nord"}'
    assert [e.index for e in events if isinstance(e, ToolCallEnd)] == [0, 1]
    assert parser.reported == parser.calls and not parser.incomplete
    # The same arguments under another tool's name are another call.
    other = text.replace('"get_weather", "arguments": {"city":"Paris"}', '"nope2", "arguments": {}')
    assert len(parse_tool_calls(other, {"get_weather", "nope2"}, fmt="generic")[1]) == 3


def test_a_cut_off_repeat_is_kept_as_cut_off():
    text = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome"}}, '
    text += '{"name": "get_weather", "arguments": {"city": "Ro'
    events, parser = _events(text, 5)
    assert [c.arguments for c in parser.reported] == ['{"city": "Rome"}', '{"city": "Ro']
    assert parser.incomplete == {1} and isinstance(events[-1], ToolCallDropped)
