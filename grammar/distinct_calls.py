"""No call twice in one reply envelope: the guard beside the grammar of ``{"tool_calls": [...]}``.

A small model that starts a list of calls tends to write the same call again and again until
``max_tokens`` (SmolLM2-135M-Instruct does, under tool_choice "auto" with parallel calls). A
call equal in name and arguments to an earlier one in the same reply is never useful, but a
context-free grammar cannot compare two calls, so this guard follows the output's text beside
the grammar: once a call in the list closes equal to an earlier one, the list may only end
(tokens that start with ``,`` are masked until ``]``). The reply then holds that call twice at
most, and the envelope's reader (``runtime.chat.tool_call_envelope``) drops the repeat.
One token can close a call and start the next (``}},``), so while the call being written reads
as the start of an earlier one, tokens that close something and then write ``,`` are masked
too: the model writes the same text in smaller tokens, and the guard sees the call close.

Calls are compared as written with the whitespace outside strings removed, so a repeat in
another layout is a repeat. Only the bytes matter: the guard works on each token's bytes, as
the tokenizer decodes them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

_LIST_HEAD = b'{"tool_calls":['
_WHITESPACE = b" \t\n\r"
_CLOSE_THEN_SEPARATOR = re.compile(rb"[}\]][\s}\]]*,")
_LIST_DEPTH = 2  # the envelope's object, then its list: a call's object opens at this depth


class CallListScanner:
    """Reads a reply envelope's bytes as they come and says whether the list of calls must end
    here (``must_close``): the call that just closed repeats an earlier one."""

    def __init__(self) -> None:
        self._canonical = bytearray()  # the output so far, without whitespace outside strings
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._call_start: int | None = None
        self._calls: list[bytes] = []
        self.must_close = False

    @property
    def may_repeat(self) -> bool:
        """Whether a call of the list is being written that so far reads as an earlier one."""
        if self._call_start is None:
            return False
        written = bytes(self._canonical[self._call_start :])
        return any(call.startswith(written) for call in self._calls)

    def feed(self, data: bytes) -> None:
        for byte in data:
            self._feed_byte(byte)

    def _feed_byte(self, byte: int) -> None:
        char = bytes((byte,))
        if self._in_string:
            self._canonical += char
            if self._escaped:
                self._escaped = False
            elif char == b"\\":
                self._escaped = True
            elif char == b'"':
                self._in_string = False
            return
        if char in _WHITESPACE:
            return
        in_list = self._canonical.startswith(_LIST_HEAD)
        self._canonical += char
        if char == b'"':
            self._in_string = True
        elif char in b"{[":
            if in_list and self._depth == _LIST_DEPTH and char == b"{":
                self._call_start = len(self._canonical) - 1
            self._depth += 1
        elif char in b"}]":
            self._depth -= 1
            if in_list and self._depth == _LIST_DEPTH and self._call_start is not None:
                call = bytes(self._canonical[self._call_start :])
                self.must_close = call in self._calls
                self._calls.append(call)
                self._call_start = None
        if char in b",]" and self._depth <= _LIST_DEPTH:
            self.must_close = False


class ByteScanner(Protocol):
    def feed(self, data: bytes) -> None: ...


ScannerT = TypeVar("ScannerT", bound=ByteScanner)


class ScannedTokens(Generic[ScannerT]):
    """The tokens a guard's matcher accepted, read by a byte scanner; a rollback starts a new
    scanner and reads the kept tokens again (scanners keep no history to undo). The guards
    beside the grammar (this module's, grammar/nesting_guard.py) hold one."""

    def __init__(self, token_bytes: Sequence[bytes], new_scanner: Callable[[], ScannerT]) -> None:
        self._token_bytes = token_bytes
        self._new_scanner = new_scanner
        self._tokens: list[int] = []
        self.scanner = new_scanner()

    def accepted(self, token_id: int) -> None:
        self._tokens.append(token_id)
        if token_id < len(self._token_bytes):
            self.scanner.feed(self._token_bytes[token_id])

    def rolled_back(self, num_tokens: int) -> None:
        """Forgets the last ``num_tokens`` tokens (the scanner reads the rest again)."""
        if num_tokens <= 0:
            return
        kept = self._tokens[: len(self._tokens) - num_tokens]
        self._tokens, self.scanner = [], self._new_scanner()
        for token_id in kept:
            self.accepted(token_id)


class DistinctCallsGuard:
    """One request's guard: fed the tokens its matcher accepts, it narrows the grammar's mask
    while the list must end. Not thread-safe, as the matcher it sits beside."""

    def __init__(self, token_bytes: Sequence[bytes], masks: GuardMasks) -> None:
        self._masks = masks
        self._scan = ScannedTokens(token_bytes, CallListScanner)

    def accepted(self, token_id: int) -> None:
        self._scan.accepted(token_id)

    def _mask(self) -> torch.Tensor | None:
        scanner = self._scan.scanner
        if scanner.must_close:
            return self._masks.no_separator
        return self._masks.no_close_then_separator if scanner.may_repeat else None

    def refuses(self, token_id: int) -> bool:
        """Whether ``token_id`` is masked here (the grammar may still allow it)."""
        mask = self._mask()
        if mask is None:
            return False
        word, bit = divmod(token_id, 32)
        return word < mask.shape[0] and not (int(mask[word]) >> bit) & 1

    def rolled_back(self, num_tokens: int) -> None:
        """Forgets the last ``num_tokens`` tokens (the scanner reads the rest again)."""
        self._scan.rolled_back(num_tokens)

    def restrict(self, bitmask: torch.Tensor, row: int) -> None:
        """Narrows the filled ``bitmask[row]``: no ``,`` after a repeated call."""
        mask = self._mask()
        if mask is not None:
            words = min(bitmask.shape[1], mask.shape[0])
            bitmask[row, :words] &= mask[:words]


@dataclass(frozen=True)
class GuardMasks:
    """The guard's packed int32 masks [words], built once per vocabulary (``guard_masks``):
    every token but those that start with ``,`` (after whitespace), and every token but those
    that close an object or list and then write ``,``."""

    no_separator: torch.Tensor
    no_close_then_separator: torch.Tensor


def guard_masks(token_bytes: Sequence[bytes], words: int) -> GuardMasks:
    tokens = list(enumerate(token_bytes[: words * 32]))
    starts = [i for i, data in tokens if data.lstrip(_WHITESPACE)[:1] == b","]
    closes = [i for i, data in tokens if _CLOSE_THEN_SEPARATOR.search(data)]
    return GuardMasks(packed_without(starts, words), packed_without(closes, words))


def packed_without(banned: list[int], words: int) -> torch.Tensor:
    """A packed int32 mask [words] allowing every token but ``banned`` (ids past the mask, a
    tokenizer's tokens beyond the model's vocabulary, are left out: no mask bit to clear)."""
    bits = torch.ones(words * 32, dtype=torch.int64)
    inside = [i for i in banned if 0 <= i < words * 32]
    bits[torch.tensor(inside, dtype=torch.int64)] = 0
    weights = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int64), torch.arange(32))
    packed = (bits.view(words, 32) * weights).sum(dim=1)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
