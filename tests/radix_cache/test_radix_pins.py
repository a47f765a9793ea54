"""Pins in the radix cache: a pinned prefix outlives LRU pressure until its TTL, pins stay
under their share of the pool, and they give way to requests rather than refuse one."""

from __future__ import annotations

import pytest
import torch

from radix_cache import KVSlotAllocator, RadixCache

POOL = 100  # tokens (page size 1)


def make_cache(fraction: float = 0.5, max_pin_s: float = 3600.0) -> RadixCache:
    allocator = KVSlotAllocator(POOL + 1, 1)
    return RadixCache(allocator, max_pinned_fraction=fraction, max_pin_s=max_pin_s)


def cache_sequence(cache: RadixCache, ids: list[int], namespace: str | None = None) -> None:
    """Insert ``ids`` as a finished request would (evicting for room like the scheduler)."""
    match = cache.match_prefix(ids, namespace)
    cache.lock(match.node)
    need = len(ids) - match.length
    slots = cache.allocator.alloc(need)
    if slots is None:
        cache.evict(need - cache.allocator.available(), now=0.0)
        slots = cache.allocator.alloc(need)
    assert slots is not None
    cached = cache.insert(ids, torch.cat([match.slots, slots]), namespace)
    assert cached == match.length
    cache.unlock(match.node)


def cached_len(cache: RadixCache, ids: list[int], namespace: str | None = None) -> int:
    return cache.prefix_length(ids, namespace)


def test_pinned_prefix_survives_a_flood_ten_times_the_pool() -> None:
    cache = make_cache()
    conversation = list(range(1000, 1030))
    cache_sequence(cache, conversation)
    assert cache.pin(conversation, ttl_s=30, now=0.0) == 30
    for i in range(100):  # 1000 tokens of other traffic through a 100-token pool
        cache_sequence(cache, [i * 10 + t for t in range(10)])
        cache.check_invariants()
    assert cached_len(cache, conversation) == 30
    assert cache.stats().evicted_tokens >= 900

    unpinned = list(range(2000, 2030))
    cache_sequence(cache, unpinned)
    for i in range(10):
        cache_sequence(cache, [50_000 + i * 10 + t for t in range(10)])
    assert cached_len(cache, unpinned) == 0  # plain LRU would have lost the conversation too


def test_pin_expires_and_repinning_extends() -> None:
    cache = make_cache()
    ids = list(range(20))
    cache_sequence(cache, ids)
    assert cache.pin(ids, ttl_s=10, now=0.0) == 20
    assert cache.pin(ids, ttl_s=5, now=8.0) == 20  # 13 > 10: extended
    assert cache.pin(ids, ttl_s=1, now=8.0) == 20  # 9 < 13: not shortened
    cache.evict(0, now=12.9)  # drops expired pins, frees nothing
    assert cache.pinned_size() == 20
    cache.evict(0, now=13.0)
    assert cache.pinned_size() == 0 and cache.stats().pins == 0
    assert cache.evictable_size() == 20
    cache.check_invariants()


def test_ttl_is_capped_by_max_pin_s() -> None:
    cache = make_cache(max_pin_s=60)
    ids = list(range(10))
    cache_sequence(cache, ids)
    cache.pin(ids, ttl_s=24 * 3600, now=0.0)
    cache.evict(0, now=59.0)
    assert cache.pinned_size() == 10
    cache.evict(0, now=60.0)
    assert cache.pinned_size() == 0


def test_pins_hold_at_most_their_fraction_oldest_dropped_first() -> None:
    cache = make_cache(fraction=0.5)  # 50 tokens
    conversations = [[c * 1000 + t for t in range(20)] for c in range(3)]
    for ids in conversations:
        cache_sequence(cache, ids)
    assert cache.pin(conversations[0], ttl_s=60, now=0.0) == 20
    assert cache.pin(conversations[1], ttl_s=60, now=1.0) == 20
    assert cache.pin(conversations[2], ttl_s=60, now=2.0) == 20  # 60 > 50: the oldest goes
    assert cache.pinned_size() == 40
    assert cache.stats().pins == 2
    cache.evict(cache.evictable_size() - 40, now=3.0)
    assert [cached_len(cache, ids) for ids in conversations] == [0, 20, 20]
    cache.check_invariants()


def test_a_pin_larger_than_the_cap_pins_nothing() -> None:
    cache = make_cache(fraction=0.1)
    ids = list(range(30))
    cache_sequence(cache, ids)
    assert cache.pin(ids, ttl_s=60, now=0.0) == 0
    assert cache.pinned_size() == 0
    cache.check_invariants()


def test_pins_give_way_to_a_running_request_oldest_first() -> None:
    cache = make_cache(fraction=1.0)
    old, new = list(range(50)), list(range(100, 150))
    cache_sequence(cache, old)
    cache_sequence(cache, new)
    cache.pin(old, ttl_s=60, now=0.0)
    cache.pin(new, ttl_s=60, now=1.0)
    assert cache.allocator.available() == 0
    # Everything is pinned, yet the cache reports it as freeable and frees it when asked.
    assert cache.evictable_size() == 100 and cache.protected_size() == 0
    assert cache.evict(30, now=2.0) >= 30
    assert cached_len(cache, old) < 50 and cached_len(cache, new) == 50
    assert cache.allocator.alloc(30) is not None
    cache.check_invariants(private_slots=30)


def test_pin_and_lock_on_one_path_keep_their_accounting_apart() -> None:
    cache = make_cache()
    ids = list(range(40))
    cache_sequence(cache, ids)
    cache.pin(ids[:30], ttl_s=60, now=0.0)  # splits the node after 30 tokens
    cache.check_invariants()
    match = cache.match_prefix(ids[:20])
    cache.lock(match.node)
    assert (cache.protected_size(), cache.pinned_size(), cache.evictable_size()) == (20, 30, 20)
    cache.check_invariants()
    assert cache.evict(POOL, now=1.0) == 20  # the unpinned 10, then the pin gives way
    assert cached_len(cache, ids) == 20
    cache.unlock(match.node)
    cache.check_invariants()
    with pytest.raises(ValueError):
        cache.unlock(match.node)  # the pin's lock is not the request's to release


def test_pins_are_per_namespace_and_need_cached_tokens() -> None:
    cache = make_cache()
    ids = list(range(10))
    cache_sequence(cache, ids, namespace="salt-a")
    assert cache.pin(ids, ttl_s=60, now=0.0) == 0  # not cached under no salt
    assert cache.pin(ids, ttl_s=60, now=0.0, namespace="salt-b") == 0
    assert cache.pin(ids, ttl_s=0, now=0.0, namespace="salt-a") == 0
    assert cache.pin(ids + [99], ttl_s=60, now=0.0, namespace="salt-a") == 10
    cache.check_invariants()


def test_reset_drops_pins() -> None:
    cache = make_cache()
    ids = list(range(10))
    cache_sequence(cache, ids)
    cache.pin(ids, ttl_s=60, now=0.0)
    cache.reset()
    assert cache.total_size() == 0 and cache.pinned_size() == 0
    assert cache.allocator.available() == POOL
    cache.check_invariants()
