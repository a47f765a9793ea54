"""The text and raw bytes of single tokens, for logprobs in API responses.

A byte-level BPE token may hold part of a multi-byte character, so ``decode([id])`` alone can
lose bytes; OpenAI's logprobs carry each token's ``bytes`` for that reason. Byte-level tokens
map back through GPT-2's byte-to-unicode table, SentencePiece tokens through ``▁`` and
``<0xNN>`` byte-fallback pieces; added tokens are their own text.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's ``bytes_to_unicode`` table."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[chr(byte)] = byte
        else:
            mapping[chr(256 + extra)] = byte
            extra += 1
    return mapping


class TokenText:
    """Per-tokenizer lookup of token text and bytes, cached per id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.byte_level = _uses_byte_level(tokenizer)
        self.added = {str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
        self._cache: dict[int, tuple[str, bytes]] = {}

    def text(self, token_id: int) -> str:
        """The token decoded alone (what SGLang's ``return_text_in_logprobs`` returns)."""
        return self._lookup(token_id)[0]

    def token_bytes(self, token_id: int) -> bytes:
        return self._lookup(token_id)[1]

    def _lookup(self, token_id: int) -> tuple[str, bytes]:
        cached = self._cache.get(token_id)
        if cached is None:
            raw = self._raw_bytes(token_id)
            cached = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return cached

    def _raw_bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if piece in self.added:
            return piece.encode()
        table = _unicode_to_byte()
        if self.byte_level and all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        return piece.replace("▁", " ").encode()


def _uses_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = json.loads(backend.to_str()).get("decoder")
    return '"ByteLevel"' in json.dumps(decoder)
