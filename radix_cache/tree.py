"""RadixCache: a radix tree over token ids whose nodes own the KV slots of their token runs."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from radix_cache.allocator import KVSlotAllocator, SlotsLike, as_slot_array
from radix_cache.eviction import EvictionPolicy, make_eviction_policy
from radix_cache.invariants import check_cache_invariants
from radix_cache.node import (
    KEY_DTYPE,
    TokensLike,
    TreeNode,
    as_token_array,
    child_key,
    matching_child,
)
from radix_cache.pins import PinTable
from radix_cache.swa import Droppable, HybridSlotAllocator, evict_window_kv, window_held
from radix_cache.tenants import TenantQueues


@dataclass(frozen=True)
class MatchResult:
    """The longest cached prefix of a query.

    ``slots``: int64 tensor of shape ``(length,)``, the KV slots of the prefix, in order.
    ``node``: the deepest node of the prefix (a root when ``length == 0``); lock it to pin the
    prefix while a request uses those slots.
    """

    slots: torch.Tensor
    length: int
    node: TreeNode


# evict_hook(namespace, path_tokens, path_slots, start): a node's run is about to leave the
# tree. ``path_tokens``/``path_slots`` (int64 arrays of equal length) cover the whole path from
# its namespace's root to the node's end; the node's own run is ``[start:]``. Every slot on the
# path still holds its KV when the hook runs.
EvictHook = Callable[[Hashable, np.ndarray, np.ndarray, int], None]


@dataclass(frozen=True)
class CacheStats:
    """Counters since construction or the last ``reset()``; sizes are in tokens."""

    hit_tokens: int  # sum of match_prefix lengths
    queried_tokens: int  # sum of match_prefix query lengths
    cached_tokens: int  # evictable + protected
    evictable_tokens: int
    protected_tokens: int
    evicted_tokens: int
    nodes: int  # excluding roots
    pinned_tokens: int  # on pinned paths (some may also be locked by requests)
    pins: int
    tenant_tokens: dict[Hashable, int]  # cached, by tenant (those holding none left out)
    tenant_evicted_tokens: dict[Hashable, int]  # evicted, by the tenant that held them


class RadixCache:
    """Prefix cache of KV slots keyed by token ids, with lock refs and pluggable eviction.

    Every non-root node owns the slots of its token run: the tree returns them to ``allocator``
    only when it evicts the node (or on ``reset``). Slots returned by ``match_prefix`` stay
    owned by the tree; lock the match's node for as long as they are in use. Each namespace
    (adapter id, cache salt, ...) has its own root, so namespaces never share entries.

    With ``page_size > 1`` everything in the tree is whole pages: matches are rounded down to
    page boundaries and a partial trailing page is never inserted.
    ``pin`` keeps a cached prefix for a while; pins hold at most ``max_pinned_fraction`` of
    the pool, for at most ``max_pin_s`` seconds each, and give way to requests (``evict``).
    ``tenant_of(namespace)`` names the tenant that owns a namespace (None: every namespace is
    one tenant's); eviction is fair between tenants (``radix_cache.tenants``): the tenant
    holding most above an equal share of the pool gives way first.
    Not thread-safe: one scheduler thread owns the cache.
    """

    def __init__(
        self,
        allocator: KVSlotAllocator,
        page_size: int | None = None,
        policy: str | EvictionPolicy = "lru",
        max_pinned_fraction: float = 0.5,
        max_pin_s: float = 3600.0,
        tenant_of: Callable[[Hashable], Hashable] | None = None,
    ) -> None:
        """``page_size`` defaults to the allocator's and must equal it if given."""
        if not 0.0 <= max_pinned_fraction <= 1.0:
            raise ValueError(f"max_pinned_fraction {max_pinned_fraction} is not in [0, 1]")
        if page_size is not None and page_size != allocator.page_size:
            raise ValueError(
                f"page_size {page_size} differs from the allocator's {allocator.page_size}"
            )
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.policy = make_eviction_policy(policy) if isinstance(policy, str) else policy
        self.max_pinned_tokens = int(max_pinned_fraction * allocator.capacity)
        self.max_pin_s = max_pin_s
        self.tenant_of = tenant_of
        # Told of every node ``evict`` drops, before its slots are freed (a lower tier keeps
        # them); None: nobody is.
        self.evict_hook: EvictHook | None = None
        self._init_state()

    def _init_state(self) -> None:
        self._roots: dict[Hashable, TreeNode] = {}
        self._queue = TenantQueues(self.policy, self.allocator.capacity)
        self._tenant_evicted: dict[Hashable, int] = {}
        self._clock = 0
        self._evictable = 0
        self._protected = 0  # locked tokens, pinned-only ones included
        self._pins = PinTable()
        self._pinned = 0  # tokens with pin_ref > 0
        self._pinned_only = 0  # tokens with lock_ref == pin_ref > 0: no request holds them
        self._num_nodes = 0
        self._hit_tokens = 0
        self._queried_tokens = 0
        self._evicted_tokens = 0

    def match_prefix(self, token_ids: TokensLike, namespace: Hashable = None) -> MatchResult:
        """Find the longest cached, page-aligned prefix of ``token_ids`` in ``namespace``.

        Splits the last node when the prefix ends inside it (so ``node`` covers exactly the
        prefix) and refreshes access time and hit count along the path. Cost: one dict lookup
        and one vectorised comparison per node on the path.
        """
        key = as_token_array(token_ids)
        self._clock += 1
        # An unseen namespace gets a throwaway root: only insert creates namespaces.
        node = self._roots.get(namespace) or TreeNode.new_root()
        return self._match_below(node, 0, [], key)

    def prefix_length(self, token_ids: TokensLike, namespace: Hashable = None) -> int:
        """The length ``match_prefix`` would return, changing nothing: no split, no access
        time, no hit counts (a look ahead, e.g. at a request's arrival)."""
        key = as_token_array(token_ids)
        node, length = self._roots.get(namespace), 0
        while node is not None and length + self.page_size <= key.size:
            found = matching_child(node, key[length:], self.page_size)
            if found is None:
                break
            child, k = found
            length += k
            node = child if k == child.key.size else None
        return length

    def match_from(
        self, node: TreeNode, length: int, token_ids: TokensLike, namespace: Hashable = None
    ) -> MatchResult:
        """``match_prefix(token_ids)`` for a caller that knows ``token_ids[:length]`` is the path
        to ``node`` (a node it holds locked, ``length`` tokens deep): that part is taken as
        cached without comparing it (its slots are read off the path), the rest is matched
        below ``node``. ``length`` may be less than the node's depth: the match then starts at
        the deepest ancestor no deeper than ``length``. Costs O(depth) plus the new part. A
        ``node`` that is not in ``namespace``'s tree (the throwaway root a match in an empty
        namespace returns) is no help: the whole key is matched from the root."""
        if node.evicted:
            raise ValueError(f"match_from an evicted {node!r}")
        path: list[TreeNode] = []
        cursor: TreeNode | None = node
        while cursor is not None and cursor.parent is not None:
            path.append(cursor)
            cursor = cursor.parent
        if cursor is not self._roots.get(namespace):
            return self.match_prefix(token_ids, namespace)
        key = as_token_array(token_ids)
        self._clock += 1
        path.reverse()
        depth, kept = 0, []
        for step in path:
            if depth + step.key.size > min(length, key.size):
                break
            kept.append(step)
            depth += step.key.size
        start = kept[-1] if kept else cursor
        assert start is not None
        for step in kept:
            self._touch(step)
        self._hit_tokens += depth
        self._queried_tokens += depth
        return self._match_below(start, depth, [step.slots for step in kept], key)

    def shorten(self, match: MatchResult, length: int) -> MatchResult:
        """``match`` cut back to its first ``length`` tokens (page-aligned, at most its length):
        the node ending there, split if it ends inside one. Not a new lookup: hit counts
        drop by what was cut. O(depth)."""
        if length >= match.length:
            return match
        assert length % self.page_size == 0, "a match ends on a page boundary"
        node, depth = match.node, match.length
        while node.parent is not None and depth - node.key.size >= length:
            depth -= node.key.size
            node = node.parent
        if node.parent is not None and length < depth:
            node = self._split(node, length - (depth - node.key.size))
        self._hit_tokens -= match.length - length
        return MatchResult(match.slots[:length], length, node)

    def pinned_prefixes(self) -> list[tuple[TreeNode, int]]:
        """Each pinned node with its depth (the pinned prefix's length), oldest pin first."""
        return [(node, node_depth(node)) for node in self._pins.nodes()]

    def window_held(self, droppable: Droppable) -> int:
        """Window slots held by the ``droppable`` part of cached nodes (``evict_window`` could
        free them all). O(nodes)."""
        assert isinstance(self.allocator, HybridSlotAllocator)
        return window_held(self._iter_nodes(), self.allocator, droppable)

    def evict_window(self, num_tokens: int, droppable: Droppable) -> int:
        """With a ``HybridSlotAllocator``: free at least ``num_tokens`` window slots (or all
        there are) by dropping the window half of cached nodes, least recently used first,
        only of their ``droppable`` part. The nodes stay: their full layers' KV still serves.
        Returns the window slots freed."""
        assert isinstance(self.allocator, HybridSlotAllocator)
        return evict_window_kv(self._iter_nodes(), self.allocator, num_tokens, droppable)

    def _match_below(
        self, node: TreeNode, length: int, path_slots: list[np.ndarray], key: np.ndarray
    ) -> MatchResult:
        """Walk down from ``node`` (``key[:length]`` deep, its path's slots in ``path_slots``)
        along ``key``; the match ends where the tree or the key does."""
        start = length
        node, length = self._descend(node, length, key, path_slots)
        self._hit_tokens += length - start
        self._queried_tokens += key.size - start
        slots = np.concatenate(path_slots, dtype=np.int64) if path_slots else np.empty(0, np.int64)
        return MatchResult(torch.from_numpy(slots), length, node)

    def _descend(
        self, node: TreeNode, length: int, key: np.ndarray, path_slots: list[np.ndarray]
    ) -> tuple[TreeNode, int]:
        """The deepest node along ``key`` below ``node`` (``key[:length]`` deep) and its depth,
        page by page: the last node is split where the key leaves it, each node on the way is
        touched and its slots appended to ``path_slots``."""
        while length + self.page_size <= key.size:
            found = matching_child(node, key[length:], self.page_size)
            if found is None:
                break
            child, k = found
            if k < child.key.size:
                child = self._split(child, k)
            self._touch(child)
            path_slots.append(child.slots)
            node, length = child, length + k
        return node, length

    def continuation(
        self, token_ids: TokensLike, max_tokens: int, namespace: Hashable = None
    ) -> np.ndarray:
        """Up to ``max_tokens`` cached tokens that followed the whole of ``token_ids`` (what an
        earlier request sharing this sequence went on with), following the most recently used
        branch; empty unless all of ``token_ids`` is cached. Read-only: no split, no access
        recorded (a lookup, not a use), any length (no page alignment)."""
        key = as_token_array(token_ids)
        node = self._roots.get(namespace)
        if node is None or max_tokens <= 0:
            return np.empty(0, dtype=KEY_DTYPE)
        length, offset = 0, 0  # key[:length] matched, through node.key[:offset]
        while length < key.size:
            rest = key[length:]
            if rest.size >= self.page_size:
                child = node.children.get(child_key(rest, self.page_size))
            else:  # a partial page: compare with each child's first tokens
                child = next(
                    (c for c in node.children.values() if np.array_equal(c.key[: rest.size], rest)),
                    None,
                )
            if child is None:
                return np.empty(0, dtype=KEY_DTYPE)
            k = min(child.key.size, rest.size)
            if not np.array_equal(child.key[:k], rest[:k]):
                return np.empty(0, dtype=KEY_DTYPE)
            node, length, offset = child, length + k, k
        parts, total = [node.key[offset:]], node.key.size - offset
        while total < max_tokens and node.children:
            node = max(node.children.values(), key=lambda c: c.last_access)
            parts.append(node.key)
            total += node.key.size
        return np.concatenate(parts)[:max_tokens]

    def insert(self, token_ids: TokensLike, slots: SlotsLike, namespace: Hashable = None) -> int:
        """Cache ``slots`` as the KV of ``token_ids``; return how many leading tokens were
        already cached (a multiple of page_size).

        ``slots`` must have the same length as ``token_ids``. Only the page-aligned part
        ``[0, len - len % page_size)`` is inserted; the caller keeps the partial trailing page.
        Ownership: slots in ``[returned, aligned_len)`` now belong to the tree; the caller's
        slots in ``[0, returned)`` are either the tree's own (from a match) or duplicates the
        caller must free. With page_size > 1, token ``i`` must sit at offset ``i % page_size``
        of a page, pages in order. Raises ValueError, before the tree takes any slot, if the
        new slots are not allocated or not laid out that way.
        """
        key, values = as_token_array(token_ids), as_slot_array(slots)
        if key.size != values.size:
            raise ValueError(f"{key.size} token ids but {values.size} slots")
        aligned = key.size - key.size % self.page_size
        key, values = key[:aligned], values[:aligned]
        self._clock += 1
        node, length = self._root(namespace), 0
        while length < aligned:
            rest = key[length:]
            found = matching_child(node, rest, self.page_size)
            if found is None:
                self._add_leaf(node, rest.copy(), values[length:])
                break
            child, k = found
            if k < child.key.size:
                child = self._split(child, k)
            self._touch(child)
            node, length = child, length + k
        return length

    def lock(self, node: TreeNode) -> None:
        """Pin ``node`` and its ancestors: their slots are not evicted until ``unlock(node)``.

        Locks nest (one per request). Locking a root is a no-op. O(depth).
        """
        if node.evicted:
            raise ValueError(f"cannot lock evicted {node!r}; call match_prefix again")
        if self._pins:  # a path may be pinned: the pin-aware walk
            self._hold(node, pin=False)
            return
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= node.key.size
                self._protected += node.key.size
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Release one ``lock(node)``. Still balanced if ``node`` was split meanwhile: a split
        puts a new parent above ``node`` that inherits its lock count. O(depth)."""
        if node.evicted or (node.parent is not None and node.lock_ref <= node.pin_ref):
            raise ValueError(f"unlock of {node!r} without a matching lock")
        if self._pins:
            self._release(node, pin=False)
            return
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= node.key.size
                self._evictable += node.key.size
                if not node.children:
                    self._enqueue(node)
            node = node.parent

    def pin(
        self,
        token_ids: TokensLike,
        ttl_s: float,
        now: float | None = None,
        namespace: Hashable = None,
    ) -> int:
        """Keep the longest cached, page-aligned prefix of ``token_ids`` in ``namespace`` from
        eviction until ``now + min(ttl_s, max_pin_s)`` (``now``: ``time.monotonic()`` if None,
        the clock every call must share). Returns the pinned length (0: nothing cached or
        ``ttl_s <= 0``, nothing pinned).

        Pinning a prefix that ends at a pinned node extends that pin (never shortens it) and
        makes it the newest. Expired pins are dropped here and in ``evict``. When pinned tokens
        would exceed ``max_pinned_fraction`` of the pool, the oldest pins are dropped until
        they do not (this one too, last, if it alone is over: then it returns 0). A pin is
        not a request's lock: ``evict`` unpins, oldest first, when it finds nothing else to
        free, so pins never keep a request from running. Splits the last node like
        ``match_prefix`` and refreshes access times along the path. O(depth).
        """
        now = time.monotonic() if now is None else now
        self._expire_pins(now)
        ttl_s = min(ttl_s, self.max_pin_s)
        root = self._roots.get(namespace)
        if ttl_s <= 0 or root is None:
            return 0
        self._clock += 1
        node, length = self._descend(root, 0, as_token_array(token_ids), [])
        if length == 0:
            return 0
        if self._pins.add(node, now + ttl_s):
            self._hold(node, pin=True)
        while self._pinned > self.max_pinned_tokens:
            oldest = self._pins.pop_oldest()
            assert oldest is not None
            self._release(oldest, pin=True)
            if oldest is node:
                return 0
        return length

    def pinned_size(self) -> int:
        """Cached tokens on pinned paths (a token some request also locks counts too)."""
        return self._pinned

    def _expire_pins(self, now: float) -> None:
        for node in self._pins.pop_expired(now):
            self._release(node, pin=True)

    def _unpin_oldest(self) -> bool:
        """Drop the oldest pin; False when there is none."""
        node = self._pins.pop_oldest()
        if node is None:
            return False
        self._release(node, pin=True)
        return True

    def _hold(self, node: TreeNode, pin: bool) -> None:
        """Take one lock (a pin when ``pin``) on ``node`` and its ancestors. O(depth). With no
        pin in the tree every ``pin_ref`` is 0 and this is ``lock``'s plain walk, which
        ``lock`` and ``unlock`` take then, so requests pay nothing for pins they do not use."""
        while node.parent is not None:
            size = node.key.size
            if node.lock_ref == 0:
                self._evictable -= size
                self._protected += size
                if pin:
                    self._pinned_only += size
            elif node.lock_ref == node.pin_ref and not pin:
                self._pinned_only -= size  # a request now holds it too
            if pin:
                if node.pin_ref == 0:
                    self._pinned += size
                node.pin_ref += 1
            node.lock_ref += 1
            node = node.parent

    def _release(self, node: TreeNode, pin: bool) -> None:
        """Give back one ``_hold(node, pin)``. O(depth)."""
        while node.parent is not None:
            size = node.key.size
            node.lock_ref -= 1
            if pin:
                node.pin_ref -= 1
                if node.pin_ref == 0:
                    self._pinned -= size
            if node.lock_ref == 0:
                self._protected -= size
                self._evictable += size
                if pin:
                    self._pinned_only -= size
                if not node.children:
                    self._enqueue(node)
            elif node.lock_ref == node.pin_ref and not pin:
                self._pinned_only += size  # only pins hold it now
            node = node.parent

    def evict(self, num_tokens: int, now: float | None = None) -> int:
        """Free at least ``num_tokens`` tokens, or every evictable token if fewer exist, by
        evicting whole unlocked leaves in policy order (a parent that loses its last child
        becomes a candidate in turn). Pins expired at ``now`` (``time.monotonic()`` if None)
        are dropped first; when no unpinned leaf is left, pins give way, oldest first.
        Returns the number of tokens freed."""
        if self._pins:
            self._expire_pins(time.monotonic() if now is None else now)
        freed_slots: list[np.ndarray] = []
        freed = 0
        emptied_root = False
        # Tokens gone from below each surviving node, subtracted from its path once at the end
        # (a chain evicted leaf by leaf would otherwise climb to the root once per node).
        gone_below: dict[TreeNode, int] = {}
        namespaces: dict[int, Hashable] | None = None
        while freed < num_tokens:
            leaf = self._queue.pop()
            if leaf is None:
                if self._unpin_oldest():
                    continue
                break
            parent = leaf.parent
            assert parent is not None
            if self.evict_hook is not None:
                if namespaces is None:
                    namespaces = {id(root): ns for ns, root in self._roots.items()}
                self._report_run(leaf, namespaces, self.evict_hook)
            del parent.children[child_key(leaf.key, self.page_size)]
            leaf.parent, leaf.evicted = None, True
            freed_slots.append(leaf.slots)
            freed += leaf.key.size
            self._queue.add_tokens(leaf.tenant, -leaf.key.size)
            evicted = self._tenant_evicted
            evicted[leaf.tenant] = evicted.get(leaf.tenant, 0) + leaf.key.size
            # Its subtree_tokens still counts its children evicted before it.
            gone_below[parent] = gone_below.get(parent, 0) + leaf.subtree_tokens
            self._num_nodes -= 1
            if parent.is_evictable_leaf:
                self._enqueue(parent)
            emptied_root |= parent.parent is None and not parent.children
        for node, tokens in gone_below.items():
            if not node.evicted:  # an evicted one's tokens went with it to its parent
                _add_to_path(node, -tokens)
        if emptied_root:  # forget namespaces with nothing cached, so salts don't pile up
            self._roots = {ns: r for ns, r in self._roots.items() if r.children or ns is None}
        if freed_slots:
            self.allocator.free(np.concatenate(freed_slots))
        self._evictable -= freed
        self._evicted_tokens += freed
        return freed

    def report_runs(self, hook: EvictHook) -> None:
        """Call ``hook`` as ``evict_hook`` is called, once for every cached node (parents
        before their children), evicting nothing: what a lower tier saves at shutdown."""
        for namespace, root in list(self._roots.items()):
            stack = [(child, root.key, root.slots) for child in root.children.values()]
            while stack:
                node, tokens, slots = stack.pop()
                tokens = np.concatenate([tokens, node.key])
                slots = np.concatenate([slots, node.slots]).astype(np.int64)
                hook(namespace, tokens, slots, tokens.size - node.key.size)
                stack += [(child, tokens, slots) for child in node.children.values()]

    def _report_run(self, node: TreeNode, namespaces: dict[int, Hashable], hook: EvictHook) -> None:
        """``hook`` about ``node`` (still in the tree), its path read off its ancestors."""
        path: list[TreeNode] = []
        cursor: TreeNode | None = node
        while cursor is not None and cursor.parent is not None:
            path.append(cursor)
            cursor = cursor.parent
        assert cursor is not None
        path.reverse()
        tokens = np.concatenate([step.key for step in path])
        slots = np.concatenate([step.slots for step in path]).astype(np.int64)
        hook(namespaces.get(id(cursor)), tokens, slots, tokens.size - node.key.size)

    def evictable_size(self) -> int:
        """Cached tokens no request locks (what ``evict`` can free; pinned ones included,
        since pins give way)."""
        return self._evictable + self._pinned_only

    def protected_size(self) -> int:
        """Cached tokens on paths locked by requests."""
        return self._protected - self._pinned_only

    @property
    def clock(self) -> int:
        """The logical clock: advanced by every ``match_prefix`` and ``insert``, read into the
        nodes' ``last_access`` and ``created_at``; back to 0 on ``reset``."""
        return self._clock

    def total_size(self) -> int:
        """All cached tokens."""
        return self._evictable + self._protected

    def reset(self) -> None:
        """Evict everything and zero the stats. Raises RuntimeError while any lock is held."""
        if self.protected_size():
            raise RuntimeError(
                f"reset() while {self.protected_size()} tokens are locked by requests"
            )
        nodes = list(self._iter_nodes())
        if nodes:
            self.allocator.free(np.concatenate([node.slots for node in nodes]))
        for node in nodes:  # so a stale MatchResult.node cannot be locked any more
            node.evicted = True
        self._init_state()

    def stats(self) -> CacheStats:
        return CacheStats(
            hit_tokens=self._hit_tokens,
            queried_tokens=self._queried_tokens,
            cached_tokens=self.total_size(),
            evictable_tokens=self.evictable_size(),
            protected_tokens=self.protected_size(),
            evicted_tokens=self._evicted_tokens,
            nodes=self._num_nodes,
            pinned_tokens=self._pinned,
            pins=len(self._pins),
            tenant_tokens=dict(self._queue.tokens),
            tenant_evicted_tokens=dict(self._tenant_evicted),
        )

    def check_invariants(self, private_slots: int | SlotsLike = 0) -> None:
        """Raise CacheInvariantError unless the tree and the pool are consistent.

        ``private_slots``: what running requests hold outside the tree, as a slot count (whole
        pages: pages * page_size) or as the slots themselves (then also checked to be
        allocated and disjoint from the tree). Checks free + evictable + protected + private ==
        allocator.capacity, no slot owned twice, sizes and lock counts consistent, and every
        evictable leaf queued for eviction. O(cached tokens); for tests and debug runs.
        """
        check_cache_invariants(self, private_slots)

    def nbytes(self) -> int:
        """Approximate host memory of the tree: nodes, child dicts, key/slot arrays, queue."""
        total = sys.getsizeof(self._roots)
        total += len(self._queue) * 128  # heap slot, entry tuple, priority tuple, stamp int
        for node in self._iter_nodes(include_roots=True):
            total += sys.getsizeof(node) + sys.getsizeof(node.children)
            total += sys.getsizeof(node.key) + sys.getsizeof(node.slots)  # arrays own their data
            total += sum(sys.getsizeof(k) for k in node.children)
        return total

    def _root(self, namespace: Hashable) -> TreeNode:
        root = self._roots.get(namespace)
        if root is None:
            tenant = self.tenant_of(namespace) if self.tenant_of is not None else None
            root = self._roots[namespace] = TreeNode.new_root(tenant)
        return root

    def _iter_nodes(self, include_roots: bool = False) -> Iterator[TreeNode]:
        stack = list(self._roots.values())
        if include_roots:
            yield from stack
        while stack:
            node = stack.pop()
            for child in node.children.values():
                yield child
                stack.append(child)

    def _touch(self, node: TreeNode) -> None:
        node.last_access = self._clock
        node.hit_count += 1
        if node.is_evictable_leaf:
            self._enqueue(node)

    def _enqueue(self, node: TreeNode) -> None:
        self._queue.push(node)
        if len(self._queue) > 2 * self._num_nodes + 1024:  # mostly stale entries: shed them
            self._queue.rebuild(n for n in self._iter_nodes() if n.is_evictable_leaf)

    def _add_leaf(self, parent: TreeNode, key: np.ndarray, slots: np.ndarray) -> None:
        self._check_new_slots(slots)
        leaf = TreeNode(key, slots.astype(KEY_DTYPE), parent, tenant=parent.tenant)
        leaf.created_at = self._clock
        self._queue.add_tokens(leaf.tenant, key.size)
        parent.children[child_key(key, self.page_size)] = leaf
        _add_to_path(parent, key.size)
        self._num_nodes += 1
        self._evictable += key.size
        self._touch(leaf)

    def _split(self, node: TreeNode, k: int) -> TreeNode:
        """Cut ``node`` after its first ``k`` tokens; return the new parent holding them.

        ``node`` keeps its identity (so locks and match results naming it stay valid) and its
        tail; the new parent inherits its lock count and clock values, so sizes don't change.
        """
        parent = node.parent
        assert parent is not None and 0 < k < node.key.size
        head = TreeNode(node.key[:k].copy(), node.slots[:k].copy(), parent, tenant=node.tenant)
        head.lock_ref, head.pin_ref = node.lock_ref, node.pin_ref
        head.last_access, head.hit_count = node.last_access, node.hit_count
        head.created_at = node.created_at
        head.subtree_tokens, node.subtree_tokens = node.subtree_tokens, node.subtree_tokens - k
        node.key, node.slots = node.key[k:].copy(), node.slots[k:].copy()
        node.parent = head
        head.children[child_key(node.key, self.page_size)] = node
        parent.children[child_key(head.key, self.page_size)] = head
        self._num_nodes += 1
        return head

    def _check_new_slots(self, slots: np.ndarray) -> None:
        """Slots handed to the tree must be allocated and, with pages, whole pages in order."""
        if self.allocator.any_free(slots):
            raise ValueError("insert() got slots that are not allocated (freed or never alloc'd)")
        if self.page_size == 1:
            return
        pages = slots.reshape(-1, self.page_size)  # (num_pages, page_size)
        if np.any(pages[:, 0] % self.page_size) or np.any(np.diff(pages, axis=1) != 1):
            raise ValueError(
                "with page_size > 1 each page of inserted slots must be one whole KV page in "
                "order (token i at offset i % page_size)"
            )


def _add_to_path(node: TreeNode | None, tokens: int) -> None:
    """Add ``tokens`` to the subtree size of ``node`` and of each of its ancestors."""
    while node is not None:
        node.subtree_tokens += tokens
        node = node.parent


def node_depth(node: TreeNode) -> int:
    """Tokens from ``node``'s root to its end. O(depth)."""
    depth = 0
    while node.parent is not None:
        depth += node.key.size
        node = node.parent
    return depth
