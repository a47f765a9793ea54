"""Role blocks rendered with the model's chat template, one block at a time.

A program appends text incrementally (``with s.user(): s += ...``), so rendering the whole
conversation at each call is not enough: we need each role's header and footer as plain text.
``ChatTemplate.from_tokenizer`` recovers them (``runtime.role_blocks``: rendering a probe
conversation with marker contents and cutting the result at the markers). The text stays a
stable prefix as the conversation grows, which is what lets the runtime's radix cache reuse it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.dsl_api import ChatTemplateError, derive_role_blocks

__all__ = ["CHATML", "ChatTemplate", "ChatTemplateError"]


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
        """Derive the blocks from a Hugging Face tokenizer's ``apply_chat_template``
        (``runtime.role_blocks``).

        Raises ChatTemplateError if the tokenizer has no template or its rendering is not a
        concatenation of role blocks (e.g. it rewrites earlier turns)."""
        blocks = derive_role_blocks(tokenizer)
        return cls(blocks.begin, blocks.prefix, blocks.suffix)


CHATML = ChatTemplate(
    "",
    {role: f"<|im_start|>{role}\n" for role in ("system", "user", "assistant")},
    {role: "<|im_end|>\n" for role in ("system", "user", "assistant")},
)
