"""Fair eviction between tenants: the tenant over its share of the pool gives way first."""

from __future__ import annotations

from collections.abc import Hashable

from radix_cache import KVSlotAllocator, RadixCache


def tenant_of(namespace: Hashable) -> Hashable:
    """``"a/x"`` belongs to tenant ``"a"``; a namespace without a slash to the default (None)."""
    return namespace.split("/")[0] if isinstance(namespace, str) and "/" in namespace else None


def make_cache(pool: int = 100, tenants: bool = True) -> RadixCache:
    allocator = KVSlotAllocator(pool + 1)  # one padding slot
    return RadixCache(allocator, tenant_of=tenant_of if tenants else None)


def insert(cache: RadixCache, ids: list[int], namespace: Hashable) -> None:
    """Cache ``ids`` in ``namespace``, evicting for room first as the scheduler does."""
    short = len(ids) - cache.allocator.available()
    if short > 0:
        cache.evict(short)
    slots = cache.allocator.alloc(len(ids))
    assert slots is not None
    cache.allocator.free(slots[: cache.insert(ids, slots, namespace)])


def cached_len(cache: RadixCache, ids: list[int], namespace: Hashable) -> int:
    return cache.prefix_length(ids, namespace)


def flood(cache: RadixCache, namespace: Hashable, prompts: int, length: int = 10) -> None:
    for i in range(prompts):
        insert(cache, [1000 * (i + 1) + j for j in range(length)], namespace)
        cache.check_invariants()


def test_a_flooding_tenant_evicts_itself_not_the_quiet_one() -> None:
    cache = make_cache()
    quiet = list(range(1, 31))
    insert(cache, quiet, "q/chat")
    flood(cache, "f/", prompts=30)  # 300 unique tokens through a pool of 100
    assert cached_len(cache, quiet, "q/chat") == len(quiet)
    stats = cache.stats()
    assert stats.tenant_tokens == {"q": 30, "f": 70}
    assert stats.tenant_evicted_tokens == {"f": 300 - 70}
    assert stats.evicted_tokens == 230


def test_without_tenants_the_flood_evicts_everyone_lru() -> None:
    cache = make_cache(tenants=False)
    quiet = list(range(1, 31))
    insert(cache, quiet, "q/chat")
    flood(cache, "f/", prompts=30)
    assert cached_len(cache, quiet, "q/chat") == 0
    assert cache.stats().tenant_evicted_tokens == {None: 230}


def test_the_tenant_furthest_over_its_share_gives_way_first() -> None:
    cache = make_cache(pool=120)  # three tenants: a share is 40 tokens
    insert(cache, list(range(1, 51)), "a/")  # 10 over
    insert(cache, list(range(101, 161)), "b/")  # 20 over
    insert(cache, list(range(201, 211)), "c/")
    assert cache.evict(10) == 60  # a whole leaf: b's
    assert cache.stats().tenant_tokens == {"a": 50, "c": 10}
    cache.check_invariants()


def test_within_their_shares_tenants_give_way_in_policy_order() -> None:
    cache = make_cache()
    insert(cache, [1, 2, 3], "a/")
    insert(cache, [4, 5, 6], "b/")
    insert(cache, [7, 8, 9], "a/x")
    cache.match_prefix([1, 2, 3], "a/")  # the oldest now: b's
    assert cache.evict(1) == 3
    assert cached_len(cache, [4, 5, 6], "b/") == 0
    assert cache.evict(1) == 3
    assert cached_len(cache, [7, 8, 9], "a/x") == 0
    assert cached_len(cache, [1, 2, 3], "a/") == 3


def test_a_tenant_over_its_share_but_all_locked_leaves_the_rest_to_lru() -> None:
    cache = make_cache()
    insert(cache, list(range(1, 71)), "f/")
    insert(cache, [201, 202], "q/")
    insert(cache, [301, 302], "q/")
    match = cache.match_prefix(list(range(1, 71)), "f/")
    cache.lock(match.node)  # a running request holds f's whole cache
    assert cache.evict(1) == 2
    assert cached_len(cache, [201, 202], "q/") == 0
    assert cached_len(cache, [301, 302], "q/") == 2
    cache.unlock(match.node)
    cache.check_invariants()


def test_tenant_counts_follow_splits_and_namespaces_of_one_tenant() -> None:
    cache = make_cache()
    insert(cache, [1, 2, 3, 4], "a/x")
    insert(cache, [1, 2, 9, 9], "a/x")  # splits the first run
    insert(cache, [1, 2, 3, 4], "a/y")  # another namespace, the same tenant
    insert(cache, [5, 6], None)
    assert cache.stats().tenant_tokens == {"a": 10, None: 2}
    cache.check_invariants()
    cache.evict(100)
    assert cache.stats().tenant_tokens == {}
    assert cache.stats().tenant_evicted_tokens == {"a": 10, None: 2}
    cache.check_invariants()


def test_pinned_kv_of_an_over_share_tenant_gives_way_after_everyone_unpinned() -> None:
    cache = RadixCache(KVSlotAllocator(101), max_pinned_fraction=1.0, tenant_of=tenant_of)
    insert(cache, list(range(1, 71)), "f/")
    insert(cache, [201, 202], "q/")
    cache.pin(list(range(1, 71)), ttl_s=60.0, now=0.0, namespace="f/")
    assert cache.evict(1, now=1.0) == 2  # q's unpinned leaf first
    assert cache.evict(1, now=1.0) == 70  # then the pin gives way
    assert cache.stats().pins == 0
    cache.check_invariants()
