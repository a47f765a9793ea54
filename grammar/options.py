"""Per-request compile options (part of the compile-cache key)."""

from __future__ import annotations

from dataclasses import dataclass

from grammar.errors import GrammarError


@dataclass(frozen=True)
class GrammarOptions:
    """How to compile. best_effort: compile JSON schemas with unenforceable features anyway
    (their output may then violate the schema). max_whitespace: 0 for compact JSON (separators
    "," and ":", no whitespace), N > 0 for ", " / ": " and whitespace runs of at most N."""

    best_effort: bool = False
    max_whitespace: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.max_whitespace, int) or self.max_whitespace < 0:
            raise GrammarError(f"max_whitespace must be an integer >= 0, got {self.max_whitespace}")
