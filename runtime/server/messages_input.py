"""A Messages API conversation as chat messages for the chat template.

``system`` (a string or text blocks) becomes the system message. A user turn's
``tool_result`` blocks become ``tool`` messages (in order, before the turn's text, which
follows as a user message); an assistant turn's text becomes its content, its ``tool_use``
blocks its ``tool_calls`` (the input as JSON text) and its ``thinking`` blocks its
``reasoning_content`` (which reasoning templates render for the turns after the last user
query, so a tool loop keeps its thinking; ``redacted_thinking`` is dropped). Text blocks of
one turn are joined with newlines. Every refusal is an ApiError 400 naming the block:
image/document and server-tool blocks, a block in the wrong role's turn, a ``tool_result``
whose ``tool_use_id`` names no earlier ``tool_use``, and thinking blocks without a reasoning
parser. A conversation that ends with an assistant turn is a prefill the reply continues
(``runtime.chat.continuation``); as Anthropic does, its text may not end with whitespace.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from runtime.server.errors import ApiError
from runtime.server.messages_protocol import (
    ContentBlock,
    Message,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    UnsupportedBlock,
)

_USER_BLOCKS = (TextBlock, ToolResultBlock)
_ASSISTANT_BLOCKS = (TextBlock, ToolUseBlock, ThinkingBlock, RedactedThinkingBlock)


# (tool_use id, input) -> the input as JSON text (the model's own spelling where it is known).
ArgumentsText = Callable[[str, dict[str, Any]], str]


def chat_messages(
    system: str | list[TextBlock] | None,
    messages: list[Message],
    reasoning: bool,
    arguments_text: ArgumentsText,
) -> list[dict[str, Any]]:
    """The chat messages of ``system`` + ``messages``; ``reasoning``: a reasoning parser is on
    (thinking blocks are read)."""
    chat: list[dict[str, Any]] = []
    if system:
        text = system if isinstance(system, str) else _joined(system)
        chat.append({"role": "system", "content": text})
    call_ids: set[str] = set()
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if message.role == "user":
            chat += _user_turn(message, where, call_ids)
        else:
            chat.append(_assistant_turn(message, where, call_ids, reasoning, arguments_text))
    final = chat[-1]
    if final["role"] == "assistant" and final["content"] != final["content"].rstrip():
        at = f"messages.{len(messages) - 1}"
        reason = f"{at}: final assistant content cannot end with trailing whitespace"
        raise ApiError(400, reason, param=at)
    return chat


def _user_turn(message: Message, where: str, call_ids: set[str]) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    turns: list[dict[str, Any]] = []
    texts: list[TextBlock] = []
    for at, block in _blocks(message, where, _USER_BLOCKS):
        if isinstance(block, TextBlock):
            texts.append(block)
        elif isinstance(block, ToolResultBlock):
            if block.tool_use_id not in call_ids:
                raise ApiError(
                    400,
                    f"{at}.tool_use_id: no earlier tool_use has the id {block.tool_use_id!r}",
                    param=f"{at}.tool_use_id",
                )
            turns.append(_tool_message(block, at))
    if texts or not turns:
        turns.append({"role": "user", "content": _joined(texts)})
    return turns


def _assistant_turn(
    message: Message,
    where: str,
    call_ids: set[str],
    reasoning: bool,
    arguments_text: ArgumentsText,
) -> dict[str, Any]:
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    texts: list[TextBlock] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for at, block in _blocks(message, where, _ASSISTANT_BLOCKS):
        if isinstance(block, TextBlock):
            texts.append(block)
        elif isinstance(block, ToolUseBlock):
            call_ids.add(block.id)
            arguments = arguments_text(block.id, block.input)
            function = {"name": block.name, "arguments": arguments}
            calls.append({"id": block.id, "type": "function", "function": function})
        elif not reasoning:
            raise ApiError(
                400,
                f"{at}: {block.type} blocks need a server started with --reasoning-parser",
                param=at,
            )
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
    turn: dict[str, Any] = {"role": "assistant", "content": _joined(texts)}
    if calls:
        turn["tool_calls"] = calls
    if thinking:
        turn["reasoning_content"] = "\n".join(thinking)
    return turn


def _blocks(
    message: Message, where: str, allowed: tuple[type, ...]
) -> Iterator[tuple[str, ContentBlock]]:
    """(path, block) of each block of ``message`` (at ``where``); ApiError 400 for a block
    this server cannot read or that is not ``allowed`` in the message's role."""
    assert isinstance(message.content, list)
    for j, block in enumerate(message.content):
        at = f"{where}.content.{j}"
        if isinstance(block, UnsupportedBlock):
            raise ApiError(400, f"{at}: {block.type} blocks are not supported by this server", at)
        if not isinstance(block, allowed):
            role = message.role
            raise ApiError(400, f"{at}: a {role} message cannot hold {block.type} blocks", at)
        yield at, block


def _tool_message(block: ToolResultBlock, at: str) -> dict[str, Any]:
    content = block.content
    if isinstance(content, list):
        for k, part in enumerate(content):
            if isinstance(part, UnsupportedBlock):
                where = f"{at}.content.{k}"
                raise ApiError(
                    400, f"{where}: {part.type} blocks are not supported by this server", where
                )
        content = _joined([part for part in content if isinstance(part, TextBlock)])
    text = content or ""
    if block.is_error:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": text}


def _joined(blocks: list[TextBlock]) -> str:
    return "\n".join(block.text for block in blocks)
