"""Keywords enforced with automata of our own (issue 16): ``multipleOf`` with bounds and
decimal steps, ``uniqueItems`` over listed items, lengths or a format beside a ``pattern``,
``propertyNames``, and pattern keys that could repeat a declared property.

Three kinds of evidence: the automata agree with arithmetic and Python's ``re`` (hypothesis);
xgrammar alone breaks each of these schemas (sampled, so the work is needed); and every
finished output of our grammars validates (random logits and the tiny model), while chosen
valid and invalid texts are accepted and refused exactly.
"""

from __future__ import annotations

import json
import re
from fractions import Fraction
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import xgrammar as xgr
from hypothesis import given, settings
from hypothesis import strategies as st

from grammar import GrammarBackend, GrammarError, GrammarSpec, UnsupportedSchemaFeature
from grammar.automaton import difference, intersection, union, with_lengths
from grammar.json_grammar import printed_ebnf
from grammar.regex_automaton import literals_dfa, pattern_dfa
from grammar.schema_numbers import StepTooLarge, multiple_of_dfa, scaled_step
from grammar.schema_unique import MAX_STATES as MAX_UNIQUE_STATES
from tests.grammar.decoder import ConstrainedDecoder, sample_random
from tests.grammar.schema_corpus import validate_output

BIAS = 4.0  # helps a random model finish (decoder.py); the mask alone decides validity

# ---- the automata against arithmetic and Python's re ------------------------------------


def _numerals(scaled: int, places: int) -> list[str]:
    """Every way to write scaled / 10^places with 0..places+1 fraction digits (no exponent)."""
    value = Fraction(scaled, 10**places)
    out = []
    for digits in range(places + 2):
        shifted = value * 10**digits
        if shifted.denominator != 1:
            continue
        text = str(abs(int(shifted))).rjust(digits + 1, "0")
        body = f"{text[:-digits]}.{text[-digits:]}" if digits else text
        out.append(("-" if shifted < 0 else "") + body)
    return out


@settings(max_examples=60, deadline=None)
@given(
    step=st.sampled_from([1, 2, 3, 7, 10, 12, 25, 40]),
    places=st.integers(0, 2),
    low=st.none() | st.integers(-300, 300),
    high=st.none() | st.integers(-300, 300),
    exclusive=st.booleans(),
)
def test_multiple_of_automaton_is_exact(
    step: int, places: int, low: int | None, high: int | None, exclusive: bool
) -> None:
    """Over a window of values: accepted exactly when within the bounds and a multiple."""
    unit = Fraction(1, 10**places)
    sub: dict[str, Any] = {"multipleOf": float(step * unit) if places else step}
    if low is not None:
        sub["exclusiveMinimum" if exclusive else "minimum"] = float(low * unit)
    if high is not None:
        sub["maximum"] = float(high * unit)
    dfa = multiple_of_dfa(sub, integer=False)
    written = scaled_step(sub["multipleOf"])[1]  # type: ignore[index]  # fraction digits written
    for scaled in range(-400, 401):
        value = scaled * unit
        within = (low is None or (value > low * unit if exclusive else value >= low * unit)) and (
            high is None or value <= high * unit
        )
        wanted = within and scaled % step == 0
        for text in _numerals(scaled, places):
            expected = wanted and len(text.partition(".")[2]) <= written and text != "-0"
            assert dfa.accepts(text) == expected, (sub, text)
    for text in ("", "-", ".", "1.", "01", "-0", "+1", "1e2", "0.", "--1"):
        assert not dfa.accepts(text)


def test_integer_steps_and_refusals() -> None:
    # An integer is a multiple of 2.5 exactly when it is one of 5.
    dfa = multiple_of_dfa({"multipleOf": 2.5, "minimum": -20, "maximum": 20}, integer=True)
    assert [n for n in range(-25, 26) if dfa.accepts(str(n))] == list(range(-20, 21, 5))
    with pytest.raises(StepTooLarge):
        multiple_of_dfa({"multipleOf": 997, "minimum": 0, "maximum": 2**62}, integer=True)


_ATOMS = ["a", "b", "[ab]", "[^a]", ".", "\\d", "(?:ab|c)", "x"]


@st.composite
def _patterns(draw: st.DrawFn) -> str:
    parts = []
    for _ in range(draw(st.integers(1, 4))):
        atom = draw(st.sampled_from(_ATOMS))
        parts.append(atom + draw(st.sampled_from(["", "*", "+", "?", "{1,2}"])))
    body = "".join(parts)
    return draw(st.sampled_from(["", "^"])) + body + draw(st.sampled_from(["", "$"]))


@settings(max_examples=80, deadline=None)
@given(pattern=_patterns(), texts=st.lists(st.text("abcx1\n", max_size=6), max_size=40))
def test_pattern_automata_agree_with_python(pattern: str, texts: list[str]) -> None:
    """On ASCII strings the automata are Python's fullmatch and search exactly, except that
    a final ``$`` does not also match before a trailing newline (a subset)."""
    full = pattern_dfa(pattern, 400)
    found = pattern_dfa(pattern, 400, search=True)
    for text in texts:
        assert full.accepts(text) == (re.fullmatch(pattern, text) is not None), (pattern, text)
        searched = re.search(pattern, text) is not None
        if found.accepts(text) or not text.endswith("\n"):
            assert found.accepts(text) == searched, (pattern, text)


@settings(max_examples=40, deadline=None)
@given(
    a=_patterns(),
    b=_patterns(),
    low=st.integers(0, 3),
    span=st.none() | st.integers(0, 3),
    texts=st.lists(st.text("abcx1", max_size=6), max_size=40),
)
def test_automaton_operations(a: str, b: str, low: int, span: int | None, texts: list[str]) -> None:
    dfa_a, dfa_b = pattern_dfa(a, 400), pattern_dfa(b, 400)
    both, either = intersection(dfa_a, dfa_b, 4000), union(dfa_a, dfa_b, 4000)
    only_a = difference(dfa_a, dfa_b, 4000)
    high = None if span is None else low + span
    sized = with_lengths(dfa_a, low, high, 4000)
    for text in texts:
        in_a, in_b = dfa_a.accepts(text), dfa_b.accepts(text)
        assert both.accepts(text) == (in_a and in_b)
        assert either.accepts(text) == (in_a or in_b)
        assert only_a.accepts(text) == (in_a and not in_b)
        fits = len(text) >= low and (high is None or len(text) <= high)
        assert sized.accepts(text) == (in_a and fits)


def test_an_exploding_pattern_is_refused_quickly() -> None:
    """[ab]*a[ab]{14} has 2^15 states; interegular took over 30 s to build it."""
    schema = {"type": "string", "pattern": "^[ab]*a[ab]{14}$", "maxLength": 20}
    with pytest.raises(UnsupportedSchemaFeature) as info:
        GrammarSpec.for_json_schema(schema)
    assert info.value.keyword == "maxLength" and "states" in str(info.value)
    assert literals_dfa(["ab", "a"], 10).accepts("ab")


# ---- xgrammar alone breaks each of these (sampled from its own grammar) --------------------

RAW_EVIDENCE: list[tuple[str, dict[str, Any]]] = [
    (
        "multipleOf, wide range",
        {"type": "integer", "minimum": 0, "maximum": 100000, "multipleOf": 3},
    ),
    ("multipleOf, one bound", {"type": "integer", "minimum": 0, "multipleOf": 2}),
    ("multipleOf on numbers", {"type": "number", "minimum": 0, "maximum": 2, "multipleOf": 0.5}),
    (
        "uniqueItems",
        {
            "type": "array",
            "items": {"enum": [0, 1]},
            "minItems": 2,
            "maxItems": 2,
            "uniqueItems": True,
        },
    ),
    ("pattern and minLength", {"type": "string", "pattern": "^(ab|c)+$", "minLength": 6}),
    (
        "propertyNames repeating a declared property",
        {
            "type": "object",
            "properties": {"a": {"type": "boolean"}},
            "additionalProperties": {"type": "integer"},
            "propertyNames": {"enum": ["a", "b"]},
        },
    ),
]  # fmt: skip


@pytest.mark.parametrize(("name", "schema"), RAW_EVIDENCE, ids=[n for n, _ in RAW_EVIDENCE])
def test_the_backend_alone_breaks_these(
    name: str, schema: dict[str, Any], backend: GrammarBackend, decoder: ConstrainedDecoder
) -> None:
    raw = xgr.Grammar.from_json_schema(
        json.dumps(schema), strict_mode=True, any_whitespace=False, separators=(",", ":")
    )
    compiled = backend.compile(GrammarSpec.for_ebnf(printed_ebnf(raw)))
    violations = 0
    for seed in range(60):
        tokens, done = sample_random(compiled, decoder.vocab_size, seed, 48, BIAS * decoder.closing)
        if done:
            try:
                validate_output(schema, decoder.tokenizer.decode(tokens[:-1]))
            except (ValueError, jsonschema.ValidationError):
                violations += 1
    assert violations > 0, f"{name}: xgrammar now enforces it; our automaton can go"


# ---- ours: every finished output validates ---------------------------------------------------

EXACT: list[tuple[str, dict[str, Any]]] = [
    ("multipleOf, wide range", RAW_EVIDENCE[0][1]),
    ("multipleOf, one bound", {"type": "integer", "exclusiveMinimum": -40, "multipleOf": 7}),
    ("multipleOf 0.01", {"type": "number", "minimum": 0, "maximum": 5, "multipleOf": 0.01}),
    ("multipleOf 2.5", {"type": "number", "exclusiveMaximum": 100, "multipleOf": 2.5}),
    ("multipleOf, integer or null", {"type": ["integer", "null"], "multipleOf": 4, "maximum": 50}),
    ("multipleOf 2.5 on integers", {"type": "integer", "minimum": -50, "multipleOf": 2.5}),
    (
        "multipleOf beside string keywords",
        {
            "type": ["integer", "string"],
            "multipleOf": 3,
            "minimum": 0,
            "maximum": 30,
            "pattern": "^[a-c]{2}$",
        },
    ),
    (
        "multipleOf beside a unique array that admits nothing",
        {
            "type": ["integer", "array"],
            "items": {"enum": [1, 2]},
            "uniqueItems": True,
            "minItems": 3,
            "multipleOf": 2,
            "minimum": 0,
            "maximum": 9,
        },
    ),
    (
        "uniqueItems over an enum",
        {"type": "array", "items": {"enum": ["a", "b", "c", "d"]}, "uniqueItems": True},
    ),
    (
        "uniqueItems with bounds",
        {
            "type": "array",
            "items": {"enum": [0, 1, 2, 1.0]},
            "minItems": 2,
            "maxItems": 3,
            "uniqueItems": True,
        },
    ),
    (
        "uniqueItems over booleans behind a reference",
        {
            "$defs": {"flag": {"type": "boolean"}},
            "type": "object",
            "properties": {
                "flags": {"type": "array", "items": {"$ref": "#/$defs/flag"}, "uniqueItems": True},
                "kinds": {
                    "type": ["array", "null"],
                    "items": {"anyOf": [{"const": "x"}, {"const": "y"}, {"type": "null"}]},
                    "uniqueItems": True,
                },
            },
            "required": ["flags", "kinds"],
        },
    ),
    (
        "pattern and lengths",
        {
            "type": "string",
            "pattern": "^[a-z]([-a-z0-9]*[a-z0-9])?$",
            "minLength": 3,
            "maxLength": 9,
        },
    ),
    ("pattern and minLength", RAW_EVIDENCE[4][1]),
    ("a searched pattern and maxLength", {"type": "string", "pattern": "ab", "maxLength": 5}),
    ("format and pattern", {"type": "string", "format": "date", "pattern": "^2"}),
    ("format and lengths", {"type": "string", "format": "ipv4", "maxLength": 9}),
    ("propertyNames repeating a declared property", RAW_EVIDENCE[5][1]),
    (
        "a typeless propertyNames pattern",
        {
            "type": "object",
            "additionalProperties": {"type": "integer"},
            "propertyNames": {"pattern": "^[a-c]+$"},
            "maxProperties": 2,
        },
    ),
    (
        "propertyNames, lengths and declared names",
        {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "toolong": {"type": "null"}},
            "required": ["ok"],
            "additionalProperties": {"type": "integer"},
            "propertyNames": {"maxLength": 2},
            "maxProperties": 3,
        },
    ),
    (
        "propertyNames beside patternProperties",
        {
            "type": "object",
            "patternProperties": {"^x": {"type": "integer"}},
            "propertyNames": {"enum": ["xa", "xb", "y"]},
        },
    ),
    (
        "overlapping patterns",
        {
            "type": "object",
            "patternProperties": {
                "^[xy]$": {"type": "integer"},
                "^[yz]$": {"type": "string", "maxLength": 2},
                "^w": {},
            },
            "maxProperties": 2,
        },
    ),
    (
        "a declared name a pattern matches",
        {
            "type": "object",
            "properties": {"xa": {"type": ["boolean", "integer"]}, "xb": {"type": "boolean"}},
            "patternProperties": {"^x": {"type": "integer"}},
            "maxProperties": 2,
        },
    ),
    (
        "false properties and patterns beside others",
        {
            "type": "object",
            "properties": {"a": False, "bb": {"type": "null"}},
            "patternProperties": {"^x": False, "^[a-z]$": {"type": "integer"}},
            "maxProperties": 2,
        },
    ),
    (
        "a false property beside additionalProperties",
        {
            "type": "object",
            "properties": {"a": False},
            "additionalProperties": {"type": "integer"},
            "propertyNames": {"maxLength": 1},
            "maxProperties": 2,
        },
    ),
    (
        "a pattern key that could spell a declared name",
        {
            "type": "object",
            "properties": {"ab": {"type": "integer", "minimum": 0, "maximum": 5}},
            "patternProperties": {"^a[a-c]$": {"type": "integer"}},
            "required": ["ab"],
        },
    ),
]  # fmt: skip


def _compile(backend: GrammarBackend, schema: dict[str, Any]) -> Any:
    return backend.compile(GrammarSpec.for_json_schema(schema))


@pytest.mark.parametrize(("name", "schema"), EXACT, ids=[n for n, _ in EXACT])
def test_outputs_validate_under_random_logits(
    name: str, schema: dict[str, Any], backend: GrammarBackend, decoder: ConstrainedDecoder
) -> None:
    compiled = _compile(backend, schema)
    finished = 0
    for seed in range(40):
        tokens, done = sample_random(compiled, decoder.vocab_size, seed, 64, BIAS * decoder.closing)
        if done:
            finished += 1
            validate_output(schema, decoder.tokenizer.decode(tokens[:-1]))
    assert finished >= 10, f"{name}: only {finished} outputs finished"


@pytest.mark.parametrize(("name", "schema"), EXACT, ids=[n for n, _ in EXACT])
def test_outputs_validate_with_the_tiny_model(
    name: str, schema: dict[str, Any], backend: GrammarBackend, decoder: ConstrainedDecoder
) -> None:
    compiled = _compile(backend, schema)
    seeds = range(4)
    for result in decoder.generate([compiled] * 4, seeds, 64, 1.0, BIAS):
        if result.terminated:
            validate_output(schema, result.text)


def _accepts(compiled: Any, decoder: ConstrainedDecoder, text: str) -> bool:
    """Whether the grammar takes ``text`` whole and may then end."""
    matcher = compiled.new_matcher()
    for token in decoder.tokenizer.encode(text, add_special_tokens=False):
        if not matcher.accept_token(token):
            return False
    return any(matcher.accept_token(stop) for stop in sorted(decoder.stop_ids)[:1])


_BY_NAME = dict(EXACT)
# (schema, texts it must accept, texts it must refuse)
ACCEPTANCE: list[tuple[dict[str, Any], list[str], list[str]]] = [
    (_BY_NAME["multipleOf, wide range"], ["0", "99999", "3", "300"], ["4", "100002", "-3", "03"]),
    (_BY_NAME["multipleOf 0.01"], ["4.6", "0.07", "5", "0", "5.00"], ["4.601", "5.01", "-0.01"]),
    (_BY_NAME["multipleOf beside string keywords"], ["27", '"ab"'], ["28", "33", '"ad"']),
    (_BY_NAME["multipleOf beside a unique array that admits nothing"], ["8"], ["[1,2]", "7"]),
    (
        _BY_NAME["uniqueItems over an enum"],
        ['["a","b"]', "[]", '["d","c","b","a"]'],
        ['["a","a"]', '["a","b","a"]'],
    ),
    (_BY_NAME["uniqueItems with bounds"], ["[0,1]", "[2,1,0]"], ["[0]", "[1,1.0]", "[0,1,2,1]"]),
    (
        _BY_NAME["a searched pattern and maxLength"],
        ['"ab"', '"xaby"', '"abab"'],
        ['"a"', '"xxxab1"', '"b"'],
    ),
    (_BY_NAME["format and pattern"], ['"2024-02-29"'], ['"1999-01-01"', '"2023-02-29"']),
    (
        _BY_NAME["a pattern key that could spell a declared name"],
        ['{"ab":3}', '{"ab":3,"ac":77}'],
        ['{"ab":3,"ab":77}', '{"ab":9}'],
    ),
    (
        _BY_NAME["overlapping patterns"],
        ['{"x":1,"z":"ab"}', '{"w1":[]}'],
        ['{"y":1}', '{"y":"a"}', '{"w":1,"x":1,"z":""}'],
    ),
    (_BY_NAME["a declared name a pattern matches"], ['{"xa":1}'], ['{"xa":true}', '{"xb":true}']),
    (
        _BY_NAME["false properties and patterns beside others"],
        ['{"bb":null,"c":1}'],
        ['{"a":1}', '{"x":1}', '{"bb":null,"bb":1}'],
    ),
    (_BY_NAME["a false property beside additionalProperties"], ['{"b":1}'], ['{"a":1}']),
    (
        _BY_NAME["propertyNames repeating a declared property"],
        ['{"a":true,"b":1}', '{"b":2}'],
        ['{"a":true,"a":1}', '{"a":5}', '{"c":1}'],
    ),
    (
        _BY_NAME["propertyNames, lengths and declared names"],
        ['{"ok":true,"a":1}'],
        ['{"ok":true,"toolong":null}', '{"ok":true,"abc":1}'],
    ),
]


@pytest.mark.parametrize(("schema", "accepted", "refused"), ACCEPTANCE)
def test_chosen_texts_are_accepted_and_refused_exactly(
    schema: dict[str, Any],
    accepted: list[str],
    refused: list[str],
    backend: GrammarBackend,
    decoder: ConstrainedDecoder,
) -> None:
    compiled = _compile(backend, schema)
    for text in accepted:
        validate_output(schema, text)
        assert _accepts(compiled, decoder, text), text
    for text in refused:
        assert not _accepts(compiled, decoder, text), text


# ---- what stays refused, and what admits nothing ------------------------------------------


def test_unique_items_beyond_the_state_bound_are_refused() -> None:
    small = {"type": "array", "items": {"enum": list(range(8))}, "uniqueItems": True}
    GrammarSpec.for_json_schema(small)  # 2^8 = 256 sets of used values
    assert MAX_UNIQUE_STATES == 256
    with pytest.raises(UnsupportedSchemaFeature, match="grammar states"):
        GrammarSpec.for_json_schema({**small, "items": {"enum": list(range(9))}})
    # A maxItems keeps the sets small: C(20, 0..2) = 211.
    GrammarSpec.for_json_schema({**small, "items": {"enum": list(range(20))}, "maxItems": 2})


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (
            {"type": "array", "items": {"const": "a"}, "minItems": 2, "uniqueItems": True},
            "admits no array",
        ),
        ({"type": "integer", "minimum": 1, "maximum": 4, "multipleOf": 5}, "admits no number"),
        ({"type": "string", "pattern": "^a+$", "minLength": 3, "maxLength": 2}, "minLength 3"),
        ({"type": "string", "format": "date", "maxLength": 9}, "admits no string"),
        (
            {
                "type": "object",
                "properties": {"long": {}},
                "required": ["long"],
                "propertyNames": {"maxLength": 2},
            },
            "admits no object",
        ),
    ],
)
def test_what_admits_nothing_says_so(schema: dict[str, Any], message: str) -> None:
    with pytest.raises(GrammarError, match=message):
        GrammarSpec.for_json_schema(schema)


def test_reserved_placeholder_strings_are_refused() -> None:
    with pytest.raises(GrammarError, match="reserved"):
        GrammarSpec.for_json_schema({"enum": ["ARBORVALUE0", "x"]})
