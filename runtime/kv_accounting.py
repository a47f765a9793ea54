"""KV accounting: who owns which slots, from admission to release.

``KVAccounting`` composes the slot allocator, the radix cache (None when disabled) and the
request-to-slot table, and moves ``KVPlacement``s through them: every slot is at any time free,
owned by the tree (evictable or pinned by a lock), or private to exactly one placement. Two
placers share it, so it sits below both: the scheduler's ``KVCacheManager``
(runtime/scheduler/kv_manager.py) places requests, and the draft model's ``DraftKVManager``
(runtime/speculative/draft_kv.py) places its own sequences in its own pool and tree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from radix_cache import KVSlotAllocator, RadixCache, TreeNode
from radix_cache.tree import MatchResult
from runtime.memory_pool import ReqToTokenPool


@dataclass
class KVPlacement:
    """Where a request's (or a draft sequence's) KV lives; written in this module only.

    While admitted, positions [0, kv_len) of its tokens have KV at the slots in row ``row`` of
    the request-to-slot table; [0, cached_len) are owned by the radix tree and
    pinned by a lock on ``last_node``; [cached_len, kv_len) are the request's private slots
    (with page_size > 1 its pages, including the unused tail of the last one).
    """

    row: int | None = None
    kv_len: int = 0
    cached_len: int = 0
    last_node: TreeNode | None = None
    cached_tokens: int = 0  # prompt tokens served from the cache, for the client
    disk_tokens: int = 0  # of the cached prefix, those its last admission loaded from disk
    # With a disk tier: the chunk keys of its tokens, hashed once (on arrival, for the
    # read-ahead) and extended as its matched tokens grow.
    disk_keys: list[str] = field(default_factory=list)
    # A loan in this step (KVCacheManager.lend): the cached length the request had before it
    # borrowed a step-mate's slots (None: no loan), and whether it lent its own.
    loan_start: int | None = None
    lends: bool = False


class HoldsKV(Protocol):
    """What ``KVAccounting`` places: a ``Req``, or a draft model's ``DraftSeq``."""

    @property
    def kv(self) -> KVPlacement: ...


class KVAccounting:
    """Placements in one pool: table rows, their cached prefixes locked in the tree, their
    private slots. Methods taking a ``key`` (the placement's token ids from position 0) and a
    ``salt`` (its namespace in the tree) leave keeping the tokens to the caller."""

    def __init__(
        self, allocator: KVSlotAllocator, tree: RadixCache | None, req_to_token_pool: ReqToTokenPool
    ) -> None:
        self.allocator = allocator
        self.tree = tree
        self.req_to_token_pool = req_to_token_pool
        self.page_size = allocator.page_size
        # Told of each insert as insert_hook(salt, key, slots, start) before duplicates are
        # freed: ``slots`` hold ``key``'s KV, new to the tree from position ``start`` on.
        self.insert_hook: Callable[[str | None, np.ndarray, np.ndarray, int], None] | None = None

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    def _place(self, holder: HoldsKV, match: Callable[[], MatchResult]) -> bool:
        """Give ``holder`` a table row and its cached prefix (``match()``, locked; none without
        a tree). False if no row is free."""
        row = self.req_to_token_pool.alloc()
        if row is None:
            return False
        kv = holder.kv
        kv.row = row
        if self.tree is not None:
            found = match()
            self.tree.lock(found.node)
            kv.last_node = found.node
            kv.cached_len = kv.kv_len = found.length
            self.req_to_token_pool.write(row, 0, found.slots)
        return True

    def alloc_extend(self, holder: HoldsKV, n: int) -> bool:
        """Allocate slots for the next ``n`` positions of ``holder`` and record them in its row,
        evicting unlocked cache if needed. False (nothing changed) if the pool cannot serve it."""
        kv = holder.kv
        slots = self._alloc(kv, n)
        if slots is None and self.tree is not None:
            self.tree.evict(n + self.page_size - self.allocator.available())
            slots = self._alloc(kv, n)
        if slots is None:
            return False
        assert kv.row is not None
        self.req_to_token_pool.write(kv.row, kv.kv_len, slots)
        kv.kv_len += n
        return True

    def _alloc(self, kv: KVPlacement, n: int) -> torch.Tensor | None:
        if kv.kv_len % self.page_size == 0:
            return self.allocator.alloc(n)
        last_slot = int(self.req_to_token_pool.host[kv.row, kv.kv_len - 1])
        return self.allocator.alloc_continuing(last_slot, n)

    def truncate(self, holder: HoldsKV, kv_len: int) -> None:
        """Forget positions [kv_len, kv.kv_len) (rejected draft tokens): free the pages past the
        one holding position kv_len - 1; that page's unused tail stays the holder's."""
        kv = holder.kv
        if kv_len >= kv.kv_len:
            return
        assert kv_len >= kv.cached_len, "cannot truncate into the cached prefix"
        keep_until = -(-kv_len // self.page_size) * self.page_size
        self._free_range(kv, keep_until, kv.kv_len)
        kv.kv_len = kv_len

    def _cache(self, holder: HoldsKV, key: np.ndarray, salt: str | None) -> None:
        """Hand the computed positions [0, len(key)) to the tree, keeping ``holder``'s lock on
        them; a trailing partial page stays private. Precondition: ``holder`` is placed."""
        kv = holder.kv
        if self.tree is None:
            return
        assert kv.row is not None and kv.last_node is not None, "caching needs a placement"
        self._insert(kv, key, salt)
        match = self.tree.match_from(kv.last_node, kv.cached_len, key, salt)
        self.req_to_token_pool.write(kv.row, 0, match.slots)
        self.tree.lock(match.node)
        self.tree.unlock(kv.last_node)
        kv.last_node, kv.cached_len = match.node, match.length

    def _keep(self, holder: HoldsKV, key: np.ndarray, salt: str | None, in_cache: bool) -> None:
        """First half of a release: free the positions past ``key``, then insert ``key``'s into
        the tree (``in_cache``; its trailing partial page is freed) or free the private ones
        too."""
        self.truncate(holder, len(key))
        kv = holder.kv
        if self.tree is None or not in_cache:
            self._free_range(kv, kv.cached_len, kv.kv_len)
            return
        self._insert(kv, key, salt)
        self._free_range(kv, kv.kv_len - kv.kv_len % self.page_size, kv.kv_len)

    def _unplace(self, holder: HoldsKV) -> None:
        """Second half of a release: drop ``holder``'s lock and give back its row."""
        kv = holder.kv
        assert kv.row is not None
        if self.tree is not None and kv.last_node is not None:
            self.tree.unlock(kv.last_node)
        self.req_to_token_pool.free(kv.row)
        kv.row, kv.last_node = None, None

    def _insert(self, kv: KVPlacement, key: np.ndarray, salt: str | None) -> None:
        """Insert ``key`` with its slots and free ``kv``'s private copies of what was cached."""
        assert self.tree is not None and kv.row is not None
        slots = self.req_to_token_pool.host[kv.row, : len(key)]
        already = self.tree.insert(key, slots, salt)
        if self.insert_hook is not None:
            aligned = len(key) - len(key) % self.page_size
            self.insert_hook(salt, key[:aligned], slots[:aligned].numpy(), kv.cached_len)
        if already > kv.cached_len:
            self.allocator.free(slots[kv.cached_len : already])

    def _free_range(self, kv: KVPlacement, start: int, end: int) -> None:
        if end > start:
            self.allocator.free(self.req_to_token_pool.host[kv.row, start:end])

    def private_slots(self, holders: Iterable[HoldsKV]) -> torch.Tensor:
        """Slots the placed ``holders`` hold outside the tree (for invariant checks)."""
        table = self.req_to_token_pool.host
        kvs = [h.kv for h in holders if h.kv.row is not None]
        parts = [table[kv.row, kv.cached_len : kv.kv_len] for kv in kvs]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def check_invariants(self, holders: Iterable[HoldsKV]) -> None:
        """Raise unless free + evictable + protected + private == capacity with no slot owned
        twice (private: ``holders``' slots outside the tree). Without a tree, checks the
        allocator's free count against the private slots."""
        private = self.private_slots(holders)
        if self.tree is not None:
            self.tree.check_invariants(private_slots=private)
            return
        pages = torch.unique(private // self.page_size).numel() if private.numel() else 0
        if self.allocator.available() + pages * self.page_size != self.capacity:
            raise AssertionError(
                f"KV leak: free {self.allocator.available()} + private {pages * self.page_size} "
                f"!= capacity {self.capacity}"
            )

    def flush(self) -> bool:
        """Drop every cached entry; refused (False) while placements or pins hold locks."""
        if self.tree is None:
            return True
        if self.tree.protected_size():
            return False
        self.tree.reset()
        return True
