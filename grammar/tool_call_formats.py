"""The tool-call syntaxes of the model families, by format name: one description per format that
both the grammar writing the calls (``grammar.tool_calls``) and the server's parser reading
them back from free text (``runtime.chat.tool_call_parser``) use. Adding a format is one
entry here. Imports nothing heavy: the server's HTTP process reads it.

Every format writes one call as the JSON object ``{"name": NAME, "<arguments key>": ARGS}``;
they differ in what surrounds the calls of one turn::

    hermes   <tool_call>{...}</tool_call><tool_call>{...}</tool_call>
    llama3   {"name": ..., "parameters": {...}}; {"name": ..., "parameters": {...}}
    mistral  [TOOL_CALLS][{...}, {...}]
    generic  <tool_call>{...}</tool_call><tool_call>{...}</tool_call>

``generic`` is the format the server describes itself, in the system turn, to a model whose
chat template has no tool syntax (``runtime.chat.generic_tools``): hermes's syntax under
its own name, never detected from a template's text.
"""

from __future__ import annotations

from dataclasses import dataclass

from grammar.errors import GrammarError


@dataclass(frozen=True)
class ToolCallFormat:
    """Where a model writes its calls.

    Calls come in sections. A section opens with ``marker`` then ``list_open`` and holds call
    objects separated by ``separator``, then ``list_close``; with ``item_close`` each call is
    a section of its own, closed by it (a turn's sections follow each other directly).
    ``arguments_key`` names the call object's arguments member.

    The grammar writes exactly that, leaving the marker out where ``writes_marker`` is False.
    The parser reads more leniently: any whitespace between the parts, the separator's mark
    without its spacing (or, without a list, no separator), "arguments" or "parameters"; and
    where ``bare_start`` is set, a section that opens without the marker when the output
    begins with ``bare_start`` (a model may drop the marker, e.g. a special token that
    decoding leaves out). ``template_hints``: texts whose presence in a chat template means
    this format.
    """

    name: str
    marker: str
    arguments_key: str = "arguments"
    list_open: str = ""
    list_close: str = ""
    item_close: str = ""
    separator: str = ""
    writes_marker: bool = True
    bare_start: str = ""
    template_hints: tuple[str, ...] = ()

    @property
    def separator_mark(self) -> str:
        """The separator without its spacing: what the parser needs between two calls."""
        return self.separator.strip()


HERMES = ToolCallFormat(
    "hermes", marker="<tool_call>", item_close="</tool_call>", template_hints=("<tool_call>",)
)
# Llama 3.1/3.2 JSON tool calling: the turn is the call object(s); <|python_tag|> may precede.
LLAMA3 = ToolCallFormat(
    "llama3",
    marker="<|python_tag|>",
    arguments_key="parameters",
    separator="; ",
    writes_marker=False,
    bare_start="{",
    template_hints=("<|python_tag|>", "<|start_header_id|>"),
)
# [TOOL_CALLS] is a special token in Mistral's own tokenizers: decoding may drop it.
MISTRAL = ToolCallFormat(
    "mistral",
    marker="[TOOL_CALLS]",
    list_open="[",
    list_close="]",
    separator=", ",
    bare_start="[",
    template_hints=("[TOOL_CALLS]",),
)
# Written between tags the server's own prompt names (runtime.chat.generic_tools); no hints.
GENERIC = ToolCallFormat("generic", marker="<tool_call>", item_close="</tool_call>")
# In the order a server checks chat templates for their hints: a Mistral template may also
# mention <tool_call>-like text, never the reverse; Llama 3 header tokens are the weakest hint.
TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {
    f.name: f for f in (MISTRAL, HERMES, LLAMA3, GENERIC)
}


def get_format(name: str) -> ToolCallFormat:
    """The format called ``name``; GrammarError naming the known ones otherwise."""
    try:
        return TOOL_CALL_FORMATS[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(TOOL_CALL_FORMATS))
        raise GrammarError(f"unknown tool-call format {name!r}; expected one of {known}") from None
