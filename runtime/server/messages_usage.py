"""Anthropic's three input counts of a Messages ``usage``, as Anthropic counts them.

A prompt's tokens are split at the last ``cache_control`` breakpoint (the end of the last
marked tool, system block or content block; 0 without one) and at what the radix cache held:

- ``cache_read_input_tokens``: prompt tokens read from the cache;
- ``cache_creation_input_tokens``: tokens up to the breakpoint that this request wrote to the
  cache (the part of that prefix it did not read);
- ``input_tokens``: the rest (after the breakpoint, and not read).

The three add up to the prompt. Every prompt goes into the radix cache as its request ends,
marked or not; only the part a client marked counts as written, which is what Anthropic bills
and what a client that reads the counts expects.

Where the breakpoint falls in tokens is read off the rendered prompt: each marked part's text
(a text block's text, a tool's description or name, a tool call's name, a tool result's text)
is found in the prompt's text, in the order Anthropic reads them (tools anywhere; system
blocks and messages in order), and the tokens that end before it are counted with the
tokenizer's offsets. A marked part without text (an image) marks nothing of its own.
"""

from __future__ import annotations

from typing import Any

from runtime.server.messages_protocol import (
    PromptRequest,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)


def split_usage(prompt_tokens: int, cached_tokens: int, breakpoint_tokens: int) -> dict[str, int]:
    """The three input counts (module doc) of a prompt of ``prompt_tokens`` tokens, of which
    the cache held the first ``cached_tokens``, marked up to ``breakpoint_tokens``."""
    created = max(0, min(breakpoint_tokens, prompt_tokens) - cached_tokens)
    return {
        "input_tokens": prompt_tokens - cached_tokens - created,
        "cache_read_input_tokens": cached_tokens,
        "cache_creation_input_tokens": created,
    }


def breakpoint_tokens(body: PromptRequest, text: str, num_tokens: int, tokenizer: Any) -> int:
    """Tokens of the rendered prompt (``text``, ``num_tokens`` long) up to the end of the last
    ``cache_control`` breakpoint of ``body`` (0: none found)."""
    end = _breakpoint_char(body, text)
    if end == 0:
        return 0
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        count = sum(1 for _, stop in encoded["offset_mapping"] if stop <= end)
    except NotImplementedError:  # a slow tokenizer has no offsets: count the prefix alone
        count = len(tokenizer(text[:end], add_special_tokens=False)["input_ids"])
    return min(count, num_tokens)


def _breakpoint_char(body: PromptRequest, text: str) -> int:
    """Where in ``text`` the last marked part ends (0: nothing marked, or not found)."""
    end = 0
    for tool in body.tools or []:  # a template writes the tools wherever it likes
        if tool.cache_control is not None:
            end = max(end, _end_of(text, tool.description or tool.name, 0))
    cursor = 0
    for needle, marked in _flow(body):
        found = _end_of(text, needle, cursor) if needle else 0
        if found:
            cursor = found
        if marked and found:
            end = max(end, found)
    return end


def _end_of(text: str, needle: str, start: int) -> int:
    at = text.find(needle, start)
    return at + len(needle) if at >= 0 else 0


def _flow(body: PromptRequest) -> list[tuple[str, bool]]:
    """``(text, marked)`` for each system block and content block, in prompt order."""
    parts: list[tuple[str, bool]] = []
    if isinstance(body.system, str):
        parts.append((body.system, False))
    else:
        parts += [(block.text, block.cache_control is not None) for block in body.system or []]
    for message in body.messages:
        if isinstance(message.content, str):
            parts.append((message.content, False))
            continue
        for block in message.content:
            marked = getattr(block, "cache_control", None) is not None
            if isinstance(block, TextBlock):
                parts.append((block.text, marked))
            elif isinstance(block, ToolUseBlock):
                parts.append((block.name, marked))
            elif isinstance(block, ToolResultBlock):
                parts += _result_parts(block, marked)
            else:
                parts.append(("", marked))
    return parts


def _result_parts(block: ToolResultBlock, marked: bool) -> list[tuple[str, bool]]:
    if isinstance(block.content, str):
        return [(block.content, marked)]
    parts = [
        (getattr(part, "text", ""), getattr(part, "cache_control", None) is not None)
        for part in block.content or []
    ]
    if marked:  # the block's mark ends with its last part
        parts[-1:] = [(parts[-1][0] if parts else "", True)]
    return parts
