"""Per-request compile options (part of the compile-cache key)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from grammar.errors import GrammarError

JSON_FORMATS = ("aligned", "compact")
# The largest whitespace run ``max_whitespace`` may ask for (the sampling params' bound).
MAX_WHITESPACE = 64
JsonLayout = int | Literal["aligned"]


@dataclass(frozen=True)
class GrammarOptions:
    """How to compile. best_effort: compile JSON schemas with unenforceable features anyway
    (their output may then violate the schema).

    The whitespace JSON output may hold: ``max_whitespace``, when given, as before this option
    existed: 0 for compact JSON (separators "," and ":", no whitespace), N > 0 for whitespace
    runs of at most N characters anywhere between tokens. Otherwise ``json_format``: "aligned"
    (the default) allows what a JSON pretty-printer writes (``grammar.json_layout``), "compact"
    no whitespace at all."""

    best_effort: bool = False
    max_whitespace: int | None = None
    json_format: str = "aligned"

    def __post_init__(self) -> None:
        if self.max_whitespace is not None and (
            not isinstance(self.max_whitespace, int)
            or isinstance(self.max_whitespace, bool)
            or not 0 <= self.max_whitespace <= MAX_WHITESPACE
        ):
            raise GrammarError(
                f"grammar_max_whitespace must be an integer from 0 to {MAX_WHITESPACE}, "
                f"got {self.max_whitespace!r}"
            )
        if self.json_format not in JSON_FORMATS:
            raise GrammarError(
                f"json_format must be one of {', '.join(JSON_FORMATS)}, got {self.json_format!r}"
            )

    @property
    def json_layout(self) -> JsonLayout:
        """What JSON grammars allow between tokens: "aligned", or the longest whitespace run
        (0: compact)."""
        if self.max_whitespace is not None:
            return self.max_whitespace
        return "aligned" if self.json_format == "aligned" else 0

    @property
    def whitespace_runs(self) -> int:
        """``max_whitespace`` as a number (unset: 0), for grammars that are not JSON layouts."""
        return self.max_whitespace or 0
