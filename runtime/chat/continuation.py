"""Continuing the conversation's final assistant message: Anthropic's prefill (the last message
is an assistant turn) and vLLM's ``continue_final_message``.

The prompt is the conversation as the chat template renders it, up to where the final
message's content starts, then that content verbatim: the template renders the conversation
with a marker for the final message's content (no generation prompt), and the text before the
marker is kept. This is exact for any template that writes a message's content as given; one
that changes it (drops, trims or escapes the marker) cannot be continued, a 400 naming
``messages``. What the template writes after the content (the turn's end) is never in the
prompt.

The prefill's tokens end the prompt and the output continues them: a constraint covers both
(the matcher takes the prefill first, the sampling param ``grammar_prefix_len``), and each API
returns the continuation alone. A prefill cannot be continued where the turn's tool choice
forces a call (the call's parser would not see the prefill's part of it), nor when the final
message holds tool calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from runtime.chat.turn_spec import TurnSpec
from runtime.errors import RequestError

# Stands for the final message's content while the conversation is rendered around it.
_CONTENT = "\u2063arbor-continued-content\u2063"


def prefill_text(messages: list[dict[str, Any]]) -> str:
    """The content the final message of ``messages`` (an assistant turn) continues."""
    return messages[-1].get("content") or ""


def check_continuable(spec: TurnSpec) -> None:
    """RequestError (a 400 naming ``messages``) when ``spec``'s final message cannot be
    continued: it is not an assistant turn, holds tool calls, or the tool choice forces a
    call."""
    final = spec.messages[-1] if spec.messages else {}
    at = f"messages.{len(spec.messages) - 1}"
    if final.get("role") != "assistant":
        raise RequestError(f"{at}: only a final assistant message can be continued", 400, at)
    if final.get("tool_calls"):
        raise RequestError(
            f"{at}: a final assistant message with tool calls cannot be continued", 400, at
        )
    if spec.tools_on and spec.tool_choice.forced:
        raise RequestError(
            f"{at}: a final assistant message cannot be continued when "
            f"{spec.param('tool_choice')} forces a tool call",
            400,
            at,
        )
    if not isinstance(final.get("content") or "", str):
        raise RequestError(f"{at}.content: must be text to be continued", 400, f"{at}.content")


def prompt_head(
    render: Callable[[list[dict[str, Any]]], str], messages: list[dict[str, Any]]
) -> str:
    """The prompt before the final message's content: ``messages`` rendered by ``render`` (the
    chat template, without a generation prompt) with a marker for that content, cut at the
    marker. RequestError naming ``messages`` when the template does not write the marker
    exactly once."""
    marked = [*messages[:-1], {**messages[-1], "content": _CONTENT}]
    text = render(marked)
    at = text.find(_CONTENT)
    if at < 0 or text.find(_CONTENT, at + 1) >= 0:
        raise RequestError(
            "messages: the chat template does not write the final assistant message's content "
            "as given, so it cannot be continued",
            400,
            "messages",
        )
    return text[:at]
