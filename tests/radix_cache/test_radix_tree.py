"""RadixCache: match/insert/split semantics, locks, namespaces, page sizes, invariant checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radix_cache import CacheInvariantError, KVSlotAllocator, RadixCache


def make_cache(page_size: int = 1, num_pages: int = 256) -> RadixCache:
    return RadixCache(KVSlotAllocator(num_pages * page_size, page_size))


def insert_fresh(cache: RadixCache, ids: list[int], namespace: str | None = None) -> torch.Tensor:
    """Insert ``ids`` with freshly allocated slots, freeing the caller's duplicates."""
    slots = cache.allocator.alloc(len(ids))
    assert slots is not None
    cached = cache.insert(ids, slots, namespace)
    aligned = len(ids) - len(ids) % cache.page_size
    cache.allocator.free(slots[:cached])
    cache.allocator.free(slots[aligned:])
    return slots


def test_empty_cache_matches_nothing() -> None:
    cache = make_cache()
    match = cache.match_prefix([1, 2, 3])
    assert match.length == 0
    assert match.slots.dtype == torch.int64 and match.slots.numel() == 0
    cache.lock(match.node)  # locking the root is a harmless no-op
    cache.unlock(match.node)
    cache.check_invariants()


def test_insert_then_match_returns_the_inserted_slots() -> None:
    cache = make_cache()
    slots = insert_fresh(cache, [5, 6, 7, 8])
    match = cache.match_prefix([5, 6, 7, 8, 9])
    assert match.length == 4
    assert match.slots.tolist() == slots.tolist()
    assert cache.total_size() == 4
    cache.check_invariants()


def test_insert_reports_the_already_cached_prefix() -> None:
    cache = make_cache()
    insert_fresh(cache, [1, 2, 3])
    slots = cache.allocator.alloc(5)
    assert slots is not None
    assert cache.insert([1, 2, 3, 4, 5], slots) == 3
    cache.allocator.free(slots[:3])
    assert cache.match_prefix([1, 2, 3, 4, 5]).slots[3:].tolist() == slots[3:].tolist()
    assert cache.insert([1, 2], cache.match_prefix([1, 2]).slots) == 2
    cache.check_invariants()


def test_match_ending_inside_a_node_splits_it() -> None:
    cache = make_cache()
    slots = insert_fresh(cache, list(range(10)))
    leaf = cache.match_prefix(list(range(10))).node
    match = cache.match_prefix([0, 1, 2, 3, 99])
    assert match.length == 4
    assert match.slots.tolist() == slots[:4].tolist()
    assert match.node is not leaf and leaf.parent is match.node  # the old node keeps the tail
    assert cache.stats().nodes == 2
    assert cache.match_prefix(list(range(10))).node is leaf
    cache.check_invariants()


def test_insert_diverging_inside_a_node_branches() -> None:
    cache = make_cache()
    insert_fresh(cache, [1, 2, 3, 4])
    slots = cache.allocator.alloc(4)
    assert slots is not None
    assert cache.insert([1, 2, 7, 8], slots) == 2
    cache.allocator.free(slots[:2])
    assert cache.stats().nodes == 3
    assert cache.match_prefix([1, 2, 7, 8]).slots[2:].tolist() == slots[2:].tolist()
    assert cache.match_prefix([1, 2, 3, 4]).length == 4
    cache.check_invariants()


@pytest.mark.parametrize(
    "as_input", [list, np.array, torch.tensor, lambda x: np.array(x, dtype=np.int32)]
)
def test_token_ids_as_list_array_or_tensor(as_input) -> None:
    cache = make_cache()
    insert_fresh(cache, [3, 1, 4, 1, 5])
    assert cache.match_prefix(as_input([3, 1, 4, 9])).length == 3


def test_lock_moves_tokens_between_evictable_and_protected() -> None:
    cache = make_cache()
    insert_fresh(cache, [1, 2, 3, 4])
    insert_fresh(cache, [1, 2, 5])
    node = cache.match_prefix([1, 2, 3, 4]).node
    cache.lock(node)
    cache.lock(node)
    assert (cache.evictable_size(), cache.protected_size()) == (1, 4)
    cache.unlock(node)
    assert (cache.evictable_size(), cache.protected_size()) == (1, 4)
    cache.unlock(node)
    assert (cache.evictable_size(), cache.protected_size()) == (5, 0)
    with pytest.raises(ValueError, match="without a matching lock"):
        cache.unlock(node)
    cache.check_invariants()


def test_lock_and_unlock_balance_across_a_split_of_the_locked_node() -> None:
    cache = make_cache()
    insert_fresh(cache, list(range(8)))
    held = cache.match_prefix(list(range(8))).node
    cache.lock(held)
    insert_fresh(cache, [0, 1, 2, 50])  # splits the locked node after 3 tokens
    cache.match_prefix([0, 1, 99])  # and again after 2
    assert (cache.evictable_size(), cache.protected_size()) == (1, 8)
    cache.check_invariants()
    cache.unlock(held)
    assert (cache.evictable_size(), cache.protected_size()) == (9, 0)
    assert cache.evict(100) == 9
    cache.check_invariants()


def test_lock_of_an_evicted_node_raises() -> None:
    cache = make_cache()
    insert_fresh(cache, [1, 2])
    node = cache.match_prefix([1, 2]).node
    cache.evict(2)
    with pytest.raises(ValueError, match="evicted"):
        cache.lock(node)
    with pytest.raises(ValueError):
        cache.unlock(node)


def test_namespaces_never_share_entries() -> None:
    cache = make_cache()
    insert_fresh(cache, [1, 2, 3], namespace="adapter-a")
    assert cache.match_prefix([1, 2, 3]).length == 0
    assert cache.match_prefix([1, 2, 3], namespace="adapter-b").length == 0
    assert cache.match_prefix([1, 2, 3], namespace="adapter-a").length == 3
    slots = cache.allocator.alloc(3)
    assert slots is not None
    assert cache.insert([1, 2, 3], slots) == 0  # the default namespace has its own copy
    assert cache.total_size() == 6
    cache.check_invariants()


def test_namespaces_are_forgotten_once_empty() -> None:
    cache = make_cache()
    for salt in range(50):
        cache.match_prefix([1, 2], namespace=f"salt-{salt}")
        insert_fresh(cache, [1, 2], namespace=f"salt-{salt}")
    assert len(cache._roots) == 50
    cache.evict(10**9)
    assert set(cache._roots) <= {None}
    assert cache.match_prefix([1, 2], namespace="salt-3").length == 0
    assert set(cache._roots) <= {None}
    cache.check_invariants()


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_inserts_and_matches_are_page_aligned(page_size: int) -> None:
    cache = make_cache(page_size)
    ids = list(range(100, 100 + 3 * page_size + 1))
    aligned = len(ids) - len(ids) % page_size  # page_size > 1: a partial trailing page
    slots = cache.allocator.alloc(len(ids))
    assert slots is not None
    assert cache.insert(ids, slots) == 0
    assert cache.total_size() == aligned  # the partial page stays with the caller
    cache.allocator.free(slots[aligned:])
    cache.check_invariants()

    match = cache.match_prefix(ids[: 2 * page_size + page_size // 2] + [7])
    assert match.length == 2 * page_size  # rounded down to a page boundary
    assert match.slots.tolist() == slots[: 2 * page_size].tolist()

    other = list(ids)
    other[page_size + page_size // 2] = 0  # diverges inside the second page
    other_slots = cache.allocator.alloc(len(other))
    assert other_slots is not None
    assert cache.insert(other, other_slots) == page_size
    cache.allocator.free(other_slots[:page_size])
    cache.allocator.free(other_slots[aligned:])
    match = cache.match_prefix(other)
    assert match.length == aligned
    assert match.slots[page_size:].tolist() == other_slots[page_size:aligned].tolist()
    cache.check_invariants()


def test_page_size_4_runs_differing_in_the_first_page_do_not_share() -> None:
    cache = make_cache(page_size=4)
    insert_fresh(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    assert cache.match_prefix([1, 2, 3, 9, 5, 6, 7, 8]).length == 0
    assert cache.match_prefix([1, 2, 3]).length == 0  # shorter than a page


def test_insert_rejects_bad_slot_layouts() -> None:
    cache = make_cache(page_size=4)
    slots = cache.allocator.alloc(8)
    assert slots is not None
    with pytest.raises(ValueError, match="token ids but"):
        cache.insert(list(range(8)), slots[:7])
    with pytest.raises(ValueError, match="whole KV page"):
        cache.insert(list(range(8)), slots.flip(0))
    cache.allocator.free(slots)
    with pytest.raises(ValueError, match="not allocated"):
        cache.insert(list(range(8)), slots)
    assert cache.total_size() == 0
    cache.check_invariants()


def test_reset_returns_every_slot_and_refuses_while_locked() -> None:
    cache = make_cache()
    insert_fresh(cache, [1, 2, 3])
    insert_fresh(cache, [1, 4], namespace="x")
    node = cache.match_prefix([1, 2, 3]).node
    cache.lock(node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.unlock(node)
    cache.reset()
    assert cache.allocator.available() == cache.allocator.capacity
    with pytest.raises(ValueError, match="evicted"):
        cache.lock(node)  # a node from before the reset
    assert cache.stats().nodes == 0 and cache.stats().hit_tokens == 0
    cache.check_invariants()


def test_stats_count_hits_and_queries() -> None:
    cache = make_cache()
    insert_fresh(cache, [1, 2, 3])
    cache.match_prefix([1, 2, 9, 9])
    cache.match_prefix([5])
    stats = cache.stats()
    assert (stats.hit_tokens, stats.queried_tokens) == (2, 5)
    assert (stats.cached_tokens, stats.evictable_tokens, stats.protected_tokens) == (3, 3, 0)
    assert stats.nodes == 2
    assert cache.nbytes() > 0


def test_check_invariants_counts_private_slots() -> None:
    cache = make_cache(page_size=4)
    insert_fresh(cache, list(range(8)))
    private = cache.allocator.alloc(5)  # a running request's slots: two pages
    assert private is not None
    with pytest.raises(CacheInvariantError, match="slot leak"):
        cache.check_invariants()
    cache.check_invariants(private_slots=8)
    cache.check_invariants(private_slots=private)
    with pytest.raises(CacheInvariantError, match="page the tree owns"):
        cache.check_invariants(private_slots=cache.match_prefix(list(range(8))).slots)


def test_check_invariants_detects_corrupted_accounting() -> None:
    cache = make_cache()
    insert_fresh(cache, [1, 2, 3])
    cache._evictable += 1
    with pytest.raises(CacheInvariantError, match="evictable"):
        cache.check_invariants()
    cache._evictable -= 1
    node = cache.match_prefix([1, 2, 3]).node
    node.lock_ref = 1  # locked behind the accounting's back
    with pytest.raises(CacheInvariantError):
        cache.check_invariants()


def test_check_invariants_detects_a_slot_owned_twice() -> None:
    cache = make_cache()
    insert_fresh(cache, [1, 2])
    insert_fresh(cache, [3, 4])
    first = cache.match_prefix([1, 2]).node
    second = cache.match_prefix([3, 4]).node
    second.slots = first.slots.copy()
    with pytest.raises(CacheInvariantError, match="owned by two"):
        cache.check_invariants()


def test_page_size_must_agree_with_the_allocator() -> None:
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(KVSlotAllocator(64, 4), page_size=1)
    assert RadixCache(KVSlotAllocator(64, 4), page_size=4).page_size == 4


@pytest.mark.parametrize("page_size", [1, 4])
def test_continuation_reads_what_followed_a_cached_sequence(page_size: int) -> None:
    cache = make_cache(page_size)
    first = list(range(10, 26))  # 16 tokens
    insert_fresh(cache, first)
    stats = cache.stats()
    assert cache.continuation(first[:5], 6).tolist() == first[5:11]  # inside a node
    assert cache.continuation(first[:8], 100).tolist() == first[8:]  # to the end
    assert cache.continuation(first, 4).tolist() == []  # nothing followed
    assert cache.continuation([10, 11, 99], 4).tolist() == []  # not all of it cached
    assert cache.continuation([7], 4).tolist() == []
    assert cache.continuation(first[:3], 0).tolist() == []
    # Read-only: no split, no access recorded.
    assert cache.stats() == stats
    # Two branches: the most recently used one is followed.
    other = first[:8] + [90 + i for i in range(8)]
    insert_fresh(cache, other)
    assert cache.continuation(first[:6], 6).tolist() == other[6:12]
    cache.match_prefix(first)  # use the first branch again
    assert cache.continuation(first[:6], 6).tolist() == first[6:12]
    assert cache.continuation(first[:8], 3, namespace="elsewhere").tolist() == []
    cache.check_invariants()


@pytest.mark.parametrize("page_size", [1, 4])
def test_prefix_length_is_match_prefix_length_and_changes_nothing(page_size: int) -> None:
    cache = make_cache(page_size)
    insert_fresh(cache, list(range(16)))
    insert_fresh(cache, [*range(8), 50, 51, 52, 53], "tenant")
    nodes, stats, clock = cache._num_nodes, cache.stats(), cache.clock
    queries = [list(range(16)), [*range(10), 99, 99, 99], [*range(8), 50, 51, 52, 53, 54], [7]]
    lengths = [cache.prefix_length(q) for q in queries]
    tenant = cache.prefix_length([*range(8), 50, 51, 52, 53, 54], "tenant")
    # Nothing moved: no node split at 10 tokens, no hit counted, the LRU clock unchanged.
    assert (cache._num_nodes, cache.stats(), cache.clock) == (nodes, stats, clock)
    assert lengths == [cache.match_prefix(q).length for q in queries]
    assert lengths == [16, 10 - 10 % page_size, 8, 0]
    assert tenant == cache.match_prefix([*range(8), 50, 51, 52, 53, 54], "tenant").length == 12
    cache.check_invariants()
