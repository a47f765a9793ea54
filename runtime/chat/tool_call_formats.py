"""How a server picks its tool-call format: the ``--tool-call-parser`` flag (a format name or
an alias) or, without it, what the chat template writes — ``generic`` when the template does
not render tools at all (``runtime.chat.generic_tools``). The formats themselves are described
once, in ``grammar.tool_call_formats``, for the grammar that writes calls and the parser that
reads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from grammar.tool_call_formats import TOOL_CALL_FORMATS, ToolCallFormat
from runtime.server_args import TOOL_CALL_PARSERS

DEFAULT_FORMAT = "hermes"
GENERIC_FORMAT = "generic"
ALIASES = {"qwen": "hermes"}


def canonical_format(name: str) -> str:
    """The format ``name`` (or its alias) stands for; ValueError naming the known ones."""
    resolved = ALIASES.get(name, name)
    if resolved not in TOOL_CALL_FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}; expected one of {TOOL_CALL_PARSERS}")
    return resolved


def tool_call_format(name: str) -> ToolCallFormat:
    """The format ``name`` (or its alias) stands for; ValueError naming the known ones."""
    return TOOL_CALL_FORMATS[canonical_format(name)]


def detect_format(chat_template: Any) -> str:
    """The format a chat template writes tool calls in (``DEFAULT_FORMAT`` when it gives no
    hint). ``chat_template`` is the tokenizer's: a string, a {name: template} mapping or None."""
    if isinstance(chat_template, Mapping):
        chat_template = "\n".join(str(t) for t in chat_template.values())
    elif isinstance(chat_template, list):  # [{"name": ..., "template": ...}, ...]
        chat_template = "\n".join(str(t.get("template", "")) for t in chat_template)
    text = chat_template if isinstance(chat_template, str) else ""
    for fmt in TOOL_CALL_FORMATS.values():  # in their order of precedence
        if any(hint in text for hint in fmt.template_hints):
            return fmt.name
    return DEFAULT_FORMAT


def resolve_format(
    tool_call_parser: str | None, chat_template: Any, renders_tools: bool = True
) -> str:
    """The server's format: ``--tool-call-parser`` when given, else ``generic`` for a template
    that does not render tools (``renders_tools`` False), else detected from the chat
    template."""
    if tool_call_parser:
        return canonical_format(tool_call_parser)
    if not renders_tools:
        return GENERIC_FORMAT
    return detect_format(chat_template)
