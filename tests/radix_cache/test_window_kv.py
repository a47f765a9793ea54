"""Window KV memory (radix_cache/swa.py): the hybrid allocator, valid match lengths, eviction
of cached window KV, and the accounting of running placements around them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radix_cache import RadixCache
from radix_cache.swa import HybridSlotAllocator, window_valid_length
from runtime.kv_accounting import KVAccounting, KVPlacement
from runtime.memory_pool import ReqToTokenPool


class Holder:
    def __init__(self) -> None:
        self.kv = KVPlacement()


@pytest.mark.parametrize("page_size", [1, 4])
def test_pages_get_a_window_page_each_and_give_both_back(page_size: int) -> None:
    allocator = HybridSlotAllocator(64 * page_size, 9 * page_size, window=8, page_size=page_size)
    slots = allocator.alloc(5 * page_size)
    assert slots is not None
    assert allocator.window_available() == 3 * page_size
    window = allocator.window_slots(slots)
    assert window.unique().numel() == slots.numel()
    assert (window % page_size == slots % page_size).all()  # offsets within a page agree
    assert allocator.has_window(slots).all()
    allocator.check_window_invariants()
    # The window pool runs out first: the full pool is untouched by the failure.
    before = allocator.available()
    assert allocator.alloc(4 * page_size) is None
    assert allocator.available() == before
    allocator.free(slots)
    assert allocator.window_available() == 8 * page_size
    assert allocator.available() == allocator.capacity
    allocator.check_window_invariants()


def test_dropped_window_half_keeps_the_full_slot() -> None:
    allocator = HybridSlotAllocator(64, 16, window=4)
    slots = allocator.alloc(10)
    assert slots is not None
    assert allocator.drop_window(slots[:6]) == 6
    assert allocator.drop_window(slots[:6]) == 0  # already gone
    assert allocator.has_window(slots).tolist() == [False] * 6 + [True] * 4
    assert (allocator.window_slots(slots[:6]) == 0).all()  # the padding page
    assert allocator.window_available() == 15 - 4
    allocator.free(slots)  # frees what is left of both halves
    assert allocator.window_available() == 15
    allocator.check_window_invariants()


def test_adopt_moves_a_window_half_to_the_copy_that_lacks_it() -> None:
    allocator = HybridSlotAllocator(64, 16, window=4)
    kept, duplicate = allocator.alloc(4), allocator.alloc(4)
    assert kept is not None and duplicate is not None
    allocator.drop_window(kept[:2])
    allocator.adopt_window(kept, duplicate)
    assert allocator.has_window(kept).all()
    assert allocator.has_window(duplicate).tolist() == [False, False, True, True]
    allocator.free(duplicate)
    allocator.check_window_invariants()
    assert allocator.window_available() == 15 - 4


@pytest.mark.parametrize(
    ("missing", "length", "window", "page", "expected"),
    [
        ([], 40, 8, 1, 40),
        ([0, 1, 2], 40, 8, 1, 40),  # long before the window: no matter
        ([32], 40, 8, 1, 40),  # position 32 < 40 - 7: a query at 40 does not see it
        ([33], 40, 8, 1, 33),  # seen by a query at 40: the match ends at it
        ([20, 33], 40, 8, 1, 33),
        ([28, 33], 40, 8, 1, 28),  # at 33 the window reaches back to 26, over 28
        ([33], 40, 8, 4, 32),  # page-aligned
        (list(range(40)), 40, 8, 1, 0),
    ],
)
def test_a_match_ends_where_the_window_before_it_is_whole(
    missing: list[int], length: int, window: int, page: int, expected: int
) -> None:
    has = np.ones(length, dtype=bool)
    has[missing] = False
    assert window_valid_length(has, length, window, page) == expected


def _setup(window_slots: int, window: int = 8) -> tuple[KVAccounting, RadixCache]:
    allocator = HybridSlotAllocator(256, window_slots, window=window)
    tree = RadixCache(allocator)
    table = ReqToTokenPool(4, 200, torch.device("cpu"))
    return KVAccounting(allocator, tree, table), tree


def _run(kv: KVAccounting, ids: np.ndarray, step: int) -> Holder:
    """Place a holder for ``ids`` and compute them ``step`` tokens at a time, caching each
    chunk as a chunked prefill does; returns it still placed."""
    holder = Holder()
    assert kv._place(holder, lambda: kv.tree.match_prefix(ids))
    while holder.kv.kv_len < len(ids):
        n = min(step, len(ids) - holder.kv.kv_len)
        assert kv.alloc_extend(holder, n)
        kv._cache(holder, ids[: holder.kv.kv_len], None)
    return holder


def test_a_long_sequence_runs_in_a_window_sized_pool() -> None:
    """60 tokens through a window pool of 8 + 12 slots: the chunks before the window lose
    their window half (to the tree's window eviction), the window stays whole."""
    kv, tree = _setup(window_slots=21)
    ids = np.arange(1000, 1060, dtype=np.int32)
    holder = _run(kv, ids, step=4)
    slots = kv.req_to_token_pool.host[holder.kv.row, :60]
    has = kv.hybrid.has_window(slots)
    assert has[60 - 7 :].all()  # what the next query at 60 reads
    assert not has[:40].any()
    kv.check_invariants([holder])
    kv._keep(holder, ids, None, in_cache=True)
    kv._unplace(holder)
    kv.check_invariants([])
    # The whole sequence is cached, but a match may only end where its window is whole.
    again = Holder()
    assert kv._place(again, lambda: tree.match_prefix(ids))
    assert again.kv.cached_len == 60
    kv._unplace(again)
    shorter = Holder()
    assert kv._place(shorter, lambda: tree.match_prefix(ids[:30]))
    assert shorter.kv.cached_len == 0
    kv._unplace(shorter)
    kv.check_invariants([])


def test_private_positions_past_the_window_are_dropped_as_decode_goes_on() -> None:
    """Without a tree a placement drops its own window KV as it grows: it never holds more
    than a window and the step."""
    allocator = HybridSlotAllocator(256, 16, window=8)
    kv = KVAccounting(allocator, None, ReqToTokenPool(2, 200, torch.device("cpu")))
    holder = Holder()
    assert kv._place(holder, lambda: None)  # type: ignore[arg-type,return-value]
    assert kv.alloc_extend(holder, 10)
    for _ in range(100):
        assert kv.alloc_extend(holder, 1)
        assert allocator.window_capacity - allocator.window_available() <= 8 + 1
    kv.check_invariants([holder])


def test_window_eviction_spares_what_running_requests_read() -> None:
    kv, tree = _setup(window_slots=40)
    first = _run(kv, np.arange(0, 24, dtype=np.int32), step=4)  # cached as 4-token nodes
    # A second request needs 20 window slots, more than are free: only what the first
    # cannot see again may go.
    second = _run(kv, np.arange(500, 520, dtype=np.int32), step=20)
    assert kv.hybrid.window_available() < 20
    slots = kv.req_to_token_pool.host[first.kv.row, :24]
    assert kv.hybrid.has_window(slots)[24 - 7 :].all()
    kv.check_invariants([first, second])


def test_the_tree_copy_takes_the_window_half_of_a_recomputed_duplicate() -> None:
    """A prefix cached without its window (evicted) and computed again by a second request:
    the tree keeps its own slots and takes the new window halves, so the second request,
    now reading the tree's slots, still finds its window."""
    kv, tree = _setup(window_slots=64)
    ids = np.arange(0, 20, dtype=np.int32)
    first = _run(kv, ids, step=20)
    kv._keep(first, ids, None, in_cache=True)
    kv._unplace(first)
    tree.evict_window(100, {})
    cached = tree.match_prefix(ids).slots
    assert not kv.hybrid.has_window(cached).any()
    second = _run(kv, np.concatenate([ids, np.arange(90, 94, dtype=np.int32)]), step=24)
    assert second.kv.cached_len == 24
    slots = kv.req_to_token_pool.host[second.kv.row, :24]
    assert torch.equal(slots[:20], cached)
    assert kv.hybrid.has_window(slots)[24 - 7 :].all()
    kv.check_invariants([second])


def test_chunks_cut_to_the_window_pool_always_make_progress() -> None:
    """A window pool of one window and 5 slots, and chunks of 16 asked for: each chunk is cut
    to what the pool can give (``chunk_limit``), the request's own cached chunks lose their
    window half up to its window (inside a node too), and the prompt gets through."""
    kv, tree = _setup(window_slots=8 + 5 + 1)
    ids = np.arange(0, 100, dtype=np.int32)
    holder = Holder()
    assert kv._place(holder, lambda: tree.match_prefix(ids))
    for _ in range(200):
        if holder.kv.kv_len == len(ids):
            break
        n = kv.chunk_limit(min(16, len(ids) - holder.kv.kv_len))
        assert 1 <= n <= 16
        assert kv.alloc_extend(holder, n)
        kv._cache(holder, ids[: holder.kv.kv_len], None)
        kv.check_invariants([holder])
    assert holder.kv.kv_len == len(ids)
    slots = kv.req_to_token_pool.host[holder.kv.row, :100]
    assert kv.hybrid.has_window(slots)[100 - 7 :].all()
