"""The content blocks of one Messages API answer, built as the generated text arrives, with the
stream events that announce them.

``ContentBuilder`` takes the generation already split into thinking, answer text and tool
calls (``TurnReader``), and keeps ``content`` (the message's blocks) and ``events``
(``content_block_start``, ``content_block_delta``..., ``content_block_stop`` per block) in
step, so a streamed message and a plain one have the same content. Deltas: ``thinking_delta``
for thinking, ``text_delta`` for text, ``input_json_delta`` for a tool's input as the model
writes it. A block is closed when the next kind starts, a call ends, or the output ends.
Whitespace alone opens no text block (between calls, or before the first); it is kept for the
text that follows. A tool_use block's ``input`` is its JSON once the call is whole; a call
the parser drops (cut off by max_tokens) keeps its block, with ``input`` holding the members
its arguments had written whole (``runtime.chat.partial_json``), the fragments a stream sent.
"""

from __future__ import annotations

import json
from typing import Any

from runtime.chat.partial_json import complete_prefix_object


def tool_use_id(call_id: str) -> str:
    """The ``toolu_...`` id of the parser's ``call_...`` id (the same random part)."""
    return "toolu_" + call_id.removeprefix("call_")


class ContentBuilder:
    def __init__(self) -> None:
        self.content: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.called_tools = False  # a call completed
        self._open: dict[str, Any] | None = None
        self._arguments = ""  # of the open tool_use block
        self._pending_space = ""

    def take_events(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events

    def thinking(self, delta: str) -> None:
        if delta:
            block = self._ensure({"type": "thinking", "thinking": "", "signature": ""})
            block["thinking"] += delta
            self._delta({"type": "thinking_delta", "thinking": delta})

    def text(self, delta: str) -> None:
        if self._open is None or self._open["type"] != "text":
            if not delta.strip():
                self._pending_space += delta
                return
            delta, self._pending_space = self._pending_space + delta, ""
        block = self._ensure({"type": "text", "text": ""})
        block["text"] += delta
        self._delta({"type": "text_delta", "text": delta})

    def call_start(self, call_id: str, name: str) -> None:
        self._close()
        self._pending_space = ""
        self._ensure({"type": "tool_use", "id": tool_use_id(call_id), "name": name, "input": {}})

    def call_arguments(self, fragment: str) -> None:
        assert self._open is not None and self._open["type"] == "tool_use", "no call is open"
        if fragment:
            self._arguments += fragment
            self._delta({"type": "input_json_delta", "partial_json": fragment})

    def call_end(self, whole: bool) -> None:
        """Close the open call; ``whole``: its arguments are a complete JSON object."""
        block = self._open
        assert block is not None and block["type"] == "tool_use", "no call is open"
        if whole:
            block["input"] = json.loads(self._arguments)
            self.called_tools = True
        else:
            block["input"] = complete_prefix_object(self._arguments)
        self._close()

    def finish(self) -> None:
        """Close the open block; whitespace that opened none becomes text when there is no
        block at all."""
        if not self.content and self._pending_space:
            space, self._pending_space = self._pending_space, ""
            self._ensure({"type": "text", "text": ""})["text"] += space
            self._delta({"type": "text_delta", "text": space})
        self._close()

    def _ensure(self, block: dict[str, Any]) -> dict[str, Any]:
        """The open block if it is of ``block``'s type, else ``block`` opened."""
        if self._open is not None and self._open["type"] == block["type"]:
            return self._open
        self._close()
        self.content.append(block)
        self._open = block
        self._arguments = ""
        self.events.append(
            {"type": "content_block_start", "index": self._index, "content_block": dict(block)}
        )
        return block

    def _delta(self, delta: dict[str, Any]) -> None:
        self.events.append({"type": "content_block_delta", "index": self._index, "delta": delta})

    def _close(self) -> None:
        if self._open is not None:
            self._open = None
            self.events.append({"type": "content_block_stop", "index": self._index})

    @property
    def _index(self) -> int:
        return len(self.content) - 1
