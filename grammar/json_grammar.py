"""JSON schema -> EBNF: check, lower, convert with xgrammar, then splice in our string grammars.

The text xgrammar prints for a schema grammar parses back to the same grammar (once its
``\\x`` escapes are made unambiguous, see ``printed_ebnf``); we replace each
placeholder ``Regex("^ARBORSTRING<i>$", json_string=true)`` with a rule of ours: the EBNF that
xgrammar's regex converter (correct, unlike its JSON-string regex mode) makes of our translated
pattern, or a bounded run of characters that need no JSON escaping.
"""

from __future__ import annotations

import copy
import json
import logging
import re
from typing import Any

import xgrammar as xgr

from grammar.errors import GrammarError
from grammar.json_layout import BACKEND_STYLE, align_whitespace
from grammar.options import JsonLayout
from grammar.schema_check import check_schema
from grammar.schema_lower import lower_schema
from grammar.schema_refs import backend_refs, table_key
from grammar.schema_rules import STRING_PLACEHOLDER, VALUE_PLACEHOLDER, Rule, StringRule
from grammar.schema_unique import WHITESPACE
from grammar.schema_walk import iter_subschemas

_STRING_PLACEHOLDER = re.compile(rf'Regex\("\^{STRING_PLACEHOLDER}(\d+)\$", json_string=true\)')
# A const string prints as an EBNF literal of its JSON text: "\"ARBORVALUE3\"".
_VALUE_PLACEHOLDER = re.compile(rf'"\\"{VALUE_PLACEHOLDER}(\d+)\\""')
# Quoted literals and classes (skipped when renaming), a rule name of a grammar of ours, or
# the whitespace a value rule allows between its tokens.
_EBNF_TOKEN = re.compile(
    rf'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|\broot((?:_\d+)*)\b|\b{WHITESPACE}\b'
)
_PLAIN_CHAR = '[^"\\\\\\0-\\x1f]'
# An escaped backslash, or a \xHH escape (taken alone so "\\x41" is left as it is).
_HEX_ESCAPE = re.compile(r"\\\\|\\x([0-9a-fA-F]{2})")
_BACKEND_ERRORS = (RuntimeError, ValueError, TypeError)
# Subschemas tried alone to find the one the backend refuses.
_MAX_PROBES = 200
# The backend's refusals the checks may let through, in our words.
_KNOWN = [
    (re.compile(r"Schema 'false' cannot accept any value"), "it admits no value"),
    (
        re.compile(r"minItems is greater than the number of prefixItems.*: (\d+) > (\d+)"),
        "it admits no array (minItems {0}, but at most {1} items)",
    ),
    (
        re.compile(r"prefixItems contains false"),
        "it admits no array (a prefixItems entry is false)",
    ),
    (re.compile(r"Invalid range: "), "it admits no number (its bounds leave none)"),
    (
        re.compile(r"minLength (\d+) is greater than maxLength (\d+)"),
        "minLength {0} > maxLength {1}",
    ),
    (
        re.compile(r"min(Items|Properties) is greater than max\w+: (\d+) > (\d+)"),
        "min{0} {1} > max{0} {2}",
    ),
]
logger = logging.getLogger(__name__)


def json_schema_ebnf(schema: dict[str, Any], best_effort: bool, layout: JsonLayout) -> str:
    """EBNF (root rule ``root``) for JSON text valid under ``schema``.

    layout 0: compact separators and no whitespace; N > 0: whitespace runs of at most N
    characters between tokens; "aligned": the layouts a pretty-printer writes
    (``grammar.json_layout``). Raises GrammarError (or its subclass UnsupportedSchemaFeature)
    for schemas that cannot be enforced exactly, unless best_effort, and AlignmentUnavailable
    when the aligned layout cannot be applied (the caller falls back to compact).
    """
    lowered, rules = lower_schema(check_schema(schema, best_effort=best_effort))
    style: dict[str, Any]
    if layout == "aligned":
        style = dict(BACKEND_STYLE)
    elif layout > 0:
        style = {"any_whitespace": True, "max_whitespace_cnt": layout}
    else:
        style = {"any_whitespace": False, "separators": (",", ":")}
    try:
        grammar = _convert(lowered, style)
    except _BACKEND_ERRORS as exc:
        raise _refusal(lowered, style, exc) from None
    if layout != "aligned":
        return splice_rules(printed_ebnf(grammar), rules, layout)
    spliced = splice_rules(printed_ebnf(grammar), rules, WHITESPACE)
    return align_whitespace(spliced, frozenset({WHITESPACE}))


def _convert(lowered: dict[str, Any], style: dict[str, Any]) -> xgr.Grammar:
    text = json.dumps(backend_refs(copy.deepcopy(lowered)))
    return xgr.Grammar.from_json_schema(text, strict_mode=True, **style)


def _refusal(lowered: dict[str, Any], style: dict[str, Any], exc: Exception) -> GrammarError:
    """The backend's refusal of a lowered schema in our words, at the pointer of the smallest
    subschema it refuses alone (tried deepest first, at most _MAX_PROBES). The checks before
    should leave nothing for it to refuse; an unknown message is logged, not shown."""
    message = backend_message(exc)
    reason = next((r.format(*m.groups()) for p, r in _KNOWN if (m := p.search(message))), None)
    if reason is None:
        logger.warning("xgrammar refused a lowered JSON schema: %s", message)
        reason = "the grammar backend cannot convert it (see the server log)"
    key = table_key(lowered)
    table = {key: lowered[key]} if isinstance(lowered.get(key), dict) else {}
    where = "/"
    for pointer, sub in list(reversed(list(iter_subschemas(lowered))))[:_MAX_PROBES]:
        try:
            _convert({**sub, **table} if pointer else lowered, style)
        except _BACKEND_ERRORS:
            where = pointer or "/"
            break
    return GrammarError(f"JSON schema at {where} cannot be enforced: {reason}")


def printed_ebnf(grammar: xgr.Grammar) -> str:
    """``str(grammar)`` made safe to parse back.

    xgrammar 0.2.8 prints U+0080..U+00FF as ``\\xHH`` but its parser reads ``\\x`` with as many
    hex digits as follow, so the "ée" of "brûlée", printed ``\\xe9e``, came back as U+0E9E.
    ``\\u`` takes exactly four digits, so every ``\\xHH`` is rewritten as ``\\u00HH``.
    """
    return _HEX_ESCAPE.sub(lambda m: f"\\u00{m[1]}" if m[1] else m[0], str(grammar))


def splice_rules(ebnf: str, rules: list[Rule], max_whitespace: int | str) -> str:
    """Replace the placeholders in ``ebnf`` by references to appended rules of ours; value rules
    allow whitespace runs of at most ``max_whitespace`` between their tokens (a rule name:
    that rule, left for ``json_layout.align_whitespace`` to place)."""
    text = _STRING_PLACEHOLDER.sub(lambda m: f"arbor_string_{m.group(1)}", ebnf)
    text = _VALUE_PLACEHOLDER.sub(lambda m: f"arbor_string_{m.group(1)}", text)
    if "Regex(" in text or VALUE_PLACEHOLDER in text:
        # A pattern we did not lower would take xgrammar's lossy path.
        raise GrammarError("internal error: an unlowered placeholder reached the grammar backend")
    if isinstance(max_whitespace, str):
        whitespace = max_whitespace
    else:
        whitespace = f"[ \\n\\r\\t]{{0,{max_whitespace}}}" if max_whitespace > 0 else '""'
    extra = [_rule_ebnf(f"arbor_string_{i}", rule, whitespace) for i, rule in enumerate(rules)]
    return "\n".join([text, *extra])


def _rule_ebnf(name: str, rule: Rule, whitespace: str) -> str:
    if rule.ebnf is not None:
        return _EBNF_TOKEN.sub(lambda m: _rename(m, name, whitespace), rule.ebnf)
    assert isinstance(rule, StringRule)
    if rule.regex is not None:
        body = printed_ebnf(xgr.Grammar.from_regex(rule.regex))
        return _EBNF_TOKEN.sub(lambda m: _rename(m, name, whitespace), body)
    low, high = rule.min_length, rule.max_length
    if high is None:
        parts = ([f"{_PLAIN_CHAR}{{{low}}}"] if low else []) + [f"{_PLAIN_CHAR}*"]
        return f"{name} ::= {' '.join(parts)}"
    return f"{name} ::= {_PLAIN_CHAR}{{{low},{high}}}" if high else f'{name} ::= ""'


def _rename(match: re.Match[str], name: str, whitespace: str) -> str:
    if match.group(0).startswith(('"', "[")):
        return match.group(0)
    if match.group(0) == WHITESPACE:
        return whitespace
    return name + (match.group(1) or "")


def backend_message(exc: BaseException) -> str:
    """xgrammar's error text without its timestamp and C++ source location prefixes."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)
