"""What the tool-call parser reports: finished calls and the events of a streamed output
(``runtime.chat.tool_calls`` has the contract)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object, as the model wrote it
    id: str = field(default_factory=new_call_id)

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry; ``index`` is set in streamed deltas."""
        call: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ToolCallStart:
    """A call to a known tool began: the ``index``-th call of the output (from 0)."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    """More of call ``index``'s arguments, as the model wrote them."""

    index: int
    fragment: str


@dataclass(frozen=True)
class ToolCallEnd:
    """Call ``index`` is complete and valid; ``call.arguments`` is its fragments joined."""

    index: int
    call: ToolCall


@dataclass(frozen=True)
class ToolCallDropped:
    """Call ``index`` started but will never end (cut off, or not valid JSON)."""

    index: int


# A str is content.
ToolCallEvent = str | ToolCallStart | ToolCallArguments | ToolCallEnd | ToolCallDropped
