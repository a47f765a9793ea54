"""Stateful property test: RadixCache against a trivially correct reference model.

The model maps every cached page-aligned prefix (per namespace) to the slots of its last page.
Hypothesis drives requests the way the scheduler will (match, lock, allocate, insert chunks,
re-match, swap locks, finish) plus bare inserts, matches, pins (with a clock that moves) and
evictions under memory pressure, with one tenant or two (fair eviction). After every step the
tree must hold exactly the model's prefixes with exactly their slots, every locked prefix must
still be cached, every live pin must survive an eviction that unpinned KV could satisfy, pins
must stay under their cap, and ``check_invariants`` must pass.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from radix_cache import KVSlotAllocator, RadixCache, TreeNode

PageKey = tuple[Hashable, tuple[int, ...]]  # (namespace, page-aligned token prefix)
NAMESPACES = [None, "adapter-b", "tenant-c"]


def tenant_of(namespace: Hashable) -> Hashable:
    """Namespaces "tenant-..." are one tenant's; the rest the default tenant's."""
    return "c" if namespace == "tenant-c" else None


class ReferenceCache:
    """Every cached page-aligned prefix -> the slots of its last page. Nothing clever."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.pages: dict[PageKey, tuple[int, ...]] = {}

    def match(self, namespace: Hashable, ids: list[int]) -> list[int]:
        slots: list[int] = []
        for end in range(self.page_size, len(ids) + 1, self.page_size):
            page = self.pages.get((namespace, tuple(ids[:end])))
            if page is None:
                break
            slots.extend(page)
        return slots

    def insert(self, namespace: Hashable, ids: list[int], slots: list[int]) -> int:
        cached = len(self.match(namespace, ids))
        aligned = len(ids) - len(ids) % self.page_size
        for end in range(cached + self.page_size, aligned + 1, self.page_size):
            self.pages[(namespace, tuple(ids[:end]))] = tuple(slots[end - self.page_size : end])
        return cached

    def drop_freed(self, allocator: KVSlotAllocator) -> int:
        """Forget the prefixes whose slots the allocator now calls free; return their tokens."""
        freed = [key for key, page in self.pages.items() if allocator.is_free(list(page)).all()]
        for key in freed:
            del self.pages[key]
        return len(freed) * self.page_size

    def is_prefix_closed(self) -> bool:
        return all(
            len(p) == self.page_size or (ns, p[: -self.page_size]) in self.pages
            for ns, p in self.pages
        )


def tree_pages(cache: RadixCache) -> dict[PageKey, tuple[int, ...]]:
    """The tree's content in the model's form, read without touching access times."""
    out: dict[PageKey, tuple[int, ...]] = {}
    ps = cache.page_size
    for namespace, root in cache._roots.items():
        stack: list[tuple[TreeNode, tuple[int, ...]]] = [(root, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                tokens, slots = child.key.tolist(), child.slots.tolist()
                for end in range(ps, len(tokens) + 1, ps):
                    out[(namespace, prefix + tuple(tokens[:end]))] = tuple(slots[end - ps : end])
                stack.append((child, prefix + tuple(tokens)))
    return out


@dataclass(eq=False)
class Request:
    """A running request: ``slots[:locked_len]`` are the tree's (pinned by ``node``'s lock),
    ``slots[locked_len:]`` are private pages it must free itself."""

    namespace: Hashable
    ids: list[int]
    slots: torch.Tensor
    node: TreeNode
    locked_len: int


class RadixCacheMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.sampled_from([1, 2, 4]),
        policy=st.sampled_from(["lru", "lfu", "fifo"]),
        pool_pages=st.integers(4, 24),
        tenants=st.booleans(),
    )
    def setup(self, page_size: int, policy: str, pool_pages: int, tenants: bool) -> None:
        self.page_size = page_size
        self.allocator = KVSlotAllocator((pool_pages + 1) * page_size, page_size)
        self.cache = RadixCache(
            self.allocator,
            policy=policy,
            max_pinned_fraction=0.5,
            tenant_of=tenant_of if tenants else None,
        )
        self.now = 0.0
        self.model = ReferenceCache(page_size)
        self.requests: list[Request] = []
        self.history: list[tuple[Hashable, list[int]]] = []

    def draw_ids(self, data: st.DataObject) -> tuple[Hashable, list[int]]:
        """Mostly extensions of earlier sequences (shared prefixes, splits), some fresh ones."""
        namespace: Hashable = data.draw(st.sampled_from(NAMESPACES))
        base: list[int] = []
        if data.draw(st.booleans()) and self.history:
            namespace, base = data.draw(st.sampled_from(self.history))
            base = base[: data.draw(st.integers(0, len(base)))]
        tail = data.draw(st.lists(st.integers(0, 2), max_size=3 * self.page_size))
        ids = (base + tail)[: 8 * self.page_size]
        self.history = [*self.history[-15:], (namespace, ids)]
        return namespace, ids

    def check_match(self, namespace: Hashable, ids: list[int]) -> TreeNode:
        match = self.cache.match_prefix(ids, namespace)
        expected = self.model.match(namespace, ids)
        assert match.length == len(expected)
        assert match.slots.tolist() == expected
        return match.node

    def alloc(self, n: int) -> torch.Tensor | None:
        """Allocate like the scheduler: on shortage evict the difference and retry once."""
        slots = self.allocator.alloc(n)
        if slots is None:
            self.evict(n - self.allocator.available())
            slots = self.allocator.alloc(n)
        return slots

    def live_pins(self) -> list[tuple[Hashable, list[int]]]:
        """The (namespace, prefix) of each pin not expired at ``now``."""
        roots = {id(root): ns for ns, root in self.cache._roots.items()}
        out = []
        for node in self.cache._pins.nodes():
            if self.cache._pins.expires_at(node) <= self.now:
                continue
            path: list[int] = []
            cursor = node
            while cursor.parent is not None:
                path[:0] = cursor.key.tolist()
                cursor = cursor.parent
            out.append((roots[id(cursor)], path))
        return out

    def evict(self, num_tokens: int) -> None:
        evictable = self.cache.evictable_size()
        unpinned = self.cache._evictable  # what evict frees before any pin gives way
        pins = self.live_pins()
        freed = self.cache.evict(num_tokens, now=self.now)
        if num_tokens <= unpinned:
            for namespace, prefix in pins:
                assert len(self.model.match(namespace, prefix)) == len(prefix)
        assert freed >= min(num_tokens, evictable)
        assert self.cache.evictable_size() == evictable - freed
        assert self.model.drop_freed(self.allocator) == freed
        assert self.model.is_prefix_closed()
        for request in self.requests:  # locked paths survive any eviction
            locked = request.ids[: request.locked_len]
            assert len(self.model.match(request.namespace, locked)) == request.locked_len

    @rule(data=st.data())
    def start_request(self, data: st.DataObject) -> None:
        namespace, ids = self.draw_ids(data)
        match = self.cache.match_prefix(ids, namespace)
        assert match.slots.tolist() == self.model.match(namespace, ids)
        self.cache.lock(match.node)
        private = self.alloc(len(ids) - match.length)
        if private is None:
            self.cache.unlock(match.node)
            return
        slots = torch.cat([match.slots, private])
        self.requests.append(Request(namespace, ids, slots, match.node, match.length))

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def insert_chunk(self, data: st.DataObject) -> None:
        """Insert a prefix of a running request, then move its lock to the new node."""
        request = data.draw(st.sampled_from(self.requests))
        end = data.draw(st.integers(request.locked_len, len(request.ids)))
        self.insert_and_relock(request, end)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), insert_first=st.booleans())
    def finish_request(self, data: st.DataObject, insert_first: bool) -> None:
        request = data.draw(st.sampled_from(self.requests))
        if insert_first:
            self.insert_and_relock(request, len(request.ids))
        self.allocator.free(request.slots[request.locked_len :])
        self.cache.unlock(request.node)
        self.requests.remove(request)

    def insert_and_relock(self, request: Request, end: int) -> None:
        ids, ns = request.ids[:end], request.namespace
        cached = self.cache.insert(ids, request.slots[:end], ns)
        assert cached == self.model.insert(ns, ids, request.slots[:end].tolist())
        assert cached >= request.locked_len
        self.allocator.free(request.slots[request.locked_len : cached])  # our duplicates
        match = self.cache.match_prefix(ids, ns)
        aligned = end - end % self.page_size
        assert match.length == aligned
        assert match.slots.tolist() == self.model.match(ns, ids)
        request.slots[:aligned] = match.slots  # adopt the tree's slots for the duplicates
        self.cache.lock(match.node)
        self.cache.unlock(request.node)
        request.node, request.locked_len = match.node, aligned

    @rule(data=st.data())
    def insert_fresh(self, data: st.DataObject) -> None:
        """Insert with all-new slots, as a request that never matched would."""
        namespace, ids = self.draw_ids(data)
        slots = self.alloc(len(ids))
        if slots is None:
            return
        cached = self.cache.insert(ids, slots, namespace)
        assert cached == self.model.insert(namespace, ids, slots.tolist())
        aligned = len(ids) - len(ids) % self.page_size
        self.allocator.free(slots[:cached])
        self.allocator.free(slots[aligned:])

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        self.check_match(*self.draw_ids(data))

    @rule(num_tokens=st.integers(0, 40))
    def evict_tokens(self, num_tokens: int) -> None:
        self.evict(num_tokens)

    @rule(data=st.data(), ttl_s=st.sampled_from([0.0, 1.0, 5.0, 30.0]))
    def pin(self, data: st.DataObject, ttl_s: float) -> None:
        namespace, ids = self.draw_ids(data)
        cached = len(self.model.match(namespace, ids))
        pinned = self.cache.pin(ids, ttl_s, now=self.now, namespace=namespace)
        assert pinned in (0, cached)
        assert pinned == 0 or ttl_s > 0
        if pinned:
            assert (namespace, ids[:pinned]) in self.live_pins()

    @rule(seconds=st.sampled_from([0.5, 2.0, 10.0]))
    def advance_clock(self, seconds: float) -> None:
        self.now += seconds

    @invariant()
    def pins_under_cap(self) -> None:
        assert self.cache.pinned_size() <= self.cache.max_pinned_tokens

    @invariant()
    def tree_equals_model(self) -> None:
        assert tree_pages(self.cache) == self.model.pages
        assert self.cache.total_size() == len(self.model.pages) * self.page_size

    @invariant()
    def accounting_holds(self) -> None:
        private = [r.slots[r.locked_len :] for r in self.requests]
        self.cache.check_invariants(private_slots=torch.cat([torch.empty(0).long(), *private]))

    def teardown(self) -> None:
        """Finishing every request and evicting everything must return the whole pool."""
        if not hasattr(self, "cache"):
            return
        for request in self.requests:
            self.allocator.free(request.slots[request.locked_len :])
            self.cache.unlock(request.node)
        self.requests = []
        self.cache.evict(self.allocator.capacity, now=self.now)
        assert self.cache.total_size() == 0
        assert self.cache.stats().pins == 0
        assert self.allocator.available() == self.allocator.capacity


RadixCacheMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRadixCacheAgainstModel = RadixCacheMachine.TestCase
