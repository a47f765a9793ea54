"""xgrammar structural tags, with every embedded JSON schema checked and lowered like ours.

A structural tag is passed to xgrammar as given, except that each ``json_schema`` format in it
is checked (fail closed), lowered (see ``schema_lower``) and capped to whitespace runs of at
most ``max(1, max_whitespace)`` characters; the printed grammar then gets our string rules
spliced in, as for plain JSON schemas.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import xgrammar as xgr

from grammar.errors import GrammarError
from grammar.json_grammar import backend_message, printed_ebnf, splice_rules
from grammar.options import GrammarOptions
from grammar.schema_check import check_schema
from grammar.schema_lower import lower_schema
from grammar.schema_refs import backend_refs
from grammar.schema_rules import Rule


def check_structural_tag(tag: dict[str, Any], options: GrammarOptions) -> None:
    """Raise GrammarError if an embedded JSON schema is invalid or (unless best-effort)
    unenforceable."""
    for fmt in _schema_formats(tag):
        if fmt.get("style", "json") != "json":
            raise GrammarError(
                f"structural_tag: json_schema style {fmt['style']!r} is not supported"
            )
        lower_schema(check_schema(fmt["json_schema"], best_effort=options.best_effort))


def structural_tag_ebnf(tag: dict[str, Any], options: GrammarOptions) -> str:
    """EBNF text (start rule ``root``) for the structural tag."""
    tag = copy.deepcopy(tag)
    rules: list[Rule] = []
    check_structural_tag(tag, options)
    whitespace = max(1, options.whitespace_runs)
    for fmt in _schema_formats(tag):
        checked = check_schema(fmt["json_schema"], best_effort=options.best_effort)
        lowered, _ = lower_schema(checked, rules)
        fmt["json_schema"] = backend_refs(lowered)
        fmt["max_whitespace_cnt"] = whitespace
    try:
        grammar = xgr.Grammar.from_structural_tag(json.dumps(tag))
    except Exception as exc:  # pydantic, JSON and C++ errors alike: the tag is invalid
        raise GrammarError(f"invalid structural_tag: {backend_message(exc)}") from None
    return splice_rules(printed_ebnf(grammar), rules, whitespace)


def _schema_formats(node: Any) -> Iterator[dict[str, Any]]:
    """Every ``{"type": "json_schema", "json_schema": {...}}`` object inside ``node``."""
    if isinstance(node, dict):
        if node.get("type") == "json_schema" and isinstance(node.get("json_schema"), dict):
            yield node
            return
        for value in node.values():
            yield from _schema_formats(value)
    elif isinstance(node, list):
        for value in node:
            yield from _schema_formats(value)
