"""Constraints that start after the reasoning: a request's grammar waits while the model thinks.

A request with a constraint and ``reasoning_end_token_id`` (e.g. the id of ``</think>``) is
free until it emits that token; its constraint applies from the next token on. While the gate
holds the matcher, ``req.constraint.matcher`` is None, so nothing of the grammar runs for the
request: no mask, no jump-forward draft, no matcher step. Once the gate opens, the matcher is
``req.constraint.matcher`` and the request is an ordinary constrained one.

Where the output starts is read from the prompt's last token that is not whitespace:

- the end token (the template closed the reasoning, e.g. Qwen3 with ``enable_thinking=False``):
  no gate, the constraint applies from the first token;
- the start token ``reasoning_start_token_id`` (the template opened the reasoning): thinking;
- anything else: thinking, or, given ``reasoning_start_token_id`` (a model that may or may not
  open a reasoning block, as Qwen3), opening: the first token is the grammar's first token or
  the start token. The start token leads to thinking; any other token is the grammar's first,
  so an output that does not reason is constrained from its first token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from runtime.sampling_params import SamplingParams

# Whitespace tokens looked past at the prompt's end (Qwen3 writes "</think>\n\n").
_PROMPT_TAIL_TOKENS = 16


class ReasoningGate:
    """Holds a request's matcher until its reasoning ends.

    ``opening``: the next token is the output's first, and may open the reasoning with
    ``start_token`` (masked as the grammar's first token or that one); else thinking (free).
    """

    def __init__(
        self, matcher: Any, end_token: int, start_token: int | None, opening: bool
    ) -> None:
        self.matcher = matcher
        self.end_token = end_token
        self.start_token = start_token
        self.opening = opening

    def advance(self, token: int) -> bool:
        """Take the request's new output token; True when the constraint applies from now on
        (the matcher has then seen every token of the answer so far)."""
        if not self.opening:
            return token == self.end_token
        self.opening = False
        if token == self.start_token:
            return False
        # The mask allowed this token as the grammar's first. xgrammar can allow a token its
        # matcher refuses (see Sampler._advance_grammars); the request then fails alone.
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"the grammar rejected its first token {token}")
        return True


def reasoning_gate(
    params: SamplingParams,
    prompt_ids: Sequence[int],
    matcher: Any,
    is_whitespace: Callable[[int], bool],
) -> ReasoningGate | None:
    """The gate for a request whose constraint compiled into ``matcher``; None when the
    constraint applies from the first token (no ``reasoning_end_token_id``, or the prompt
    already closed the reasoning). ``is_whitespace(token)``: the token decodes to whitespace."""
    end = params.reasoning_end_token_id
    if end is None:
        return None
    start = params.reasoning_start_token_id
    last = _last_visible_token(prompt_ids, is_whitespace)
    if last == end:
        return None
    opening = start is not None and last != start
    return ReasoningGate(matcher, end, start, opening)


def _last_visible_token(ids: Sequence[int], is_whitespace: Callable[[int], bool]) -> int | None:
    for token in reversed(ids[-_PROMPT_TAIL_TOKENS:]):
        if not is_whitespace(token):
            return token
    return None
