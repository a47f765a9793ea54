"""The tool-call syntaxes the parser reads, by format name, and how a server picks one.

A format has two halves with one name: what the grammar writes under tool_choice
required/named (``grammar.tool_calls.TOOL_CALL_FORMATS``) and what the parser accepts in free
text (a ``ToolCallSyntax`` here), which is a little more lenient: whitespace and newlines
between calls, "arguments" or "parameters", the opening marker left out where a model may
drop it. Adding a format is one entry in each registry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from runtime.server_args import TOOL_CALL_PARSERS

DEFAULT_FORMAT = "hermes"
ALIASES = {"qwen": "hermes"}


@dataclass(frozen=True)
class ToolCallSyntax:
    """Where calls are in a model's output.

    A section of calls opens at ``marker`` anywhere in the output, or, tentatively, at
    ``bare_start`` when the output (after whitespace) begins with it: a tentative section that
    turns out not to hold a call of a known tool is content after all. Inside a section:
    ``list_open``, then JSON call objects separated by whitespace or one of ``separators``,
    each followed by ``item_close`` when set (which ends the section), then ``list_close``.
    Without a closing text the section ends at the first character that cannot continue it.
    ``template_hints``: texts whose presence in a chat template means this format.
    """

    name: str
    marker: str
    bare_start: str = ""
    list_open: str = ""
    list_close: str = ""
    item_close: str = ""
    separators: str = ""
    template_hints: tuple[str, ...] = ()


HERMES = ToolCallSyntax(
    "hermes", marker="<tool_call>", item_close="</tool_call>", template_hints=("<tool_call>",)
)
# Llama 3.1/3.2 JSON tool calling: the turn is the call object(s); <|python_tag|> may precede.
LLAMA3 = ToolCallSyntax(
    "llama3",
    marker="<|python_tag|>",
    bare_start="{",
    separators=";",
    template_hints=("<|python_tag|>", "<|start_header_id|>"),
)
# [TOOL_CALLS] is a special token in Mistral's own tokenizers: decoding may drop it.
MISTRAL = ToolCallSyntax(
    "mistral",
    marker="[TOOL_CALLS]",
    bare_start="[",
    list_open="[",
    list_close="]",
    separators=",",
    template_hints=("[TOOL_CALLS]",),
)
# In detection order: a Mistral template may also mention <tool_call>-like text, never the
# reverse; Llama 3 header tokens are the weakest hint.
SYNTAXES: dict[str, ToolCallSyntax] = {s.name: s for s in (MISTRAL, HERMES, LLAMA3)}


def canonical_format(name: str) -> str:
    """The format ``name`` (or its alias) stands for; ValueError naming the known ones."""
    resolved = ALIASES.get(name, name)
    if resolved not in SYNTAXES:
        raise ValueError(f"unknown tool-call format {name!r}; expected one of {TOOL_CALL_PARSERS}")
    return resolved


def get_syntax(name: str) -> ToolCallSyntax:
    return SYNTAXES[canonical_format(name)]


def detect_format(chat_template: Any) -> str:
    """The format a chat template writes tool calls in (``DEFAULT_FORMAT`` when it gives no
    hint). ``chat_template`` is the tokenizer's: a string, a {name: template} mapping or None."""
    if isinstance(chat_template, Mapping):
        chat_template = "\n".join(str(t) for t in chat_template.values())
    elif isinstance(chat_template, list):  # [{"name": ..., "template": ...}, ...]
        chat_template = "\n".join(str(t.get("template", "")) for t in chat_template)
    text = chat_template if isinstance(chat_template, str) else ""
    for syntax in SYNTAXES.values():
        if any(hint in text for hint in syntax.template_hints):
            return syntax.name
    return DEFAULT_FORMAT


def resolve_format(tool_call_parser: str | None, chat_template: Any) -> str:
    """The server's format: ``--tool-call-parser`` when given, else detected from the chat
    template."""
    if tool_call_parser:
        return canonical_format(tool_call_parser)
    return detect_format(chat_template)
