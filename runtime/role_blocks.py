"""Each chat role's header and footer as plain text, recovered from a tokenizer's chat template.

A DSL program appends text incrementally (``with s.user(): s += ...``), so rendering the whole
conversation at each call is not enough: it needs each role's header and footer. They are
recovered by rendering a probe conversation with marker contents and cutting the result at the
markers. The server derives them from its own tokenizer and reports them in
``/get_model_info`` (``chat_template_blocks``), so a client needs no copy of the model folder;
``frontend_lang.ChatTemplate`` is built from them. No torch here: the HTTP process imports this.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

_MARKS = ("\x01S\x01", "\x01U\x01", "\x01A\x01", "\x01V\x01")


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be split into per-role headers and footers."""


@dataclass(frozen=True)
class RoleBlocks:
    """``begin`` opens a conversation; ``prefix[role]`` and ``suffix[role]`` surround a message
    (roles: system, user, assistant)."""

    begin: str
    prefix: dict[str, str]
    suffix: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def derive_role_blocks(tokenizer: Any) -> RoleBlocks:
    """The blocks of a Hugging Face tokenizer's ``apply_chat_template``.

    Raises ChatTemplateError if the tokenizer has no template or its rendering is not a
    concatenation of role blocks (e.g. it rewrites earlier turns)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("the tokenizer has no chat template")
    sys_m, user_m, asst_m, user2_m = _MARKS

    def render(messages: list[tuple[str, str]]) -> str:
        text = tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in messages],
            tokenize=False,
            add_generation_prompt=False,
        )
        if not isinstance(text, str):
            raise ChatTemplateError("apply_chat_template(tokenize=False) gave no string")
        return text

    conversation = [("system", sys_m), ("user", user_m), ("assistant", asst_m)]
    full = render([*conversation, ("user", user2_m)])
    pieces = _split(full, _MARKS)
    head, sys_to_user, user_to_asst, asst_to_user, tail = pieces
    user_suffix = tail
    assistant_suffix = _split(render(conversation), (asst_m,))[1]
    if not (user_to_asst.startswith(user_suffix) and asst_to_user.startswith(assistant_suffix)):
        raise ChatTemplateError("role footers differ between turns")
    assistant_prefix = user_to_asst[len(user_suffix) :]
    user_prefix = asst_to_user[len(assistant_suffix) :]
    if not sys_to_user.endswith(user_prefix):
        raise ChatTemplateError("the user header differs between turns")
    system_suffix = sys_to_user[: len(sys_to_user) - len(user_prefix)]
    begin, system_prefix = "", head
    lone_user = _split(render([("user", user_m)]), (user_m,))[0]
    if lone_user.endswith(user_prefix):
        candidate = lone_user[: len(lone_user) - len(user_prefix)]
        if head.startswith(candidate):
            begin, system_prefix = candidate, head[len(candidate) :]
    begin = _without_auto_bos(begin, tokenizer)
    return RoleBlocks(
        begin,
        {"system": system_prefix, "user": user_prefix, "assistant": assistant_prefix},
        {"system": system_suffix, "user": user_suffix, "assistant": assistant_suffix},
    )


def role_blocks_or_why(tokenizer: Any) -> RoleBlocks | str:
    """``derive_role_blocks``, or why there are none as a message: a template may raise anything
    on the probe conversation (jinja's ``raise_exception`` for a role it refuses, say)."""
    try:
        return derive_role_blocks(tokenizer)
    except ChatTemplateError as exc:
        return str(exc)
    except Exception as exc:
        return repr(exc)


def _split(text: str, marks: tuple[str, ...]) -> list[str]:
    pieces, rest = [], text
    for mark in marks:
        if rest.count(mark) != 1:
            raise ChatTemplateError("the template does not render each message's content once")
        before, rest = rest.split(mark)
        pieces.append(before)
    return [*pieces, rest]


def _without_auto_bos(begin: str, tokenizer: Any) -> str:
    """Drop the BOS text from ``begin`` when tokenizing already adds the BOS token."""
    bos = getattr(tokenizer, "bos_token", None)
    if not bos or not begin.startswith(bos):
        return begin
    ids = tokenizer("").input_ids
    adds_bos = bool(ids) and ids[0] == tokenizer.bos_token_id
    return begin[len(bos) :] if adds_bos else begin
