"""Decides when a request is done after each new token: EOS and stop tokens, stop strings and
stop regexes on the decoded text (across token boundaries), the grammar, and max_new_tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from runtime.ipc import FinishReason

if TYPE_CHECKING:
    from runtime.scheduler.req import Req

# Prompt tokens given to an incremental decoder as context (SentencePiece spacing).
PROMPT_TAIL = 6

# Extra tokens decoded beyond a stop string's byte length: a window of this many tokens always
# covers the string even when it starts in the middle of a token.
_WINDOW_SLACK = 4


class StopChecker:
    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)

    def check(self, req: Req, check_grammar: bool = True) -> None:
        """Set ``req.finished_reason`` if the token just appended ends the request.

        check_grammar: whether the matcher's state belongs to this token (not when it has
        already accepted tokens after it)."""
        params = req.sampling
        token = req.output_ids[-1]
        produced = len(req.output_ids)
        if produced >= params.min_new_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                req.finish(FinishReason.stop(token))
                return
            if token in params.stop_token_ids:
                req.finish(FinishReason.stop(token))
                return
            if params.stop and self._check_stop_strings(req):
                return
            if params.stop_regex and self._check_stop_regex(req):
                return
        matcher = req.constraint.matcher
        if check_grammar and matcher is not None and matcher.is_terminated():
            req.finish(FinishReason.stop(None))
            return
        if produced >= params.max_new_tokens:
            req.finish(FinishReason.cut(produced))

    def _check_stop_strings(self, req: Req) -> bool:
        window = max(len(s.encode()) for s in req.sampling.stop) + _WINDOW_SLACK
        tail = self.tokenizer.decode(
            req.output_ids[-window:], skip_special_tokens=req.sampling.skip_special_tokens
        )
        for stop in req.sampling.stop:
            if stop in tail:
                req.finish(FinishReason.stop(stop))
                return True
        return False

    def _check_stop_regex(self, req: Req) -> bool:
        """Feed the new text to the request's stop-regex matcher (prepared, with its automata
        and its decoder, in the grammar queue: building them here could stall the scheduler)."""
        matcher, decoder = req.constraint.stop_regex, req.constraint.stop_text
        if matcher is None or decoder is None:
            raise RuntimeError("the stop regexes were not prepared")
        before = len(decoder.text)
        decoder.add(req.output_ids[-1:], final=False)
        match = matcher.feed(decoder.text[before:])
        if match is None:
            return False
        start, end = match
        req.finish(FinishReason.stop(decoder.text[start:end]))
        return True
