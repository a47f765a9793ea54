"""``multipleOf`` with bounds, as an exact automaton over the digits of the number.

Measured on xgrammar 0.2.8: an integer ``multipleOf`` is exact alone (a remainder automaton)
and with both bounds only while the range is narrow (it lists the multiples: fewer than 10,000
integers); with one bound, or a wider range, it logs a warning and drops ``multipleOf``
(``{"type": "integer", "minimum": 0, "maximum": 100000, "multipleOf": 3}`` emitted 4 and 8).
``multipleOf`` on numbers is dropped always. So we write these numbers ourselves.

Divisibility of a decimal numeral by k is regular: reading digits left to right, the remainder
``r -> (10 r + d) mod k`` is all an automaton needs. A step with f decimal places (0.01, 2.5)
scales to an integer one: x is a multiple of s = S / 10^f exactly when x has at most f
fraction digits and its scaled value x * 10^f is a multiple of S. Bounds scale the same way and
are compared digit by digit (the integer part by length, then lexicographically; the fraction
padded with zeros). The automaton's states are (int digits read, comparison with each bound,
remainder), minimized; a step or range whose automaton would exceed ``MAX_STATES`` is refused.

Numbers are written as JSON numbers without exponent: an optional ``-``, an integer part
without leading zeros, and at most f fraction digits (never ``-0``).
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation, localcontext
from fractions import Fraction
from typing import Any

from grammar.automaton import AutomatonTooLarge, CharSet, Dfa, build, chars, minimized, to_ebnf

# Largest automaton (after minimization) written as rules; larger ones are refused. Each rule
# costs the backend about 0.25 ms of compile at a 4k vocabulary.
MAX_STATES = 600
# States explored before minimization (digits read x bound comparisons x remainder).
_MAX_BUILD_STATES = 8 * MAX_STATES
_DIGITS = [(c, chars(str(c))) for c in range(10)]
_LT, _EQ, _GT = -1, 0, 1


class StepTooLarge(ValueError):
    """The multipleOf automaton would be too large to compile quickly."""


def scaled_step(value: Any) -> tuple[int, int] | None:
    """(S, f) with ``value`` = S / 10^f, or None when value is not a positive finite number."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        return None
    try:
        step = Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
    except InvalidOperation:
        return None
    if not step.is_finite():
        return None
    sign, digits, exponent = step.normalize().as_tuple()
    assert isinstance(exponent, int)
    units = int("".join(map(str, digits)))
    if exponent >= 0:
        return units * 10**exponent, 0
    return units, -exponent


def integer_step(value: Any) -> int | None:
    """The k such that an integer is a multiple of ``value`` exactly when k divides it (for
    ``value`` = p/q in lowest terms, k = p); None for a value that is not a positive number."""
    scaled = scaled_step(value)
    if scaled is None:
        return None
    units, places = scaled
    return Fraction(units, 10**places).numerator


def multiple_of_ebnf(sub: dict[str, Any], integer: bool) -> str:
    """EBNF rules (start rule ``root``) for the numbers ``sub``'s ``multipleOf`` and bounds
    admit (integers only when ``integer``). Raises StepTooLarge when the automaton is too
    large, ValueError when no number is admitted."""
    dfa = multiple_of_dfa(sub, integer)
    if not dfa.finals:
        raise ValueError("no number within the bounds is a multiple of it")
    return to_ebnf(dfa, json_string=False)


def multiple_of_dfa(sub: dict[str, Any], integer: bool) -> Dfa:
    """The minimal automaton behind ``multiple_of_ebnf`` (no final state: no number)."""
    if integer:
        step = integer_step(sub["multipleOf"])
        if step is None:
            raise ValueError("multipleOf must be a positive number")
        units, places = step, 0
    else:
        scaled = scaled_step(sub["multipleOf"])
        if scaled is None:
            raise ValueError("multipleOf must be a positive number")
        units, places = scaled
    low, high = _scaled_bounds(sub, places)
    # Minimized, such automata hold about one state per remainder and digit position: refuse
    # a clearly large one before building it.
    digits = max(len(str(abs(b))) for b in (low or 0, high or 0)) - places + 1
    estimate = units * (max(digits, 1) + places)
    if estimate > MAX_STATES:
        raise StepTooLarge(f"its automaton needs about {estimate} states (at most {MAX_STATES})")
    try:
        dfa = minimized(_numbers(units, places, low, high))
    except AutomatonTooLarge:
        raise StepTooLarge(f"its automaton has over {_MAX_BUILD_STATES} states") from None
    if dfa.size > MAX_STATES:
        raise StepTooLarge(f"its automaton has {dfa.size} states (at most {MAX_STATES})")
    return dfa


def _scaled_bounds(sub: dict[str, Any], places: int) -> tuple[int | None, int | None]:
    """The bounds on x * 10^places (integers; None: unbounded), exclusive ones made inclusive."""
    scale = Decimal(10) ** places
    bounds: list[int | None] = []
    with localcontext() as context:
        context.prec = 400
        for keys, rounding, step in (
            (("minimum", "exclusiveMinimum"), "ROUND_CEILING", 1),
            (("maximum", "exclusiveMaximum"), "ROUND_FLOOR", -1),
        ):
            found = []
            for key in keys:
                value = _decimal(sub.get(key))
                if value is not None:
                    scaled = value * scale
                    bound = int(scaled.to_integral_value(rounding=rounding))
                    found.append(bound + step if key == keys[1] and bound == scaled else bound)
            # The tightest: the largest lower bound, the smallest upper one.
            bounds.append((max if step > 0 else min)(found) if found else None)
    return bounds[0], bounds[1]


def _decimal(value: Any) -> Decimal | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    result = Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
    return result if result.is_finite() else None


def _numbers(step: int, places: int, low: int | None, high: int | None) -> Dfa:
    """Numerals whose scaled value N (= x * 10^places) lies in [low, high] and is a multiple
    of ``step``: the non-negative ones, and ``-`` followed by the magnitude of negative ones."""
    positive: _Magnitudes | None = None
    if high is None or high >= 0:
        positive = _Magnitudes(step, places, max(low, 0) if low is not None else 0, high)
    negative: _Magnitudes | None = None
    if low is None or low < 0:
        upper = -low if low is not None else None
        lower = max(-high, 1) if high is not None else 1
        if upper is None or lower <= upper:
            negative = _Magnitudes(step, places, lower, upper)

    def moves(state: Any) -> list[tuple[CharSet, Any]]:
        if state == "start":
            out = list(positive.moves(positive.start, "p")) if positive else []
            if negative:
                out.append((chars("-"), ("n", negative.start)))
            return out
        side = positive if state[0] == "p" else negative
        assert side is not None
        return list(side.moves(state[1], state[0]))

    def is_final(state: Any) -> bool:
        if state == "start":
            return False
        side = positive if state[0] == "p" else negative
        assert side is not None
        return side.is_final(state[1])

    return build("start", moves, is_final, _MAX_BUILD_STATES)


class _Magnitudes:
    """Numerals (no sign) of the magnitudes M in [low, high] (high None: unbounded) whose
    scaled value is a multiple of ``step``. States: ("i", digits read, int part is "0",
    comparison of the int digits with each bound's, remainder) while reading the integer
    part; ("f", fraction digits read, state of each bound, remainder) after the point."""

    def __init__(self, step: int, places: int, low: int, high: int | None) -> None:
        self.step, self.places = step, places
        unit = 10**places
        self.low_int, low_frac = str(low // unit), low % unit
        self.low_frac = f"{low_frac:0{places}d}" if places else ""
        self.high_int = self.high_frac = None
        if high is not None:
            self.high_int = str(high // unit)
            self.high_frac = f"{high % unit:0{places}d}" if places else ""
        self.start = ("i", 0, False, _EQ, _EQ, 0)

    def moves(self, state: tuple[Any, ...], tag: str) -> list[tuple[CharSet, Any]]:
        out: list[tuple[CharSet, Any]] = []
        if state[0] == "i":
            _, read, zero, low_cmp, high_cmp, rest = state
            if not zero:
                for digit, charset in _DIGITS:
                    nxt = self._int_digit(read, low_cmp, high_cmp, rest, digit)
                    if nxt is not None:
                        out.append((charset, (tag, nxt)))
            if read and self.places:
                after = self._point(read, low_cmp, high_cmp)
                if after is not None:
                    out.append((chars("."), (tag, ("f", 0, *after, rest))))
            return out
        _, read, low_state, high_state, rest = state
        if read < self.places:
            for digit, charset in _DIGITS:
                low_next = _frac_step(low_state, self.low_frac, read, digit, _GT)
                high_next = _frac_step(high_state, self.high_frac, read, digit, _LT)
                if low_next is not None and high_next is not None:
                    nxt = ("f", read + 1, low_next, high_next, (rest * 10 + digit) % self.step)
                    out.append((charset, (tag, nxt)))
        return out

    def is_final(self, state: tuple[Any, ...]) -> bool:
        if state[0] == "i":
            _, read, _, low_cmp, high_cmp, rest = state
            after = self._point(read, low_cmp, high_cmp) if read else None
            if after is None:
                return False
            low_state, frac_read = after[0], 0
        else:
            _, frac_read, low_state, _, rest = state
            if frac_read == 0:
                return False  # a point needs a digit after it
        # Padding the fraction with zeros never exceeds an upper bound it was within, but may
        # fall short of a lower bound it was tight with.
        if low_state == "tight" and self.low_frac[frac_read:].strip("0"):
            return False
        return rest * 10 ** (self.places - frac_read) % self.step == 0

    def _int_digit(
        self, read: int, low_cmp: int, high_cmp: int, rest: int, digit: int
    ) -> tuple[Any, ...] | None:
        """The state after one more integer digit; None past the upper bound's length."""
        if self.high_int is not None and read + 1 > len(self.high_int):
            return None
        low_cmp = _extend(low_cmp, self.low_int, read, digit)
        high_cmp = _extend(high_cmp, self.high_int, read, digit)
        read += 1
        if self.high_int is None and read > len(self.low_int):
            # Longer than the lower bound and no upper bound: only the remainder matters.
            read, low_cmp = len(self.low_int) + 1, _GT
        zero = read == 1 and digit == 0
        return ("i", read, zero, low_cmp, high_cmp, (rest * 10 + digit) % self.step)

    def _point(self, read: int, low_cmp: int, high_cmp: int) -> tuple[str, str] | None:
        """The state of each bound once the integer part ends after ``read`` digits (None when
        the number already lies outside the bounds)."""
        low = _final_cmp(read, low_cmp, self.low_int)
        if low == _LT:
            return None
        high = _EQ if self.high_int is None else _final_cmp(read, high_cmp, self.high_int)
        if self.high_int is not None and high == _GT:
            return None
        return (
            "tight" if low == _EQ else "ok",
            "tight" if self.high_int is not None and high == _EQ else "ok",
        )


def _frac_step(state: str, bound: str | None, read: int, digit: int, passing: int) -> str | None:
    """A bound's state after one more fraction digit: "ok" (decided within it), "tight" (equal
    so far) or None (outside it). ``passing``: the comparison that decides it within."""
    if state == "ok" or bound is None:
        return "ok"
    cmp = (digit > int(bound[read])) - (digit < int(bound[read]))
    if cmp == _EQ:
        return "tight"
    return "ok" if cmp == passing else None


def _extend(cmp: int, bound: str | None, read: int, digit: int) -> int:
    """The lexicographic comparison of the digits read so far with the bound's first digits,
    after one more digit (positions beyond the bound's length keep the comparison)."""
    if bound is None or cmp != _EQ or read >= len(bound):
        return cmp
    target = int(bound[read])
    return (digit > target) - (digit < target)


def _final_cmp(read: int, cmp: int, bound: str) -> int:
    """How an integer part of ``read`` digits compares with ``bound``'s integer part."""
    if read != len(bound):
        return _GT if read > len(bound) else _LT
    return cmp
