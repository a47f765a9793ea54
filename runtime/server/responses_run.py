"""Running one Responses API generation: the generated text split into output items, the
final response object, and the server-sent event stream.

The stream is ``response.created``, ``response.in_progress``, the item events of
``OutputBuilder`` as text arrives, then ``response.completed`` (or ``response.incomplete``
when ``max_output_tokens`` cut the output short) carrying the whole response. Every event has
a ``sequence_number`` and is sent as ``event: <type>`` plus ``data: <json>``. A failure after
the stream started sends an ``error`` event and ``response.failed``.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.chat.tool_call_events import (
    ToolCallArguments,
    ToolCallDropped,
    ToolCallEnd,
    ToolCallStart,
)
from runtime.chat.turn_reader import Text, Thinking, TurnReader
from runtime.errors import RequestError, SchedulerDied
from runtime.server.errors import ClientGone
from runtime.server.openai_format import chat_logprobs
from runtime.server.openai_protocol import served_tier
from runtime.server.responses_output import OutputBuilder, new_id
from runtime.server.responses_protocol import ResponsesRequest
from runtime.server.streams import Events
from runtime.server.token_text import TokenText
from runtime.tokenizer_manager import RequestOutput


@dataclass
class ResponseRun:
    """One response being generated; ``response`` is completed in place. ``reader`` reads the
    output (its tool calls, its reasoning; where a tool-calling turn is remembered)."""

    response: dict[str, Any]
    token_text: TokenText
    reader: TurnReader = field(default_factory=TurnReader)
    want_logprobs: bool = False
    builder: OutputBuilder = field(default_factory=OutputBuilder)
    final: RequestOutput | None = None
    _logprobs_sent: int = 0

    def feed(self, chunk: RequestOutput) -> None:
        """Add one output of the generation to the output items."""
        logprobs = self._new_logprobs(chunk) if self.want_logprobs else None
        for event in self.reader.feed(chunk):
            if isinstance(event, Thinking):
                self.builder.reasoning(event.text)
            elif isinstance(event, Text):
                self.builder.text(event.text, logprobs)
                logprobs = None
            elif isinstance(event, ToolCallStart):
                self.builder.call_start(event.id, event.name)
            elif isinstance(event, ToolCallArguments):
                self.builder.call_arguments(event.fragment)
            elif isinstance(event, (ToolCallEnd, ToolCallDropped)):
                whole = isinstance(event, ToolCallEnd)
                self.builder.call_end("completed" if whole else "incomplete")
            else:
                if logprobs:
                    self.builder.text("", logprobs)
                    logprobs = None
                self.final = event.final
                self._complete(event.final, event.reasoning_tokens)
        if logprobs:
            self.builder.text("", logprobs)

    def fail(self, message: str) -> None:
        self.builder.finish("incomplete")
        self.response.update(
            status="failed",
            output=self.builder.items,
            error={"code": "server_error", "message": message},
        )

    def _new_logprobs(self, chunk: RequestOutput) -> list[dict[str, Any]]:
        chosen, tops = chunk.logprobs(start=self._logprobs_sent)
        self._logprobs_sent += len(chosen)
        return chat_logprobs(self.token_text, chosen, tops)["content"] if chosen else []

    def _complete(self, final: RequestOutput, reasoning_tokens: int) -> None:
        cut = final.finish_reason is not None and final.finish_reason.type == "length"
        self.builder.finish("incomplete" if cut else "completed")
        prompt = final.prompt_tokens
        output = final.completion_tokens
        self.response.update(
            status="incomplete" if cut else "completed",
            incomplete_details={"reason": "max_output_tokens"} if cut else None,
            completed_at=int(time.time()),
            output=self.builder.items,
            usage={
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": final.cached_tokens},
                "output_tokens": output,
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": prompt + output,
            },
        )
        if final.grammar_notes:  # extension: the constraint was applied otherwise than asked
            self.response["grammar_notes"] = list(final.grammar_notes)


async def stream_response(
    run: ResponseRun, events: Events, on_done: Callable[[RequestOutput], None]
) -> AsyncIterator[bytes]:
    """The SSE body; ``on_done(final chunk)`` runs once the response is complete."""
    sequence = 0

    def event(payload: dict[str, Any]) -> bytes:
        nonlocal sequence
        payload["sequence_number"] = sequence
        sequence += 1
        data = json.dumps(payload, ensure_ascii=False)
        return f"event: {payload['type']}\ndata: {data}\n\n".encode()

    yield event({"type": "response.created", "response": copy.deepcopy(run.response)})
    yield event({"type": "response.in_progress", "response": copy.deepcopy(run.response)})
    try:
        async for _, chunk in events:
            run.feed(chunk)
            for item_event in run.builder.take_events():
                yield event(item_event)
    except ClientGone:
        return
    except (RequestError, SchedulerDied) as exc:
        code = "invalid_request_error" if getattr(exc, "status_code", 500) < 500 else "server_error"
        yield event({"type": "error", "code": code, "message": str(exc), "param": None})
        run.fail(str(exc))
        for item_event in run.builder.take_events():
            yield event(item_event)
        yield event({"type": "response.failed", "response": run.response})
        return
    if run.final is not None:
        on_done(run.final)
    kind = "response.incomplete" if run.response["status"] == "incomplete" else "response.completed"
    yield event({"type": kind, "response": run.response})


def new_response(body: ResponsesRequest, model: str) -> dict[str, Any]:
    """The response object of ``body`` before any output: status in_progress, the request's
    settings echoed."""
    fmt = (
        body.text.format.model_dump(by_alias=True, exclude_none=True)
        if body.text and body.text.format
        else {"type": "text"}
    )
    return {
        "id": new_id("resp"),
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": body.max_tool_calls,
        "model": model,
        "output": [],
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "reasoning": {
            "effort": body.reasoning.effort if body.reasoning else None,
            "summary": body.reasoning.summary if body.reasoning else None,
        },
        "store": body.store,
        "temperature": body.temperature if body.temperature is not None else 1.0,
        "text": {"format": fmt, "verbosity": body.text.verbosity if body.text else None},
        "tool_choice": _echo_choice(body),
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
        "top_logprobs": body.top_logprobs,
        "top_p": body.top_p if body.top_p is not None else 1.0,
        "truncation": body.truncation or "disabled",
        "usage": None,
        "user": body.user,
        "safety_identifier": body.safety_identifier,
        "prompt_cache_key": body.prompt_cache_key,
        "metadata": body.metadata or {},
        **served_tier(body.service_tier),
    }


def _echo_choice(body: ResponsesRequest) -> Any:
    choice = body.tool_choice
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump()
