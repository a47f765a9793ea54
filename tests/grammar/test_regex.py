"""Regex analysis and translation, and stop_regex matching, against Python's ``re``."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grammar import GrammarError, StopRegex, to_backend_regex
from grammar.regex import to_json_string_regex


@pytest.mark.parametrize(
    ("pattern", "construct"),
    [
        ("a(?=b)b", "lookahead"),
        ("a(?!b).", "negative lookahead"),
        ("(?<=a)b", "lookbehind"),
        ("(?<!a)b", "negative lookbehind"),
        (r"(a)\1", "backreferences"),
        (r"(?P<x>a)(?P=x)", "backreferences"),
        (r"\bword", "word boundaries"),
        ("(?i)abc", "inline flags"),
        ("a++", "possessive"),
        ("(?>ab)", "atomic groups"),
        ("a|^b", "anchor"),
        ("a$b", "anchor"),
        (r"\W+", r"\\W"),
        (r"\D", r"\\D"),
        (r"[^\d]", "negated class"),
        (r"[\S]", "inside a character class"),
        ("(", "invalid regex"),
        ("[b-a]", "invalid regex"),
        ("[^\\s\\S]x", "negated class"),
        ("a{2}{", "interegular cannot parse it"),
    ],
)
def test_unsupported_regex_is_rejected_by_name(pattern: str, construct: str) -> None:
    with pytest.raises(GrammarError, match=construct):
        to_backend_regex(pattern)


@pytest.mark.parametrize(
    ("pattern", "rewritten"),
    [
        (r"^\x41b$", "Ab"),
        (r"(?P<year>\d{4})", r"(?:[\d]{4})"),
        (r"a.b", "a[^\\n]b"),
        (r"\#\ ", "# "),
        ("[]a]", "[\\]a]"),
    ],
)
def test_rewrites(pattern: str, rewritten: str) -> None:
    assert to_backend_regex(pattern) == rewritten


PATTERNS = [
    r"[a-c]{1,3}",
    r"\S{2}",
    r'["\\x]{1,3}',
    r"a.b",
    r"(foo|ba[rz])+",
    r"[^a]{2}",
    r"\d{2}\.\d",
    r"[ -~]{3}",
    r"\s\w",
    r"é\u3000[\u00e0-\u00ff]",
]


@pytest.mark.parametrize("pattern", PATTERNS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_translations_keep_python_semantics(pattern: str, data: st.DataObject) -> None:
    text = data.draw(st.from_regex(pattern, fullmatch=True))
    assert re.fullmatch(to_backend_regex(pattern), text)
    if not any(ord(c) < 0x20 for c in text):  # classes never emit raw control characters
        escaped = json.dumps(text, ensure_ascii=False)[1:-1]
        assert re.fullmatch(to_json_string_regex(pattern), escaped)


@pytest.mark.parametrize("pattern", PATTERNS)
@settings(max_examples=40, deadline=None)
@given(text=st.text(alphabet='abcfoxz"\\ .é-9\n\t', max_size=5))
def test_json_string_regex_admits_only_matching_values(pattern: str, text: str) -> None:
    escaped = json.dumps(text, ensure_ascii=False)[1:-1]
    if re.fullmatch(to_json_string_regex(pattern), escaped):
        assert re.fullmatch(pattern, text)


def test_stop_regex_streams_across_chunks() -> None:
    stop = StopRegex([r"\d{3}", "END"])
    assert stop.feed("abc 12") is None
    assert stop.feed("x 4567") == (8, 11)
    assert stop.feed("more") == (8, 11)
    assert StopRegex([r"ab+c"]).feed("aab") is None


def test_stop_regex_rejects_bad_patterns() -> None:
    for pattern, message in [("a*", "empty string"), ("(", "invalid"), (r"\bx", "unsupported")]:
        with pytest.raises(GrammarError, match=message):
            StopRegex([pattern])


def _reference_match(patterns: list[str], text: str) -> tuple[int, int] | None:
    """Brute force: the earliest-ending match, earliest start among those."""
    for end in range(1, len(text) + 1):
        for start in range(end):
            if any(re.fullmatch(p, text[start:end]) for p in patterns):
                return start, end
    return None


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet="ab1c ", max_size=12),
    cuts=st.lists(st.integers(0, 12), max_size=3),
    patterns=st.lists(
        st.sampled_from(["ab+", "b1", "[0-9]c", "a b", "c{2,3}", "(ab|ba)1"]),
        min_size=1,
        max_size=3,
    ),
)
def test_stop_regex_matches_brute_force(text: str, cuts: list[int], patterns: list[str]) -> None:
    stop = StopRegex(patterns)
    found = None
    last = 0
    for cut in sorted(c for c in cuts if c <= len(text)) + [len(text)]:
        found = stop.feed(text[last:cut])
        last = cut
    assert found == _reference_match(patterns, text)
