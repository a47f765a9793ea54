"""OpenAI response bodies built from the tokenizer manager's results: choices, usage,
logprobs in both the chat shape and the legacy completions shape, finish reasons."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.chat.turn_reader import TurnReader
from runtime.server.token_text import TokenText
from runtime.tokenizer_manager import RequestOutput, TokenLogprob


@dataclass
class ResponseContext:
    """What every body and chunk of one OpenAI response shares."""

    request_id: str
    created: int
    model: str
    n: int  # samples per prompt: choice i * n + j is sample j of prompt i
    token_text: TokenText
    include_usage: bool = False
    # Chat: a fresh reader per choice (reasoning, tool calls, remembered turns).
    reader: Callable[[], TurnReader] | None = None
    # Completions with echo: the prompt texts, prepended to each prompt's choices.
    echo_texts: list[str] = field(default_factory=list)
    # The service_tier field every body and chunk carries (served_tier), if any.
    tier: dict[str, str] = field(default_factory=dict)
    # Chat with the legacy functions: the call is answered as function_call (legacy_call).
    legacy_functions: bool = False


def envelope(ctx: ResponseContext, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    """What every response body and stream chunk starts with."""
    head = {"id": ctx.request_id, "object": kind, "created": ctx.created, "model": ctx.model}
    return {**head, "choices": choices, **ctx.tier}


def finish_fields(
    output: RequestOutput, called_tools: bool = False, cut_call: bool = False
) -> dict[str, Any]:
    """``finish_reason`` ("stop", "length", "tool_calls", "abort") and SGLang's
    ``matched_stop`` (the stop string or token that ended the output, if any). An output with
    tool calls finishes with "tool_calls", also when max tokens cut what followed them, but
    with "length" when they cut a call itself (``cut_call``: its arguments are partial). An
    extension, ``grammar_notes``, says how the constraint was applied when that differs from
    what was asked (a JSON layout that could not be aligned)."""
    reason = output.finish_reason
    if reason is None:
        return {"finish_reason": None}
    kind: str = reason.type
    if kind in ("stop", "length") and called_tools and not (kind == "length" and cut_call):
        kind = "tool_calls"
    notes = {"grammar_notes": list(output.grammar_notes)} if output.grammar_notes else {}
    return {"finish_reason": kind, "matched_stop": reason.matched} | notes


def legacy_call(fields: dict[str, Any]) -> dict[str, Any]:
    """A chat message, delta or finish in the legacy functions' shape: its one tool call as
    ``function_call`` (``{"name", "arguments"}``, without id or index), finish_reason
    "function_call" for "tool_calls"."""
    legacy = dict(fields)
    calls = legacy.pop("tool_calls", None)
    if calls:
        legacy["function_call"] = calls[0]["function"]
    if legacy.get("finish_reason") == "tool_calls":
        legacy["finish_reason"] = "function_call"
    return legacy


def usage(finals: list[RequestOutput], n: int) -> dict[str, Any]:
    """Prompt tokens count once per prompt however many samples it has."""
    firsts = finals[::n]
    prompt = sum(f.prompt_tokens for f in firsts)
    completion = sum(f.completion_tokens for f in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(f.cached_tokens for f in firsts)},
    }


def chat_logprobs(
    text: TokenText, chosen: list[TokenLogprob], tops: list[list[TokenLogprob]]
) -> dict[str, Any]:
    """``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}``."""

    def entry(logprob: float | None, token: int) -> dict[str, Any]:
        return {
            "token": text.text(token),
            "logprob": logprob,
            "bytes": list(text.token_bytes(token)),
        }

    content = []
    for i, (logprob, token) in enumerate(chosen):
        top = tops[i] if i < len(tops) else []
        content.append({**entry(logprob, token), "top_logprobs": [entry(lp, t) for lp, t in top]})
    return {"content": content}


def completion_logprobs(
    text: TokenText, chosen: list[TokenLogprob], tops: list[list[TokenLogprob]], offset: int
) -> dict[str, Any]:
    """The legacy shape: parallel lists ``tokens``, ``token_logprobs``, ``top_logprobs``
    (token text -> logprob) and ``text_offset`` (from ``offset`` on)."""
    tokens = [text.text(token) for _, token in chosen]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [logprob for logprob, _ in chosen],
        "top_logprobs": [
            {text.text(t): lp for lp, t in (tops[i] if i < len(tops) else [])}
            for i in range(len(chosen))
        ],
        "text_offset": offsets,
    }


def completion_response(
    ctx: ResponseContext, finals: list[RequestOutput], want_logprobs: bool
) -> dict[str, Any]:
    choices = []
    for index, final in enumerate(finals):
        prefix = ctx.echo_texts[index // ctx.n] if ctx.echo_texts else ""
        logprobs = None
        if want_logprobs:
            chosen, tops = final.logprobs()
            if ctx.echo_texts:
                prompt_chosen, prompt_tops = final.logprobs(prompt=True)
                chosen, tops = prompt_chosen + chosen, prompt_tops + tops
            logprobs = completion_logprobs(ctx.token_text, chosen, tops, 0)
        choices.append(
            {"index": index, "text": prefix + final.text, "logprobs": logprobs}
            | finish_fields(final)
        )
    return envelope(ctx, "text_completion", choices) | {"usage": usage(finals, ctx.n)}


def chat_response(
    ctx: ResponseContext, finals: list[RequestOutput], want_logprobs: bool
) -> dict[str, Any]:
    choices = []
    for index, final in enumerate(finals):
        message: dict[str, Any] = {"role": "assistant", "content": final.text}
        finish: dict[str, bool] = {}
        if ctx.reader is not None:
            reader = ctx.reader()
            reader.read_whole(final)
            done = reader.done
            assert done is not None
            message["content"] = (reader.text or None) if done.markup else reader.text
            if reader.reasoning is not None:
                message["reasoning_content"] = reader.thinking if done.has_reasoning else None
            if done.reported:  # every call the stream would have sent, cut off ones too
                message["tool_calls"] = [call.to_openai() for call in done.reported]
            finish = {"called_tools": done.called_tools, "cut_call": done.cut_call}
        logprobs = None
        if want_logprobs:
            logprobs = chat_logprobs(ctx.token_text, *final.logprobs())
        ending = finish_fields(final, **finish)
        if ctx.legacy_functions:
            message, ending = legacy_call(message), legacy_call(ending)
        choices.append({"index": index, "message": message, "logprobs": logprobs} | ending)
    return envelope(ctx, "chat.completion", choices) | {"usage": usage(finals, ctx.n)}
