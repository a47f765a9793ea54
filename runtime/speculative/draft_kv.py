"""KV accounting of the draft model: which slots each drafting request holds, from admission to
release, in the draft's own pool and radix tree (page size 1).

Mirrors the target's ``KVCacheManager`` discipline: every slot of the draft pool is at any time
free, owned by the tree (evictable, or pinned by a sequence's lock), or private to exactly one
sequence; ``check_invariants`` proves it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from radix_cache import CacheInvariantError, KVSlotAllocator, RadixCache, TreeNode
from runtime.memory_pool import ReqToTokenPool

TOKEN_DTYPE = np.int32  # the radix tree's key dtype


def as_tokens(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """1-D int32 array of ``token_ids``; a view when it already is one (no per-call copy)."""
    if isinstance(token_ids, list):
        return np.fromiter(token_ids, dtype=TOKEN_DTYPE, count=len(token_ids))
    return np.asarray(token_ids).astype(TOKEN_DTYPE, copy=False).reshape(-1)


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int32 arrays."""
    n = min(a.size, b.size)
    if a[:n].tobytes() == b[:n].tobytes():
        return n
    return int((a[:n] != b[:n]).argmax())


@dataclass
class DraftSeq:
    """One request's KV in the draft pool.

    Positions [0, kv_len) of row ``row`` hold KV: first ``confirmed`` (tokens of the request's
    own sequence), then ``drafted`` (tokens this worker proposed and fed, not yet known to be
    accepted). [0, cached_len) are the tree's slots, pinned by a lock on ``last_node``;
    [cached_len, kv_len) are the sequence's private slots. Its KV lives in the draft tree's
    namespace of ``cache_salt``.
    """

    key: str
    row: int
    last_node: TreeNode
    cached_len: int
    confirmed: np.ndarray  # int32, the request's tokens whose KV is computed
    drafted: list[int] = field(default_factory=list)
    prefilled: bool = False  # caught up with the request's sequence at least once
    cache_salt: str | None = None

    @property
    def kv_len(self) -> int:
        return self.confirmed.size + len(self.drafted)


class DraftKVManager:
    """Admission, growth, truncation and release of ``DraftSeq``s, keyed by request id."""

    def __init__(
        self, allocator: KVSlotAllocator, tree: RadixCache, req_to_token_pool: ReqToTokenPool
    ) -> None:
        if allocator.page_size != 1:
            raise ValueError("the draft pool uses page size 1")
        self.allocator = allocator
        self.tree = tree
        self.req_to_token_pool = req_to_token_pool
        self.seqs: dict[str, DraftSeq] = {}

    def prepare(
        self, key: str, token_ids: np.ndarray, cache_salt: str | None = None
    ) -> tuple[DraftSeq | None, bool]:
        """The sequence of ``key`` with its KV cut back to what ``token_ids`` still agrees with,
        leaving at least the last token to compute (its logits are the first draft step's).

        Admits an unknown key (a table row and its cached prefix in ``cache_salt``'s
        namespace, locked; a key keeps the salt it was admitted with). Returns the sequence
        (None when no table row is free) and whether it was admitted by this call. Precondition:
        ``token_ids`` is non-empty.
        """
        seq = self.seqs.get(key)
        if seq is not None:
            start = min(self._agreed_len(seq, token_ids), token_ids.size - 1)
            if start >= seq.cached_len:
                self._truncate(seq, start, token_ids)
                return seq, False
            self.release(key, keep_in_cache=True)  # the sequence changed inside the cached part
        return self._admit(key, token_ids, cache_salt), True

    def _admit(self, key: str, token_ids: np.ndarray, salt: str | None) -> DraftSeq | None:
        row = self.req_to_token_pool.alloc()
        if row is None:
            return None
        match = self.tree.match_prefix(token_ids[: token_ids.size - 1], salt)
        self.tree.lock(match.node)
        self.req_to_token_pool.write(row, 0, match.slots)
        confirmed = token_ids[: match.length].copy()
        seq = DraftSeq(key, row, match.node, match.length, confirmed, cache_salt=salt)
        self.seqs[key] = seq
        return seq

    def _agreed_len(self, seq: DraftSeq, token_ids: np.ndarray) -> int:
        """How many leading tokens of ``seq``'s KV are the first tokens of ``token_ids``."""
        agreed = common_prefix_len(seq.confirmed, token_ids)
        if agreed < seq.confirmed.size:
            return agreed
        for token in seq.drafted:  # accepted draft tokens keep their KV
            if agreed == token_ids.size or int(token_ids[agreed]) != token:
                break
            agreed += 1
        return agreed

    def _truncate(self, seq: DraftSeq, kv_len: int, token_ids: np.ndarray) -> None:
        """Free positions [kv_len, seq.kv_len); the rest becomes confirmed (it agrees with
        ``token_ids``). Precondition: cached_len <= kv_len <= the agreed length."""
        self._free_range(seq, kv_len, seq.kv_len)
        if kv_len != seq.confirmed.size or seq.drafted:
            seq.confirmed = token_ids[:kv_len].copy()
            seq.drafted = []

    def grow(self, seq: DraftSeq, token_ids: np.ndarray | list[int], confirmed: bool) -> bool:
        """Give ``seq`` slots for ``token_ids`` at its next positions (evicting unlocked cache
        if needed) and record them, as confirmed or drafted tokens. False, changing nothing,
        when the pool cannot hold them. The caller then computes their KV."""
        n = len(token_ids)
        slots = self.allocator.alloc(n)
        if slots is None:
            self.tree.evict(n - self.allocator.available())
            slots = self.allocator.alloc(n)
        if slots is None:
            return False
        self.req_to_token_pool.write(seq.row, seq.kv_len, slots)
        if confirmed:
            assert not seq.drafted, "confirmed tokens cannot follow drafted ones"
            seq.confirmed = np.concatenate([seq.confirmed, np.asarray(token_ids, TOKEN_DTYPE)])
        else:
            seq.drafted.extend(int(t) for t in token_ids)
        return True

    def cache_prefix(self, seq: DraftSeq, n: int) -> None:
        """Hand confirmed positions [0, n) to the tree, keeping ``seq``'s lock on them, so
        requests arriving meanwhile with the same prompt reuse it. Precondition: no later
        call truncates ``seq`` below ``n`` (keep ``n`` under the request's length)."""
        if n <= seq.cached_len:
            return
        tokens = seq.confirmed[:n]
        self._insert(seq, tokens)
        match = self.tree.match_prefix(tokens, seq.cache_salt)
        self.req_to_token_pool.write(seq.row, 0, match.slots)
        self.tree.lock(match.node)
        self.tree.unlock(seq.last_node)
        seq.last_node, seq.cached_len = match.node, match.length

    def release(self, key: str, keep_in_cache: bool) -> None:
        """Give back everything ``key`` holds: its lock, its private slots and its row. Drafted
        tokens are dropped; with ``keep_in_cache`` the confirmed ones go into the tree first.
        Unknown keys are ignored."""
        seq = self.seqs.pop(key, None)
        if seq is None:
            return
        confirmed = seq.confirmed.size
        self._free_range(seq, confirmed, seq.kv_len)
        if keep_in_cache:
            self._insert(seq, seq.confirmed)
        else:
            self._free_range(seq, seq.cached_len, confirmed)
        self.tree.unlock(seq.last_node)
        self.req_to_token_pool.free(seq.row)

    def _insert(self, seq: DraftSeq, tokens: np.ndarray) -> None:
        """Insert ``tokens`` (a confirmed prefix) with their slots; free the sequence's private
        copies of what the tree already held."""
        slots = self.req_to_token_pool.host[seq.row, : tokens.size]
        already = self.tree.insert(tokens, slots, seq.cache_salt)
        if already > seq.cached_len:
            self.allocator.free(slots[seq.cached_len : already])

    def _free_range(self, seq: DraftSeq, start: int, end: int) -> None:
        if end > start:
            self.allocator.free(self.req_to_token_pool.host[seq.row, start:end])

    def private_slots(self) -> torch.Tensor:
        """Slots the sequences hold outside the tree."""
        table = self.req_to_token_pool.host
        parts = [table[s.row, s.cached_len : s.kv_len] for s in self.seqs.values()]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def check_invariants(self) -> None:
        """Raise CacheInvariantError unless free + cached + private == capacity with no slot
        owned twice, and every sequence has a row of its own."""
        rows = [s.row for s in self.seqs.values()]
        if len(set(rows)) != len(rows):
            raise CacheInvariantError(f"two draft sequences share a table row: {sorted(rows)}")
        if len(rows) + self.req_to_token_pool.available() != self.req_to_token_pool.padding_row:
            raise CacheInvariantError("a table row leaked or is free while a sequence holds it")
        for seq in self.seqs.values():
            if not 0 <= seq.cached_len <= seq.confirmed.size:
                raise CacheInvariantError(
                    f"draft sequence {seq.key!r} caches {seq.cached_len} of "
                    f"{seq.confirmed.size} confirmed tokens"
                )
        self.tree.check_invariants(private_slots=self.private_slots())

    def flush(self) -> bool:
        """Drop every cached entry; refused (False) while sequences hold locks on the tree."""
        if self.tree.protected_size():
            return False
        self.tree.reset()
        return True
