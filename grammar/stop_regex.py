"""``stop_regex``: find where a request's output first matches one of its stop regexes.

Each pattern becomes an interegular FSM (Python ``re`` semantics, no anchors or lookbehind),
simulated from every start offset at once as text streams in, so each character is examined
once per live state rather than re-searching the whole output every step.

Building the automaton can take time exponential in the pattern, so it happens in the compile
sandbox (see ``grammar.sandbox``), and patterns are bounded: their counted repetitions
(``MAX_STOP_REGEX_SIZE`` positions) before the automaton is built, its states
(``MAX_STOP_REGEX_STATES``) after. A built ``StopRegex`` pickles; each request gets a copy.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import interegular

from grammar.errors import GrammarError
from grammar.regex import check_expanded_size

# Bounds on one stop regex: positions with repetitions written out, and automaton states.
MAX_STOP_REGEX_SIZE = 2048
MAX_STOP_REGEX_STATES = 4096


class StopRegex:
    """Streams output text; reports the first stop-regex match as (start, end) offsets.

    ``feed(delta)`` appends the text decoded since the last call. The match reported is the one
    that ends earliest in the whole text (a stream cannot wait for a longer match), and of those
    the one starting earliest. Offsets count characters from the start of all fed text. Once a
    match is found every later call returns it. Not thread-safe; one per request.
    """

    def __init__(self, patterns: Sequence[str]) -> None:
        self.patterns = tuple(patterns)
        self._fsms = [_compile(p) for p in self.patterns]
        self._live = [frozenset(s for s in fsm.states if fsm.islive(s)) for fsm in self._fsms]
        self._active: list[dict[Any, int]] = [{} for _ in self._fsms]  # state -> earliest start
        self._offset = 0
        self.match: tuple[int, int] | None = None

    def feed(self, delta: str) -> tuple[int, int] | None:
        """Consume ``delta``; return the first match's (start, end) or None if none yet."""
        for i, ch in enumerate(delta):
            if self.match is not None:
                break
            self._step(ch, self._offset + i)
        self._offset += len(delta)
        return self.match

    def _step(self, ch: str, index: int) -> None:
        """Advance every live path by ``ch``, the character at offset ``index``."""
        best: tuple[int, int] | None = None
        for k, fsm in enumerate(self._fsms):
            active = self._active[k]
            active.setdefault(fsm.initial, index)
            try:
                symbol = fsm.alphabet[ch]
            except KeyError:
                symbol = None
            moved: dict[Any, int] = {}
            for state, start in active.items():
                transitions = fsm.map.get(state)
                target = transitions.get(symbol) if transitions and symbol is not None else None
                if target is not None and target in self._live[k]:
                    moved[target] = min(start, moved.get(target, start))
            self._active[k] = moved
            starts = [start for state, start in moved.items() if state in fsm.finals]
            if starts and (best is None or min(starts) < best[0]):
                best = (min(starts), index + 1)
        if best is not None:
            self.match = best

    def first_match(self, text: str) -> tuple[int, int] | None:
        """Stateless: the match ``feed`` would report for ``text`` fed from scratch."""
        return StopRegex(self.patterns).feed(text)


def _compile(pattern: str) -> interegular.FSM:
    try:
        re.compile(pattern)
        check_expanded_size(pattern, "stop_regex", MAX_STOP_REGEX_SIZE)
        fsm = interegular.parse_pattern(pattern).to_fsm()
    except re.error as exc:
        raise GrammarError(f"invalid stop_regex {pattern!r}: {exc}") from None
    except (interegular.Unsupported, interegular.InvalidSyntax) as exc:
        raise GrammarError(f"unsupported stop_regex {pattern!r}: {exc}") from None
    if len(fsm.states) > MAX_STOP_REGEX_STATES:
        raise GrammarError(
            f"stop_regex {pattern!r} needs an automaton of {len(fsm.states)} states "
            f"(the limit is {MAX_STOP_REGEX_STATES}); simplify it"
        )
    if fsm.accepts(""):
        raise GrammarError(f"stop_regex {pattern!r} matches the empty string")
    if fsm.empty():
        raise GrammarError(f"stop_regex {pattern!r} matches no string")
    return fsm
