"""Hypothesis strategies for what a client may put in a ``/generate`` request: sampling params
(in range, at and beyond the extremes, wrong types, lone surrogates, long stop lists), JSON
schemas (a recursive grammar over the keywords constrained decoding supports, and some it does
not) and regexes (literals, classes, groups, alternation, counted and open repetitions, and
bombs: nested counts, ambiguous stars, huge counts, unsupported and invalid syntax).

Bodies are encoded by ``encoded_bodies``, not by an HTTP client: a hostile client sends
``Infinity``, ``NaN`` and lone surrogates (escaped, or as raw bytes that are not UTF-8).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from hypothesis import strategies as st

from runtime.request_checks import INT64_MAX, INT64_MIN

Json = Any

EXTREME_INTS = [
    -1,
    0,
    1,
    2**31 - 1,
    2**31,
    2**53 + 1,
    INT64_MAX,
    INT64_MAX + 1,
    INT64_MIN,
    INT64_MIN - 1,
    10**30,
    -(10**30),
]
EXTREME_FLOATS = [
    0.0,
    -0.0,
    5e-324,
    -5e-324,
    1e-300,
    1e-5,
    0.9999999999999999,
    1.0000000000000002,
    2.0000000000000004,
    -2.0000000000000004,
    65536.00000000001,
    1e308,
    -1e308,
    math.inf,
    -math.inf,
    math.nan,
]
LONE_SURROGATES = st.characters(categories=("Cs",))

# ---- JSON values -----------------------------------------------------------------------

json_scalars: st.SearchStrategy[Json] = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**20), 10**20),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
# A value of the wrong type for any field (scalars, short lists, small objects).
wrong_types: st.SearchStrategy[Json] = st.one_of(
    json_scalars,
    st.lists(json_scalars, max_size=3),
    st.dictionaries(st.text(max_size=4), json_scalars, max_size=3),
)
with_surrogates = st.text(st.characters(codec="utf-8") | LONE_SURROGATES, min_size=1, max_size=6)
# Mostly plain text; one in five may hold lone surrogates (which the server must refuse).
texts = st.one_of(*[st.text(max_size=12)] * 4, with_surrogates)
# Any value at all for a field: extremes, non-finite numbers, wrong types, surrogates.
hostile_values: st.SearchStrategy[Json] = st.one_of(
    st.sampled_from(EXTREME_INTS),
    st.sampled_from(EXTREME_FLOATS),
    wrong_types,
    with_surrogates,
)


def floats_with_edges(low: float, high: float, *edges: float) -> st.SearchStrategy[float]:
    """Floats in ``[low, high]``, and often exactly the given edge values."""
    return st.one_of(st.floats(low, high), st.sampled_from([low, high, *edges]))


# ---- sampling params -------------------------------------------------------------------

LEGAL_STOP = st.text(min_size=1, max_size=12)
# Each field of SamplingParamsInput with values it accepts, extremes included (a temperature
# of 5e-324, a repetition penalty of 65536, a bias of -Infinity, 1024 stop token ids).
# max_new_tokens stays small: generation time.
VALID_FIELDS: dict[str, st.SearchStrategy[Json]] = {
    "max_new_tokens": st.integers(0, 24),
    "min_new_tokens": st.integers(0, 4),
    "temperature": floats_with_edges(0.0, 2.0, 5e-324, 1e-5, 1e-6, 1e4, 1e308),
    "top_p": floats_with_edges(5e-324, 1.0, 1e-9, 0.9999999999999999),
    "top_k": st.one_of(st.just(-1), st.integers(1, 4096), st.sampled_from([1, 4095, 4096])),
    "min_p": floats_with_edges(0.0, 1.0, 5e-324, 0.9999999999999999),
    "frequency_penalty": floats_with_edges(-2.0, 2.0),
    "presence_penalty": floats_with_edges(-2.0, 2.0),
    "repetition_penalty": floats_with_edges(5e-324, 65536.0, 1e-9, 1.0),
    "logit_bias": st.dictionaries(
        st.integers(0, 4095).map(str),
        floats_with_edges(-1e5, 1e5, -math.inf, -1e4, 1e4, 5e-324),
        max_size=8,
    ),
    "seed": st.integers(INT64_MIN, INT64_MAX),
    "stop": st.one_of(
        LEGAL_STOP,
        st.lists(LEGAL_STOP, max_size=4),
        st.lists(LEGAL_STOP, min_size=60, max_size=64),  # up to the cap, 64
        st.just(["x" * 1024]),  # the longest stop string
    ),
    "stop_token_ids": st.one_of(
        st.lists(st.integers(0, 4095), max_size=8),
        st.lists(st.integers(0, 4095), min_size=1024, max_size=1024),  # the cap
    ),
    "stop_regex": st.one_of(
        st.sampled_from(["[0-9]+", "\\n\\n", "(ab|cd){2}", "x{1,3}y"]),
        st.lists(st.sampled_from(["[0-9]+", "def", "\\s{4}"]), max_size=3),
    ),
    "ignore_eos": st.booleans(),
    "no_stop_trim": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "n": st.integers(1, 4),
    "choice": st.one_of(LEGAL_STOP, st.lists(LEGAL_STOP, min_size=1, max_size=5)),
    "json_object": st.booleans(),
    "grammar_best_effort": st.booleans(),
    "grammar_max_whitespace": st.integers(0, 64),
}
# Values the server must refuse, or that sit just past an edge.
INVALID_FIELDS: dict[str, st.SearchStrategy[Json]] = {
    "max_new_tokens": st.sampled_from([-1, INT64_MAX + 1, 1.0, True]),
    "top_k": st.sampled_from([0, -2, 4097, INT64_MAX]),
    "n": st.sampled_from([0, 5, INT64_MAX]),
    "logit_bias": st.dictionaries(
        st.sampled_from(["-1", "4096", "00012", "1e3", " 7", "9" * 25, "", "x"]),
        st.sampled_from([0.0, math.nan, math.inf, -math.inf, 1e308]),
        min_size=1,
        max_size=2,
    ),
    "stop": st.one_of(
        st.just(""),
        st.lists(LEGAL_STOP, min_size=65, max_size=66),
        st.just(["x" * 1025]),
    ),
    "stop_token_ids": st.one_of(
        st.lists(st.sampled_from([-1, 4096, INT64_MAX, INT64_MAX + 1]), min_size=1, max_size=2),
        st.lists(st.integers(0, 4095), min_size=1025, max_size=1025),
    ),
    "stop_regex": st.sampled_from(["(", "a{100000}", "(a|b)*c{2000}", "\\b"]),
    "grammar_max_whitespace": st.sampled_from([-1, 65]),
}


@st.composite
def sampling_params(draw: st.DrawFn) -> dict[str, Json]:
    """A few sampling fields with values the server accepts (extremes included); half the
    time one of them (or an unknown field) replaced by a value it must refuse: an invalid
    one, or any hostile value."""
    names = draw(st.lists(st.sampled_from(sorted(VALID_FIELDS)), max_size=5, unique=True))
    params = {name: draw(VALID_FIELDS[name]) for name in names}
    if draw(st.booleans()):
        return params
    name = draw(st.sampled_from([*sorted(VALID_FIELDS), "colour", "max_tokens", "\ud800"]))
    invalid = INVALID_FIELDS.get(name)
    params[name] = draw(hostile_values if invalid is None else invalid | hostile_values)
    return params


# ---- cache salts ------------------------------------------------------------------------

PRINTABLE_ASCII = st.characters(min_codepoint=0x20, max_codepoint=0x7E)
# What ``cache_salt`` may be: 1 to 256 printable ASCII characters, at the edges too.
valid_salts = st.one_of(
    st.text(PRINTABLE_ASCII, min_size=1, max_size=24),
    st.sampled_from([" ", "~", "x" * 256, '"\\/{}[]', "salt with spaces"]),
)


@st.composite
def _salt_with_one_bad_character(draw: st.DrawFn) -> str:
    salt = draw(st.text(PRINTABLE_ASCII, max_size=12))
    bad = draw(st.characters(codec="utf-8").filter(lambda c: not " " <= c <= "~") | LONE_SURROGATES)
    at = draw(st.integers(0, len(salt)))
    return salt[:at] + bad + salt[at:]


# Values ``cache_salt`` must refuse (a 400 naming it): empty, too long, a character that is not
# printable ASCII (controls, DEL, non-ASCII, lone surrogates), or not a string at all.
invalid_salts = st.one_of(
    st.just(""),
    st.text(PRINTABLE_ASCII, min_size=257, max_size=400),
    _salt_with_one_bad_character(),
    st.sampled_from(["\x00", "\x7f", "tab\t", "new\nline", "\u00e9", "\ufeff"]),
    hostile_values.filter(lambda v: v is not None and not isinstance(v, str)),
)


@st.composite
def encoded_bodies(draw: st.DrawFn, body: Json) -> bytes:
    """``body`` as JSON bytes: ``Infinity``/``NaN`` literals allowed; a lone surrogate either
    escaped (``\\ud800``) or written raw (bytes that are not UTF-8)."""
    if draw(st.booleans()):
        return json.dumps(body, allow_nan=True).encode()
    return json.dumps(body, allow_nan=True, ensure_ascii=False).encode("utf-8", "surrogatepass")


# ---- regexes ---------------------------------------------------------------------------

LITERAL_CHARS = "abcxyz019 _-.+*?()[]{}|^$\\/\"'\n\té€"
CLASSES = [
    "[a-c]",
    "[^a-z]",
    "[0-9a-f]",
    "[ab]",
    "[-x]",
    "[\\]]",
    "[^\\n]",
    "[é-ü]",
    "\\d",
    "\\w",
    "\\s",
    "\\S",
    ".",
]
BOMBS = [
    "(a{1,20}){1,20}",
    "((a|b){20}){20}",
    "(a*)*",
    "(a|a)*b",
    "(a+)+$",
    "[ab]*a[ab]{14}",
    "(x{1,100}){1,100}y",
    "a{10000}",
    "a{100001}",
    "((((a{2}){2}){2}){2}){2}",
    "(?:[0-9]{1,3}\\.){3}[0-9]{1,3}",
]
UNSUPPORTED_OR_INVALID = [
    "(?=a)a",
    "(a)\\1",
    "\\bword\\b",
    "(?i)abc",
    "a^b",
    "\\D+",
    "(",
    "a{2,1}",
    "[z-a]",
    "\\",
    "*a",
    "",
]


def _quantified(atom: str, draw: st.DrawFn) -> str:
    low = draw(st.integers(0, 4))
    high = low + draw(st.integers(0, 4))
    suffix = draw(
        st.sampled_from(["", "", "*", "+", "?", f"{{{low}}}", f"{{{low},{high}}}", f"{{{low},}}"])
    )
    if suffix and draw(st.integers(0, 5)) == 0:
        suffix += "?"  # lazy
    return atom + suffix if suffix else atom


@st.composite
def _atoms(draw: st.DrawFn) -> str:
    if draw(st.booleans()):
        return re.escape(draw(st.text(st.sampled_from(LITERAL_CHARS), min_size=1, max_size=3)))
    return draw(st.sampled_from(CLASSES))


def _extend(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    @st.composite
    def combined(draw: st.DrawFn) -> str:
        kind = draw(st.sampled_from(["concat", "alternation", "group", "repeat"]))
        if kind == "concat":
            return "".join(draw(st.lists(children, min_size=2, max_size=3)))
        if kind == "alternation":
            return "|".join(draw(st.lists(children, min_size=2, max_size=3)))
        inner = draw(children)
        group = draw(st.sampled_from(["({})", "(?:{})"])).format(inner)
        return _quantified(group, draw) if kind == "repeat" else group

    return combined()


@st.composite
def _quantified_atoms(draw: st.DrawFn) -> str:
    return _quantified(draw(_atoms()), draw)


regexes: st.SearchStrategy[str] = st.one_of(
    st.recursive(_quantified_atoms(), _extend, max_leaves=8),
    st.recursive(_quantified_atoms(), _extend, max_leaves=8),
    st.sampled_from(BOMBS),
    st.sampled_from(UNSUPPORTED_OR_INVALID),
)


# ---- JSON schemas ----------------------------------------------------------------------

FORMATS = ["date", "time", "date-time", "email", "uuid", "ipv4", "ipv6", "uri", "hostname", "zz"]
PROPERTY_NAMES = st.sampled_from(["a", "b", "name", "id", "x y", "é", '"q"', ""])
# Patterns for string schemas: plain enough that every JSON-schema validator reads them alike.
simple_patterns = st.one_of(
    st.sampled_from(["^[a-z]+$", "[0-9]{2,4}", "^(ab|cd)*$", "x?y+", "^\\w{1,5}$", "(", "\\bq"]),
    st.recursive(_quantified_atoms(), _extend, max_leaves=3).map(lambda p: f"^{p}$"),
)


@st.composite
def _string_schema(draw: st.DrawFn) -> dict[str, Json]:
    schema: dict[str, Json] = {"type": "string"}
    if draw(st.booleans()):
        schema["minLength"] = draw(st.integers(0, 6))
    if draw(st.booleans()):
        schema["maxLength"] = schema.get("minLength", 0) + draw(st.integers(-1, 8))
    if draw(st.integers(0, 3)) == 0:
        schema["pattern"] = draw(simple_patterns)
    if draw(st.integers(0, 3)) == 0:
        schema["format"] = draw(st.sampled_from(FORMATS))
    return schema


@st.composite
def _number_schema(draw: st.DrawFn) -> dict[str, Json]:
    kind = draw(st.sampled_from(["integer", "number"]))
    schema: dict[str, Json] = {"type": kind}
    bound = st.integers(-1000, 1000) if kind == "integer" else st.floats(-1e3, 1e3)
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        if draw(st.integers(0, 2)) == 0:
            schema[key] = draw(bound | st.sampled_from([INT64_MAX, INT64_MIN, 1e308]))
    if draw(st.integers(0, 5)) == 0:
        schema["multipleOf"] = draw(st.sampled_from([2, 3, 0.5, 0.01, 1e-9]))
    return schema


schema_leaves: st.SearchStrategy[dict[str, Json]] = st.one_of(
    _string_schema(),
    _number_schema(),
    st.sampled_from([{"type": "boolean"}, {"type": "null"}, {"type": ["string", "null"]}, {}]),
    st.lists(json_scalars, min_size=1, max_size=4, unique_by=json.dumps).map(
        lambda values: {"enum": values}
    ),
    json_scalars.map(lambda value: {"const": value}),
    st.just({"$ref": "#/$defs/item"}),
)


def _schema_nodes(children: st.SearchStrategy[dict[str, Json]]) -> st.SearchStrategy[Json]:
    @st.composite
    def objects(draw: st.DrawFn) -> dict[str, Json]:
        properties = draw(st.dictionaries(PROPERTY_NAMES, children, max_size=4))
        schema: dict[str, Json] = {"type": "object", "properties": properties}
        names = sorted(properties)
        schema["required"] = draw(st.lists(st.sampled_from(names), unique=True)) if names else []
        extra = draw(st.sampled_from([None, False, True]))
        if extra is not None:
            schema["additionalProperties"] = extra
        return schema

    @st.composite
    def arrays(draw: st.DrawFn) -> dict[str, Json]:
        schema: dict[str, Json] = {"type": "array", "items": draw(children)}
        low = draw(st.integers(0, 3))
        if draw(st.booleans()):
            schema["minItems"] = low
        if draw(st.booleans()):
            schema["maxItems"] = low + draw(st.integers(-1, 3))
        return schema

    combinations = st.tuples(
        st.sampled_from(["anyOf", "oneOf", "allOf"]), st.lists(children, min_size=1, max_size=3)
    ).map(lambda pair: {pair[0]: pair[1]})
    return st.one_of(objects(), arrays(), combinations)


def _nested(depth: int) -> dict[str, Json]:
    schema: dict[str, Json] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema, "maxItems": 1}
    return schema


LINKED_LIST = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "v": {"type": "integer"},
                "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]},
            },
            "required": ["v", "next"],
        }
    },
    "$ref": "#/$defs/node",
}


@st.composite
def json_schemas(draw: st.DrawFn) -> dict[str, Json]:
    """A JSON schema (2020-12), mostly with a ``$defs/item`` its ``$ref``s point to."""
    tree = st.recursive(schema_leaves, _schema_nodes, max_leaves=10)
    kind = draw(st.integers(0, 19))
    if kind == 0:
        return LINKED_LIST
    if kind == 1:
        return _nested(draw(st.sampled_from([30, 120, 300])))
    schema = dict(draw(tree))
    schema["$defs"] = {"item": draw(schema_leaves.filter(lambda s: "$ref" not in s))}
    return schema
