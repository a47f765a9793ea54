"""Running one Messages API generation: the generated text as content blocks, the final
Message object, and Anthropic's server-sent event stream.

The stream is ``message_start`` (the message with no content yet, and the input usage),
``ping``, the block events of ``ContentBuilder`` as text arrives, ``message_delta`` (the stop
reason, the stop sequence and the usage) and ``message_stop``; each is sent as
``event: <type>`` plus ``data: <json>``. A failure after the stream started sends an ``error``
event (``{"type": "error", "error": {...}}``) and ends the stream.

``stop_reason``: ``tool_use`` when a call completed (and none was cut off), ``max_tokens``
when the output hit ``max_tokens``, ``stop_sequence`` when one of ``stop_sequences`` ended it
(``stop_sequence`` names it), else ``end_turn``. ``usage`` splits the prompt as Anthropic
does (``messages_usage``): read from the cache, written to it up to the last ``cache_control``
breakpoint, and the rest.
"""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from runtime.chat.tool_call_events import (
    ToolCallArguments,
    ToolCallDropped,
    ToolCallEnd,
    ToolCallStart,
)
from runtime.chat.turn_reader import Done, Text, Thinking, TurnReader
from runtime.errors import RequestError, SchedulerDied
from runtime.server.errors import ClientGone, anthropic_error_body
from runtime.server.messages_output import ContentBuilder
from runtime.server.messages_usage import split_usage
from runtime.server.responses_output import new_id
from runtime.server.streams import Events
from runtime.tokenizer_manager import RequestOutput


def new_message(model: str) -> dict[str, Any]:
    """A Message before any output."""
    return {
        "id": new_id("msg"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {
            "input_tokens": 0,
            "output_tokens": 0,
            "cache_read_input_tokens": 0,
            "cache_creation_input_tokens": 0,
        },
    }


@dataclass
class MessageRun:
    """One message being generated; ``message`` is completed in place. ``reader`` reads the
    output (its tool calls, its thinking; where a tool-calling turn is remembered)."""

    message: dict[str, Any]
    reader: TurnReader = field(default_factory=TurnReader)
    # Prompt tokens up to the last cache_control breakpoint (``messages_usage``).
    breakpoint_tokens: int = 0
    builder: ContentBuilder = field(default_factory=ContentBuilder)
    final: RequestOutput | None = None
    _started: bool = False

    def feed(self, chunk: RequestOutput) -> None:
        """Add one output of the generation to the content."""
        if not self._started:
            self._started = True
            self._count(chunk, output_tokens=0)
        for event in self.reader.feed(chunk):
            if isinstance(event, Thinking):
                self.builder.thinking(event.text)
            elif isinstance(event, Text):
                self.builder.text(event.text)
            elif isinstance(event, ToolCallStart):
                self.builder.call_start(event.id, event.name)
            elif isinstance(event, ToolCallArguments):
                self.builder.call_arguments(event.fragment)
            elif isinstance(event, (ToolCallEnd, ToolCallDropped)):
                self.builder.call_end(whole=isinstance(event, ToolCallEnd))
            else:
                self.builder.finish()
                self._complete(event)

    def opening(self) -> dict[str, Any]:
        """The message as ``message_start`` shows it: no content, no stop reason yet."""
        return {**copy.deepcopy(self.message), "content": [], "stop_reason": None}

    def _count(self, chunk: RequestOutput, output_tokens: int) -> None:
        split = split_usage(chunk.prompt_tokens, chunk.cached_tokens, self.breakpoint_tokens)
        self.message["usage"] = {
            "input_tokens": split["input_tokens"],
            "output_tokens": output_tokens,
            "cache_read_input_tokens": split["cache_read_input_tokens"],
            "cache_creation_input_tokens": split["cache_creation_input_tokens"],
        }

    def _complete(self, done: Done) -> None:
        final = self.final = done.final
        self._count(final, final.completion_tokens)
        reason = final.finish_reason
        stop_sequence = None
        if self.builder.called_tools and not done.dropped_call:
            stop_reason = "tool_use"
        elif reason is not None and reason.type == "length":
            stop_reason = "max_tokens"
        elif reason is not None and isinstance(reason.matched, str):
            stop_reason, stop_sequence = "stop_sequence", reason.matched
        else:
            stop_reason = "end_turn"
        self.message.update(
            content=self.builder.content, stop_reason=stop_reason, stop_sequence=stop_sequence
        )
        if final.grammar_notes:  # extension: the constraint was applied otherwise than asked
            self.message["grammar_notes"] = list(final.grammar_notes)


async def stream_message(run: MessageRun, events: Events) -> AsyncIterator[bytes]:
    """The SSE body of ``run``. Precondition: ``events`` is primed (its first chunk, which
    carries the prompt's token counts, is ready)."""

    def event(payload: dict[str, Any]) -> bytes:
        data = json.dumps(payload, ensure_ascii=False)
        return f"event: {payload['type']}\ndata: {data}\n\n".encode()

    started = False
    try:
        async for _, chunk in events:
            run.feed(chunk)
            if not started:
                started = True
                yield event({"type": "message_start", "message": run.opening()})
                yield event({"type": "ping"})
            for block_event in run.builder.take_events():
                yield event(block_event)
    except ClientGone:
        return
    except (RequestError, SchedulerDied) as exc:
        status = exc.status_code if isinstance(exc, RequestError) else 503
        yield event(anthropic_error_body(status, str(exc)))
        return
    message = run.message
    delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
    yield event({"type": "message_delta", "delta": delta, "usage": message["usage"]})
    yield event({"type": "message_stop"})
