"""KV accounting: who owns which slots, from admission to release.

``KVAccounting`` composes the slot allocator, the radix cache (None when disabled) and the
request-to-slot table, and moves ``KVPlacement``s through them: every slot is at any time free,
owned by the tree (evictable or pinned by a lock), or private to exactly one placement. The
scheduler's ``KVCacheManager`` places requests with it; the draft model's ``DraftKVManager``
(runtime/speculative/draft_kv.py) places its own sequences in its own pool and tree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from radix_cache import KVSlotAllocator, RadixCache, TreeNode
from radix_cache.tree import MatchResult
from runtime.memory_pool import ReqToTokenPool
from runtime.scheduler.program_pins import ProgramPins

if TYPE_CHECKING:
    from runtime.scheduler.disk_tier import KVDiskTier
    from runtime.scheduler.req import Req


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


class KVCacheManager(KVAccounting):
    """The target model's requests, from admission to release."""

    def __init__(
        self,
        allocator: KVSlotAllocator,
        tree: RadixCache | None,
        req_to_token_pool: ReqToTokenPool,
        program_pin_ttl_s: float = 600.0,
    ) -> None:
        super().__init__(allocator, tree, req_to_token_pool)
        # Called as hook(req, keep_in_cache) whenever a request gives its KV back (the draft
        # model's KV follows the target's).
        self.release_hooks: list[Callable[[Req, bool], None]] = []
        # KV pinned between the steps of compiled DSL programs.
        self.pins = ProgramPins(tree, program_pin_ttl_s)
        # Lenders and borrowers of this step's loans, in the order the loans were made.
        self._loans: list[Req] = []
        # The disk tier under the tree (attach_disk_tier), or None.
        self.disk: KVDiskTier | None = None

    def attach_disk_tier(self, disk: KVDiskTier) -> None:
        """Keep what the tree evicts (or, write_through, what it takes) on ``disk`` and load
        prefixes from it at admission. Precondition: there is a tree."""
        assert self.tree is not None, "the disk tier sits under the radix tree"
        self.disk = disk
        self.tree.evict_hook = disk.save_run
        if disk.write_through:
            self.insert_hook = disk.save_run

    def read_ahead(self, req: Req) -> int:
        """On ``req``'s arrival, with a disk tier: hash its chunk keys (kept for its admission)
        and hint the tier's files of the chunks after the prefix that memory holds now (see
        ``KVDiskTier.read_ahead``). Changes nothing in the tree. Returns the chunks hinted."""
        assert self.disk is not None and self.tree is not None
        ids = req.token_ids.prefix(req.match_limit)
        req.kv.disk_keys = self.disk.keys(ids, req.cache_salt, req.kv.disk_keys)
        in_memory = self.tree.prefix_length(ids, req.cache_salt)
        return self.disk.read_ahead(req.kv.disk_keys, in_memory // self.disk.chunk_tokens)

    def available_tokens(self) -> int:
        """Slots a new allocation can get: free now, or freed by evicting unlocked cache."""
        evictable = self.tree.evictable_size() if self.tree else 0
        return self.allocator.available() + evictable

    def cached_prefix_len(self, req: Req) -> int:
        """Length of the cached prefix a request would reuse (touches the tree's LRU clock)."""
        if self.tree is None:
            return 0
        return self.cached_prefix(req).length

    def cached_prefix(self, req: Req) -> MatchResult:
        """The cached prefix of ``req`` in its salt's namespace: from its program branch's
        pinned node when it continues one (no comparison of the pinned part), else matched
        from the namespace's root."""
        assert self.tree is not None
        key, salt = req.token_ids.prefix(req.match_limit), req.cache_salt
        step = req.program
        if step is not None:
            pin = self.pins.get(step.program, step.continue_from)
            if pin is not None:
                return self.tree.match_from(pin.node, min(pin.length, step.reuse_len), key, salt)
        return self.tree.match_prefix(key, salt)

    def admit(self, req: Req) -> bool:
        """Give ``req`` a table row and its cached prefix, locked. False if no row is free."""
        kv = req.kv
        if not self._place(req, lambda: self.cached_prefix(req)):
            return False
        kv.loan_start, kv.lends = None, False
        kv.disk_tokens = self._load_from_disk(req) if self.disk is not None else 0
        if not req.output_ids:  # a retracted request already reported its first match
            kv.cached_tokens = kv.cached_len
        return True

    def _load_from_disk(self, req: Req) -> int:
        """Extend ``req``'s cached prefix (just placed) with the chunks the disk tier holds
        after it, when loading them pays: into fresh slots, then into the tree under its salt
        and locked like a match. A chunk that fails to load ends the run (the rest is
        recomputed). Returns the tokens loaded."""
        assert self.disk is not None and self.tree is not None and req.kv.row is not None
        kv, salt = req.kv, req.cache_salt
        ids = req.token_ids.prefix(req.match_limit)
        start = kv.cached_len
        kv.disk_keys = self.disk.keys(ids, salt, kv.disk_keys)
        run = self.disk.plan(kv.disk_keys, start)
        if run is None or not self.alloc_extend(req, run.end - start):
            return 0
        slots = self.req_to_token_pool.host[kv.row, start : run.end]
        end = self.disk.load(run, ids, start, slots)
        self.truncate(req, end)
        if end > start:
            self._cache(req, ids[:end], salt)
        return end - start

    def lend(self, lender: Req, borrower: Req, end: int) -> None:
        """Let ``borrower`` (just admitted: nothing past its cached prefix) read ``lender``'s
        slots for positions [borrower.kv.cached_len, end) of the prefix they share, which the
        lender computes in this step's forward (each layer writes the whole batch's K/V before
        any request attends): the borrower computes only what follows. The borrowed positions
        count as its cached prefix; ``settle_loans`` hands them to the tree after the forward.
        Precondition: both have the same cache salt."""
        assert self.tree is not None and lender.kv.row is not None and borrower.kv.row is not None
        assert lender.cache_salt == borrower.cache_salt, "KV is never lent across cache salts"
        start = borrower.kv.cached_len
        assert borrower.kv.kv_len == start < end <= lender.kv.kv_len and end % self.page_size == 0
        self.req_to_token_pool.write(
            borrower.kv.row, start, self.req_to_token_pool.host[lender.kv.row, start:end]
        )
        borrower.kv.loan_start = start
        borrower.kv.kv_len = borrower.kv.cached_len = end
        lender.kv.lends = True
        self._loans += (lender, borrower)
        if not borrower.output_ids:
            borrower.kv.cached_tokens = end

    def settle_loans(self) -> None:
        """After the forward that computed them, make this step's lent slots the tree's: in
        the order the loans were made (a lender before its borrowers; one that also borrowed
        settles its own loan first), each lender's computed prefix is inserted and each
        borrower locks the tree's path to the end of its loan in place of its own lock. Runs
        before anything can release a lender (an abort during the forward included)."""
        loans, self._loans = self._loans, []
        for req in loans:
            kv = req.kv
            if kv.row is None or (kv.loan_start is None and not kv.lends):
                continue  # settled already (listed twice), or released before the forward
            assert self.tree is not None and kv.last_node is not None
            if kv.loan_start is not None:
                key = req.token_ids.prefix(kv.cached_len)
                match = self.tree.match_from(kv.last_node, kv.loan_start, key, req.cache_salt)
                if match.length != kv.cached_len:
                    raise AssertionError(
                        f"{req.rid}: the tree holds {match.length} of {kv.cached_len} lent tokens"
                    )
                # The tree's slots for the loan (the lender's, unless a request inserted the
                # same tokens first); what precedes it was the borrower's own match.
                loan = slice(kv.loan_start, kv.cached_len)
                self.req_to_token_pool.write(kv.row, kv.loan_start, match.slots[loan])
                self.tree.lock(match.node)
                self.tree.unlock(kv.last_node)
                kv.last_node, kv.loan_start = match.node, None
            if kv.lends:
                kv.lends = False
                self.cache_prefix(req)

    def cache_prefix(self, req: Req) -> None:
        """Hand the computed positions [0, kv_len) to the tree (a chunked prefill's progress),
        keeping the request's lock on them; the trailing partial page stays private."""
        self._cache(req, req.token_ids.prefix(req.kv.kv_len), req.cache_salt)

    def release(self, req: Req, keep_in_cache: bool, finished: bool = False) -> None:
        """Give back everything ``req`` holds: its lock, its private slots and its row.

        keep_in_cache: insert the computed positions into the tree first (finished and
        retracted requests), so later requests reuse them; aborted requests just free.
        finished: the request is done (not retracted); a compiled program's step then pins
        what it computed under its branch (``ProgramStep.keep_as``).
        """
        kv = req.kv
        if kv.row is None:
            return
        for hook in self.release_hooks:
            hook(req, keep_in_cache)
        # A request stopped inside a verified draft holds KV past its last kept token.
        key, salt, step = req.token_ids.prefix(kv.kv_len), req.cache_salt, req.program
        self._keep(req, key, salt, keep_in_cache)
        branch = step.keep_as if step is not None and finished and keep_in_cache else None
        if self.tree is not None and branch is not None:
            assert step is not None and kv.last_node is not None
            aligned = key[: len(key) - len(key) % self.page_size]
            match = self.tree.match_from(kv.last_node, kv.cached_len, aligned, salt)
            self.pins.pin(step.program, branch, match.node, match.length)
        self._unplace(req)

    def retract(self, req: Req) -> None:
        """Release ``req``'s KV into the cache for its return to the queue: its placement
        starts over."""
        self.release(req, keep_in_cache=True)
        req.kv.kv_len = req.kv.cached_len = 0
