"""Tool calls in chat: the constraint for ``tool_choice`` and the parser of the model's output.

Formats (described in ``grammar.tool_call_formats``; the server's is
``ServerState.tool_call_format``, from ``--tool-call-parser`` or detected from the chat
template by ``runtime.chat.tool_call_formats``)::

    hermes (alias qwen)  <tool_call>{"name": ..., "arguments": {...}}</tool_call> ...
    llama3               {"name": ..., "parameters": {...}}; {...}   (<|python_tag|> optional)
    mistral              [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
    generic              as hermes, described by the server's own system text to a model whose
                         template has no tool syntax (``runtime.chat.generic_tools``)

With ``tool_choice`` "required" or a named function the output is constrained by grammar to
calls in the format (``tool_call_constraint``); with "auto" it is free and the parser finds them,
except in ``generic``: there "auto" constrains the whole reply to the reply envelope, a JSON
object holding calls or a response (``calls_or_answer``; read by
``runtime.chat.tool_call_envelope.EnvelopeParser``), since a model without tool syntax of
its own never starts a call unprompted.

The parser (``make_tool_parser``) takes the output in pieces: ``feed(text)`` and, at the end,
``finish()`` each return events (``runtime.chat.tool_call_events``) in output order:

- ``str``: content, never tool markup;
- ``ToolCallStart(index, id, name)``: a call to a known tool began; ``index`` counts calls
  from 0 in output order, ``id`` is its ``call_...`` id;
- ``ToolCallArguments(index, fragment)``: more of that call's arguments, exactly as written
  (the fragments of a call concatenate to its ``ToolCall.arguments``);
- ``ToolCallEnd(index, call)``: the call's JSON object closed and is a valid call;
- ``ToolCallDropped(index)``: the started call will never end: the output stopped inside it
  (max tokens) or it is not valid JSON. It is not in ``calls``; the APIs still return it as
  it was streamed, so a whole response and a stream agree (docs/serving.md, "Tool calls").

A call starts once its name is read and names one of the tools and its arguments are seen to
be an object. Markup that is not a valid call of a known tool is dropped, never returned as
content; a section that cannot be followed any further hides the rest of its block (hermes:
up to ``</tool_call>``; the other formats: the rest of the output). Where the format lets the
output begin with a call without a marker (llama3 ``{``, mistral ``[``), that text is held
back until it is known to be a call, and is content if it is not (its name is no tool's, or
it is no call object; cut off by the end of the output, it is a call, and dropped, once its
first key has been read as "name"). At most ``max_calls`` calls start; later ones are
dropped. ``constrained`` (tool_choice required or named: the grammar made the whole output
calls) drops all content, so a call cut short never shows as text.
"""

from __future__ import annotations

from typing import Any

from runtime.chat.tool_call_envelope import EnvelopeParser
from runtime.chat.tool_call_events import ToolCall
from runtime.chat.tool_call_formats import GENERIC_FORMAT, canonical_format
from runtime.chat.tool_call_parser import ToolCallParser

__all__ = [
    "EnvelopeParser",
    "ToolCallParser",
    "calls_or_answer",
    "make_tool_parser",
    "parse_output",
    "parse_tool_calls",
    "tool_call_constraint",
    "turn_constraint",
]


def tool_call_constraint(
    tools: list[dict[str, Any]],
    mode: str,
    name: str | None = None,
    parallel: bool = True,
    fmt: str = "hermes",
    answer: dict[str, Any] | None = None,
    branch: str | None = None,
) -> dict[str, Any]:
    """The ``structural_tag`` sampling parameter for tool_choice "required" (any of ``tools``)
    or "named" (only ``name``): calls in format ``fmt`` whose arguments validate against the
    tool's parameters schema — one or more with ``parallel``, exactly one without. ``tools``
    are OpenAI function definitions ``{"name", "parameters", ...}``. ``answer``: a JSON schema
    the output may satisfy instead (``calls_or_answer``). ``branch``: the side of a reply
    envelope the server decided on (``runtime.chat.tool_decision``)."""
    return (
        {
            "tools": [
                {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object"}}
                for tool in tools
            ],
            "mode": mode,
            "name": name,
            "parallel": parallel,
            "format": canonical_format(fmt),
        }
        | ({} if answer is None else {"answer": answer})
        | ({} if branch is None else {"branch": branch})
    )


def calls_or_answer(
    tools: list[dict[str, Any]],
    parallel: bool,
    fmt: str,
    answer: dict[str, Any],
    envelope: bool = False,
    branch: str | None = None,
) -> dict[str, Any] | None:
    """tool_choice "auto" with a response format (``answer``: the ``json_schema`` or
    ``json_object`` sampling param, or empty for text): the ``structural_tag`` that lets the
    output be calls to any of ``tools`` or an answer in that format; None when there is no
    tool or no format (the output is then free, or the format alone). ``envelope`` (the
    ``generic`` format only): the reply envelope instead
    (``runtime.chat.generic_tools.ReplyEnvelope``), calls or a response, the response a
    string when there is no format; ``branch`` ("call" or "answer") holds it to the side the
    server decided on (``runtime.chat.tool_decision``)."""
    if not tools:
        return None
    if envelope:
        schema = answer.get("json_schema") or ({"type": "object"} if answer else None)
        return tool_call_constraint(
            tools, "auto", parallel=parallel, fmt=fmt, answer=schema, branch=branch
        )
    if not answer:
        return None
    schema = answer.get("json_schema") or {"type": "object"}
    return tool_call_constraint(tools, "required", parallel=parallel, fmt=fmt, answer=schema)


def turn_constraint(
    tools: list[dict[str, Any]],
    mode: str,
    name: str | None,
    parallel: bool,
    fmt: str,
    answer: dict[str, Any],
    envelope: bool = False,
    branch: str | None = None,
) -> dict[str, Any]:
    """The sampling params that constrain one turn, ``mode`` being the tool choice (none,
    auto, required or named: ``name``) over ``tools`` and ``answer`` the answer format's
    params (``json_schema`` / ``json_object``, or empty): forced calls (the format is for a
    later turn), calls or an answer in the format (auto; ``envelope``: the generic format's
    reply envelope, held to ``branch`` when the server decided), or the format alone."""
    if mode in ("required", "named"):
        return {"structural_tag": tool_call_constraint(tools, mode, name, parallel, fmt)}
    auto = mode == "auto"
    tag = calls_or_answer(tools, parallel, fmt, answer, envelope, branch) if auto else None
    return answer if tag is None else {"structural_tag": tag}


def make_tool_parser(
    fmt: str, tool_names: set[str], max_calls: int | None, constrained: bool = False
) -> ToolCallParser | EnvelopeParser:
    """A parser for one output in format ``fmt`` (a name or alias: hermes, qwen, llama3,
    mistral, generic); ValueError for an unknown format. ``generic`` under tool_choice auto
    (not ``constrained``) reads the reply envelope."""
    if canonical_format(fmt) == GENERIC_FORMAT and not constrained:
        return EnvelopeParser(tool_names, max_calls)
    return ToolCallParser(tool_names, max_calls, fmt, constrained)


def parse_tool_calls(
    text: str,
    tool_names: set[str],
    max_calls: int | None = None,
    fmt: str = "hermes",
    constrained: bool = False,
) -> tuple[str | None, list[ToolCall]]:
    """(content, complete tool calls) of a whole output (``parse_output``)."""
    content, parser = parse_output(text, tool_names, max_calls, fmt, constrained)
    return content, parser.calls


def parse_output(
    text: str,
    tool_names: set[str],
    max_calls: int | None = None,
    fmt: str = "hermes",
    constrained: bool = False,
) -> tuple[str | None, ToolCallParser | EnvelopeParser]:
    """(content, the spent parser) of a whole output, read as a stream of it would be: the
    content is exactly the content events joined, so a streamed response and a whole one
    agree. Content is None when only calls (or dropped markup) remain. The parser has the
    calls (``calls``: complete; ``reported``: every call started, as streamed)."""
    parser = make_tool_parser(fmt, tool_names, max_calls, constrained)
    events = parser.feed(text) + parser.finish()
    content = "".join(e for e in events if isinstance(e, str))
    if parser.reported or parser.saw_markup or constrained:
        return (content or None), parser
    return content, parser
