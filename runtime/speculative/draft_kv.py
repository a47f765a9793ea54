"""KV accounting of the draft model: which slots each drafting request holds, from admission to
release, in the draft's own pool and radix tree (page size 1), by the target's ``KVAccounting``
(runtime/kv_accounting.py). What differs is the tokens: a sequence holds KV for tokens
of its request's sequence, then for tokens it drafted itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from radix_cache import CacheInvariantError, KVSlotAllocator, RadixCache
from radix_cache.node import KEY_DTYPE, common_prefix_len
from runtime.kv_accounting import KVAccounting, KVPlacement
from runtime.memory_pool import ReqToTokenPool


@dataclass
class DraftSeq:
    """One request's KV in the draft pool, in the draft tree's namespace of ``cache_salt``.

    ``tokens`` (int32) are those of positions [0, kv.kv_len): the first ``confirmed`` are the
    request's own; the rest this worker proposed and fed, not yet known to be accepted.
    """

    key: str
    cache_salt: str | None
    tokens: np.ndarray = field(default_factory=lambda: np.empty(0, KEY_DTYPE))
    confirmed: int = 0
    prefilled: bool = False  # caught up with the request's sequence at least once
    kv: KVPlacement = field(default_factory=KVPlacement)

    @property
    def row(self) -> int:
        assert self.kv.row is not None, "a sequence in the manager has a row"
        return self.kv.row


class DraftKVManager(KVAccounting):
    """Admission, growth, truncation and release of ``DraftSeq``s, keyed by request id."""

    tree: RadixCache

    def __init__(
        self, allocator: KVSlotAllocator, tree: RadixCache, req_to_token_pool: ReqToTokenPool
    ) -> None:
        if allocator.page_size != 1:
            raise ValueError("the draft pool uses page size 1")
        super().__init__(allocator, tree, req_to_token_pool)
        self.seqs: dict[str, DraftSeq] = {}

    def prepare(
        self, key: str, token_ids: np.ndarray, cache_salt: str | None = None
    ) -> tuple[DraftSeq | None, bool]:
        """The sequence of ``key`` with its KV cut back to what ``token_ids`` still agrees with
        (accepted draft tokens keep theirs), leaving at least the last token to compute (its
        logits are the first draft step's); all of it is then confirmed.

        Admits an unknown key (a table row and its cached prefix in ``cache_salt``'s
        namespace, locked; a key keeps the salt it was admitted with). Returns the sequence
        (None when no table row is free) and whether it was admitted by this call. Precondition:
        ``token_ids`` is non-empty.
        """
        seq = self.seqs.get(key)
        if seq is not None:
            agreed = common_prefix_len(seq.tokens, token_ids, 1)
            start = min(agreed, token_ids.size - 1)
            if start >= seq.kv.cached_len:
                self.truncate(seq, start)
                seq.tokens, seq.confirmed = seq.tokens[:start], start
                return seq, False
            self.release(key, keep_in_cache=True)  # the sequence changed inside the cached part
        seq = DraftSeq(key, cache_salt)
        if not self._place(seq, lambda: self.tree.match_prefix(token_ids[:-1], cache_salt)):
            return None, True
        seq.tokens = token_ids[: seq.kv.cached_len].copy()
        seq.confirmed = seq.tokens.size
        self.seqs[key] = seq
        return seq, True

    def grow(self, seq: DraftSeq, token_ids: np.ndarray | list[int], confirmed: bool) -> bool:
        """Give ``seq`` slots for ``token_ids`` at its next positions (evicting unlocked cache
        if needed) and record them, as confirmed or drafted tokens. False, changing nothing,
        when the pool cannot hold them. The caller then computes their KV."""
        if not self.alloc_extend(seq, len(token_ids)):
            return False
        if confirmed:
            assert seq.confirmed == seq.tokens.size, "confirmed tokens cannot follow drafted ones"
            seq.confirmed += len(token_ids)
        seq.tokens = np.concatenate([seq.tokens, np.asarray(token_ids, KEY_DTYPE)])
        return True

    def cache_prefix(self, seq: DraftSeq, n: int) -> None:
        """Hand confirmed positions [0, n) to the tree, keeping ``seq``'s lock on them, so
        requests arriving meanwhile with the same prompt reuse it. Precondition: no later
        call truncates ``seq`` below ``n`` (keep ``n`` under the request's length)."""
        if n > seq.kv.cached_len:
            self._cache(seq, seq.tokens[:n], seq.cache_salt)

    def release(self, key: str, keep_in_cache: bool) -> None:
        """Give back everything ``key`` holds: its lock, its private slots and its row. Drafted
        tokens are dropped; with ``keep_in_cache`` the confirmed ones go into the tree first.
        Unknown keys are ignored."""
        seq = self.seqs.pop(key, None)
        if seq is not None:
            self._keep(seq, seq.tokens[: seq.confirmed], seq.cache_salt, keep_in_cache)
            self._unplace(seq)

    def check_seqs(self) -> None:
        """Raise CacheInvariantError unless free + cached + private == capacity with no slot
        owned twice, and every sequence has a row of its own and KV for its tokens."""
        rows = [s.kv.row for s in self.seqs.values()]
        if len(set(rows)) != len(rows) or None in rows:
            raise CacheInvariantError(f"draft sequences without a row of their own: {rows}")
        if len(rows) + self.req_to_token_pool.available() != self.req_to_token_pool.padding_row:
            raise CacheInvariantError("a table row leaked or is free while a sequence holds it")
        for seq in self.seqs.values():
            kv = seq.kv
            if not 0 <= kv.cached_len <= seq.confirmed <= seq.tokens.size == kv.kv_len:
                raise CacheInvariantError(
                    f"draft sequence {seq.key!r} caches {kv.cached_len} of {seq.confirmed} "
                    f"confirmed tokens, {seq.tokens.size} tokens, KV for {kv.kv_len}"
                )
        self.check_invariants(self.seqs.values())
