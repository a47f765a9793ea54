"""Tool calls in chat: the constraint for ``tool_choice`` and the parser of the model's output.

The chat template writes a call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(see ``runtime/test_model/tokenizer.py``); the model is expected to answer in kind. With
``tool_choice`` "required" or a named function the output is constrained by grammar to such
blocks (the ``structural_tag`` sampling parameter); with "auto" it is free and any well-formed
block naming one of the tools becomes a tool call while everything else stays content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_BEGIN = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry; ``index`` is set in streamed deltas."""
        call: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def tool_call_constraint(
    tools: list[dict[str, Any]], mode: str, name: str | None = None, parallel: bool = True
) -> dict[str, Any]:
    """The ``structural_tag`` sampling parameter for tool_choice "required" (any of ``tools``)
    or "named" (only ``name``): blocks whose arguments validate against the tool's parameters
    schema — one or more with ``parallel``, exactly one without. ``tools`` are OpenAI function
    definitions ``{"name", "parameters", ...}``."""
    return {
        "tools": [
            {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object"}}
            for tool in tools
        ],
        "mode": mode,
        "name": name,
        "parallel": parallel,
    }


class ToolCallParser:
    """Splits generated text, fed in pieces, into content and tool calls.

    ``feed`` returns content strings and ToolCalls in output order. Text that may be the start
    of a ``<tool_call>`` tag, or an unterminated block, is held back until it is decided;
    ``finish`` releases what is left as content. A block that is not a JSON object with a
    string "name" among ``tool_names`` and an object "arguments" stays content. At most
    ``max_calls`` calls are returned (later well-formed blocks are dropped).
    """

    def __init__(self, tool_names: set[str], max_calls: int | None = None) -> None:
        self.tool_names = tool_names
        self.max_calls = max_calls
        self.num_calls = 0
        self._buffer = ""

    def feed(self, text: str) -> list[str | ToolCall]:
        self._buffer += text
        events: list[str | ToolCall] = []
        while True:
            start = self._buffer.find(TOOL_CALL_BEGIN)
            if start < 0:
                keep = _partial_tag_len(self._buffer, TOOL_CALL_BEGIN)
                ready = self._buffer[: len(self._buffer) - keep]
                if ready:
                    events.append(ready)
                self._buffer = self._buffer[len(ready) :]
                return events
            if start > 0:
                events.append(self._buffer[:start])
                self._buffer = self._buffer[start:]
            end = self._buffer.find(TOOL_CALL_END)
            if end < 0:
                return events
            block = self._buffer[: end + len(TOOL_CALL_END)]
            self._buffer = self._buffer[len(block) :]
            call = self._parse(block[len(TOOL_CALL_BEGIN) : -len(TOOL_CALL_END)])
            if call is None:
                events.append(block)
            elif self.max_calls is None or self.num_calls < self.max_calls:
                self.num_calls += 1
                events.append(call)

    def finish(self) -> list[str | ToolCall]:
        rest, self._buffer = self._buffer, ""
        return [rest] if rest else []

    def _parse(self, body: str) -> ToolCall | None:
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self.tool_names:
            return None
        arguments = value.get("arguments")
        if not isinstance(arguments, dict):
            return None
        return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def parse_tool_calls(
    text: str, tool_names: set[str], max_calls: int | None = None
) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a whole output. Content is None when only calls remain."""
    parser = ToolCallParser(tool_names, max_calls)
    events = parser.feed(text) + parser.finish()
    calls = [e for e in events if isinstance(e, ToolCall)]
    content = "".join(e for e in events if isinstance(e, str))
    if calls:
        return (content.strip() or None), calls
    return content, calls


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
