"""Role blocks rendered with the model's chat template, one block at a time.

A program appends text incrementally (``with s.user(): s += ...``), so rendering the whole
conversation at each call is not enough: we need each role's header and footer as plain text.
``ChatTemplate.from_tokenizer`` recovers them by rendering a probe conversation with marker
contents and cutting the result at the markers. The text stays a stable prefix as the
conversation grows, which is what lets the runtime's radix cache reuse it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_MARKS = ("\x01S\x01", "\x01U\x01", "\x01A\x01", "\x01V\x01")


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be split into per-role headers and footers."""


@dataclass(frozen=True)
class ChatTemplate:
    """Per-role text around a message's content.

    ``begin`` opens a conversation (before the first role block; the BOS text is left out when
    the tokenizer adds BOS itself); ``prefix[role]`` and ``suffix[role]`` surround a message.
    The rendering of messages m1..mn is ``begin + sum(prefix[r] + content + suffix[r])``.
    """

    begin: str
    prefix: dict[str, str]
    suffix: dict[str, str]

    def render(self, messages: list[dict[str, str]]) -> str:
        parts = [self.begin]
        for message in messages:
            role = message["role"]
            parts.append(self.prefix[role] + message["content"] + self.suffix[role])
        return "".join(parts)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> ChatTemplate:
        """Derive the blocks from a Hugging Face tokenizer's ``apply_chat_template``.

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
        return cls(
            begin,
            {"system": system_prefix, "user": user_prefix, "assistant": assistant_prefix},
            {"system": system_suffix, "user": user_suffix, "assistant": assistant_suffix},
        )


CHATML = ChatTemplate(
    "",
    {role: f"<|im_start|>{role}\n" for role in ("system", "user", "assistant")},
    {role: "<|im_end|>\n" for role in ("system", "user", "assistant")},
)


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
