"""``minLength`` / ``maxLength`` / ``format`` beside ``pattern``, made exact.

xgrammar 0.2.8 keeps a pattern and drops the lengths or the format beside it. We enforce the
combination, from cheapest to most general:

- the lengths are implied: every string the pattern fullmatches already has an allowed length
  (``"^[A-Z]{2}$"`` with ``maxLength: 2``): the lengths are dropped;
- the pattern is one repeated character class (``"^[a-z0-9-]+$"`` with ``maxLength: 63``):
  the repetition takes the bounds (``^[a-z0-9-]{1,63}$``), since each repetition is one
  character;
- a ``format`` we write as a pattern (``date``, ``date-time``, ``time``, ``ipv4``) beside a
  pattern: when one language contains the other, the smaller one alone is exact;
- otherwise the automata of the patterns (the user's, the format's) are intersected with a
  length counter (``string_rule_ebnf``), and the product, written as one EBNF rule per state,
  replaces the string's grammar. Products beyond ``MAX_STRING_STATES`` are refused by the
  checker (their compile would cost seconds at a 150k vocabulary).

Patterns are generated with fullmatch semantics (``grammar.regex``), so lengths are measured
on the strings the pattern fullmatches. Every automaton is built with a state bound
(``grammar.regex_automaton``), so a pattern whose automaton explodes is refused, not built.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from grammar.automaton import (
    AutomatonTooLarge,
    Dfa,
    included,
    intersection,
    to_ebnf,
    with_lengths,
)
from grammar.errors import GrammarError
from grammar.regex_automaton import PatternUnsupported, anchored_end, any_string_dfa, pattern_dfa
from grammar.schema_formats import FORMAT_PATTERNS

# The largest automaton written as rules for one string. Compile cost measured on xgrammar
# 0.2.8: about 0.16 ms per state at a 4k vocabulary, 4 ms at 150k.
MAX_STRING_STATES = 512
# One repeated atom: a class, an escape class or a dot, with + or *, optionally anchored.
_ONE_REPEATED_CLASS = re.compile(r"^\^(\[(?:\\.|[^\]\\])+\]|\\[dwsDWS]|\.)([+*])\$$")


class StringTooComplex(ValueError):
    """The string's automaton cannot be built within the bounds (the reason says why)."""


def fold_lengths_into_pattern(sub: dict[str, Any]) -> None:
    """Drop or fold ``sub``'s minLength/maxLength where ``pattern`` can carry them exactly."""
    pattern = sub.get("pattern")
    if not isinstance(pattern, str) or not ("minLength" in sub or "maxLength" in sub):
        return
    if not (pattern.startswith("^") and anchored_end(pattern)):
        return  # a search, not a whole match: the automaton keeps its meaning
    low = sub.get("minLength", 0)
    high = sub.get("maxLength")
    if not isinstance(low, int) or not (high is None or isinstance(high, int)):
        return
    try:
        shortest, longest = _length_range(pattern_automaton(pattern))
    except (GrammarError, StringTooComplex):
        return
    if shortest is None:
        return
    if shortest >= low and (high is None or (longest is not None and longest <= high)):
        sub.pop("minLength", None)
        sub.pop("maxLength", None)
        return
    match = _ONE_REPEATED_CLASS.match(pattern)
    if match is None:
        return
    atom, repeat = match.groups()
    low = max(low, 1 if repeat == "+" else 0)
    if high is not None and low > high:
        return  # the checker reports the empty range
    sub["pattern"] = f"^{atom}{{{low},{'' if high is None else high}}}$"
    sub.pop("minLength", None)
    sub.pop("maxLength", None)


def fold_format_into_pattern(sub: dict[str, Any]) -> None:
    """Keep only the smaller of ``format`` and ``pattern`` when one contains the other."""
    pattern, name = sub.get("pattern"), sub.get("format")
    if not isinstance(pattern, str) or name not in FORMAT_PATTERNS:
        return
    try:
        mine, theirs = pattern_automaton(FORMAT_PATTERNS[name]), pattern_automaton(pattern)
    except (GrammarError, StringTooComplex):
        return
    if included(mine, theirs):
        del sub["pattern"]  # every formatted string matches the pattern
    elif included(theirs, mine):
        del sub["format"]  # every string of the pattern is well formatted


def string_patterns(sub: dict[str, Any]) -> list[str]:
    """The patterns a string subschema's value must fullmatch: its ``pattern`` and the pattern
    of a ``format`` we write as one."""
    found = [sub["pattern"]] if isinstance(sub.get("pattern"), str) else []
    if sub.get("format") in FORMAT_PATTERNS:
        found.append(FORMAT_PATTERNS[sub["format"]])
    return found


def string_rule_ebnf(patterns: tuple[str, ...], low: int, high: int | None) -> str:
    """EBNF rules (start ``root``) for the JSON-escaped text of the strings that fullmatch every
    pattern and have ``low`` to ``high`` characters (high None: unbounded). Raises
    StringTooComplex beyond the bounds, GrammarError when no string qualifies or a pattern is
    invalid."""
    return to_ebnf(string_dfa(patterns, low, high), json_string=True)


@functools.lru_cache(maxsize=256)
def string_dfa(patterns: tuple[str, ...], low: int, high: int | None) -> Dfa:
    """The automaton behind ``string_rule_ebnf`` (cached: the checker and the lowering both
    ask for it)."""
    try:
        dfa = any_string_dfa()
        for pattern in patterns:
            dfa = intersection(dfa, pattern_automaton(pattern, search=True), MAX_STRING_STATES)
        if low > 0 or high is not None:
            dfa = with_lengths(dfa, low, high, MAX_STRING_STATES)
    except AutomatonTooLarge:
        raise StringTooComplex(
            f"its automaton exceeds {MAX_STRING_STATES} states; shorten maxLength or simplify "
            "the pattern"
        ) from None
    if not dfa.finals:
        raise GrammarError("no string satisfies its pattern, format and lengths together")
    return dfa


@functools.lru_cache(maxsize=256)
def pattern_automaton(pattern: str, search: bool = False, wide: bool = False) -> Dfa:
    """The automaton of the strings ``pattern`` fullmatches (or, with ``search``, matches as
    JSON Schema's ``pattern`` does; ``wide``: a superset, see ``pattern_dfa``);
    StringTooComplex when it has none here."""
    try:
        return pattern_dfa(pattern, MAX_STRING_STATES, search, wide)
    except AutomatonTooLarge:
        raise StringTooComplex(
            f"the automaton of pattern {pattern!r} exceeds {MAX_STRING_STATES} states"
        ) from None
    except PatternUnsupported:
        raise StringTooComplex(f"pattern {pattern!r} has no automaton here") from None


def _length_range(dfa: Dfa) -> tuple[int | None, int | None]:
    """(shortest, longest) lengths of the strings ``dfa`` accepts (trimmed: every state is on
    a path to a final one); longest None when unbounded; (None, None) when there are none."""
    if not dfa.finals:
        return None, None
    edges = [{target for _, target in out} for out in dfa.edges]
    frontier, seen, depth = {0}, {0}, 0
    while not frontier & dfa.finals:
        frontier = {t for s in frontier for t in edges[s]} - seen
        seen |= frontier
        depth += 1
    shortest = depth
    # Longest path in an acyclic automaton (a cycle means unbounded), in topological order.
    indegree = [0] * dfa.size
    for targets in edges:
        for target in targets:
            indegree[target] += 1
    order, ready = [], [s for s in range(dfa.size) if indegree[s] == 0]
    while ready:
        state = ready.pop()
        order.append(state)
        for target in edges[state]:
            indegree[target] -= 1
            if indegree[target] == 0:
                ready.append(target)
    if len(order) < dfa.size:
        return shortest, None
    longest = [-1] * dfa.size
    for state in reversed(order):
        tails = [longest[t] + 1 for t in edges[state] if longest[t] >= 0]
        longest[state] = max(tails + ([0] if state in dfa.finals else []), default=-1)
    return shortest, longest[0]
