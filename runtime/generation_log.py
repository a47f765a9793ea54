"""What the generations of one API request added up to, for its trace span
(``runtime/server/tracing.py``).

The server sets a ``GenerationLog`` as the current one while it handles a traced request; every
generation the request runs (sub-requests, samples, validate-and-retry draws, a program's gens)
finishes in ``TokenizerManager.generate``, which adds its final output here. Tasks started while
handling the request copy the context, so they log to the same object. Nothing is set, and
nothing is logged, when tracing is off.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from dataclasses import dataclass, field

from runtime.ipc import TextOutput

_CURRENT: ContextVar[GenerationLog | None] = ContextVar("arbor_generation_log", default=None)


@dataclass
class GenerationLog:
    """Sums over the request's finished generations; ``ids`` their callers' request ids, and
    the phase times (``PhaseTimes``) summed too: they overlap for parallel generations."""

    generations: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    def add(self, out: TextOutput, label: str) -> None:
        """Take in a generation's final output (``label``: the id its caller knows)."""
        self.generations += 1
        self.prompt_tokens += out.prompt_tokens
        self.completion_tokens += out.completion_tokens
        self.cached_tokens += out.cached_tokens
        if out.finished_reason is not None:
            self.finish_reasons.append(out.finished_reason.type)
        self.ids.append(label)
        if out.times is not None:
            self.queue_s += out.times.queue_s
            self.prefill_s += out.times.prefill_s
            self.decode_s += out.times.decode_s


def current_generation_log() -> GenerationLog | None:
    """The log of the request being handled in this context (None: not traced)."""
    return _CURRENT.get()


def set_generation_log(log: GenerationLog | None) -> Token[GenerationLog | None]:
    """Make ``log`` current in this context; returns the token ``reset_generation_log`` takes."""
    return _CURRENT.set(log)


def reset_generation_log(token: Token[GenerationLog | None]) -> None:
    _CURRENT.reset(token)
