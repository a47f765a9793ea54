"""The ``generic`` tool-call format: tools for a chat template that has no tool syntax.

A template "does not render tools" when it renders the same text for the same messages with
and without ``tools`` (``template_renders_tools``; SmolLM2's is one). Its model would never
see the tool definitions. Under the generic format (chosen for such a template unless
``--tool-call-parser`` names another, or named there) the server writes the tools itself, into
the system turn, and renders the template without ``tools`` (``generic_messages``)::

    You can call the following tools:
    {"name": "get_weather", "description": "...", "parameters": {...}}
    To call a tool, reply with <tool_call>{"name": <tool name>, "arguments": <arguments
    object>}</tool_call>

A call is ``<tool_call>{"name": NAME, "arguments": ARGS}</tool_call>``, several following each
other directly: hermes's syntax, which the tool-call grammar writes and the parser reads
(``grammar.tool_call_formats.GENERIC``). Tuned on SmolLM2-135M-Instruct
(``benchmarks/generic_tools_tuning.py``; docs/agents.md has the table): with this text a call
forced by ``tool_choice: required`` got its arguments right 12 times in 12 (4 without the
tools in the prompt); under free ``auto`` no wording or syntax tried (a ``{"tool_call": ...}``
JSON object, a list inside the tags, longer instructions, an example, the user turn) made that
model call at all. So under ``auto`` the reply is constrained to the ``ReplyEnvelope``, one
JSON object that either calls or answers, and the last line of the system text describes that
instead (as llama.cpp does for templates without tool syntax); a request with a grammar of its
own keeps the free reply. Which side of the envelope the reply takes, the server decides by
default from how likely the model finds each tool's name (``runtime.chat.tool_decision``).

Earlier turns are rendered for such a template too: an assistant turn's calls become its
text, in the call syntax (with the arguments string as the client sent it, so a re-sent turn
reads as the model wrote it), and tool results (role ``tool``) become a user turn naming the
tool each result came from.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from grammar.tool_call_formats import GENERIC
from runtime.errors import RequestError

# The call syntax the system text describes is the one the grammar writes and the parser reads.
CALL_OPEN, CALL_CLOSE = GENERIC.marker, GENERIC.item_close
_PROBE_MESSAGES = [{"role": "user", "content": "arbor-probe"}]
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "arbor_probe_tool",
            "description": "arbor-probe",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]

_renders_tools: dict[tuple[str, str], bool] = {}
_lock = threading.Lock()


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether ``tokenizer``'s chat template writes tool definitions into the prompt: False
    when a conversation renders to the same text with and without ``tools``, or fails only
    with them. True when the template cannot render at all (nothing to decide). Cached per
    tokenizer class and template text."""
    key = (type(tokenizer).__qualname__, repr(getattr(tokenizer, "chat_template", None)))
    with _lock:
        known = _renders_tools.get(key)
    if known is not None:
        return known
    try:
        plain = _render(tokenizer, None)
    except Exception:  # no template, or one that cannot render a user turn
        answer = True
    else:
        try:
            answer = _render(tokenizer, _PROBE_TOOLS) != plain
        except Exception:  # fails only when given tools: it has no use for them
            answer = False
    with _lock:
        _renders_tools[key] = answer
    return answer


def _render(tokenizer: Any, tools: list[dict[str, Any]] | None) -> str:
    text = tokenizer.apply_chat_template(
        _PROBE_MESSAGES, tools=tools, add_generation_prompt=True, tokenize=False
    )
    return str(text)


@dataclass(frozen=True)
class ReplyEnvelope:
    """Under tool_choice "auto" the whole reply is one JSON object that either calls tools or
    answers (the grammar ``grammar.tool_calls.reply_envelope_ebnf`` holds it to that; the
    parser is ``runtime.chat.tool_call_envelope``): ``{"tool_call": CALL}`` (``parallel``:
    ``{"tool_calls": [CALL, ...]}``) or ``{"response": ANSWER}``, ANSWER a string
    (``text_answer``) or JSON in the request's response format. ``constrained``: whether the
    grammar holds the reply to it; a free reply (the request's ``reply_envelope: "free"``)
    gets the same prompt and the same reader, and whatever the model writes. ``scored``: the
    server decides between calling and answering by the tool names' scores and holds the
    grammar to that side (``runtime.chat.tool_decision``; the request's ``reply_envelope:
    "scored"``, the default); otherwise a constrained reply's key is the model's own pick."""

    parallel: bool
    text_answer: bool = True
    constrained: bool = True
    scored: bool = False

    @property
    def calls_key(self) -> str:
        return "tool_calls" if self.parallel else "tool_call"

    def instruction(self) -> str:
        """The sentence that tells the model the reply's shape."""
        call = '{"name": <tool name>, "arguments": <arguments object>}'
        calls = f"[{call}, ...]" if self.parallel else call
        answer = "<your answer as a string>" if self.text_answer else "<your answer as JSON>"
        what = "one or more tools" if self.parallel else "a tool"
        return (
            f'Reply with a JSON object: {{"{self.calls_key}": {calls}}} to call {what}, or '
            f'{{"response": {answer}}} to answer the user directly.'
        )

    def calls_text(self, calls: Sequence[tuple[str, str]]) -> str:
        """Earlier calls (name, arguments JSON text as sent) as this envelope writes them."""
        objects = [
            f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {arguments}}}'
            for name, arguments in calls
        ]
        if self.parallel or len(objects) != 1:
            return f'{{"tool_calls": [{", ".join(objects)}]}}'
        return f'{{"tool_call": {objects[0]}}}'


def reply_envelope(parallel: bool, text_answer: bool, mode: str | None) -> ReplyEnvelope:
    """The envelope of a request whose ``reply_envelope`` field is ``mode``: "scored" (the
    default: the server decides call or answer, ``runtime.chat.tool_decision``),
    "constrained" (the grammar holds the reply to the envelope and the model picks its key) or
    "free". A free reply cannot promise a response format (only the grammar could hold an
    answer to it): RequestError (a 400) naming the field."""
    if mode == "free" and not text_answer:
        raise RequestError(
            'reply_envelope "free" leaves the reply unconstrained, so it cannot be held to a '
            'response format: drop the format or use "constrained"',
            param="reply_envelope",
        )
    return ReplyEnvelope(
        parallel, text_answer, constrained=mode != "free", scored=mode in (None, "scored")
    )


def generic_system_text(
    tools: Sequence[Mapping[str, Any]], envelope: ReplyEnvelope | None = None
) -> str:
    """The tools and how to call them, for the system turn: in the call syntax, or, with
    ``envelope`` (tool_choice "auto"), the reply envelope. ``tools``: OpenAI tools
    (``{"type": "function", "function": {...}}``) or bare function definitions."""
    lines = ["You can call the following tools:"]
    for tool in tools:
        function = tool.get("function", tool)
        entry = {"name": function["name"]}
        if function.get("description"):
            entry["description"] = function["description"]
        entry["parameters"] = function.get("parameters") or {"type": "object", "properties": {}}
        lines.append(json.dumps(entry, ensure_ascii=False))
    if envelope is not None:
        lines.append(envelope.instruction())
    else:
        lines.append(
            f'To call a tool, reply with {CALL_OPEN}{{"name": <tool name>, '
            f'"arguments": <arguments object>}}{CALL_CLOSE}'
        )
    return "\n".join(lines)


def generic_call_text(name: str, arguments: str | Mapping[str, Any]) -> str:
    """One call as the tool-call grammar writes it; ``arguments`` as sent (a JSON string is
    kept verbatim)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    head = f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '
    return f"{CALL_OPEN}{head}{args}}}{CALL_CLOSE}"


def call_names(messages: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """The tool name of each call id in ``messages``' assistant turns."""
    names: dict[str, str] = {}
    for message in messages:
        for call in message.get("tool_calls") or []:
            if call.get("id"):
                names[str(call["id"])] = str(call.get("function", call).get("name", ""))
    return names


def generic_messages(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    known_calls: Mapping[str, str] | None = None,
    envelope: ReplyEnvelope | None = None,
) -> list[dict[str, Any]]:
    """``messages`` for a template without tool syntax, to be rendered without ``tools``: the
    tools' text (if any) leads the system message (one is added when there is none), an
    assistant turn's ``tool_calls`` are appended to its text as calls, and each run of tool
    results becomes one user turn, a line per result naming its tool (found by call id in the
    assistant turns before it, or in ``known_calls``: {call id: tool name}). With
    ``envelope`` (tool_choice "auto") the system text describes it and earlier calls are
    written in it."""
    names = dict(known_calls or {})
    result: list[dict[str, Any]] = []
    results_turn: dict[str, Any] | None = None  # the user turn the latest tool results went to
    for message in messages:
        role = message.get("role")
        if role == "tool":
            line = _tool_result_line(message, names)
            if results_turn is not None:
                results_turn["content"] += "\n" + line
            else:
                results_turn = {"role": "user", "content": line}
                result.append(results_turn)
            continue
        results_turn = None
        if role == "assistant" and message.get("tool_calls"):
            result.append(_assistant_with_calls(message, names, envelope))
        else:
            result.append(dict(message))
    if tools:
        text = generic_system_text(tools, envelope)
        if result and result[0].get("role") == "system":
            first = result[0]
            first["content"] = text + ("\n\n" + first["content"] if first.get("content") else "")
        else:
            result.insert(0, {"role": "system", "content": text})
    return result


def _assistant_with_calls(
    message: Mapping[str, Any], names: dict[str, str], envelope: ReplyEnvelope | None
) -> dict[str, Any]:
    calls = []
    for call in message["tool_calls"]:
        function = call.get("function", call)
        name = str(function.get("name", ""))
        if call.get("id"):
            names[str(call["id"])] = name
        arguments = function.get("arguments") or "{}"
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append((name, arguments))
    turn = {k: v for k, v in message.items() if k != "tool_calls"}
    if envelope is not None:  # the reply was the envelope alone
        turn["content"] = envelope.calls_text(calls)
    else:
        written = "".join(generic_call_text(name, arguments) for name, arguments in calls)
        turn["content"] = (message.get("content") or "") + written
    return turn


def _tool_result_line(message: Mapping[str, Any], names: dict[str, str]) -> str:
    name = message.get("name") or names.get(str(message.get("tool_call_id")), "")
    content = message.get("content")
    text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
    return f"Result of tool {name}: {text}" if name else f"Tool result: {text}"
