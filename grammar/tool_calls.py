"""Tool calls as a grammar: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.

The JSON inside a block is an ``anyOf`` over one object schema per allowed tool, whose "name"
is that tool's name as a ``const`` and whose "arguments" is the tool's parameters schema. The
blocks follow each other without separators, as the test model's chat template writes them.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from grammar.errors import GrammarError, UnsupportedSchemaFeature
from grammar.schema_check import check_schema
from grammar.schema_walk import iter_subschemas

TOOL_CALL_BEGIN = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
ROOT_RULE = "arbor_tool_calls"


def normalize_tools(
    tools: Sequence[Mapping[str, Any]], mode: str, name: str | None, best_effort: bool
) -> list[tuple[str, dict[str, Any]]]:
    """(name, parameters schema) of each tool a call may use, checked; GrammarError if bad."""
    if mode not in ("required", "named"):
        raise GrammarError(f"tool_choice mode must be 'required' or 'named', got {mode!r}")
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
            raise UnsupportedSchemaFeature(exc.keyword, where, _reason(exc)) from None
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


def tool_calls_schema(tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The JSON schema of one call: tools is [{"name", "parameters"}, ...].

    Each parameters schema moves to ``$defs/arbor_tool_<i>`` (xgrammar resolves references
    through objects but not through array indices such as ``anyOf/0``), its own local
    ``$ref``s re-rooted there.
    """
    defs: dict[str, Any] = {}
    options = []
    for i, tool in enumerate(tools):
        key = f"arbor_tool_{i}"
        defs[key] = _reroot(tool["parameters"], f"#/$defs/{key}")
        options.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool["name"]},
                    "arguments": {"$ref": f"#/$defs/{key}"},
                },
                "required": ["name", "arguments"],
            }
        )
    return {"$defs": defs, "anyOf": options}


def tool_calls_rule(parallel: bool) -> str:
    """The start rule around a JSON grammar whose start rule is ``root``."""
    block = f'"{TOOL_CALL_BEGIN}" root "{TOOL_CALL_END}"'
    return f"{ROOT_RULE} ::= {block}" + (f" ({block})*" if parallel else "")


def _reroot(schema: dict[str, Any], prefix: str) -> dict[str, Any]:
    """A copy of ``schema`` whose local $refs still resolve once it sits at ``prefix``."""
    moved = copy.deepcopy(schema)
    for _, sub in iter_subschemas(moved):
        ref = sub.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            sub["$ref"] = prefix + ref[1:]
    return moved


def _reason(exc: UnsupportedSchemaFeature) -> str:
    text = str(exc)
    start = text.index(": ") + 2
    return text[start : text.rindex(" (set grammar_best_effort")]
