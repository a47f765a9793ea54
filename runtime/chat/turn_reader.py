"""Reading one generated turn back: typed outputs in, typed events out.

A ``TurnReader`` reads one choice's output (``RequestOutput``s as the scheduler streams them,
or one whole final output) and gives the events every API renders, in output order:

- ``Thinking(text)``: more of the reasoning (``--reasoning-parser``), before the answer's
  events of the same piece; never empty;
- ``Text(text)``: more of the answer's content, never tool markup (with tools on, as the
  tool-call parser reads it: ``runtime.chat.tool_calls`` has the contract);
- ``ToolCallStart``, ``ToolCallArguments``: a call began, more of its arguments;
- ``ToolCallEnd`` (a whole call) or ``ToolCallDropped`` (cut off, or not valid JSON): the
  call is over;
- ``Done``: the output ended; what the APIs' finish reasons and usage read.

The reader is the one place that splits reasoning from the answer, reads tool calls from the
answer, and remembers the output ids of a turn that made calls (``GeneratedTurns``), so a
conversation that re-sends it follows the radix cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from runtime.chat.generated_turns import GeneratedTurns
from runtime.chat.reasoning import ReasoningParser
from runtime.chat.tool_call_envelope import EnvelopeParser
from runtime.chat.tool_call_events import (
    ToolCall,
    ToolCallArguments,
    ToolCallDropped,
    ToolCallEnd,
    ToolCallStart,
)
from runtime.chat.tool_call_parser import ToolCallParser

if TYPE_CHECKING:
    from runtime.tokenizer_manager import RequestOutput


@dataclass(frozen=True)
class Thinking:
    """More of the reasoning."""

    text: str


@dataclass(frozen=True)
class Text:
    """More of the answer's content (may be empty where a piece held none)."""

    text: str


@dataclass(frozen=True)
class Done:
    """The output ended with ``final``. ``calls``: the whole calls; ``reported``: every call
    that started, as a stream sent it (cut-off ones too); ``cut_call``: max tokens cut a call
    short; ``dropped_call``: some started call never ended; ``markup``: the answer held tool
    markup or was constrained to calls (its content is then null when empty);
    ``reasoning_tokens``: output tokens up to the end of the reasoning."""

    final: RequestOutput
    calls: tuple[ToolCall, ...] = ()
    reported: tuple[ToolCall, ...] = ()
    cut_call: bool = False
    dropped_call: bool = False
    markup: bool = False
    has_reasoning: bool = False
    reasoning_tokens: int = 0

    @property
    def called_tools(self) -> bool:
        return bool(self.reported)


TurnEvent = (
    Thinking | Text | ToolCallStart | ToolCallArguments | ToolCallEnd | ToolCallDropped | Done
)


class TurnReader:
    """Reads one output of a turn. ``tools``: the tool-call parser (None: tools off);
    ``reasoning``: the reasoning parser (None: no reasoning); ``turns``: where a turn that
    made calls is remembered, under ``turn_id(call.id)`` for each whole call;
    ``reasoning_end_token_id``: the end tag's token, to count reasoning tokens; ``on_calls``:
    told of the final output when it ended in whole tool calls (``TurnPlan`` pins it)."""

    def __init__(
        self,
        tools: ToolCallParser | EnvelopeParser | None = None,
        reasoning: ReasoningParser | None = None,
        turns: GeneratedTurns | None = None,
        reasoning_end_token_id: int | None = None,
        turn_id: Callable[[str], str] = str,
        on_calls: Callable[[RequestOutput], None] | None = None,
    ) -> None:
        self.tools = tools
        self.reasoning = reasoning
        self._turns = turns
        self._end_token = reasoning_end_token_id
        self._turn_id = turn_id
        self._on_calls = on_calls
        self.thinking = ""  # the reasoning so far
        self.text = ""  # the answer's content so far
        self.done: Done | None = None
        self._dropped = False  # a started call never ended

    @property
    def has_reasoning(self) -> bool:
        return self.reasoning is not None and self.reasoning.has_reasoning

    def feed(self, chunk: RequestOutput) -> list[TurnEvent]:
        """The events of one streamed output (its ``delta``); ``Done`` last when it ended."""
        finished = chunk.finish_reason is not None
        events = self.read_text(chunk.delta, finished)
        if finished:
            events.append(self._finish(chunk))
        return events

    def read_whole(self, final: RequestOutput) -> list[TurnEvent]:
        """The events of a whole output at once (its ``text``), read as its stream would be."""
        return self.read_text(final.text, True) + [self._finish(final)]

    def read_text(self, text: str, final: bool) -> list[TurnEvent]:
        """The events of ``text``, the output's next piece (``final``: its last), without
        ``Done``: the native API's reading, which has no tools."""
        thinking, answer = "", text
        if self.reasoning is not None:
            split = self.reasoning.feed(text, final=final)
            thinking, answer = split.reasoning, split.content
        self.thinking += thinking
        events: list[TurnEvent] = [Thinking(thinking)] if thinking else []
        if self.tools is None:
            self.text += answer
            return [*events, Text(answer)]
        pieces = self.tools.feed(answer)
        if final:
            pieces += self.tools.finish()
        for piece in pieces:
            if isinstance(piece, str):
                self.text += piece
                events.append(Text(piece))
                continue
            self._dropped = self._dropped or isinstance(piece, ToolCallDropped)
            events.append(piece)
        return events

    def _finish(self, final: RequestOutput) -> Done:
        tools = self.tools
        done = Done(
            final,
            has_reasoning=self.has_reasoning,
            reasoning_tokens=self._reasoning_tokens(final.output_ids),
        )
        if tools is not None:
            constrained = isinstance(tools, ToolCallParser) and tools.constrained
            done = replace(
                done,
                calls=tuple(tools.calls),
                reported=tuple(tools.reported),
                cut_call=tools.cut_off,
                dropped_call=self._dropped,
                markup=bool(tools.reported) or tools.saw_markup or constrained,
            )
        if self._turns is not None and done.calls:
            ids = [self._turn_id(call.id) for call in done.calls]
            self._turns.remember(ids, final, [call.arguments for call in done.calls])
        if self._on_calls is not None and done.calls:
            self._on_calls(final)
        self.done = done
        return done

    def _reasoning_tokens(self, output_ids: list[int]) -> int:
        """Output tokens up to and including the end of the reasoning (all of them when the
        reasoning never ended)."""
        if self.reasoning is None or not self.reasoning.has_reasoning:
            return 0
        if self._end_token is not None and self._end_token in output_ids:
            return output_ids.index(self._end_token) + 1
        return len(output_ids) if self.reasoning.phase != "answer" else 0


def native_result(
    reader: TurnReader, result: dict[str, Any], new_text: str, final: bool
) -> dict[str, Any]:
    """A native result (``RequestOutput.to_dict()``, ``/generate`` and ``Engine.generate``)
    with its reasoning split off by ``reader`` (changed in place): ``text`` is the answer so
    far, ``reasoning_content`` the thinking (None when the output has none); a streamed
    result's ``delta`` is new answer text and ``reasoning_delta`` new thinking. ``new_text``:
    the output's text since the last result (all of it for a whole one)."""
    events = reader.read_text(new_text, final)
    result["text"] = reader.text
    result["reasoning_content"] = reader.thinking if reader.has_reasoning else None
    if "delta" in result:
        result["delta"] = "".join(e.text for e in events if isinstance(e, Text))
        result["reasoning_delta"] = "".join(e.text for e in events if isinstance(e, Thinking))
    return result
