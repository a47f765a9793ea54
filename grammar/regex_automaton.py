"""The automaton of a pattern, built with a hard bound on its size.

A pattern's DFA can be exponential in its length (``[ab]*a[ab]{14}`` has 2^15 states), and
interegular's construction cannot be stopped early: measured here, such patterns took more
than 30 s. So patterns that must become automata (lengths or a format beside a ``pattern``,
``propertyNames``) are parsed here from their backend form (``to_backend_regex``: unsupported
constructs already refused) into a Thompson NFA, and made deterministic by subset construction
that raises ``AutomatonTooLarge`` at ``limit`` states.

Character classes keep Python's meaning except that ``\\d``, ``\\w`` and ``\\s`` are their
ASCII parts (a subset of Python's Unicode classes, so every string accepted here also matches
the pattern in Python).
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

from grammar.automaton import (
    AutomatonTooLarge,
    CharSet,
    Dfa,
    build,
    chars,
    complement,
    minimized,
    normalize,
    subtract_sets,
)
from grammar.regex import expanded_size, to_backend_regex

try:
    from re import _constants as _sre_constants  # type: ignore[attr-defined]
    from re import _parser as _sre  # type: ignore[attr-defined]
except ImportError:  # Python 3.10
    import sre_constants as _sre_constants
    import sre_parse as _sre

_CATEGORIES: dict[Any, CharSet] = {
    _sre_constants.CATEGORY_DIGIT: normalize([(0x30, 0x39)]),
    _sre_constants.CATEGORY_WORD: normalize(
        [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
    ),
    _sre_constants.CATEGORY_SPACE: chars(" \t\n\r\f\v"),
}
_SURROGATES: CharSet = ((0xD800, 0xDFFF),)
_ANY_BUT_NEWLINE = subtract_sets(complement(chars("\n")), _SURROGATES)
_ANY = subtract_sets(((0, 0x10FFFF),), _SURROGATES)


class PatternUnsupported(Exception):
    """The pattern uses a construct this module does not build automata for."""


def pattern_dfa(
    pattern: str, limit: int, search: bool = False, wide: bool = False, what: str = "pattern"
) -> Dfa:
    """The minimal DFA of the strings ``pattern`` (Python syntax) fullmatches, or with
    ``search`` the strings it matches somewhere in, as JSON Schema's ``pattern`` does (a leading
    ``^`` / trailing ``$`` anchor the match). Within the subset described above; with ``wide``,
    a superset instead (``\\d``, ``\\w``, ``\\s`` read as any character, a final ``$`` also
    before a trailing newline), for languages that must be kept out. Raises GrammarError for a
    pattern ``to_backend_regex`` refuses, AutomatonTooLarge beyond ``limit`` states,
    PatternUnsupported for constructs without an automaton here."""
    backend = to_backend_regex(pattern, what)
    if expanded_size(backend) > 4 * limit:
        raise AutomatonTooLarge(f"its repetitions expand beyond {4 * limit} positions")
    nfa = _Nfa(wide)
    start = nfa.new()
    if search and not pattern.startswith("^"):
        start = nfa.any_string(start)
    end = nfa.add(_sre.parse(backend), start)
    if search and not anchored_end(pattern):
        end = nfa.any_string(end)
    elif search and wide:  # Python's $ also matches before a final newline
        after = nfa.new()
        nfa.epsilon[end].append(after)
        nfa.moves[end].append((chars("\n"), after))
        end = after
    return minimized(nfa.determinize(end, limit))


def literals_dfa(values: list[str], limit: int) -> Dfa:
    """The DFA of exactly the strings in ``values`` (a trie)."""

    def moves(prefix: str) -> list[tuple[CharSet, str]]:
        following = {
            v[len(prefix)] for v in values if len(v) > len(prefix) and v.startswith(prefix)
        }
        return [(chars(c), prefix + c) for c in sorted(following)]

    return build("", moves, lambda prefix: prefix in values, limit)


def any_string_dfa() -> Dfa:
    """Every string (of characters, surrogates excluded)."""
    return build(0, lambda _: [(_ANY, 0)], lambda _: True, limit=1)


def anchored_end(pattern: str) -> bool:
    """Whether ``pattern`` ends with a ``$`` anchor (not an escaped dollar)."""
    backslashes = len(pattern[:-1]) - len(pattern[:-1].rstrip("\\"))
    return pattern.endswith("$") and backslashes % 2 == 0


class _Nfa:
    """States with epsilon moves and character-set moves (Thompson's construction)."""

    def __init__(self, wide: bool) -> None:
        self.wide = wide
        self.epsilon: list[list[int]] = []
        self.moves: list[list[tuple[CharSet, int]]] = []

    def new(self) -> int:
        self.epsilon.append([])
        self.moves.append([])
        return len(self.epsilon) - 1

    def any_string(self, start: int) -> int:
        """Append a loop over every character after ``start``; returns its state."""
        loop = self.new()
        self.epsilon[start].append(loop)
        self.moves[loop].append((_ANY, loop))
        return loop

    def add(self, items: Any, start: int) -> int:
        """Append the automaton of parsed ``items`` after ``start``; returns its end state."""
        current = start
        for op, value in items:
            current = self._item(op, value, current)
        return current

    def _item(self, op: Any, value: Any, start: int) -> int:
        if op in (_sre_constants.LITERAL, _sre_constants.NOT_LITERAL, _sre_constants.ANY,
                  _sre_constants.IN):  # fmt: skip
            end = self.new()
            self.moves[start].append((_class(op, value, self.wide), end))
            return end
        if op == _sre_constants.SUBPATTERN:
            return self.add(value[-1], start)
        if op == _sre_constants.BRANCH:
            end = self.new()
            for branch in value[1]:
                self.epsilon[self.add(branch, start)].append(end)
            return end
        if op in (_sre_constants.MAX_REPEAT, _sre_constants.MIN_REPEAT):
            low, high, item = value
            current = start
            for _ in range(low):
                current = self.add(item, current)
            if high == _sre_constants.MAXREPEAT:
                loop = self.new()
                self.epsilon[current].append(loop)
                self.epsilon[self.add(item, loop)].append(loop)
                return loop
            end = self.new()
            for _ in range(high - low):
                self.epsilon[current].append(end)
                current = self.add(item, current)
            self.epsilon[current].append(end)
            return end
        raise PatternUnsupported(f"{op} has no automaton here")

    def closure(self, states: set[int]) -> frozenset[int]:
        pending, seen = list(states), set(states)
        while pending:
            for target in self.epsilon[pending.pop()]:
                if target not in seen:
                    seen.add(target)
                    pending.append(target)
        return frozenset(seen)

    def determinize(self, end: int, limit: int) -> Dfa:
        def moves(state: frozenset[int]) -> list[tuple[CharSet, frozenset[int]]]:
            edges = [edge for nfa_state in state for edge in self.moves[nfa_state]]
            # Split the characters at every range boundary; within a piece the targets agree.
            cuts = sorted(
                {lo for cs, _ in edges for lo, _ in cs}
                | {hi + 1 for cs, _ in edges for _, hi in cs}
            )
            pieces: dict[frozenset[int], list[tuple[int, int]]] = {}
            for lo, nxt in zip(cuts, cuts[1:], strict=False):
                targets = {t for cs, t in edges if _contains(cs, lo)}
                if targets:
                    pieces.setdefault(self.closure(targets), []).append((lo, nxt - 1))
            return [(normalize(ranges), target) for target, ranges in pieces.items()]

        return build(self.closure({0}), moves, lambda state: end in state, limit)


def _contains(charset: CharSet, code: int) -> bool:
    index = bisect_right(charset, (code, 0x110000)) - 1
    return index >= 0 and charset[index][0] <= code <= charset[index][1]


def _class(op: Any, value: Any, wide: bool) -> CharSet:
    if op == _sre_constants.LITERAL:
        return ((value, value),)
    if op == _sre_constants.NOT_LITERAL:
        return subtract_sets(complement(((value, value),)), _SURROGATES)
    if op == _sre_constants.ANY:
        return _ANY_BUT_NEWLINE
    negated = False
    ranges: list[tuple[int, int]] = []
    for kind, item in value:
        if kind == _sre_constants.NEGATE:
            negated = True
        elif kind == _sre_constants.LITERAL:
            ranges.append((item, item))
        elif kind == _sre_constants.RANGE:
            ranges.append(item)
        elif kind == _sre_constants.CATEGORY and item in _CATEGORIES:
            # Python's classes are Unicode: their ASCII part is a subset of them, any character
            # a superset. (Only the \S rewrite negates one, listing Unicode's spaces: exact.)
            ranges.extend(_ANY if wide and not negated else _CATEGORIES[item])
        else:
            raise PatternUnsupported(f"class item {kind} {item}")
    charset = normalize(ranges)
    categories = {item for kind, item in value if kind == _sre_constants.CATEGORY}
    if negated and categories - {_sre_constants.CATEGORY_SPACE}:
        raise PatternUnsupported("a negated class with \\d or \\w")
    if negated:
        # Only the \S rewrite negates a category (with Unicode's other spaces listed): exact.
        charset = complement(charset)
    return subtract_sets(charset, _SURROGATES)
