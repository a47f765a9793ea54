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
from radix_cache.swa import Droppable, HybridSlotAllocator, window_valid_length
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
    # With window KV (HybridSlotAllocator): private positions below this have had their
    # window half dropped (no query of this placement reads them through a window again).
    window_dropped: int = 0


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
        # With window KV memory (radix_cache/swa.py): the hybrid allocator, else None.
        self.hybrid = allocator if isinstance(allocator, HybridSlotAllocator) else None
        self._placed: dict[int, KVPlacement] = {}  # by row

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
        kv.row, kv.window_dropped = row, 0
        self._placed[row] = kv
        if self.tree is not None:
            found = match()
            if self.hybrid is not None:
                found = self._window_whole(found)
            self.tree.lock(found.node)
            kv.last_node = found.node
            kv.cached_len = kv.kv_len = found.length
            self.req_to_token_pool.write(row, 0, found.slots)
        return True

    def _window_whole(self, found: MatchResult) -> MatchResult:
        """``found`` cut back to where the windowed layers hold every position a query after it
        can see (``window_valid_length``): the rest is computed again."""
        assert self.hybrid is not None and self.tree is not None
        has = self.hybrid.has_window(found.slots)
        length = window_valid_length(has, found.length, self.hybrid.window, self.page_size)
        return self.tree.shorten(found, length)

    def alloc_extend(self, holder: HoldsKV, n: int) -> bool:
        """Allocate slots for the next ``n`` positions of ``holder`` and record them in its row,
        evicting unlocked cache if needed. False (nothing changed) if the pool cannot serve it.
        With window KV memory, first drops the window half of its private positions no query
        will read through a window again, and makes room in the window pool too."""
        kv = holder.kv
        if self.hybrid is not None:
            self._drop_out_of_window(kv)
            self._make_window_room(n)
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

    def _drop_out_of_window(self, kv: KVPlacement) -> None:
        """Free the window half of ``kv``'s private pages wholly before its window: queries at
        positions >= kv_len read back to kv_len - window + 1 at the earliest."""
        assert self.hybrid is not None and kv.row is not None
        start = max(kv.cached_len, kv.window_dropped)
        start += -start % self.page_size  # a page the tree shares stays the tree's
        end = kv.kv_len - self.hybrid.window + 1
        end -= end % self.page_size
        if end > start:
            self.hybrid.drop_window(self.req_to_token_pool.host[kv.row, start:end])
            kv.window_dropped = end

    def _make_window_room(self, n: int) -> None:
        """Evict cached window KV until ``n`` more positions (and a page) fit in the window
        pool, sparing what running placements and pins read through their windows; pins give
        way to running placements when that is not enough (their prefix is then matched only
        where its window is whole, or computed again)."""
        assert self.hybrid is not None
        for with_pins in (True, False):
            short = n + self.page_size - self.hybrid.window_available()
            if short <= 0 or self.tree is None:
                return
            self.tree.evict_window(short, self._window_droppable(with_pins))

    def _window_anchors(self, with_pins: bool = True) -> list[tuple[TreeNode, int, int]]:
        """(node, its depth, the position of the next query) of every cached path something
        will read through a window: each placement's locked prefix and (``with_pins``) each
        pin."""
        anchors = [
            (kv.last_node, kv.cached_len, kv.kv_len)
            for kv in self._placed.values()
            if kv.last_node is not None
        ]
        assert self.tree is not None
        if with_pins:
            anchors += [(node, depth, depth) for node, depth in self.tree.pinned_prefixes()]
        return anchors

    def _window_droppable(self, with_pins: bool = True) -> Droppable:
        """How much of each cached node some anchor (``_window_anchors``) reads through its
        window, as ``Droppable``: a query at position p reads back to p - window + 1, so a
        node on an anchor's path keeps its window half from there on."""
        assert self.hybrid is not None
        droppable: Droppable = {}
        for node, depth, reader in self._window_anchors(with_pins):
            horizon = reader - self.hybrid.window + 1
            cursor: TreeNode | None = node
            while cursor is not None and cursor.parent is not None and depth > horizon:
                start = depth - cursor.key.size
                head = max(0, horizon - start)
                head -= head % self.page_size
                droppable[cursor] = min(head, droppable.get(cursor, head))
                depth = start
                cursor = cursor.parent
        return droppable

    def window_evictable(self) -> int:
        """Window slots an allocation can get: free, or held by cached nodes no placement
        reads through its window (pins give way). O(cached nodes)."""
        assert self.hybrid is not None
        free = self.hybrid.window_available()
        if self.tree is None:
            return free
        return free + self.tree.window_held(self._window_droppable(with_pins=False))

    def chunk_limit(self, n: int) -> int:
        """``n`` new positions for one placement, cut to what the window pool can still take
        (at least a page): all of ``n`` without window KV memory."""
        if self.hybrid is None or n + self.page_size <= self.hybrid.window_available():
            return n  # what is free is enough: no walk of the tree
        room = self.window_evictable() - self.page_size
        return min(n, max(room - room % self.page_size, self.page_size))

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
        del self._placed[kv.row]
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
            duplicates = slots[kv.cached_len : already]
            if self.hybrid is not None:
                # The tree kept its own copy; where that copy's window half was dropped, it
                # takes this one's (the placement reads the tree's copy from now on).
                assert kv.last_node is not None
                tree_copy = self.tree.match_from(kv.last_node, kv.cached_len, key[:already], salt)
                self.hybrid.adopt_window(tree_copy.slots[kv.cached_len :], duplicates)
            self.allocator.free(duplicates)

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
        if self.hybrid is not None:
            self.hybrid.check_window_invariants()
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
