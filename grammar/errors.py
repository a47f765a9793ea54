"""The errors a grammar request can end with. All are ``ValueError``s: the request was wrong.

At the API edge each becomes an HTTP 400 carrying ``str(error)``; in ``Engine.generate`` it is
raised as is. Only the request that asked for the grammar fails.
"""

from __future__ import annotations


class GrammarError(ValueError):
    """A constraint that cannot be compiled or enforced as asked; the message says why."""


class UnsupportedSchemaFeature(GrammarError):
    """A JSON-schema keyword the backend would drop or weaken, so output could break the schema.

    ``keyword`` is the keyword, ``pointer`` the JSON pointer of the subschema holding it
    ("" for the root). Requests may opt into best-effort compilation to accept the weakening.
    """

    def __init__(self, keyword: str, pointer: str, reason: str) -> None:
        location = f"{pointer}/{keyword}" if pointer or keyword else "/"
        super().__init__(
            f"unsupported JSON schema feature '{keyword}' at {location}: {reason} "
            "(strict_mode 'validate' enforces the rest and validates each output; "
            "grammar_best_effort compiles it anyway without this guarantee)"
        )
        self.keyword = keyword
        self.pointer = pointer
        self.reason = reason


class GrammarCompileTimeout(GrammarError):
    """Compiling the grammar took longer than the configured compile timeout."""

    def __init__(self, kind: str, seconds: float) -> None:
        super().__init__(
            f"compiling the {kind} grammar took longer than {seconds:g} s; "
            "simplify the constraint (long bounded repetitions and large maxLength are costly)"
        )
        self.seconds = seconds
