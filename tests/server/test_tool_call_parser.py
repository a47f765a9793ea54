"""The tool-call parser of each format: whole outputs, streamed pieces, broken and cut-off calls,
and how a server picks its format."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grammar.tool_call_formats import TOOL_CALL_FORMATS
from runtime.chat.generic_tools import generic_call_text
from runtime.chat.tool_call_events import (
    ToolCallArguments,
    ToolCallDropped,
    ToolCallEnd,
    ToolCallEvent,
    ToolCallStart,
)
from runtime.chat.tool_call_formats import (
    canonical_format,
    detect_format,
    resolve_format,
)
from runtime.chat.tool_calls import make_tool_parser, parse_output, parse_tool_calls
from runtime.server_args import TOOL_CALL_PARSERS, ServerArgs
from runtime.test_model.chat_templates import CHAT_TEMPLATES

NAMES = {"get_weather", "get_time"}
WEATHER = ("get_weather", '{"city": "Paris"}')
TIME = ("get_time", '{"zone": "UTC"}')


def hermes(name: str, args: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'


def llama3(name: str, args: str) -> str:
    return f'{{"name": "{name}", "parameters": {args}}}'


def mistral_item(name: str, args: str) -> str:
    return f'{{"name": "{name}", "arguments": {args}}}'


# (format, output, content, [(name, arguments)])
CASES = [
    (
        "hermes",
        f"Let me check. {hermes(*WEATHER)}\n{hermes(*TIME)}",
        "Let me check.",
        [WEATHER, TIME],
    ),
    (
        "hermes",
        '<tool_call>\n{"arguments": {"zone": "UTC"}, "name": "get_time"}\n</tool_call>\n',
        None,
        [TIME],
    ),
    ("hermes", "no calls < here <tool", "no calls < here <tool", []),
    ("qwen", hermes(*WEATHER) + " done", "done", [WEATHER]),
    ("llama3", f"{llama3(*WEATHER)}; {llama3(*TIME)}", None, [WEATHER, TIME]),
    ("llama3", f"{llama3(*WEATHER)}\n{llama3(*TIME)}", None, [WEATHER, TIME]),
    ("llama3", f"<|python_tag|>{llama3('get_time', '{}')}", None, [("get_time", "{}")]),
    ("llama3", ' {"name": "get_time"}', None, [("get_time", "{}")]),
    ("llama3", f"Calling: <|python_tag|>{llama3(*TIME)}", "Calling:", [TIME]),
    ("llama3", '{"name": "Ann", "age": 3} is JSON', '{"name": "Ann", "age": 3} is JSON', []),
    ("llama3", f"text first {llama3(*TIME)}", f"text first {llama3(*TIME)}", []),
    (
        "mistral",
        f"[TOOL_CALLS][{mistral_item(*WEATHER)}, {mistral_item(*TIME)}]",
        None,
        [WEATHER, TIME],
    ),
    ("mistral", f" [{mistral_item(*TIME)}]", None, [TIME]),
    ("mistral", f"Sure. [TOOL_CALLS] [ {mistral_item(*TIME)} ]", "Sure.", [TIME]),
    ("mistral", "[1, 2] and [TOOL_CAL", "[1, 2] and [TOOL_CAL", []),
    ("mistral", "[] is empty", "[] is empty", []),
    # generic: the syntax the server's own prompt describes (runtime.chat.generic_tools)
    ("generic", generic_call_text(*WEATHER) + generic_call_text(*TIME), None, [WEATHER, TIME]),
    ("generic", f"I will look. {generic_call_text(*TIME)}", "I will look.", [TIME]),
    ("generic", "It is sunny in Paris.", "It is sunny in Paris.", []),
    (
        "mistral",
        f'[TOOL_CALLS][{{"name": "nope", "arguments": {{}}}}, {mistral_item(*TIME)}]',
        None,
        [TIME],
    ),
]


@dataclass
class Summary:
    """What a client assembles from the events."""

    content: str = ""
    names: dict[int, str] = field(default_factory=dict)
    ids: dict[int, str] = field(default_factory=dict)
    arguments: dict[int, str] = field(default_factory=dict)
    ended: dict[int, tuple[str, str, str]] = field(default_factory=dict)  # id, name, args
    dropped: set[int] = field(default_factory=set)

    def calls(self) -> list[tuple[str, str]]:
        return [(name, args) for _, name, args in self.ended.values()]


def summarize(events: list[ToolCallEvent]) -> Summary:
    """Assemble events, checking their order: Start, Arguments..., then End or Dropped."""
    out = Summary()
    for event in events:
        if isinstance(event, str):
            out.content += event
            continue
        index = event.index
        if isinstance(event, ToolCallStart):
            assert index not in out.names and index == len(out.names), events
            assert event.id.startswith("call_")
            out.names[index], out.ids[index], out.arguments[index] = event.name, event.id, ""
            continue
        assert index in out.names and index not in out.ended and index not in out.dropped
        if isinstance(event, ToolCallArguments):
            out.arguments[index] += event.fragment
        elif isinstance(event, ToolCallEnd):
            call = event.call
            assert (call.id, call.name) == (out.ids[index], out.names[index])
            assert call.arguments == out.arguments[index]
            json.loads(call.arguments)
            out.ended[index] = (call.id, call.name, call.arguments)
        else:
            assert isinstance(event, ToolCallDropped)
            out.dropped.add(index)
    assert set(out.names) == set(out.ended) | out.dropped, "a started call was left open"
    return out


def run(fmt: str, pieces: list[str], max_calls: int | None = None) -> Summary:
    parser = make_tool_parser(fmt, NAMES, max_calls)
    events: list[ToolCallEvent] = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    summary = summarize(events)
    assert [(c.name, c.arguments) for c in parser.calls] == summary.calls()
    return summary


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_whole_outputs(fmt: str, text: str, content: str | None, calls: list[tuple[str, str]]):
    parsed_content, parsed = parse_tool_calls(text, NAMES, fmt=fmt)
    assert parsed_content == content
    assert [(c.name, c.arguments) for c in parsed] == calls
    assert len({c.id for c in parsed}) == len(parsed)


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_every_split_gives_the_whole_parse(fmt: str, text: str, content: str | None, calls):
    whole = run(fmt, [text])
    assert whole.calls() == calls
    for cut in range(len(text) + 1):
        split = run(fmt, [text[:cut], text[cut:]])
        assert (split.content, split.calls()) == (whole.content, whole.calls()), cut
    by_char = run(fmt, list(text))
    assert (by_char.content, by_char.calls()) == (whole.content, whole.calls())


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("hermes", hermes(*WEATHER) + hermes(*TIME)),
        ("llama3", f"{llama3(*WEATHER)}; {llama3(*TIME)}"),
        ("mistral", f"[TOOL_CALLS][{mistral_item(*WEATHER)}, {mistral_item(*TIME)}]"),
        ("mistral", f"[{mistral_item(*WEATHER)}, {mistral_item(*TIME)}]"),
    ],
)
def test_cut_off_calls_are_dropped_never_content(fmt: str, text: str):
    first_key_read = text.index('"name"') + len('"name"')
    ends = (text.index("}}") + 2, text.rindex("}}") + 2)  # where each call's object closes
    for cut in range(len(text)):
        prefix = text[:cut]
        streamed = run(fmt, list(prefix))
        content, calls = parse_tool_calls(prefix, NAMES, fmt=fmt)
        assert [(c.name, c.arguments) for c in calls] == streamed.calls()
        assert len(calls) == sum(cut >= end for end in ends)
        if cut >= first_key_read:
            assert content is None, (cut, content)
        # A started call that did not end was dropped: arguments are never half a call's.
        assert all(streamed.arguments[i] == streamed.ended[i][2] for i in streamed.ended)
        constrained_content, constrained_calls = parse_tool_calls(
            prefix, NAMES, fmt=fmt, constrained=True
        )
        assert constrained_content is None and len(constrained_calls) == len(calls)


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "get_time", "arguments": "zone"}</tool_call>',
        '<tool_call>{"name": 7, "arguments": {}}</tool_call>',
        '<tool_call>{"name": "get_time", "arguments": {"zone": tru}}</tool_call>',
    ],
)
def test_broken_hermes_blocks_are_dropped(block: str):
    content, calls = parse_tool_calls(f"a {block} b {hermes(*TIME)}", NAMES)
    assert content == "a b"
    assert [(c.name, c.arguments) for c in calls] == [TIME]


def test_an_unclosed_hermes_block_hides_the_rest_of_its_block():
    text = f'a <tool_call>{{"name": "get_time", "arguments": {{}} b {hermes(*TIME)} c'
    assert parse_tool_calls(text, NAMES) == ("a c", [])


def test_a_started_call_that_turns_out_invalid_is_dropped():
    text = '<tool_call>{"name": "get_time", "arguments": {"zone": tru}}</tool_call>'
    parser = make_tool_parser("hermes", NAMES, None)
    events = parser.feed(text) + parser.finish()
    assert isinstance(events[0], ToolCallStart) and isinstance(events[-1], ToolCallDropped)
    assert parser.calls == []


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral", "generic"])
def test_max_calls(fmt: str):
    text = {
        "hermes": hermes(*WEATHER) * 3,
        "llama3": "; ".join([llama3(*WEATHER)] * 3),
        "mistral": f"[TOOL_CALLS][{', '.join([mistral_item(*WEATHER)] * 3)}]",
        "generic": generic_call_text(*WEATHER) * 3,
    }[fmt]
    content, calls = parse_tool_calls(text, NAMES, max_calls=1, fmt=fmt)
    assert content is None and [(c.name, c.arguments) for c in calls] == [WEATHER]
    assert len(run(fmt, list(text), max_calls=1).names) == 1


def test_content_is_not_held_back_longer_than_needed():
    parser = make_tool_parser("hermes", NAMES, None)
    assert parser.feed("hello") == ["hello"]
    assert parser.feed(" world <tool_") == [" world"]
    llama = make_tool_parser("llama3", NAMES, None)
    assert llama.feed("It is") == ["It is"]


def test_content_after_calls_loses_its_leading_whitespace_streamed_too():
    text = hermes(*TIME) + "\n\n done"
    assert run("hermes", list(text)).content == "done"
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "done" and [(c.name, c.arguments) for c in calls] == [TIME]


def test_a_call_cut_off_is_reported_with_its_partial_arguments():
    content, parser = parse_output('<tool_call>{"name": "get_time", "arguments": {"zo', NAMES)
    assert content is None and parser.calls == [] and parser.cut_off
    assert [(c.name, c.arguments) for c in parser.reported] == [("get_time", '{"zo')]
    assert parser.incomplete == {0}


def test_constrained_output_has_no_content():
    assert parse_tool_calls("<tool", NAMES, constrained=True) == (None, [])
    assert parse_tool_calls('{"name": "get_ti', NAMES, fmt="llama3", constrained=True) == (None, [])


# Outputs built from pieces of each format, split anywhere: the events assemble into the
# same content and calls as the whole output's.
_PIECES = {
    "hermes": [
        "Hi ",
        "a < b ",
        hermes(*WEATHER),
        hermes(*TIME),
        "<tool_call>{bad}</tool_call>",
        "\n",
        '<tool_call>{"name": "get_time", "arguments": {"z',
    ],
    "llama3": [llama3(*WEATHER), "; ", llama3(*TIME), "\n", '{"a": [1, "}"]}', " ok"],
    "generic": [
        "Sure. ",
        generic_call_text(*WEATHER),
        generic_call_text(*TIME),
        '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',
        "a <tool b",
        '<tool_call>{"name": "get_weather", "arguments": {"ci',
    ],
    "mistral": [
        "[TOOL_CALLS][",
        mistral_item(*WEATHER),
        ", ",
        mistral_item(*TIME),
        "]",
        "[1]",
        "[]",
        " text ",
    ],
}


@settings(max_examples=150, deadline=None)
@given(data=st.data(), fmt=st.sampled_from(sorted(_PIECES)))
def test_any_split_of_any_output_gives_the_whole_parse(data: st.DataObject, fmt: str):
    pieces = data.draw(st.lists(st.sampled_from(_PIECES[fmt]), max_size=6))
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    whole, split = run(fmt, [text]), run(fmt, chunks)
    assert (split.content, split.calls()) == (whole.content, whole.calls())
    assert split.dropped == whole.dropped
    # A whole response (parse_output) reports what the stream sent: the same content, and
    # every started call, dropped ones too, with the arguments streamed.
    content, parser = parse_output(text, NAMES, fmt=fmt)
    assert (content or "") == split.content
    streamed = [(split.names[i], split.arguments[i]) for i in sorted(split.names)]
    assert [(c.name, c.arguments) for c in parser.reported] == streamed
    assert parser.incomplete == split.dropped


def test_format_names_and_detection():
    assert {canonical_format(name) for name in TOOL_CALL_PARSERS} == set(TOOL_CALL_FORMATS)
    assert canonical_format("qwen") == "hermes"
    with pytest.raises(ValueError, match="unknown tool-call format"):
        canonical_format("harmony")
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerArgs("m", tool_call_parser="harmony")
    expected = {
        "chatml": "hermes",
        "plain": "hermes",  # no hint in its text; the server sees it renders no tools
        "llama3": "llama3",
        "mistral": "mistral",
        "qwen3": "hermes",
    }
    for name, template in CHAT_TEMPLATES.items():
        assert detect_format(template.template) == expected[name]
    assert detect_format(None) == "hermes"
    assert detect_format({"default": "x", "tool_use": "{{ '[TOOL_CALLS]' }}"}) == "mistral"
    assert detect_format("<|start_header_id|>{{ '<|python_tag|>' }}") == "llama3"
    chatml = CHAT_TEMPLATES["chatml"].template
    assert resolve_format(None, chatml) == "hermes"
    assert resolve_format("mistral", chatml) == "mistral"  # the flag wins over the template
    plain = CHAT_TEMPLATES["plain"].template
    assert resolve_format(None, plain, renders_tools=False) == "generic"
    assert resolve_format("hermes", plain, renders_tools=False) == "hermes"
    assert canonical_format("generic") == "generic"
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli(
        parser.parse_args(["--model-path", "m", "--tool-call-parser", "qwen"])
    )
    assert args.tool_call_parser == "qwen"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "m", "--tool-call-parser", "harmony"])
