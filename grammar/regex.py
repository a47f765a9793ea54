"""Regex analysis before compiling: Python ``re`` semantics in, a pattern xgrammar matches alike.

Regex constraints promise ``re.fullmatch(pattern, output)``, and schema patterns are checked by
validators with Python's ``re``. xgrammar 0.2.8's regex dialect differs (measured): ``\\xHH``
reads a variable number of hex digits, ``\\W``/``\\S``/``\\D`` complement ASCII classes (so they
match characters Python's exclude), lookarounds, backreferences, inline flags, word boundaries
and possessive or atomic groups fail with a position-only message, and its JSON-string mode for
schema ``pattern`` drops characters (``(?:x[0-9]{1,2})?`` lets "5" through). So each pattern is
parsed here once: unsupported constructs are rejected by name, the rest is re-emitted either as
a plain regex (``to_backend_regex``) or as a regex over the *escaped* text of a JSON string
(``to_json_string_regex``), which we compile with xgrammar's plain regex mode. Both accept a
subset of Python's language, so every output still matches. interegular must parse the
rewritten pattern too (it follows Python's semantics), which catches what the scan let through;
its automaton is not built (the backend matches without one, and a DFA can be exponential in
the pattern: ``[ab]*a[ab]{16}``). Counted repetitions are bounded by ``expanded_size``.
"""

from __future__ import annotations

import re
import unicodedata
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import interegular

from grammar.automaton import class_text
from grammar.errors import GrammarError

try:
    from re import _parser as _sre  # type: ignore[attr-defined]
except ImportError:  # Python 3.10
    import sre_parse as _sre

# The largest ``expanded_size`` of a regex or schema pattern. The backend does not unroll
# repetitions, so this only keeps absurd patterns out; stop regexes, which become automata,
# have a far smaller limit.
MAX_REGEX_SIZE = 100_000
_REPEATS = tuple(
    getattr(_sre, name)
    for name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")
    if hasattr(_sre, name)
)
_ATOMIC_GROUP = getattr(_sre, "ATOMIC_GROUP", object())

# Python's \s beyond xgrammar's ASCII [ \t\n\r\f\v]; excluding them keeps \S within Python's.
_UNICODE_SPACES = [(0x1C, 0x1F), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A)]
_UNICODE_SPACES += [(0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000)]
_METACHARS = ".^$*+?{}[]()|\\/-"
_CLASS_SPECIALS = "]\\^-["
_NAMED_CONTROLS = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\f": "\\f", "\v": "\\v"}
_JSON_ESCAPES = {'"': '"', "\\": "\\", "\b": "b", "\f": "f", "\n": "n", "\r": "r", "\t": "t"}
_UNSUPPORTED_ESCAPES = {
    "b": "word boundaries (\\b)",
    "B": "non-boundaries (\\B)",
    "A": "anchors (\\A)",
    "Z": "anchors (\\Z)",
    "z": "anchors (\\z)",
    "G": "anchors (\\G)",
    "D": "\\D (the backend's \\D also matches non-ASCII digits; write e.g. [^0-9] instead)",
    "W": "\\W (the backend's \\W also matches non-ASCII letters; write e.g. [^a-zA-Z0-9_])",
}
_GROUP_PREFIXES = (
    ("(?:", None),
    ("(?P<", None),
    ("(?P=", "backreferences"),
    ("(?=", "lookahead assertions"),
    ("(?!", "negative lookahead assertions"),
    ("(?<=", "lookbehind assertions"),
    ("(?<!", "negative lookbehind assertions"),
    ("(?>", "atomic groups"),
    ("(?#", "comments"),
    ("(?(", "conditional groups"),
)


def to_backend_regex(pattern: str, what: str = "regex") -> str:
    """The pattern rewritten for xgrammar's regex mode; its language is within Python's.

    ``what`` names the pattern in error messages. A leading ``^`` and trailing ``$`` are dropped
    (matching is full-match anyway); anchors elsewhere are rejected. Raises GrammarError for
    invalid syntax and unsupported constructs.
    """
    return _translate(pattern, what, json_string=False)


def to_json_string_regex(pattern: str, what: str = "pattern") -> str:
    """A regex over the escaped content of a JSON string whose decoded value fullmatches pattern.

    Characters that JSON must escape are emitted escaped: ``"`` as ``\\"``, ``\\`` as ``\\\\``,
    and control characters the pattern names literally as their JSON escapes. Control characters
    that only a class or ``.`` admits are never emitted (a subset, so still valid). Same errors
    as ``to_backend_regex``.
    """
    return _translate(pattern, what, json_string=True)


def _translate(pattern: str, what: str, json_string: bool) -> str:
    try:
        with warnings.catch_warnings():  # "possible nested set" and friends: valid, if odd
            warnings.simplefilter("ignore", FutureWarning)
            re.compile(pattern)
    except re.error as exc:
        raise GrammarError(f"invalid {what} {pattern!r}: {exc}") from None
    check_expanded_size(pattern, what, MAX_REGEX_SIZE)
    plain = _Rewriter(pattern, what, json_string=False).run()
    try:
        interegular.parse_pattern(plain)
    except (interegular.Unsupported, interegular.InvalidSyntax) as exc:
        reason = str(exc) or "interegular cannot parse it"
        raise GrammarError(f"unsupported {what} {pattern!r}: {reason}") from None
    return _Rewriter(pattern, what, json_string=True).run() if json_string else plain


def expanded_size(pattern: str) -> int:
    """How many atoms ``pattern`` (valid Python syntax) has with every counted repetition
    written out: ``a{3}(bc){2}`` has 7, ``a*`` 1, ``a{2,}`` 2. What an automaton or a grammar
    that unrolls repetitions grows with."""
    return _size(_sre.parse(pattern))


def check_expanded_size(pattern: str, what: str, limit: int) -> None:
    """GrammarError unless ``expanded_size(pattern) <= limit``."""
    size = expanded_size(pattern)
    if size > limit:
        raise GrammarError(
            f"{what} {pattern!r} is too large: its repetitions expand to {size} positions "
            f"(the limit is {limit}); use smaller repetition counts"
        )


def _size(items: Iterable[tuple[Any, Any]]) -> int:
    total = 0
    for op, value in items:
        if op in _REPEATS:
            low, high, item = value
            total += max(low if high == _sre.MAXREPEAT else high, 1) * _size(item)
        elif op == _sre.SUBPATTERN:
            total += _size(value[-1])
        elif op == _sre.BRANCH:
            total += sum(_size(branch) for branch in value[1])
        elif op in (_sre.ASSERT, _sre.ASSERT_NOT):
            total += _size(value[1])
        elif op == _ATOMIC_GROUP:
            total += _size(value)
        elif op == _sre.GROUPREF_EXISTS:
            total += sum(_size(branch) for branch in value[1:] if branch is not None)
        else:
            total += 1
    return total


@dataclass
class _CharSet:
    """A character class: code-point ranges plus shorthand classes (d, w, s), maybe negated."""

    ranges: list[tuple[int, int]] = field(default_factory=list)
    shorthands: set[str] = field(default_factory=set)
    negated: bool = False

    def contains(self, char: str) -> bool:
        code = ord(char)
        inside = any(lo <= code <= hi for lo, hi in self.ranges) or any(
            re.fullmatch(f"\\{s}", char) for s in self.shorthands
        )
        return inside != self.negated


class _Rewriter:
    """One left-to-right pass over a pattern that ``re.compile`` accepted."""

    def __init__(self, pattern: str, what: str, json_string: bool) -> None:
        self.src = pattern
        self.what = what
        self.json_string = json_string
        self.pos = 0
        self.out: list[str] = []

    def fail(self, construct: str) -> GrammarError:
        return GrammarError(
            f"unsupported {self.what} {self.src!r}: {construct} at position {self.pos} "
            "cannot be enforced by the grammar backend"
        )

    def run(self) -> str:
        src = self.src
        if src.startswith("^"):
            self.pos = 1
        end = len(src) - 1 if src.endswith("$") and not _escaped(src, len(src) - 1) else len(src)
        while self.pos < end:
            ch = src[self.pos]
            if ch == "\\":
                self.escape()
            elif ch == "[":
                self.emit_set(self.char_class())
            elif ch == "(":
                self.group()
            elif ch == ".":
                self.emit_set(_CharSet(ranges=[(10, 10)], negated=True))
                self.pos += 1
            elif ch in "^$":
                raise self.fail(f"the anchor {ch!r}")
            elif ch in "*+?}" and src[self.pos + 1 : self.pos + 2] == "+":
                raise self.fail("possessive quantifiers")
            elif ch in "*+?{}|)":
                self.out.append(ch)
                self.pos += 1
            else:
                self.emit_literal(ch)
                self.pos += 1
        return "".join(self.out)

    def group(self) -> None:
        rest = self.src[self.pos :]
        if not rest.startswith("(?"):
            self.out.append("(")
            self.pos += 1
            return
        for prefix, unsupported in _GROUP_PREFIXES:
            if rest.startswith(prefix):
                if unsupported:
                    raise self.fail(unsupported)
                if prefix == "(?P<":  # a named group is a plain group for matching purposes
                    self.pos = self.src.index(">", self.pos) + 1
                else:
                    self.pos += len(prefix)
                self.out.append("(?:")
                return
        raise self.fail("inline flags")

    def escape(self) -> None:
        """An escape outside a class: a shorthand class, or one literal character."""
        ch = self.src[self.pos + 1]
        if ch == "S":
            self.pos += 2
            self.emit_set(_CharSet(ranges=list(_UNICODE_SPACES), shorthands={"s"}, negated=True))
        elif ch in "dws":
            self.pos += 2
            self.emit_set(_CharSet(shorthands={ch}))
        else:
            self.emit_literal(self.escaped_char(in_class=False))

    def escaped_char(self, in_class: bool) -> str:
        """Decode the single-character escape at ``pos`` and advance past it."""
        src = self.src
        ch = src[self.pos + 1]
        if ch.isdigit():
            raise self.fail("backreferences" if ch != "0" else "octal escapes")
        if ch in _UNSUPPORTED_ESCAPES and not (in_class and ch == "b"):
            raise self.fail(_UNSUPPORTED_ESCAPES[ch])
        if ch == "N":
            close = src.index("}", self.pos)
            name = src[self.pos + 3 : close]
            self.pos = close + 1
            return unicodedata.lookup(name)
        if ch in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[ch]
            digits = src[self.pos + 2 : self.pos + 2 + width]
            self.pos += 2 + width
            return chr(int(digits, 16))
        self.pos += 2
        named = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a", "b": "\b"}
        return named.get(ch, ch)

    def char_class(self) -> _CharSet:
        src = self.src
        self.pos += 1
        result = _CharSet(negated=src.startswith("^", self.pos))
        self.pos += result.negated
        first = True
        while src[self.pos] != "]" or first:
            first = False
            if src.startswith(("\\d", "\\w", "\\s"), self.pos):
                if result.negated:
                    raise self.fail(f"{src[self.pos : self.pos + 2]} inside a negated class")
                result.shorthands.add(src[self.pos + 1])
                self.pos += 2
                continue
            if src.startswith("\\S", self.pos):
                raise self.fail("\\S inside a character class")
            low = self.class_char()
            high = low
            if src[self.pos] == "-" and src[self.pos + 1] != "]":
                self.pos += 1
                high = self.class_char()
            result.ranges.append((ord(low), ord(high)))
        self.pos += 1
        return result

    def class_char(self) -> str:
        if self.src[self.pos] == "\\":
            return self.escaped_char(in_class=True)
        self.pos += 1
        return self.src[self.pos - 1]

    def emit_literal(self, char: str) -> None:
        if self.json_string and (char in _JSON_ESCAPES or ord(char) < 0x20):
            self.out.append(re.escape(_json_escape(char)))
        else:
            self.out.append("\\" + char if char in _METACHARS else char)

    def emit_set(self, chars: _CharSet) -> None:
        if not self.json_string:
            self.out.append(_class_text(chars, extra=""))
            return
        # Raw part: the class without the characters JSON must escape; then the escapes of the
        # named ones the class admits (other control characters are left out: a subset).
        if chars.negated:
            raw = _class_text(chars, extra='"\\\\\\x00-\\x1f')
        else:
            kept = _subtract(chars.ranges, [(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C)])
            spaces = [(0x20, 0x20)] + _UNICODE_SPACES[1:] if "s" in chars.shorthands else []
            subset = _CharSet(ranges=kept + spaces, shorthands=chars.shorthands - {"s"})
            raw = _class_text(subset, extra="") if subset.ranges or subset.shorthands else ""
        alternatives = [raw] if raw else []
        alternatives += [re.escape(_json_escape(c)) for c in _JSON_ESCAPES if chars.contains(c)]
        if not alternatives:
            raise self.fail("a class of control characters only")
        joined = "|".join(alternatives)
        self.out.append(alternatives[0] if len(alternatives) == 1 else f"(?:{joined})")


def _class_text(chars: _CharSet, extra: str) -> str:
    """``[...]`` text for a class, with ``extra`` (already escaped) appended to its items."""
    head = ("^" if chars.negated else "") + "".join(f"\\{s}" for s in sorted(chars.shorthands))
    return class_text(chars.ranges, _class_char, head, extra)


def _class_char(code: int) -> str:
    char = chr(code)
    if char in _CLASS_SPECIALS:
        return "\\" + char
    return _NAMED_CONTROLS.get(char, char)


def _subtract(ranges: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    result = list(ranges)
    for hole_lo, hole_hi in holes:
        pieces = []
        for lo, hi in result:
            if hi < hole_lo or lo > hole_hi:
                pieces.append((lo, hi))
                continue
            if lo < hole_lo:
                pieces.append((lo, hole_lo - 1))
            if hi > hole_hi:
                pieces.append((hole_hi + 1, hi))
        result = pieces
    return result


def _json_escape(char: str) -> str:
    """How JSON writes ``char`` inside a string (only for characters it must escape)."""
    return "\\" + _JSON_ESCAPES[char] if char in _JSON_ESCAPES else f"\\u{ord(char):04x}"


def _escaped(text: str, index: int) -> bool:
    """Whether text[index] is preceded by an odd number of backslashes."""
    count = 0
    while index - count - 1 >= 0 and text[index - count - 1] == "\\":
        count += 1
    return count % 2 == 1
