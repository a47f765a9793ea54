"""What the interpreter needs from a model server: generate, score choices, and a chat template."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

from frontend_lang.chat import ChatTemplate
from runtime.dsl_api import HEAL_WINDOW as HEAL_WINDOW


class BackendError(RuntimeError):
    """The backend refused or failed a call; the message is the server's (or the client's)."""


class ProgramsUnsupported(BackendError):
    """The server cannot run compiled programs (an older server, another engine): the
    program goes on interpreted."""


# Called with each new piece of text as a generation streams.
OnDelta = Callable[[str], None]


@dataclass(frozen=True)
class Prompt:
    """The state a call continues: its full text, and the same as chat messages (for backends
    that take messages). ``open_role`` is the role block the call sits in, if any, whose
    content so far is ``open_content``."""

    text: str
    messages: list[dict[str, str]] = field(default_factory=list)
    open_role: str | None = None
    open_content: str = ""

    @property
    def uses_roles(self) -> bool:
        return bool(self.messages) or self.open_role is not None


@dataclass(frozen=True)
class GenOutput:
    """Generated text and the runtime's meta info (prompt_tokens, completion_tokens,
    cached_tokens, finish_reason where the backend reports them)."""

    text: str
    meta: dict[str, Any]

    @property
    def finish_type(self) -> str | None:
        """How the output ended ("stop", "length", "abort"), where the backend reports it."""
        reason = self.meta.get("finish_reason")
        return reason.get("type") if isinstance(reason, dict) else None


@dataclass(frozen=True)
class ChoiceLogprobs:
    """Prompt logprobs of ``prefix + choice`` for each choice, over a window at the end of the
    prefix so that token healing can move the boundary.

    ``prefix_tokens``: the prefix's own tokens from the window's start (ids, or token strings
    where a backend has no ids). ``choice_tokens[i]``: the tokens of ``prefix + choices[i]``
    from the same start; ``choice_logprobs[i][j]`` is the logprob of ``choice_tokens[i][j]``.
    The window starts at the same token position for the prefix and every choice.
    """

    prefix_tokens: list[Hashable]
    choice_tokens: list[list[Hashable]]
    choice_logprobs: list[list[float]]
    meta: list[dict[str, Any]]


class Backend(ABC):
    """A model server as the DSL sees it. Implementations are safe to call from many threads
    at once (fork branches and run_batch call concurrently)."""

    @property
    @abstractmethod
    def chat_template(self) -> ChatTemplate:
        """How role blocks are rendered as text for this model."""

    @abstractmethod
    def generate(
        self, prompt: Prompt, sampling_params: dict[str, Any], on_delta: OnDelta | None = None
    ) -> GenOutput:
        """Continue ``prompt`` under ``sampling_params`` (the runtime's native names).

        With ``on_delta`` the output is streamed: it is called with each new piece of text, in
        order, and the pieces concatenate to the returned text. Raises BackendError."""

    @abstractmethod
    def choice_logprobs(self, prompt: Prompt, choices: list[str]) -> ChoiceLogprobs:
        """Score every ``prompt.text + choice`` in one batched call that reuses the cached
        prefix. Raises BackendError (with the reason) where the server cannot score prompts."""

    @abstractmethod
    def unconditional_logprobs(self, choices: list[str]) -> list[list[float]]:
        """Logprobs of each choice's tokens with no prefix (after BOS where the model has one)."""

    @property
    def supports_programs(self) -> bool:
        """Whether ``run_program`` works: programs then run compiled by default."""
        return False

    def run_program(self, request: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Run a segment of a compiled program next to the runtime's KV cache: the request and
        the events are ``runtime/program``'s (``POST /program``). Raises BackendError, or
        ProgramsUnsupported where the server has no compiled execution."""
        raise ProgramsUnsupported(f"{type(self).__name__} does not run compiled programs")

    def end_program(self, program_id: str) -> None:  # noqa: B027 - optional hook
        """Release what a compiled program holds in the runtime (its pinned KV)."""

    def cache_prefix(self, prompt: Prompt) -> None:  # noqa: B027 - optional hook
        """Prefill ``prompt`` so that calls continuing it (fork branches) hit the cache."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release what the backend holds (an in-process engine, HTTP connections)."""
