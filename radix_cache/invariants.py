"""Consistency checks of a RadixCache and its allocator, run by tests and debug builds."""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

import numpy as np

from radix_cache.allocator import PADDING_PAGE, SlotsLike, as_slot_array, sorted_unique
from radix_cache.node import child_key

if TYPE_CHECKING:
    from radix_cache.node import TreeNode
    from radix_cache.tree import RadixCache


class CacheInvariantError(AssertionError):
    """The radix cache or its slot accounting is inconsistent: a bug, never a user error."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise CacheInvariantError(message)


def check_cache_invariants(cache: RadixCache, private_slots: int | SlotsLike) -> None:
    """See ``RadixCache.check_invariants``."""
    page_size = cache.page_size
    for namespace, root in cache._roots.items():
        _require(
            root.key.size == 0 and root.lock_ref == 1 and root.parent is None,
            f"root of namespace {namespace!r} is damaged: {root!r}",
        )
        tenant = cache.tenant_of(namespace) if cache.tenant_of is not None else None
        _require(
            root.tenant == tenant,
            f"root of namespace {namespace!r} has tenant {root.tenant!r}, not {tenant!r}",
        )
    nodes = list(cache._iter_nodes())
    queued = set()
    for tenant, node in cache._queue.live_nodes():
        _require(node.tenant == tenant, f"{node!r} of {node.tenant!r} is in {tenant!r}'s queue")
        queued.add(id(node))
    tenant_tokens: dict[Hashable, int] = {}
    evictable = protected = pinned_only = pinned = 0
    for node in nodes:
        size = node.key.size
        _require(
            size > 0 and size == node.slots.size and size % page_size == 0,
            f"{node!r} has {size} tokens and {node.slots.size} slots (page_size {page_size})",
        )
        _require(not node.evicted, f"evicted {node!r} is still in the tree")
        parent = node.parent
        _require(
            parent is not None and node.tenant == parent.tenant,
            f"{node!r} has tenant {node.tenant!r}, its parent another",
        )
        tenant_tokens[node.tenant] = tenant_tokens.get(node.tenant, 0) + size
        _require(
            parent is not None and parent.children.get(child_key(node.key, page_size)) is node,
            f"{node!r} is not filed under its first page in its parent",
        )
        child_locks = sum(child.lock_ref for child in node.children.values())
        _require(
            node.lock_ref >= child_locks,
            f"{node!r} has lock_ref {node.lock_ref} < {child_locks} held by its children",
        )
        child_pins = sum(child.pin_ref for child in node.children.values())
        _require(
            child_pins <= node.pin_ref <= node.lock_ref,
            f"{node!r} has pin_ref {node.pin_ref}, children's pins {child_pins}",
        )
        pinned += size if node.pin_ref else 0
        if node.lock_ref and node.lock_ref == node.pin_ref:
            pinned_only += size
        elif node.lock_ref:
            protected += size
        else:
            evictable += size
            if not node.children:
                _require(id(node) in queued, f"evictable leaf {node!r} is not queued: it leaks")
    _require(
        (evictable + pinned_only, protected, pinned)
        == (cache.evictable_size(), cache.protected_size(), cache.pinned_size()),
        f"tree holds evictable={evictable}, pinned only={pinned_only}, protected={protected}, "
        f"pinned={pinned} but the cache reports evictable={cache.evictable_size()}, "
        f"protected={cache.protected_size()}, pinned={cache.pinned_size()}",
    )
    _require(
        tenant_tokens == cache._queue.tokens,
        f"tenants hold {tenant_tokens} tokens but the cache counts {cache._queue.tokens}",
    )
    _check_pin_counts(cache)
    _require(len(nodes) == cache.stats().nodes, f"{len(nodes)} nodes but stats count differs")
    _check_subtree_sizes(cache, nodes)

    allocator = cache.allocator
    owned = np.concatenate([n.slots for n in nodes] + [np.empty(0, dtype=np.int32)])
    owned = owned.astype(np.int64)  # (cached tokens,)
    _require(sorted_unique(owned).size == owned.size, "a slot is owned by two tree nodes")
    if owned.size:
        _require(
            owned.min() >= page_size * (PADDING_PAGE + 1) and owned.max() < allocator.num_slots,
            "the tree owns a slot of the padding page or outside the pool",
        )
        _require(not allocator.any_free(owned), "the tree owns a slot whose page is free")
    if page_size > 1 and owned.size:
        pages = owned.reshape(-1, page_size)
        _require(
            not np.any(pages[:, 0] % page_size) and not np.any(np.diff(pages, axis=1) != 1),
            "a tree node holds slots that are not whole pages in order",
        )

    private_count = _private_slot_count(cache, owned, private_slots)
    free = allocator.available()
    _require(
        free + evictable + pinned_only + protected + private_count == allocator.capacity,
        f"slot leak: free {free} + evictable {evictable} + pinned only {pinned_only} + "
        f"protected {protected} + private {private_count} != capacity {allocator.capacity}",
    )


def _check_pin_counts(cache: RadixCache) -> None:
    """Every node's ``pin_ref`` is the number of pins on it or below it, and every pin
    names a node in the tree."""
    expected: dict[int, int] = {}
    for pinned in cache._pins.nodes():
        _require(not pinned.evicted, f"pinned {pinned!r} was evicted")
        cursor = pinned
        while cursor.parent is not None:
            expected[id(cursor)] = expected.get(id(cursor), 0) + 1
            cursor = cursor.parent
    for node in cache._iter_nodes():
        _require(
            node.pin_ref == expected.get(id(node), 0),
            f"{node!r} has pin_ref {node.pin_ref} but {expected.get(id(node), 0)} pins on it",
        )


def _check_subtree_sizes(cache: RadixCache, nodes: list[TreeNode]) -> None:
    """Every node's ``subtree_tokens`` is its own run plus its children's subtrees."""
    # ``nodes`` lists parents before children, so the reversed order sees children first.
    for node in [*reversed(nodes), *cache._roots.values()]:
        expected = node.key.size + sum(c.subtree_tokens for c in node.children.values())
        _require(
            node.subtree_tokens == expected,
            f"{node!r} has subtree_tokens {node.subtree_tokens}, but its run and children hold "
            f"{expected}",
        )


def _private_slot_count(
    cache: RadixCache, owned: np.ndarray, private_slots: int | SlotsLike
) -> int:
    if isinstance(private_slots, int):
        return private_slots
    page_size = cache.page_size
    private_pages = sorted_unique(as_slot_array(private_slots) // page_size)
    _require(
        not cache.allocator.any_free(private_pages * page_size),
        "a request holds a slot whose page is free",
    )
    tree_pages = np.zeros(cache.allocator.num_pages, dtype=bool)
    tree_pages[owned // page_size] = True
    _require(
        not tree_pages[private_pages].any(), "a request's private slot lies in a page the tree owns"
    )
    return private_pages.size * page_size
