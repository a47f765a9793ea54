"""Decoding one sequence of token ids as it grows: a sliding window of a few tokens of context
plus the new ones (constant cost per token), and only complete characters emitted (a byte-level
BPE token may end inside a multi-byte character). Used by the detokenizer and by the
scheduler's stop-regex checks.
"""

from __future__ import annotations

from typing import Any


class IncrementalDecoder:
    """Decodes one request's output as it grows."""

    def __init__(
        self,
        tokenizer: Any,
        context_ids: list[int],
        skip_special: bool,
        spaces_between_special: bool,
    ) -> None:
        self.tokenizer = tokenizer
        self.ids = list(context_ids)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.kwargs = {
            "skip_special_tokens": skip_special,
            "spaces_between_special_tokens": spaces_between_special,
        }
        self.text = ""  # everything decoded so far (complete characters)

    def add(self, new_ids: list[int], final: bool) -> None:
        """Append tokens; ``text`` grows by every complete character they finish (and, when
        ``final``, by whatever is left)."""
        self.ids.extend(new_ids)
        if len(self.ids) == self.read_offset:
            return
        window = self._decode(self.ids[self.prefix_offset :])
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        if len(window) > len(before) and (final or not window.endswith("\ufffd")):
            self.text += window[len(before) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self.kwargs) if ids else ""
