"""The events a compiled program's segment yields, in order per branch: ``ProgramStarted``
first, ``ProgramDone`` last. ``to_dict`` is an event's JSON (``POST /program``,
``Engine.run_program``): ``{"type": KIND, **fields}``."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar


@dataclass
class ProgramEvent:
    KIND: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.KIND, **asdict(self)}


@dataclass
class ProgramStarted(ProgramEvent):
    KIND = "program"
    program_id: str


@dataclass
class GenDelta(ProgramEvent):
    """Streaming: a gen's new text; ``completion_tokens``: its output tokens so far."""

    KIND = "delta"
    branch: str
    text: str
    completion_tokens: int


@dataclass
class GenDone(ProgramEvent):
    KIND = "gen"
    branch: str
    name: str | None
    text: str
    meta_info: dict[str, Any]


@dataclass
class SelectDone(ProgramEvent):
    """The choice picked, and the scores it was picked by (``unconditional``: None unless the
    method needs them); ``meta``: prompt and cached tokens of each choice's request."""

    KIND = "select"
    branch: str
    name: str | None
    choice: str
    prefix_tokens: list[int]
    choice_tokens: list[list[int]]
    choice_logprobs: list[list[float]]
    meta: list[dict[str, int]]
    unconditional: list[list[float]] | None
    reused_tokens: int
    reencoded_tokens: int


@dataclass
class OpFailed(ProgramEvent):
    """An op failed (``status``: its HTTP status); its branch stops there."""

    KIND = "error"
    branch: str
    name: str | None
    status: int
    message: str


@dataclass
class ProgramStats:
    """A program's requests and their tokens so far (``reused_tokens``: tokens of a prompt kept
    from the branch; ``reencoded_tokens``: tokens its new text was encoded into)."""

    requests: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    reencoded_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class ProgramDone(ProgramEvent):
    KIND = "done"
    program_id: str
    meta_info: ProgramStats
