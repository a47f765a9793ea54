"""The turn reader: typed outputs in, typed events out (runtime/chat/turn_reader.py)."""

from __future__ import annotations

from typing import Any

from runtime.chat.generated_turns import GeneratedTurns
from runtime.chat.reasoning import make_reasoning_parser
from runtime.chat.tool_call_events import (
    ToolCallArguments,
    ToolCallDropped,
    ToolCallEnd,
    ToolCallStart,
)
from runtime.chat.tool_calls import make_tool_parser
from runtime.chat.turn_reader import Done, Text, Thinking, TurnEvent, TurnReader, native_result
from runtime.ipc import FinishReason
from runtime.tokenizer_manager import RequestOutput

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def _chunks(pieces: list[str], reason: FinishReason) -> list[RequestOutput]:
    text, out = "", []
    for i, piece in enumerate(pieces):
        text += piece
        last = i == len(pieces) - 1
        ids = list(range(10, 11 + i))
        out.append(RequestOutput("r", text, piece, ids, 5, i + 1, 0, reason if last else None, 0))
    return out


def _read(reader: TurnReader, pieces: list[str], reason: FinishReason) -> list[TurnEvent]:
    return [event for chunk in _chunks(pieces, reason) for event in reader.feed(chunk)]


def _kinds(events: list[TurnEvent]) -> list[str]:
    return [type(event).__name__ for event in events]


def _tools(constrained: bool = False) -> Any:
    return make_tool_parser("hermes", {"get_weather"}, None, constrained)


def test_thinking_then_text_then_done() -> None:
    reader = TurnReader(reasoning=make_reasoning_parser("qwen3"))
    events = _read(reader, ["<think>hm", "m</th", "ink>The answer", "."], FinishReason.stop(2))
    assert _kinds(events) == ["Thinking", "Text", "Thinking", "Text", "Text", "Text", "Done"]
    assert "".join(e.text for e in events if isinstance(e, Thinking)) == "hmm"
    assert "".join(e.text for e in events if isinstance(e, Text)) == "The answer."
    done = events[-1]
    assert isinstance(done, Done) and done.has_reasoning and not done.called_tools
    assert reader.thinking == "hmm" and reader.text == "The answer."


def test_a_call_streams_start_arguments_end() -> None:
    reader = TurnReader(_tools())
    events = _read(reader, ["Let me look. ", CALL[:40], CALL[40:]], FinishReason.stop(2))
    calls = [e for e in events if not isinstance(e, Text)]
    assert isinstance(calls[0], ToolCallStart) and calls[0].name == "get_weather"
    args = "".join(e.fragment for e in calls if isinstance(e, ToolCallArguments))
    end = next(e for e in calls if isinstance(e, ToolCallEnd))
    assert args == end.call.arguments and '"Paris"' in args
    done = events[-1]
    assert isinstance(done, Done)
    assert done.called_tools and done.calls == (end.call,) and done.markup and not done.cut_call
    assert reader.text.strip() == "Let me look."


def test_a_call_cut_off_is_dropped_and_reported() -> None:
    reader = TurnReader(_tools())
    events = _read(reader, [CALL[:50]], FinishReason.cut(2))
    assert _kinds(events)[-2:] == ["ToolCallDropped", "Done"]
    done = events[-1]
    assert isinstance(done, Done) and isinstance(events[-2], ToolCallDropped)
    assert done.dropped_call and done.cut_call and not done.calls and len(done.reported) == 1


def test_whole_output_reads_as_its_stream() -> None:
    pieces = ["Sure. ", CALL[:30], CALL[30:]]
    streamed = _read(TurnReader(_tools()), pieces, FinishReason.stop(2))
    final = _chunks(pieces, FinishReason.stop(2))[-1]
    whole = TurnReader(_tools()).read_whole(final)

    def shape(events: list[TurnEvent]) -> tuple[str, list[str]]:
        text = "".join(e.text for e in events if isinstance(e, Text))
        return text, [type(e).__name__ for e in events if not isinstance(e, Text)]

    assert shape(streamed) == shape(whole)


def test_a_turn_with_calls_is_remembered_under_the_api_id() -> None:
    turns = GeneratedTurns(tokenizer=None)
    reader = TurnReader(_tools(), turns=turns, turn_id=lambda i: "toolu_" + i)
    compact = '<tool_call>{"name": "get_weather", "arguments": {"city":"Paris"}}</tool_call>'
    events = _read(reader, [compact], FinishReason.stop(None))
    end = next(e for e in events if isinstance(e, ToolCallEnd))
    # As the model wrote them (no space after the colon), under the API's id only.
    assert turns.arguments_text("toolu_" + end.call.id, {"city": "Paris"}) == '{"city":"Paris"}'
    assert turns.arguments_text(end.call.id, {"city": "Paris"}) == '{"city": "Paris"}'


def test_no_tools_passes_every_piece_as_text() -> None:
    events = _read(TurnReader(), ["a", "", "b"], FinishReason.stop(None))
    assert _kinds(events) == ["Text", "Text", "Text", "Done"]


def test_native_result_splits_reasoning() -> None:
    reader = TurnReader(reasoning=make_reasoning_parser("deepseek-r1"))
    first = native_result(reader, {"text": "x", "delta": ""}, "plan</think>", final=False)
    assert first["reasoning_delta"] == "plan" and first["delta"] == ""
    last = native_result(reader, {"text": "x", "delta": ""}, " Yes", final=True)
    assert last["text"] == "Yes" and last["reasoning_content"] == "plan"
    plain = native_result(TurnReader(reasoning=make_reasoning_parser("qwen3")), {}, "No.", True)
    assert plain == {"text": "No.", "reasoning_content": None}
