"""Chat templates a server takes with ``--chat-template FILE|NAME``: for a model whose files
carry none (a base model, such as Gemma 3 270M), or to replace the one they carry.

A built-in template is a Jinja text in the form Hugging Face tokenizers keep
(``tokenizer.chat_template``) and the token that ends its turns, which the scheduler adds to the
model's stop tokens when the vocabulary has it as one token. No torch here: the HTTP process
imports this.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class BuiltinTemplate:
    text: str
    turn_end: str


# Gemma's turn format: user and model turns between <start_of_turn>ROLE and <end_of_turn>. It
# has no system or tool role: a system message opens the first user turn, and a tool result
# is a user turn of its own.
_GEMMA = (
    "{{- bos_token -}}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + message['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\n' -}}"
    "{%- if message['role'] == 'user' -%}{{- ns.system -}}{%- set ns.system = '' -%}{%- endif -%}"
    "{%- if message['role'] == 'tool' -%}{{- 'Tool result: ' -}}{%- endif -%}"
    "{{- (message['content'] or '') | trim -}}"
    "{{- '<end_of_turn>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
)

# ChatML: <|im_start|>ROLE, the content, <|im_end|>.
_CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

BUILTIN_TEMPLATES = {
    "gemma": BuiltinTemplate(_GEMMA, "<end_of_turn>"),
    "chatml": BuiltinTemplate(_CHATML, "<|im_end|>"),
}


class ChatTemplateSpecError(ValueError):
    """``--chat-template`` names no built-in template and no readable, valid Jinja file."""


def chat_template_text(spec: str) -> str:
    """The Jinja text ``spec`` names: a built-in name or a file. ChatTemplateSpecError when it
    is neither, or when the text does not compile."""
    builtin = BUILTIN_TEMPLATES.get(spec)
    if builtin is not None:
        return builtin.text
    path = Path(spec).expanduser()
    if not path.is_file():
        names = ", ".join(BUILTIN_TEMPLATES)
        raise ChatTemplateSpecError(
            f"--chat-template {spec!r}: no such file, and not a built-in name ({names})"
        )
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateSpecError(f"--chat-template {spec}: cannot be read ({exc})") from None
    _compile(text, spec)
    return text


def _compile(text: str, spec: str) -> None:
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateSpecError(
            f"--chat-template {spec}: not a valid Jinja template (line {exc.lineno}: {exc.message})"
        ) from None


def template_stop_ids(tokenizer: Any, spec: str | None) -> tuple[int, ...]:
    """The id of the turn-ending token of the built-in template ``spec``, when the vocabulary
    has it as one token: a chat reply stops there (``()`` for a file or no template)."""
    builtin = BUILTIN_TEMPLATES.get(spec or "")
    if builtin is None:
        return ()
    ids = tokenizer.encode(builtin.turn_end, add_special_tokens=False)
    return tuple(ids) if len(ids) == 1 else ()


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


NO_TEMPLATE = (
    "this model has no chat template, so the chat APIs cannot render messages: use "
    "/v1/completions or /generate, or start the server with --chat-template FILE|NAME "
    f"(built-in names: {', '.join(BUILTIN_TEMPLATES)})"
)
