"""Eviction: policy order (LRU, LFU, FIFO), leaves before parents, locks, the policy registry."""

from __future__ import annotations

import numpy as np
import pytest

from radix_cache import (
    EvictionPolicy,
    KVSlotAllocator,
    RadixCache,
    TreeNode,
    make_eviction_policy,
    register_eviction_policy,
)
from radix_cache.node import child_key


def make_cache(policy: str | EvictionPolicy = "lru", page_size: int = 1) -> RadixCache:
    return RadixCache(KVSlotAllocator(256 * page_size, page_size), policy=policy)


def insert_fresh(cache: RadixCache, ids: list[int]) -> None:
    slots = cache.allocator.alloc(len(ids))
    assert slots is not None
    cache.allocator.free(slots[: cache.insert(ids, slots)])


def cached(cache: RadixCache, ids: list[int]) -> bool:
    """Whether all of ``ids`` is cached, looked up without touching access times."""
    key = np.array(ids, dtype=np.int32)
    node, pos = cache._roots[None], 0
    while pos < len(ids):
        child = node.children.get(child_key(key[pos:], cache.page_size))
        if child is None or child.key.tolist() != ids[pos : pos + child.key.size]:
            return False
        node, pos = child, pos + child.key.size
    return True


A, B, C = [1, 1, 1], [2, 2, 2], [3, 3, 3]


def test_lru_evicts_the_least_recently_used_leaf() -> None:
    cache = make_cache("lru")
    for ids in (A, B, C):
        insert_fresh(cache, ids)
    cache.match_prefix(A)
    assert cache.evict(1) == 3
    assert [cached(cache, ids) for ids in (A, B, C)] == [True, False, True]
    assert cache.evict(1) == 3
    assert [cached(cache, ids) for ids in (A, B, C)] == [True, False, False]
    cache.check_invariants()


def test_lfu_evicts_the_least_hit_leaf() -> None:
    cache = make_cache("lfu")
    for ids in (A, B, C):
        insert_fresh(cache, ids)
    for _ in range(3):
        cache.match_prefix(A)
    cache.match_prefix(C)
    cache.match_prefix(C)
    cache.match_prefix(B)  # most recent, but fewest hits
    cache.evict(1)
    assert [cached(cache, ids) for ids in (A, B, C)] == [True, False, True]
    cache.evict(1)
    assert [cached(cache, ids) for ids in (A, B, C)] == [True, False, False]


def test_fifo_evicts_the_oldest_insert_however_often_used() -> None:
    cache = make_cache("fifo")
    for ids in (A, B, C):
        insert_fresh(cache, ids)
    for _ in range(5):
        cache.match_prefix(A)
    cache.evict(1)
    assert [cached(cache, ids) for ids in (A, B, C)] == [False, True, True]


def test_a_parent_becomes_evictable_once_its_children_are_gone() -> None:
    cache = make_cache()
    insert_fresh(cache, [1, 2, 3, 4])
    insert_fresh(cache, [1, 2, 5, 6])  # root -> [1 2] -> {[3 4], [5 6]}
    assert cache.evict(1) == 2  # one whole leaf, nothing more
    assert cache.stats().nodes == 2
    assert cache.evict(3) == 4  # the other leaf, then the parent it leaves behind
    assert cache.stats().nodes == 0 and cache.total_size() == 0
    assert cache.allocator.available() == cache.allocator.capacity
    cache.check_invariants()


def test_locked_paths_survive_any_eviction() -> None:
    cache = make_cache()
    insert_fresh(cache, [1, 2, 3, 4])
    insert_fresh(cache, [1, 2, 5, 6])
    insert_fresh(cache, [7, 8])
    held = cache.match_prefix([1, 2, 3, 4])
    cache.lock(held.node)
    assert cache.evict(10**9) == 4
    assert cache.protected_size() == 4 and cache.evictable_size() == 0
    again = cache.match_prefix([1, 2, 3, 4])
    assert again.slots.tolist() == held.slots.tolist()
    cache.check_invariants()
    cache.unlock(held.node)
    assert cache.evict(10**9) == 4
    cache.check_invariants()


def test_evict_frees_at_least_the_request_when_possible() -> None:
    cache = make_cache()
    for start in range(0, 40, 4):
        insert_fresh(cache, list(range(start + 1, start + 5)))
    assert cache.evict(6) == 8  # whole leaves of 4
    assert cache.evict(0) == 0
    assert cache.evict(1000) == 32


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_eviction_returns_whole_pages_to_the_allocator(page_size: int) -> None:
    cache = make_cache(page_size=page_size)
    ids = list(range(1, 5 * page_size + 1))
    insert_fresh(cache, ids)
    insert_fresh(cache, ids[: 2 * page_size] + [0] * (2 * page_size))
    before = cache.allocator.available()
    freed = cache.evict(10**9)
    assert freed == 5 * page_size + 2 * page_size
    assert cache.allocator.available() == before + freed == cache.allocator.capacity
    cache.check_invariants()


def test_stale_queue_entries_are_compacted() -> None:
    cache = make_cache()
    insert_fresh(cache, [1, 2])
    for _ in range(3000):
        cache.match_prefix([1, 2])
    assert len(cache._queue) <= 2 * cache.stats().nodes + 1025
    cache.check_invariants()


def test_registry_makes_policies_by_name_and_rejects_unknown_ones() -> None:
    assert {make_eviction_policy(n).name for n in ("lru", "lfu", "fifo")} == {"lru", "lfu", "fifo"}
    with pytest.raises(ValueError, match="registered"):
        make_eviction_policy("random")
    with pytest.raises(ValueError, match="already registered"):
        register_eviction_policy("lru")(type(make_eviction_policy("lru")))


@register_eviction_policy("test-mru")
class MostRecentlyUsedFirst(EvictionPolicy):
    def priority(self, node: TreeNode) -> tuple[int, ...]:
        return (-node.last_access,)


def test_a_registered_custom_policy_drives_eviction() -> None:
    cache = make_cache("test-mru")
    for ids in (A, B, C):
        insert_fresh(cache, ids)
    cache.match_prefix(A)
    cache.evict(1)
    assert [cached(cache, ids) for ids in (A, B, C)] == [False, True, True]


# ---- the eviction hook (a lower tier keeps what the tree drops) -----------------------------


def test_evict_hook_sees_each_dropped_run_with_its_whole_path_before_its_slots_are_freed():
    cache = make_cache(page_size=2)
    trunk, a, b = [1, 2, 3, 4], [5, 6], [7, 8, 9, 10]
    slots_of: dict[tuple[int, ...], list[int]] = {}
    for ids in (trunk + a, trunk + b):
        slots = cache.allocator.alloc(len(ids))
        assert slots is not None
        already = cache.insert(ids, slots, "salt")
        cache.allocator.free(slots[:already])
        slots_of[tuple(ids)] = slots.tolist()
    seen: list[tuple[object, list[int], list[int], int]] = []

    def hook(namespace: object, tokens: np.ndarray, slots: np.ndarray, start: int) -> None:
        assert not cache.allocator.any_free(slots)  # the KV is still there to copy
        seen.append((namespace, tokens.tolist(), slots.tolist(), start))

    cache.evict_hook = hook
    assert cache.evict(100) == 10
    trunk_slots = slots_of[tuple(trunk + a)][:4]  # the first insert's
    assert sorted(seen, key=lambda s: (len(s[1]), s[1])) == [
        ("salt", trunk, trunk_slots, 0),
        ("salt", trunk + a, slots_of[tuple(trunk + a)], 4),
        ("salt", trunk + b, trunk_slots + slots_of[tuple(trunk + b)][4:], 4),
    ]


def test_report_runs_visits_every_node_and_evicts_nothing():
    cache = make_cache()
    insert_fresh(cache, [1, 2, 3, 4])
    insert_fresh(cache, [1, 2, 9])
    runs: list[tuple[list[int], int]] = []
    cache.report_runs(lambda ns, tokens, slots, start: runs.append((tokens.tolist(), start)))
    assert sorted(runs) == [([1, 2], 0), ([1, 2, 3, 4], 2), ([1, 2, 9], 2)]
    assert cache.total_size() == 5
