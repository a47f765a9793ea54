"""Tool-call parsing (whole outputs and streamed pieces) and token bytes for logprobs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from runtime.server.token_text import TokenText
from runtime.server.tool_calls import ToolCall, ToolCallParser, parse_tool_calls

NAMES = {"get_weather", "get_time"}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def test_blocks_become_calls_and_the_rest_content():
    content, calls = parse_tool_calls(f"Let me check. {CALL}{CALL}", NAMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ] * 2
    assert calls[0].id != calls[1].id


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "get_time", "arguments": "zone"}</tool_call>',
        '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}',  # never closed
    ],
)
def test_malformed_blocks_stay_content(block: str):
    assert parse_tool_calls(f"a {block} b", NAMES) == (f"a {block} b", [])


def test_no_calls_keeps_content_verbatim():
    assert parse_tool_calls("  plain text  ", NAMES) == ("  plain text  ", [])
    assert parse_tool_calls(CALL, NAMES)[0] is None


def test_max_calls_drops_later_calls():
    _, calls = parse_tool_calls(CALL * 3, NAMES, max_calls=1)
    assert len(calls) == 1


@pytest.mark.parametrize("step", [1, 2, 5, 13])
def test_streamed_pieces_give_the_same_result(step: int):
    text = f"Sure <tool{CALL} then <tool_ca and {CALL} done <"
    parser = ToolCallParser(NAMES)
    events = []
    for start in range(0, len(text), step):
        events += parser.feed(text[start : start + step])
    events += parser.finish()
    content = "".join(e for e in events if isinstance(e, str))
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert content == "Sure <tool then <tool_ca and  done <"
    assert len(calls) == 2
    # Content that cannot start a tag is never held back longer than it must be.
    assert ToolCallParser(NAMES).feed("hello") == ["hello"]
    assert ToolCallParser(NAMES).feed("hello <tool_") == ["hello "]


def test_token_bytes_rebuild_multibyte_text(tiny_model_path: Path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    text = "naïve café 中文 🙂 <tool_call>"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    token_text = TokenText(tokenizer)
    assert b"".join(token_text.token_bytes(i) for i in ids).decode() == text
    assert token_text.text(tokenizer.eos_token_id) == tokenizer.eos_token
