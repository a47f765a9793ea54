"""The output items of one response, built as the generated text arrives, with the stream
events that announce them.

``OutputBuilder`` takes the generation already split into reasoning text, answer text and tool
calls, and keeps ``items`` (the response's ``output``) and ``events`` (Responses stream
events, without ``sequence_number``) in step, so a streamed response and a plain one have the
same output. Item by item:

- reasoning: ``output_item.added``, ``reasoning_text.delta``..., ``reasoning_text.done``,
  ``output_item.done``;
- message: ``output_item.added``, ``content_part.added``, ``output_text.delta``...,
  ``output_text.done``, ``content_part.done``, ``output_item.done``;
- function_call: ``output_item.added`` (call id and name), ``function_call_arguments.delta``...,
  ``function_call_arguments.done``, ``output_item.done``.

An item is closed when the next kind starts, a call ends, or the output ends. Whitespace
between tool calls opens no message. A call the parser drops (cut off, or not valid JSON)
keeps its place in the output with status "incomplete", so output indexes never move.
"""

from __future__ import annotations

import uuid
from typing import Any


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._pending_space = ""
        self.called_tools = False

    def take_events(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events

    def reasoning(self, delta: str) -> None:
        if not delta:
            return
        item = self._ensure("reasoning")
        part = item["content"][0]
        part["text"] += delta
        self._event("response.reasoning_text.delta", item, content_index=0, delta=delta)

    def text(self, delta: str, logprobs: list[dict[str, Any]] | None = None) -> None:
        if self._open is None or self._open["type"] != "message":
            if not delta.strip() and not logprobs:
                self._pending_space += delta
                return
            delta, self._pending_space = self._pending_space + delta, ""
        item = self._ensure("message")
        part = item["content"][0]
        part["text"] += delta
        if logprobs:
            part.setdefault("logprobs", []).extend(logprobs)
        self._event(
            "response.output_text.delta",
            item,
            content_index=0,
            delta=delta,
            logprobs=logprobs or [],
        )

    def call_start(self, call_id: str, name: str) -> None:
        self._close()
        self._pending_space = ""
        self.called_tools = True
        item = {
            "type": "function_call",
            "id": new_id("fc"),
            "call_id": call_id,
            "name": name,
            "arguments": "",
            "status": "in_progress",
        }
        self._add(item)

    def call_arguments(self, fragment: str) -> None:
        item = self._open
        assert item is not None and item["type"] == "function_call", "no call is open"
        if fragment:
            item["arguments"] += fragment
            self._event("response.function_call_arguments.delta", item, delta=fragment)

    def call_end(self, status: str) -> None:
        """Close the open call: "completed", or "incomplete" for a call that will never be
        whole (cut off, or not valid JSON); it stays in the output with that status."""
        item = self._open
        assert item is not None and item["type"] == "function_call", "no call is open"
        self._close(status)

    def finish(self, status: str = "completed") -> None:
        """Close the open item (``status`` "incomplete" when the output was cut short). An
        output with no item at all gets one message, possibly empty."""
        if not self.items:
            self._ensure("message")
            self._open_pending_text()
        self._close(status)

    def _open_pending_text(self) -> None:
        if self._pending_space and self._open is not None:
            self._open["content"][0]["text"] += self._pending_space
            self._event(
                "response.output_text.delta",
                self._open,
                content_index=0,
                delta=self._pending_space,
                logprobs=[],
            )
            self._pending_space = ""

    def _ensure(self, kind: str) -> dict[str, Any]:
        if self._open is not None and self._open["type"] == kind:
            return self._open
        self._close()
        item: dict[str, Any]
        if kind == "reasoning":
            item = {
                "type": "reasoning",
                "id": new_id("rs"),
                "summary": [],
                "content": [{"type": "reasoning_text", "text": ""}],
                "status": "in_progress",
            }
            self._add(item)
            return item
        item = {
            "type": "message",
            "id": new_id("msg"),
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self._add(item)
        part = {"type": "output_text", "text": "", "annotations": []}
        item["content"].append(part)
        self._event("response.content_part.added", item, content_index=0, part=dict(part))
        return item

    def _add(self, item: dict[str, Any]) -> None:
        self.items.append(item)
        self._open = item
        self._event("response.output_item.added", None, item=_snapshot(item))

    def _close(self, status: str = "completed") -> None:
        item, self._open = self._open, None
        if item is None:
            return
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            self._event(
                "response.output_text.done",
                item,
                content_index=0,
                text=part["text"],
                logprobs=part.get("logprobs", []),
            )
            self._event("response.content_part.done", item, content_index=0, part=dict(part))
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            self._event("response.reasoning_text.done", item, content_index=0, text=text)
        else:
            self._event(
                "response.function_call_arguments.done",
                item,
                name=item["name"],
                arguments=item["arguments"],
            )
        self._event("response.output_item.done", None, item=_snapshot(item))

    def _event(self, kind: str, of: dict[str, Any] | None, **fields: Any) -> None:
        """Record an event about the last item (``of``: the item, for events naming it)."""
        event: dict[str, Any] = {"type": kind, "output_index": len(self.items) - 1}
        if of is not None:
            event["item_id"] = of["id"]
        event.update(fields)
        self.events.append(event)


def _snapshot(item: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``item`` as it stands (events must not change once sent)."""
    copy = dict(item)
    if "content" in copy:
        copy["content"] = [dict(part) for part in copy["content"]]
    return copy
