"""Chunk keys: each page-aligned chunk of a prompt is named by a hash of its namespace and the
whole prefix up to the chunk's end, so equal keys mean equal prefixes (up to a 256-bit hash
collision, which the token ids stored in each file catch for the chunk's own tokens).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

# blake2b digest size in bytes; keys are its lowercase hex, 64 characters.
_DIGEST_BYTES = 32
KEY_HEX_LENGTH = 2 * _DIGEST_BYTES
_HEX_DIGITS = frozenset("0123456789abcdef")
# Bumped whenever the hashing below changes, so old files are never found under new keys.
_SCHEME = b"arbor-kv-disk-keys-v1"


def _namespace_seed(namespace: str | None) -> bytes:
    """The chain's starting value. None (no salt) is tagged 0; a string is tagged 1 and
    length-prefixed, so None, "" and every salt string seed different chains, and no salt can
    be spelled to equal another salt followed by token bytes."""
    if namespace is None:
        tagged = b"\x00"
    else:
        encoded = namespace.encode("utf-8")
        tagged = b"\x01" + len(encoded).to_bytes(8, "little") + encoded
    return hashlib.blake2b(_SCHEME + tagged, digest_size=_DIGEST_BYTES).digest()


def chunk_keys(
    token_ids: np.ndarray,
    chunk_tokens: int,
    namespace: str | None,
    known: Sequence[str] = (),
) -> list[str]:
    """Hex keys of the full chunks of ``token_ids`` (1-D integer array; any int dtype gives the
    same keys): key ``i`` names tokens ``[i*chunk_tokens, (i+1)*chunk_tokens)`` and is
    ``blake2b(key_{i-1} || chunk i's tokens as int64 little-endian)``, starting from a seed of
    ``namespace`` (the request's cache_salt: tenants never share chunks). A trailing partial
    chunk gets no key.

    ``known``: keys a previous call returned for a prefix of these tokens in this namespace
    (the caller vouches for that); they are reused and only the chunks after them hashed."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1 or (tokens.size and not np.issubdtype(tokens.dtype, np.integer)):
        raise ValueError(f"token_ids must be 1-D integers, got {tokens.dtype} {tokens.shape}")
    tokens = tokens.astype("<i8", copy=False)
    full = len(tokens) // chunk_tokens
    if len(known) >= full:
        return list(known[:full])
    keys = list(known)
    previous = bytes.fromhex(keys[-1]) if keys else _namespace_seed(namespace)
    for start in range(len(keys) * chunk_tokens, full * chunk_tokens, chunk_tokens):
        digest = hashlib.blake2b(previous, digest_size=_DIGEST_BYTES)
        digest.update(tokens[start : start + chunk_tokens].tobytes())
        previous = digest.digest()
        keys.append(previous.hex())
    return keys


def is_chunk_key(key: object) -> bool:
    """Whether ``key`` is a key ``chunk_keys`` could return: exactly KEY_HEX_LENGTH lowercase
    hex digits. Keys become file names, so nothing else (``..``, ``/``, NUL) reaches a path."""
    return isinstance(key, str) and len(key) == KEY_HEX_LENGTH and _HEX_DIGITS.issuperset(key)
