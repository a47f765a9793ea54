"""``minLength`` / ``maxLength`` / ``format`` beside ``pattern``, made exact where it is cheap.

xgrammar 0.2.8 keeps a pattern and drops the lengths beside it. Two common real-world shapes
are exact without intersecting automata:

- the lengths are implied: every string the pattern fullmatches already has an allowed length
  (``"^[A-Z]{2}$"`` with ``maxLength: 2``): the lengths are dropped;
- the pattern is one repeated character class (``"^[a-z0-9-]+$"`` with ``maxLength: 63``):
  the repetition takes the bounds (``^[a-z0-9-]{1,63}$``), since each repetition is one
  character.

A ``format`` we enforce with a pattern of our own (``date``, ``date-time``, ``time``, ``ipv4``)
beside a user's ``pattern``: when one language contains the other (compared as automata), the
smaller one alone is exact (``format: date`` with ``^\\d{4}-\\d{2}-\\d{2}$``: the date
pattern). Anything else keeps both keywords, and the checker refuses them by keyword and
pointer.
Patterns are generated with fullmatch semantics (``grammar.regex``), so lengths are measured
on the strings the pattern fullmatches.
"""

from __future__ import annotations

import re
from typing import Any

import interegular

from grammar.errors import GrammarError
from grammar.regex import to_backend_regex
from grammar.schema_formats import FORMAT_PATTERNS

# One repeated atom: a class, an escape class or a dot, with + or *, optionally anchored.
# Larger automata are not analysed (the walk below recurses once per state).
_MAX_STATES = 400
_ONE_REPEATED_CLASS = re.compile(r"^\^?(\[(?:\\.|[^\]\\])+\]|\\[dwsDWS]|\.)([+*])\$?$")


def fold_lengths_into_pattern(sub: dict[str, Any]) -> None:
    """Drop or fold ``sub``'s minLength/maxLength where ``pattern`` can carry them exactly."""
    pattern = sub.get("pattern")
    if not isinstance(pattern, str) or not ("minLength" in sub or "maxLength" in sub):
        return
    low = sub.get("minLength", 0)
    high = sub.get("maxLength")
    if not isinstance(low, int) or not (high is None or isinstance(high, int)):
        return
    shortest, longest = _length_range(pattern)
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
        mine = interegular.parse_pattern(to_backend_regex(FORMAT_PATTERNS[name])).to_fsm()
        theirs = interegular.parse_pattern(to_backend_regex(pattern)).to_fsm()
        if mine.difference(theirs).empty():
            del sub["pattern"]  # every formatted string matches the pattern
        elif theirs.difference(mine).empty():
            del sub["format"]  # every string of the pattern is well formatted
    except (GrammarError, interegular.Unsupported, interegular.InvalidSyntax):
        return


def _length_range(pattern: str) -> tuple[int | None, int | None]:
    """(shortest, longest) lengths of the strings ``pattern`` fullmatches; longest None when
    unbounded; (None, None) when the pattern cannot be analysed (the checker reports it)."""
    try:
        fsm = interegular.parse_pattern(to_backend_regex(pattern)).to_fsm()
    except (GrammarError, interegular.Unsupported, interegular.InvalidSyntax):
        return None, None
    if len(fsm.map) > _MAX_STATES:
        return None, None
    edges = {state: set(moves.values()) for state, moves in fsm.map.items()}
    # States from which a final state can be reached: only paths through them count.
    live = set(fsm.finals)
    changed = True
    while changed:
        changed = False
        for state, targets in edges.items():
            if state not in live and targets & live:
                live.add(state)
                changed = True
    if fsm.initial not in live:
        return None, None
    shortest = _shortest(fsm.initial, edges, set(fsm.finals))
    return shortest, _longest(fsm.initial, edges, set(fsm.finals), live)


def _shortest(start: Any, edges: dict[Any, set[Any]], finals: set[Any]) -> int:
    frontier, seen, depth = {start}, {start}, 0
    while frontier:
        if frontier & finals:
            return depth
        frontier = {t for s in frontier for t in edges.get(s, ()) if t not in seen}
        seen |= frontier
        depth += 1
    return 0


def _longest(
    start: Any, edges: dict[Any, set[Any]], finals: set[Any], live: set[Any]
) -> int | None:
    """The longest path to a final state through live states; None if a live cycle exists."""
    best: dict[Any, int | None] = {}
    visiting: set[Any] = set()

    def walk(state: Any) -> int | None:  # longest path from state to a final, -1 if none
        if state in best:
            return best[state]
        if state in visiting:
            raise _Cycle
        visiting.add(state)
        longest = 0 if state in finals else -1
        for target in edges.get(state, ()):
            if target in live:
                tail = walk(target)
                if tail is not None and tail >= 0:
                    longest = max(longest, tail + 1)
        visiting.discard(state)
        best[state] = longest
        return longest

    try:
        result = walk(start)
    except _Cycle:
        return None
    return result if result is not None and result >= 0 else None


class _Cycle(Exception):
    """A cycle through live states: strings of any length."""
