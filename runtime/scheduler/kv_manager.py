"""The target model's KV accounting: ``KVCacheManager`` places the scheduler's requests.

It extends ``KVAccounting`` (runtime/kv_accounting.py, shared with the draft model's
``DraftKVManager``) with what only requests have: cached-prefix matching from a program's pin,
the disk tier under the tree, in-step loans between step-mates, and release hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from radix_cache import KVSlotAllocator, RadixCache, TreeNode
from radix_cache.tree import MatchResult
from runtime.ipc import PinPrefix
from runtime.kv_accounting import KVAccounting
from runtime.memory_pool import ReqToTokenPool
from runtime.scheduler.program_pins import ProgramPins

if TYPE_CHECKING:
    from runtime.scheduler.disk_tier import KVDiskTier
    from runtime.scheduler.req import Req


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

    def _window_anchors(self, with_pins: bool = True) -> list[tuple[TreeNode, int, int]]:
        """Also the compiled programs' pins: their next step reads through its window."""
        anchors = super()._window_anchors(with_pins)
        if with_pins:
            anchors += [(pin.node, pin.length, pin.length) for pin in self.pins.all_pins()]
        return anchors

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
        what it computed under its branch (``ProgramStep.keep_as``), and a request with a
        ``pin`` pins what it asks for (``RadixCache.pin``).
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
        pin = req.pin
        if self.tree is not None and pin is not None and finished and keep_in_cache:
            length = len(key) if pin.prompt_tokens is None else min(pin.prompt_tokens, len(key))
            self.tree.pin(key[:length], pin.ttl_s, namespace=salt)
        self._unplace(req)

    def pin_prefix(self, pin: PinPrefix) -> int:
        """Pin what the tree holds of ``pin.token_ids`` (``PinPrefix``); returns the tokens
        pinned (0 without a tree)."""
        if self.tree is None:
            return 0
        return self.tree.pin(pin.token_ids, pin.ttl_s, namespace=pin.cache_salt)

    def retract(self, req: Req) -> None:
        """Release ``req``'s KV into the cache for its return to the queue: its placement
        starts over."""
        self.release(req, keep_in_cache=True)
        req.kv.kv_len = req.kv.cached_len = 0
