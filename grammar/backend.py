"""The grammar backend interface: compile a spec once, match it per request, fill token masks.

Masks are packed int32 bitmasks in xgrammar's layout: token t of row r is allowed iff bit
``t % 32`` of ``bitmask[r, t // 32]`` is set; ``kernels.apply_token_bitmask`` applies them.
Matchers belong to the scheduler thread; ``GrammarBackend.compile`` may run on any thread.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grammar.errors import GrammarError
from grammar.spec import GrammarSpec


class GrammarMatcher(ABC):
    """One request's position in its grammar. Not thread-safe: one thread drives it."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (state unchanged) if the grammar forbids it.

        Accepting a stop token allowed by the grammar terminates the matcher.
        """

    @abstractmethod
    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 [N, W] on CPU).

        Precondition: not terminated. Stop tokens are allowed exactly where the grammar can end.
        """

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether a stop token was accepted: the request is finished."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (at most the number accepted)."""

    @abstractmethod
    def jump_forward_string(self) -> str:
        """The longest text every continuation starts with from here ("" if none)."""

    @abstractmethod
    def jump_forward_tokens(self, max_tokens: int) -> list[int]:
        """Draft token ids for the forced continuation; the state does not change.

        The draft is the tokenizer's encoding of ``jump_forward_string`` truncated to
        ``max_tokens`` and to the longest prefix this matcher accepts token by token, so
        ``accept_token`` succeeds on each in turn. [] if nothing is forced.
        """


@dataclass(frozen=True)
class LoweredGrammar:
    """A spec after the backend's own preparation (``payload``, backend-specific and picklable),
    ready for ``GrammarBackend.compile_lowered``: the costly and risky part of a compile done,
    so it can run in a sandbox process and only the backend's compile runs where it serves.
    ``notes``: what the request should be told about how its constraint was applied (a JSON
    layout it asked for that could not be applied)."""

    spec: GrammarSpec
    payload: Any = None
    notes: tuple[str, ...] = ()


class CompiledGrammar(ABC):
    """A spec compiled for one tokenizer; immutable, shareable across threads and requests."""

    spec: GrammarSpec

    @abstractmethod
    def new_matcher(self) -> GrammarMatcher:
        """A matcher at the grammar's start."""

    def admits_output(self, vocab_size: int) -> bool:
        """Whether any token (a stop token included) is allowed at the start: False for a
        grammar whose language is empty, which could never produce a valid output."""
        mask = allocate_bitmask(1, vocab_size)
        self.new_matcher().fill_mask(mask, 0)
        return bool(mask.any())

    @property
    @abstractmethod
    def memory_bytes(self) -> int:
        """Approximate memory held by the compiled grammar."""


class GrammarBackend(ABC):
    """Compiles specs for one tokenizer (vocab_size may exceed the tokenizer's length: padded
    model vocabularies; those ids are never allowed). Thread-safe ``compile``."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile ``spec``; raise GrammarError (naming the problem) if it cannot be."""

    def lower(self, spec: GrammarSpec) -> LoweredGrammar:
        """Everything of ``compile`` that can run apart from the serving process (schema
        lowering, regex analysis); GrammarError if the spec is invalid."""
        return LoweredGrammar(spec)

    def compile_lowered(self, lowered: LoweredGrammar) -> CompiledGrammar:
        """The rest of ``compile``: ``compile(spec) == compile_lowered(lower(spec))``."""
        return self.compile(lowered.spec)

    def fill_masks(
        self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]
    ) -> None:
        """``matchers[i].fill_mask(bitmask, rows[i])`` for all i (backends may parallelise)."""
        for matcher, row in zip(matchers, rows, strict=True):
            matcher.fill_mask(bitmask, row)

    def accept_tokens(
        self, matchers: Sequence[GrammarMatcher], tokens: Sequence[int]
    ) -> list[bool]:
        """``matchers[i].accept_token(tokens[i])`` for all i (backends may batch it). A refused
        token leaves its matcher as it was."""
        return [m.accept_token(t) for m, t in zip(matchers, tokens, strict=True)]


_BACKENDS: dict[str, type[GrammarBackend]] = {}
# The backends that ship with Arbor, by the module that registers each: imported when first
# asked for (``grammar`` itself imports none of them).
BUILTIN_BACKENDS = {"xgrammar": "grammar.xgrammar_backend"}


def register_backend(name: str) -> Callable[[type[GrammarBackend]], type[GrammarBackend]]:
    """Class decorator: make a GrammarBackend subclass available as ``name``."""

    def wrap(cls: type[GrammarBackend]) -> type[GrammarBackend]:
        _BACKENDS[name] = cls
        return cls

    return wrap


def create_backend(
    name: str, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], **kwargs: Any
) -> GrammarBackend:
    """The backend registered as ``name`` for this tokenizer; GrammarError if unknown."""
    if name not in _BACKENDS and name in BUILTIN_BACKENDS:
        importlib.import_module(BUILTIN_BACKENDS[name])
    if name not in _BACKENDS:
        known = sorted({*_BACKENDS, *BUILTIN_BACKENDS})
        raise GrammarError(f"unknown grammar backend {name!r}; available: {known}")
    return _BACKENDS[name](tokenizer, vocab_size, stop_token_ids, **kwargs)


def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """A CPU int32 bitmask [batch, ceil(vocab_size / 32)] with every token allowed."""
    return torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def allow_token(bitmask: torch.Tensor, row: int, token: int) -> None:
    """Set token ``token``'s bit in ``bitmask[row]`` (a filled CPU int32 bitmask), in place."""
    word = int(bitmask[row, token // 32]) | (1 << (token % 32))
    bitmask[row, token // 32] = word - (1 << 32) if word >= 1 << 31 else word
