"""What a request asks its output to match: a kind, a canonical spec string and options.

A ``GrammarSpec`` is hashable and canonical, so it is also the compile-cache key: two schemas
that differ only in key order (outside ``properties``, whose order is the output's order) or
in JSON formatting share one entry. The factories validate what can be validated without a
tokenizer (schema checks, regex analysis, EBNF syntax), so bad requests fail at the API edge.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import xgrammar as xgr

from grammar.errors import GrammarError
from grammar.json_grammar import backend_message
from grammar.options import GrammarOptions
from grammar.regex import to_backend_regex
from grammar.schema_check import check_schema
from grammar.schema_lower import lower_schema
from grammar.structural_tag import check_structural_tag
from grammar.tool_call_formats import get_format
from grammar.tool_calls import normalize_tools

KINDS = ("json_schema", "json_object", "regex", "ebnf", "choice", "structural_tag", "tool_calls")
# Sampling-parameter keys that each select a kind ("choices" is an alias of "choice").
_PARAM_KINDS = {
    "json_schema": "json_schema",
    "regex": "regex",
    "ebnf": "ebnf",
    "choice": "choice",
    "choices": "choice",
    "structural_tag": "structural_tag",
    "json_object": "json_object",
}
_OPTION_KEYS = ("grammar_best_effort", "grammar_max_whitespace", "json_format")
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
# Deepest nesting of objects and arrays in a schema document (a property nested in a property
# costs two levels). Real schemas stay far below; the checks and lowering recurse per level.
MAX_SCHEMA_DEPTH = 128


@dataclass(frozen=True)
class GrammarSpec:
    """kind: one of KINDS. spec: the canonical text of the constraint (JSON for json_schema,
    choice, structural_tag and tool_calls; the pattern or grammar text otherwise)."""

    kind: str
    spec: str
    options: GrammarOptions = field(default_factory=GrammarOptions)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}; expected one of {KINDS}")

    def compact(self) -> GrammarSpec:
        """This spec with compact JSON output (the fallback when it cannot be aligned)."""
        options = replace(self.options, max_whitespace=None, json_format="compact")
        return replace(self, options=options)

    @classmethod
    def from_sampling_params(cls, params: Mapping[str, Any] | object) -> GrammarSpec | None:
        """The constraint named in sampling params, or None when there is none.

        Reads json_schema (dict, JSON string or pydantic model class), regex, ebnf, choice
        (or choices), structural_tag, json_object (bool), and the options grammar_best_effort,
        grammar_max_whitespace and json_format (None: aligned; ``GrammarOptions``). ``params``
        is a mapping or an object with those attributes. Raises GrammarError if more than one
        constraint is given or it is invalid.

        A ``structural_tag`` of the form ``{"tools": [...], "mode": "required"|"named"|"auto",
        "name": ..., "parallel": bool, "format": "hermes"|"llama3"|"mistral", "answer": schema,
        "branch": "call"|"answer"}`` ("format" optional, hermes by default; "answer" and
        "branch" optional) is the tool-call constraint
        (``for_tool_calls``) the OpenAI layer sends for tool_choice required/named, or auto
        with a response format; any other is an xgrammar tag.
        """
        if isinstance(params, Mapping):
            values = {key: params.get(key) for key in (*_PARAM_KINDS, *_OPTION_KEYS)}
        else:
            values = {key: getattr(params, key, None) for key in (*_PARAM_KINDS, *_OPTION_KEYS)}
        given = [key for key in _PARAM_KINDS if values[key] not in (None, False, "", (), [])]
        if len(given) > 1:
            raise GrammarError(f"at most one constraint per request; got {', '.join(given)}")
        if not given:
            return None
        options = GrammarOptions(
            best_effort=bool(values["grammar_best_effort"]),
            max_whitespace=values["grammar_max_whitespace"],
            json_format=values["json_format"] or "aligned",
        )
        key = given[0]
        value = values[key]
        kind = _PARAM_KINDS[key]
        if kind == "json_object":
            return cls.for_json_object(options)
        if kind == "structural_tag" and isinstance(value, Mapping) and _is_tool_calls(value):
            return cls.for_tool_calls(
                value["tools"],
                value["mode"],
                value.get("name"),
                bool(value.get("parallel", True)),
                options,
                value.get("format", "hermes"),
                value.get("answer"),
                value.get("branch"),
            )
        factory = {
            "json_schema": cls.for_json_schema,
            "regex": cls.for_regex,
            "ebnf": cls.for_ebnf,
            "choice": cls.for_choice,
            "structural_tag": cls.for_structural_tag,
        }[kind]
        return factory(value, options)

    @classmethod
    def for_json_schema(cls, schema: Any, options: GrammarOptions | None = None) -> GrammarSpec:
        """A schema given as a dict, a JSON string, or a pydantic model class; checked here."""
        options = options or GrammarOptions()
        parsed = parse_schema(schema)
        check_nesting(parsed, "json_schema")
        # Surfaces unsupported keywords, untranslatable patterns and empty enums now.
        lower_schema(check_schema(parsed, best_effort=options.best_effort))
        return cls("json_schema", canonical_schema_json(parsed), options)

    @classmethod
    def for_json_object(cls, options: GrammarOptions | None = None) -> GrammarSpec:
        """Any JSON object (OpenAI's JSON mode)."""
        return cls("json_object", "", options or GrammarOptions())

    @classmethod
    def for_regex(cls, pattern: Any, options: GrammarOptions | None = None) -> GrammarSpec:
        """Output that ``re.fullmatch``es ``pattern`` (Python syntax); analysed here."""
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError("regex must be a non-empty string")
        to_backend_regex(pattern)
        return cls("regex", pattern, options or GrammarOptions())

    @classmethod
    def for_ebnf(cls, grammar: Any, options: GrammarOptions | None = None) -> GrammarSpec:
        """A GBNF-style grammar whose start rule is ``root``; its syntax is checked here."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise GrammarError("ebnf must be a non-empty grammar text")
        try:
            xgr.Grammar.from_ebnf(grammar)
        except (RuntimeError, ValueError) as exc:
            raise GrammarError(f"invalid EBNF grammar: {backend_message(exc)}") from None
        return cls("ebnf", grammar, options or GrammarOptions())

    @classmethod
    def for_choice(cls, choices: Any, options: GrammarOptions | None = None) -> GrammarSpec:
        """Output equal to one of ``choices`` (a non-empty list of non-empty strings)."""
        if isinstance(choices, str) or not isinstance(choices, Sequence) or not choices:
            raise GrammarError("choice must be a non-empty list of strings")
        if not all(isinstance(c, str) and c for c in choices):
            raise GrammarError("every choice must be a non-empty string")
        return cls(
            "choice", json.dumps(list(choices), ensure_ascii=False), options or GrammarOptions()
        )

    @classmethod
    def for_structural_tag(cls, tag: Any, options: GrammarOptions | None = None) -> GrammarSpec:
        """An xgrammar structural tag (dict or JSON string); its JSON schemas are checked."""
        options = options or GrammarOptions()
        if isinstance(tag, str):
            tag = _loads(tag, "structural_tag")
        if not isinstance(tag, dict):
            raise GrammarError("structural_tag must be a JSON object")
        check_nesting(tag, "structural_tag")
        check_structural_tag(tag, options)
        return cls("structural_tag", json.dumps(tag, ensure_ascii=False), options)

    @classmethod
    def for_tool_calls(
        cls,
        tools: Sequence[Mapping[str, Any]],
        mode: str = "required",
        name: str | None = None,
        parallel: bool = True,
        options: GrammarOptions | None = None,
        format: str = "hermes",
        answer: Any = None,
        branch: str | None = None,
    ) -> GrammarSpec:
        """Tool calls in ``format`` (a ``grammar.tool_call_formats`` name; hermes:
        ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks).

        tools: OpenAI-style ``{"type": "function", "function": {"name", "parameters"}}`` or
        plain ``{"name", "parameters"}`` dicts. mode "required": calls to any of the tools;
        "named": calls to the tool called ``name`` only; "auto" (``generic`` format only):
        the reply envelope, a JSON object holding either calls or a response
        (``grammar.tool_calls.reply_envelope_ebnf``; the response is a string, or valid
        against ``answer`` when given). parallel: allow several calls, else
        exactly one. Each parameters schema is checked as a JSON schema. answer: a JSON schema
        the output may satisfy instead of calling tools (tool_choice "auto" with a response
        format; ``{"type": "object"}`` for JSON mode), checked like ``for_json_schema``.
        branch: with mode "auto", "call" or "answer" holds the envelope to that side (the
        server decided which: ``runtime.chat.tool_decision``); None leaves both.
        """
        options = options or GrammarOptions()
        get_format(format)
        if mode == "auto" and format != "generic":
            raise GrammarError(
                "tool_choice mode 'auto' as a grammar is the generic format's reply envelope; "
                f"format {format!r} has none"
            )
        check_nesting(tools, "tools")
        normalized = normalize_tools(tools, mode, name, options.best_effort)
        payload = {
            "tools": [
                {"name": tool_name, "parameters": json.loads(canonical_schema_json(params))}
                for tool_name, params in normalized
            ],
            "parallel": bool(parallel),
            "format": format,
        }
        if branch is not None and (mode != "auto" or branch not in ("call", "answer")):
            raise GrammarError(
                f"tool-call branch {branch!r}: only mode 'auto' takes one, 'call' or 'answer'"
            )
        if mode == "auto":
            payload["envelope"] = True
        if branch is not None:
            payload["branch"] = branch
        if answer is not None:
            parsed = parse_schema(answer)
            check_nesting(parsed, "json_schema")
            lower_schema(check_schema(parsed, best_effort=options.best_effort))
            payload["answer"] = json.loads(canonical_schema_json(parsed))
        return cls("tool_calls", json.dumps(payload, ensure_ascii=False), options)


def check_nesting(value: Any, what: str, limit: int = MAX_SCHEMA_DEPTH) -> None:
    """GrammarError if ``value`` (JSON-like) nests objects and arrays deeper than ``limit``:
    the schema walkers recurse per level. Iterative, so any depth is safe to measure."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list | tuple):
            if depth > limit:
                raise GrammarError(
                    f"{what} nests deeper than {limit} levels of objects and arrays; "
                    "flatten it (or use $defs and $ref for recursive shapes)"
                )
            members = item.values() if isinstance(item, dict) else item
            stack.extend((member, depth + 1) for member in members)


def _is_tool_calls(tag: Mapping[str, Any]) -> bool:
    return "tools" in tag and "mode" in tag


def _loads(text: str, field: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"{field} is not valid JSON: {exc}") from None


def parse_schema(schema: Any) -> dict[str, Any]:
    """A JSON schema as a dict, from a dict, a JSON string, or a pydantic model class."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        return schema.model_json_schema()
    if isinstance(schema, str):
        schema = _loads(schema, "json_schema")
    if not isinstance(schema, dict):
        raise GrammarError(
            f"json_schema must be an object, a JSON string or a pydantic model class, "
            f"got {type(schema).__name__}"
        )
    return schema


def canonical_schema_json(schema: dict[str, Any]) -> str:
    """Compact JSON with sorted keys in every schema object, except that the names under
    ``properties`` keep their order (it is the order fields are generated in)."""
    return json.dumps(_canonical(schema), ensure_ascii=False, separators=(",", ":"))


def _canonical(node: Any) -> Any:
    if isinstance(node, list):
        return [_canonical(item) for item in node]
    if not isinstance(node, dict):
        return node
    result: dict[str, Any] = {}
    for key in sorted(node):
        value = node[key]
        if key in _DATA_KEYWORDS:
            result[key] = value  # data, not schema: objects inside stay exactly as given
        elif key == "properties" and isinstance(value, dict):
            result[key] = {name: _canonical(sub) for name, sub in value.items()}
        else:
            result[key] = _canonical(value)
    return result
