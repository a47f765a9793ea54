"""Responses API input items as chat messages for the chat template, and output items as the
input items of the next turn.

Messages map one to one (``developer`` becomes ``system``; ``input_text`` / ``output_text``
parts are joined). A run of ``function_call`` items, with the assistant message just before
them, becomes one assistant message with ``tool_calls`` (parallel calls); a
``function_call_output`` becomes a ``tool`` message, and must answer a call made before it
(in the items or in the conversation they continue). Reasoning items are dropped: chat
templates of reasoning models strip earlier turns' thinking. ``item_reference`` items are
resolved through the response store.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from runtime.server.errors import ApiError

_ROLES = {"user", "system", "developer", "assistant"}
_TEXT_PARTS = {"input_text", "output_text", "text", "refusal"}


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's ``input`` as a list of items (a string is one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value)


def items_to_messages(
    items: list[dict[str, Any]],
    resolve: Callable[[str], dict[str, Any] | None],
    param: str = "input",
    earlier: Sequence[dict[str, Any]] = (),
) -> list[dict[str, Any]]:
    """Chat messages for ``items``; ApiError 400 naming ``{param}.{i}`` for a bad item.
    ``resolve`` finds a stored item by id (for ``item_reference``); ``earlier``: the chat
    messages of the conversation the items continue (the previous response's), whose calls
    a ``function_call_output`` may answer."""
    messages: list[dict[str, Any]] = []
    calls = {call["id"] for message in earlier for call in message.get("tool_calls") or ()}
    for i, item in enumerate(items):
        where = f"{param}.{i}"
        if not isinstance(item, dict):
            raise ApiError(400, f"{where}: an input item must be an object", param=where)
        if item.get("type") == "item_reference":
            ref = item.get("id")
            found = resolve(ref) if isinstance(ref, str) else None
            if found is None:
                raise ApiError(400, f"{where}: no stored item with id {ref!r}", param=where)
            item = found
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            _add_call(messages, item, where)
            calls.add(item["call_id"])
        elif kind == "function_call_output":
            messages.append(_call_output(item, where, calls))
        elif kind != "reasoning":
            raise ApiError(400, f"{where}: input items of type {kind!r} are not supported", where)
    return messages


def output_to_items(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as they would be sent back as input (no status fields)."""
    items = []
    for item in output:
        if item["type"] == "message":
            content = [
                {"type": "output_text", "text": part.get("text", "")} for part in item["content"]
            ]
            items.append({"type": "message", "role": "assistant", "content": content})
        elif item["type"] == "function_call":
            keys = ("type", "call_id", "name", "arguments")
            items.append({key: item[key] for key in keys})
    return items


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise ApiError(
            400, f"{where}.role: must be one of user, system, developer, assistant", f"{where}.role"
        )
    return {"role": "system" if role == "developer" else role, "content": _text(item, where)}


def _text(item: dict[str, Any], where: str) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(
            400, f"{where}.content: must be a string or a list of parts", f"{where}.content"
        )
    if not content:
        raise ApiError(400, f"{where}.content: the list of parts is empty", f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content.{j}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise ApiError(400, f"{at}: content parts of type {kind!r} are not supported", at)
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise ApiError(400, f"{at}: the part needs a string text", at)
        texts.append(text)
    return "".join(texts)


def _add_call(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise ApiError(
                400, f"{where}.{key}: a function_call needs a string {key}", f"{where}.{key}"
            )
    call = {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _call_output(item: dict[str, Any], where: str, calls: set[str]) -> dict[str, Any]:
    """A ``tool`` message; ``calls``: the ids of the calls made before it."""
    call_id = item.get("call_id")
    if not isinstance(call_id, str):
        raise ApiError(400, f"{where}.call_id: a function_call_output needs a call_id", where)
    output = item.get("output")
    if isinstance(output, list):
        output = _text({"content": output}, where) if output else ""
    if not isinstance(output, str):
        raise ApiError(400, f"{where}.output: must be a string or a list of text parts", where)
    if call_id not in calls:
        raise ApiError(
            400,
            f"{where}.call_id: no function_call with call_id {call_id!r} comes before this "
            "output, in the input or in the previous response",
            f"{where}.call_id",
        )
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}
