"""Server-sent event streams of the OpenAI API: ``text_completion`` and
``chat.completion.chunk`` chunks as tokens arrive, then ``data: [DONE]``.

Per choice: chat first sends the assistant role, then content deltas, then a chunk with the
finish reason. With tools on, each tool call streams as OpenAI does: first
``{"tool_calls": [{"index", "id", "type": "function", "function": {"name", "arguments": ""}}]}``
once its name is known, then ``{"tool_calls": [{"index", "function": {"arguments": ...}}]}``
fragments as the model writes them (``ToolCallParser``'s events). The chunks concatenate to
the non-streamed response: the same content, reasoning and calls (with the legacy
``functions``, the one call as ``{"function_call": {"name", "arguments": ""}}``, then
``{"function_call": {"arguments": ...}}``) (a call cut off by max
tokens has sent what it had, as the whole response returns it, and finishes the choice with
"length"). With
``stream_options.include_usage`` every chunk carries ``"usage": null`` and a last chunk with
no choices carries the usage. An error after the stream started is
sent as an ``{"error": ...}`` event before ``[DONE]``.

With ``--reasoning-parser``, chat sends the thinking as ``reasoning_content`` deltas apart
from the content; the content deltas and tool calls come from the answer alone.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from runtime.chat.tool_call_events import ToolCallArguments, ToolCallStart
from runtime.chat.turn_reader import Done, Text, Thinking, TurnEvent, TurnReader
from runtime.server.openai_format import (
    ResponseContext,
    chat_logprobs,
    completion_logprobs,
    envelope,
    finish_fields,
    legacy_call,
    usage,
)
from runtime.server.streams import Events, sse_event
from runtime.tokenizer_manager import RequestOutput


def _chunk(
    ctx: ResponseContext, kind: str, choices: list[dict[str, Any]], totals: Any = None
) -> bytes:
    """One chunk; with include_usage every chunk has ``usage`` (``totals``: the last's)."""
    body = envelope(ctx, kind, choices)
    if ctx.include_usage:
        body["usage"] = totals
    return sse_event(body)


@dataclass
class _Choices:
    """What a stream has sent of each choice: whether it started, its output logprobs, and its
    final output by choice index (for the usage chunk, which counts prompts by index)."""

    count: int
    started: list[bool] = field(init=False)
    sent: list[int] = field(init=False)
    finals: list[RequestOutput | None] = field(init=False)

    def __post_init__(self) -> None:
        self.started, self.sent = [False] * self.count, [0] * self.count
        self.finals = [None] * self.count

    def start(self, index: int) -> bool:
        """Whether this is choice ``index``'s first chunk."""
        first, self.started[index] = not self.started[index], True
        return first

    def new_logprobs(self, index: int, chunk: RequestOutput) -> tuple[list[Any], list[Any]]:
        """The output logprobs of choice ``index`` not sent yet (and now counted as sent)."""
        chosen, tops = chunk.logprobs(start=self.sent[index])
        self.sent[index] += len(chosen)
        return chosen, tops

    def usage_chunk(self, ctx: ResponseContext, kind: str) -> bytes:
        finals = [final for final in self.finals if final is not None]
        return _chunk(ctx, kind, [], usage(finals, ctx.n))


async def completion_stream(
    ctx: ResponseContext, events: Events, num_choices: int, want_logprobs: bool
) -> AsyncIterator[bytes]:
    kind = "text_completion"
    choices = _Choices(num_choices)
    offsets = [0] * num_choices  # characters of text sent per choice
    async for index, chunk in events:
        text = chunk.delta
        first = choices.start(index)
        if first and ctx.echo_texts:
            text = ctx.echo_texts[index // ctx.n] + text
        logprobs = None
        if want_logprobs:
            chosen, tops = choices.new_logprobs(index, chunk)
            if first and ctx.echo_texts:
                prompt_chosen, prompt_tops = chunk.logprobs(prompt=True)
                chosen, tops = prompt_chosen + chosen, prompt_tops + tops
            logprobs = completion_logprobs(ctx.token_text, chosen, tops, offsets[index])
        offsets[index] += len(text)
        if chunk.finish_reason is not None:
            choices.finals[index] = chunk
        choice = {"index": index, "text": text, "logprobs": logprobs} | finish_fields(chunk)
        yield _chunk(ctx, kind, [choice])
    if ctx.include_usage:
        yield choices.usage_chunk(ctx, kind)


async def chat_stream(
    ctx: ResponseContext, events: Events, num_choices: int, want_logprobs: bool
) -> AsyncIterator[bytes]:
    kind = "chat.completion.chunk"
    choices = _Choices(num_choices)
    readers = [ctx.reader() if ctx.reader else TurnReader() for _ in range(num_choices)]
    async for index, chunk in events:
        if choices.start(index):
            role = {"role": "assistant", "content": ""}
            yield _chunk(ctx, kind, [{"index": index, "delta": role, "logprobs": None}])
        turn_events = readers[index].feed(chunk)
        logprobs = None
        if want_logprobs:
            chosen, tops = choices.new_logprobs(index, chunk)
            logprobs = chat_logprobs(ctx.token_text, chosen, tops) if chosen else None
        deltas = [delta for event in turn_events if (delta := _chat_delta(event)) is not None]
        if ctx.legacy_functions:
            deltas = [legacy_call(delta) for delta in deltas]
        if logprobs is not None and not deltas:
            deltas.append({"content": ""})
        for delta in deltas:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
            yield _chunk(ctx, kind, [choice])
            logprobs = None
        done = turn_events[-1] if turn_events else None
        if isinstance(done, Done):
            choices.finals[index] = chunk
            finish = finish_fields(chunk, called_tools=done.called_tools, cut_call=done.cut_call)
            finish = legacy_call(finish) if ctx.legacy_functions else finish
            yield _chunk(ctx, kind, [{"index": index, "delta": {}, "logprobs": None} | finish])
    if ctx.include_usage:
        yield choices.usage_chunk(ctx, kind)


def _chat_delta(event: TurnEvent) -> dict[str, Any] | None:
    """The chat delta of one turn event (None for those that send nothing)."""
    if isinstance(event, Thinking):
        return {"reasoning_content": event.text}
    if isinstance(event, Text):
        return {"content": event.text} if event.text else None
    if isinstance(event, ToolCallStart):
        function = {"name": event.name, "arguments": ""}
        call = {"index": event.index, "id": event.id, "type": "function", "function": function}
        return {"tool_calls": [call]}
    if isinstance(event, ToolCallArguments):
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.fragment}}]}
    return None
