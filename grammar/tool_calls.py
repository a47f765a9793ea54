"""Tool calls as a grammar, in the syntax of a model family (``grammar.tool_call_formats``).

Every format writes one call as the JSON object ``{"name": NAME, "<arguments key>": ARGS}``
with the spacing chat templates use (``", "`` and ``": "``) around the arguments, which follow
the tool's parameters schema (in the request's JSON layout); what surrounds the
calls of one turn is the format's.

Each tool's parameters schema becomes its own JSON grammar (rules prefixed ``arbor_tool_<i>_``,
so local ``$ref``s resolve as written); the call rule is an alternation over the tools with
each name a literal, so the whole prefix up to the arguments is jump-forward material.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from grammar.errors import GrammarError, UnsupportedSchemaFeature
from grammar.json_grammar import json_schema_ebnf
from grammar.json_layout import SPACE_RULE, WS_RULE, aligned_rules
from grammar.options import JsonLayout
from grammar.schema_check import check_schema
from grammar.tool_call_formats import ToolCallFormat

ROOT_RULE = "arbor_tool_calls"
_CALL_RULE = "arbor_tool_call"
_ANSWER_PREFIX = "arbor_answer_"
_ENVELOPE_PREFIX = "arbor_envelope_"
# A quoted literal or a character class (left alone when renaming), or an identifier.
_EBNF_WORD = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_]*')
_RULE_DEFINITION = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::=", re.M)


def normalize_tools(
    tools: Sequence[Mapping[str, Any]], mode: str, name: str | None, best_effort: bool
) -> list[tuple[str, dict[str, Any]]]:
    """(name, parameters schema) of each tool a call may use, checked; GrammarError if bad.
    mode "auto" (the reply envelope, ``reply_envelope_ebnf``) allows every tool, as
    "required" does."""
    if mode not in ("required", "named", "auto"):
        raise GrammarError(f"tool_choice mode must be 'required', 'named' or 'auto', got {mode!r}")
    result: list[tuple[str, dict[str, Any]]] = []
    for i, tool in enumerate(tools):
        function = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise GrammarError(f"tools[{i}] needs a function name")
        params = function.get("parameters") or {"type": "object"}
        try:
            check_schema(params, best_effort=best_effort)
        except UnsupportedSchemaFeature as exc:
            where = f"/tools/{i}/function/parameters{exc.pointer}"
            raise UnsupportedSchemaFeature(exc.keyword, where, exc.reason) from None
        except GrammarError as exc:
            raise GrammarError(f"tool {function['name']!r}: {exc}") from None
        result.append((function["name"], dict(params)))
    if mode == "named":
        result = [(tool_name, params) for tool_name, params in result if tool_name == name]
        if not result:
            raise GrammarError(f"tool_choice names {name!r}, which is not among the tools")
    if not result:
        raise GrammarError("tool calls need at least one tool")
    return result


def tool_calls_ebnf(
    tools: Sequence[Mapping[str, Any]],
    fmt: ToolCallFormat,
    parallel: bool,
    best_effort: bool,
    layout: JsonLayout,
    answer: Mapping[str, Any] | None = None,
) -> tuple[str, str]:
    """(EBNF text, start rule) for one or more calls (exactly one unless ``parallel``), or,
    when ``answer`` (a checked JSON schema) is given, either those calls or one JSON value
    valid against ``answer``: tool_choice "auto" with a response format.

    tools: ``[{"name", "parameters"}, ...]`` as ``normalize_tools`` left them."""
    rules: list[str] = []
    cases: list[str] = []
    for i, tool in enumerate(tools):
        prefix = f"arbor_tool_{i}_"
        body = json_schema_ebnf(tool["parameters"], best_effort, layout)
        rules.append(_prefixed_rules(body, prefix))
        head = f"{{{json.dumps('name')}: {json.dumps(tool['name'], ensure_ascii=False)}, "
        head += f"{json.dumps(fmt.arguments_key)}: "
        cases.append(f"({_literal(head)} {prefix}root {_literal('}')})")
    opening = _literal((fmt.marker if fmt.writes_marker else "") + fmt.list_open)
    closing, item = _literal(fmt.list_close), _CALL_RULE
    if fmt.item_close:  # each call is a section of its own
        item = _sequence(opening, item, _literal(fmt.item_close))
        opening = closing = _literal("")
    calls = f"{item} ({_sequence(_literal(fmt.separator), item)})*" if parallel else item
    start = f"{ROOT_RULE} ::= {_sequence(opening, calls, closing)}"
    if answer is not None:
        body = json_schema_ebnf(dict(answer), best_effort, layout)
        rules.append(_prefixed_rules(body, _ANSWER_PREFIX))
        start = f"{ROOT_RULE} ::= ({start.split(' ::= ', 1)[1]}) | {_ANSWER_PREFIX}root"
    call = f"{_CALL_RULE} ::= {' | '.join(cases)}"
    return "\n".join([*rules, call, start]), ROOT_RULE


def reply_envelope_ebnf(
    tools: Sequence[Mapping[str, Any]],
    parallel: bool,
    best_effort: bool,
    layout: JsonLayout,
    answer: Mapping[str, Any] | None = None,
    branch: str | None = None,
) -> tuple[str, str]:
    """(EBNF text, start rule) for a whole reply that is one JSON object choosing between
    calling tools and answering (tool_choice "auto" in the ``generic`` format, whose prompt
    describes it: ``runtime.chat.generic_tools``); ``branch`` "call" or "answer" holds it to
    that side alone (the server decided: ``runtime.chat.tool_decision``)::

        {"tool_call": {"name": NAME, "arguments": ARGS}}          (without ``parallel``)
        {"tool_calls": [{"name": NAME, "arguments": ARGS}, ...]}  (with ``parallel``)
        {"response": ANSWER}

    ARGS follows the tool's parameters schema; ANSWER is a JSON string, or a value valid
    against ``answer`` when given (a response format). The object's whitespace is the
    layout's, as in the arguments. tools: as ``normalize_tools`` left them."""
    ws, space, ws_rules = _layout_whitespace(layout)
    rules: list[str] = list(ws_rules)
    cases: list[str] = []
    for i, tool in enumerate(tools):
        prefix = f"arbor_tool_{i}_"
        arguments = json_schema_ebnf(tool["parameters"], best_effort, layout)
        rules.append(_prefixed_rules(arguments, prefix))
        name = json.dumps(tool["name"], ensure_ascii=False)
        cases.append(
            _sequence(
                '"{"', ws, _literal('"name":'), space, _literal(name), '","', ws,
                _literal('"arguments":'), space, f"{prefix}root", ws, '"}"',
            )
        )  # fmt: skip
    rules.append(f"{_CALL_RULE} ::= {' | '.join(f'({case})' for case in cases)}")
    if parallel:
        more = _sequence('","', ws, _CALL_RULE)
        calls = _sequence(
            _literal('"tool_calls":'), space, '"["', ws, _CALL_RULE, f"({more})*", ws, '"]"'
        )
    else:
        calls = _sequence(_literal('"tool_call":'), space, _CALL_RULE)
    body = json_schema_ebnf(dict(answer or {"type": "string"}), best_effort, layout)
    rules.append(_prefixed_rules(body, _ANSWER_PREFIX))
    response = _sequence(_literal('"response":'), space, f"{_ANSWER_PREFIX}root")
    choice = {"call": calls, "answer": response}.get(branch or "", f"(({calls}) | ({response}))")
    rules.append(f"{ROOT_RULE} ::= {_sequence(_literal('{'), ws, choice, ws, _literal('}'))}")
    return "\n".join(rules), ROOT_RULE


def _layout_whitespace(layout: JsonLayout) -> tuple[str, str, list[str]]:
    """(whitespace between tokens, after a colon, the rules they need) in ``layout``: the
    aligned layout's own rules, none for compact JSON, or runs of at most ``layout``."""
    if layout == "aligned":
        renamed = [_prefixed_rules(rule, _ENVELOPE_PREFIX) for rule in aligned_rules()]
        return _ENVELOPE_PREFIX + WS_RULE, _ENVELOPE_PREFIX + SPACE_RULE, renamed
    if layout == 0:
        return '""', '""', []
    run = f"{_ENVELOPE_PREFIX}ws"
    return run, run, [f"{run} ::= [ \\n\\t]{{0,{layout}}}"]


def _prefixed_rules(ebnf: str, prefix: str) -> str:
    """``ebnf`` with every rule it defines renamed ``prefix + name`` (references included)."""
    names = set(_RULE_DEFINITION.findall(ebnf))

    def rename(match: re.Match[str]) -> str:
        word = match.group(0)
        return prefix + word if word in names else word

    return _EBNF_WORD.sub(rename, ebnf)


def _sequence(*parts: str) -> str:
    """EBNF parts in a row, empty literals left out."""
    return " ".join(part for part in parts if part != '""')


def _literal(text: str) -> str:
    """An EBNF string literal for ``text`` (xgrammar reads JSON string escapes)."""
    return json.dumps(text, ensure_ascii=False)
