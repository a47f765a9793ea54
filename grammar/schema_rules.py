"""The grammar rules we write ourselves, and the placeholders that stand for them in a schema.

``lower_schema`` replaces what the backend would get wrong with placeholders: a string's content
becomes the pattern ``^ARBORSTRING<i>$`` and a whole value the constant ``"ARBORVALUE<i>"``; the
backend's converter prints them unchanged, and ``json_grammar.splice_rules`` swaps in rule ``i``
of the list that lowering returned.
"""

from __future__ import annotations

from dataclasses import dataclass

STRING_PLACEHOLDER = "ARBORSTRING"
VALUE_PLACEHOLDER = "ARBORVALUE"


@dataclass(frozen=True)
class StringRule:
    """What may stand between the quotes of one placeholder string: ``regex`` (over the
    JSON-escaped text) when set; else ``ebnf`` (rules over the escaped text, start rule
    ``root``, renamed when spliced) when set; otherwise ``min_length`` to ``max_length``
    (None: unbounded) characters that need no escaping."""

    regex: str | None = None
    min_length: int = 0
    max_length: int | None = None
    ebnf: str | None = None


@dataclass(frozen=True)
class ValueRule:
    """A whole JSON value: ``ebnf`` rules with start rule ``root`` (renamed when spliced) in
    which ``arbor_ws`` stands for the whitespace allowed between tokens."""

    ebnf: str


Rule = StringRule | ValueRule


def string_placeholder(rules: list[Rule], rule: StringRule) -> str:
    """The ``pattern`` that stands for ``rule`` (appended to ``rules``)."""
    rules.append(rule)
    return f"^{STRING_PLACEHOLDER}{len(rules) - 1}$"


def value_placeholder(rules: list[Rule], rule: ValueRule) -> str:
    """The ``const`` that stands for ``rule`` (appended to ``rules``)."""
    rules.append(rule)
    return f"{VALUE_PLACEHOLDER}{len(rules) - 1}"
