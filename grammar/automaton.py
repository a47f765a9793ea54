"""Deterministic automata over character ranges, and the EBNF rules that spell them.

Some JSON-schema keywords describe regular languages that xgrammar 0.2.8 drops when they are
combined (a ``pattern`` with ``minLength``/``maxLength``, a ``format`` with a ``pattern``,
``multipleOf`` with bounds, ``uniqueItems``). We build their automaton (``regex_automaton``
from a pattern, ``schema_numbers`` state by state), intersect it with what else constrains the
value, and write each state as one right-linear EBNF rule (``s ::= [a-c] t | "x" u | ""``),
which the backend compiles exactly.

Transitions are labelled with sets of code points (``CharSet``: sorted, disjoint, inclusive
ranges), so a state with a class such as ``[^"]`` has one edge, not a million. Construction
is bounded: every builder takes a state limit and raises ``AutomatonTooLarge`` beyond it, so a
caller can refuse the keyword instead of compiling a huge grammar.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

CharSet = tuple[tuple[int, int], ...]
MAX_CODE = 0x10FFFF
# UTF-16 surrogates are not characters: no JSON text or backend class may hold them.
_SURROGATES: CharSet = ((0xD800, 0xDFFF),)
# How JSON writes the characters it must escape (the others below U+0020 become \u00XX).
_SHORT_ESCAPES = {0x22: '\\"', 0x5C: "\\\\", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n", 0x0D: "\\r"}
_SHORT_ESCAPES[0x09] = "\\t"
_MUST_ESCAPE: CharSet = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C))
_CLASS_SPECIALS = frozenset('\\]-^["')


class AutomatonTooLarge(Exception):
    """The automaton would exceed the state limit its builder was given."""


def chars(text: str) -> CharSet:
    """The set of the characters in ``text``."""
    return normalize((ord(c), ord(c)) for c in text)


def normalize(ranges: Iterable[tuple[int, int]]) -> CharSet:
    """Sorted, disjoint, merged ranges."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


def intersect_sets(a: CharSet, b: CharSet) -> CharSet:
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo <= hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def subtract_sets(a: CharSet, b: CharSet) -> CharSet:
    return intersect_sets(a, complement(b))


def complement(a: CharSet) -> CharSet:
    out, start = [], 0
    for lo, hi in a:
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= MAX_CODE:
        out.append((start, MAX_CODE))
    return tuple(out)


@dataclass(frozen=True)
class Dfa:
    """States are 0..n-1 with 0 initial; ``edges[s]`` lists (chars, target) with disjoint
    chars. A missing character means no move (rejection)."""

    finals: frozenset[int]
    edges: tuple[tuple[tuple[CharSet, int], ...], ...]

    @property
    def size(self) -> int:
        return len(self.edges)

    def accepts(self, text: str) -> bool:
        state = 0
        for char in text:
            code = ord(char)
            for charset, target in self.edges[state]:
                if any(lo <= code <= hi for lo, hi in charset):
                    state = target
                    break
            else:
                return False
        return state in self.finals


def build(
    start: Hashable,
    moves: Callable[[Any], Iterable[tuple[CharSet, Hashable]]],
    is_final: Callable[[Any], bool],
    limit: int,
) -> Dfa:
    """The automaton reachable from ``start``, where ``moves(state)`` gives (chars, next state)
    pairs with disjoint chars; states are any hashable values (numbered here in BFS order).
    Raises AutomatonTooLarge past ``limit`` states. Dead states are trimmed; a language with
    no string is one non-final state."""
    number = {start: 0}
    order = [start]
    edges: list[list[tuple[CharSet, int]]] = []
    for state in order:  # grows while iterating: a breadth-first walk
        out: dict[int, list[tuple[int, int]]] = {}
        for charset, target in moves(state):
            if not charset:
                continue
            if target not in number:
                if len(order) >= limit:
                    raise AutomatonTooLarge(f"more than {limit} states")
                number[target] = len(order)
                order.append(target)
            out.setdefault(number[target], []).extend(charset)
        edges.append([(normalize(ranges), t) for t, ranges in out.items()])
    finals = frozenset(i for i, state in enumerate(order) if is_final(state))
    return _trimmed(finals, edges)


def _trimmed(finals: frozenset[int], edges: list[list[tuple[CharSet, int]]]) -> Dfa:
    """Only the states on some path from the start to a final state, renumbered."""
    live = set(finals)
    reverse: dict[int, set[int]] = {}
    for source, out in enumerate(edges):
        for _, target in out:
            reverse.setdefault(target, set()).add(source)
    pending = list(live)
    while pending:
        for source in reverse.get(pending.pop(), ()):
            if source not in live:
                live.add(source)
                pending.append(source)
    if 0 not in live:
        return Dfa(frozenset(), ((),))
    number = {0: 0}
    order = [0]
    for state in order:
        for _, target in edges[state]:
            if target in live and target not in number:
                number[target] = len(order)
                order.append(target)
    return Dfa(
        frozenset(number[s] for s in order if s in finals),
        tuple(tuple((cs, number[t]) for cs, t in edges[s] if t in live) for s in order),
    )


def intersection(a: Dfa, b: Dfa, limit: int) -> Dfa:
    """Strings both accept."""

    def moves(pair: tuple[int, int]) -> Iterable[tuple[CharSet, tuple[int, int]]]:
        for set_a, target_a in a.edges[pair[0]]:
            for set_b, target_b in b.edges[pair[1]]:
                common = intersect_sets(set_a, set_b)
                if common:
                    yield common, (target_a, target_b)

    return build((0, 0), moves, lambda p: p[0] in a.finals and p[1] in b.finals, limit)


def union(a: Dfa, b: Dfa, limit: int) -> Dfa:
    """Strings either accepts."""

    def moves(
        pair: tuple[int | None, int | None],
    ) -> Iterable[tuple[CharSet, tuple[int | None, int | None]]]:
        edges_a = a.edges[pair[0]] if pair[0] is not None else ()
        edges_b = b.edges[pair[1]] if pair[1] is not None else ()
        for set_a, target_a in edges_a:
            rest = set_a
            for set_b, target_b in edges_b:
                common = intersect_sets(set_a, set_b)
                if common:
                    yield common, (target_a, target_b)
                    rest = subtract_sets(rest, set_b)
            if rest:
                yield rest, (target_a, None)
        covered: CharSet = normalize(r for set_a, _ in edges_a for r in set_a)
        for set_b, target_b in edges_b:
            rest = subtract_sets(set_b, covered)
            if rest:
                yield rest, (None, target_b)

    def is_final(pair: tuple[int | None, int | None]) -> bool:
        return pair[0] in a.finals or pair[1] in b.finals

    return build((0, 0), moves, is_final, limit)


def difference(a: Dfa, b: Dfa, limit: int) -> Dfa:
    """Strings ``a`` accepts and ``b`` does not."""

    def moves(pair: tuple[int, int | None]) -> Iterable[tuple[CharSet, tuple[int, int | None]]]:
        state_a, state_b = pair
        for set_a, target_a in a.edges[state_a]:
            rest = set_a
            for set_b, target_b in b.edges[state_b] if state_b is not None else ():
                common = intersect_sets(set_a, set_b)
                if common:
                    yield common, (target_a, target_b)
                    rest = subtract_sets(rest, set_b)
            if rest:
                yield rest, (target_a, None)  # b can no longer accept

    def is_final(pair: tuple[int, int | None]) -> bool:
        return pair[0] in a.finals and (pair[1] is None or pair[1] not in b.finals)

    return build((0, 0), moves, is_final, limit)


def included(a: Dfa, b: Dfa) -> bool:
    """Whether every string ``a`` accepts, ``b`` accepts too."""
    seen: set[tuple[int, int | None]] = {(0, 0)}
    pending: list[tuple[int, int | None]] = [(0, 0)]
    while pending:
        state_a, state_b = pending.pop()
        if state_a in a.finals and (state_b is None or state_b not in b.finals):
            return False
        for set_a, target_a in a.edges[state_a]:
            rest = set_a
            nexts: list[tuple[int, int | None]] = []
            for set_b, target_b in b.edges[state_b] if state_b is not None else ():
                if intersect_sets(set_a, set_b):
                    nexts.append((target_a, target_b))
                    rest = subtract_sets(rest, set_b)
            if rest:
                nexts.append((target_a, None))  # characters b cannot read: b rejects
            for pair in nexts:
                if pair not in seen:
                    seen.add(pair)
                    pending.append(pair)
    return True


def with_lengths(dfa: Dfa, low: int, high: int | None, limit: int) -> Dfa:
    """Strings ``dfa`` accepts whose length (in characters) is within [low, high]; high None:
    unbounded. The count saturates at ``low`` when there is no upper bound."""
    cap = high if high is not None else low

    def moves(pair: tuple[int, int]) -> Iterable[tuple[CharSet, tuple[int, int]]]:
        state, count = pair
        if high is not None and count >= high:
            return
        for charset, target in dfa.edges[state]:
            yield charset, (target, min(count + 1, cap))

    return build((0, 0), moves, lambda p: p[0] in dfa.finals and p[1] >= low, limit)


def minimized(dfa: Dfa) -> Dfa:
    """The smallest equivalent automaton (Moore's partition refinement; its rounds grow with
    the automaton's depth, so use it on small ones)."""
    block = [int(s in dfa.finals) for s in range(dfa.size)]
    count = len(set(block))
    while True:
        signatures: dict[tuple[Any, ...], int] = {}
        refined = []
        for state in range(dfa.size):
            merged: dict[int, list[tuple[int, int]]] = {}
            for charset, target in dfa.edges[state]:
                merged.setdefault(block[target], []).extend(charset)
            key = (block[state], tuple(sorted((b, normalize(r)) for b, r in merged.items())))
            refined.append(signatures.setdefault(key, len(signatures)))
        block = refined
        if len(signatures) == count:
            break
        count = len(signatures)

    representative = {b: s for s, b in reversed(list(enumerate(block)))}

    def moves(b: int) -> Iterable[tuple[CharSet, int]]:
        state = representative[b]
        merged: dict[int, list[tuple[int, int]]] = {}
        for charset, target in dfa.edges[state]:
            merged.setdefault(block[target], []).extend(charset)
        return [(normalize(r), t) for t, r in merged.items()]

    finals = {block[s] for s in dfa.finals}
    return build(block[0], moves, lambda b: b in finals, limit=dfa.size + 1)


def to_ebnf(dfa: Dfa, json_string: bool) -> str:
    """EBNF rules spelling ``dfa``'s language, start rule ``root``, the others ``root_<i>``
    (the names ``json_grammar`` renames when it splices rules in).

    json_string: the language is of decoded string contents, and the rules spell their JSON
    text: ``"`` and ``\\`` escaped; control characters as their JSON escapes where an edge holds
    nothing else (a class or ``.`` that also admits them spells only its other characters: a
    subset, so still exact, as ``grammar.regex`` does). A state that can
    only end the string gives ``""``; an automaton that accepts nothing gives a rule that
    matches nothing, which callers check for beforehand (``Dfa.finals`` empty)."""

    def name(state: int) -> str:
        return "root" if state == 0 else f"root_{state}"

    lines = []
    for state, out in enumerate(dfa.edges):
        alternatives = [f"{_spell(charset, json_string)} {name(target)}" for charset, target in out]
        if state in dfa.finals:
            alternatives.append('""')
        if not alternatives:  # only an automaton with no string reaches here
            alternatives.append("[^\\u0000-\\U0010ffff]")
        lines.append(f"{name(state)} ::= {' | '.join(alternatives)}")
    return "\n".join(lines)


def _spell(charset: CharSet, json_string: bool) -> str:
    """One EBNF element matching one character of ``charset`` (as JSON text if json_string)."""
    if not json_string:
        return _class(charset)
    parts = []
    raw = subtract_sets(charset, _MUST_ESCAPE)
    if raw:
        parts.append(_class(raw))
    escaped = intersect_sets(charset, _MUST_ESCAPE)
    if raw:  # control characters only where the pattern names them, as grammar.regex does
        escaped = intersect_sets(escaped, chars('"\\'))
    for lo, hi in escaped:
        for code in range(lo, hi + 1):
            escape = _SHORT_ESCAPES.get(code, f"\\u{code:04x}")
            parts.append('"' + escape.replace("\\", "\\\\").replace('"', '\\"') + '"')
    return parts[0] if len(parts) == 1 else f"({' | '.join(parts)})"


def _class(charset: CharSet) -> str:
    return class_text(charset, _class_char)


def class_text(
    ranges: Iterable[tuple[int, int]], render: Callable[[int], str], head: str = "", tail: str = ""
) -> str:
    """A bracket class ``[head items tail]`` of ``ranges``: each range a character or ``lo-hi``,
    its ends written by ``render`` (which escapes what the target syntax needs)."""
    items = [render(lo) if lo == hi else f"{render(lo)}-{render(hi)}" for lo, hi in ranges]
    return f"[{head}{''.join(items)}{tail}]"


def _class_char(code: int) -> str:
    char = chr(code)
    if char in _CLASS_SPECIALS:
        return "\\" + char
    if 0x20 <= code < 0x7F:
        return char
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
