"""KVSlotAllocator: page-granular alloc/free, continuing allocations, double-free detection."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radix_cache import DoubleFreeError, KVSlotAllocator


def test_fresh_pool_reserves_the_padding_page() -> None:
    allocator = KVSlotAllocator(32, page_size=4)
    assert allocator.capacity == 28
    assert allocator.available() == 28
    slots = allocator.alloc(28)
    assert slots is not None
    assert slots.dtype == torch.int64
    assert sorted(slots.tolist()) == list(range(4, 32))
    assert allocator.alloc(1) is None


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_alloc_hands_out_whole_pages_in_order(page_size: int) -> None:
    allocator = KVSlotAllocator(page_size * 8, page_size)
    n = 2 * page_size + 1
    slots = allocator.alloc(n)
    assert slots is not None and slots.shape == (n,)
    assert allocator.available() == allocator.capacity - 3 * page_size
    for i in range(n):  # token i sits at offset i % page_size of its page
        assert slots[i] % page_size == i % page_size
        if i % page_size:
            assert slots[i] == slots[i - 1] + 1


def test_alloc_zero_and_negative() -> None:
    allocator = KVSlotAllocator(8)
    empty = allocator.alloc(0)
    assert empty is not None and empty.numel() == 0
    assert allocator.available() == 7
    with pytest.raises(ValueError):
        allocator.alloc(-1)


def test_alloc_returns_none_without_side_effects_when_short() -> None:
    allocator = KVSlotAllocator(16, page_size=4)
    assert allocator.alloc(13) is None
    assert allocator.available() == 12


def test_free_returns_every_page_a_slot_touches() -> None:
    allocator = KVSlotAllocator(32, page_size=4)
    slots = allocator.alloc(6)  # two pages, the second one partly used
    assert slots is not None
    allocator.free(slots)
    assert allocator.available() == 28
    again = allocator.alloc(28)
    assert again is not None and len(set(again.tolist())) == 28


@pytest.mark.parametrize("page_size", [1, 4])
def test_double_free_raises_and_changes_nothing(page_size: int) -> None:
    allocator = KVSlotAllocator(16 * page_size, page_size)
    a = allocator.alloc(2 * page_size)
    b = allocator.alloc(page_size)
    assert a is not None and b is not None
    allocator.free(a)
    before = allocator.available()
    with pytest.raises(DoubleFreeError):
        allocator.free(torch.cat([b, a]))  # b is valid, a is not: nothing may be freed
    assert allocator.available() == before
    assert not allocator.is_free(b).any()


def test_repeated_slot_in_one_free_call_raises_with_page_size_1() -> None:
    allocator = KVSlotAllocator(8)
    slots = allocator.alloc(2)
    assert slots is not None
    with pytest.raises(DoubleFreeError):
        allocator.free([int(slots[0]), int(slots[0])])


def test_free_rejects_padding_page_and_out_of_range() -> None:
    allocator = KVSlotAllocator(16, page_size=4)
    with pytest.raises(DoubleFreeError, match="padding"):
        allocator.free([1])
    with pytest.raises(ValueError):
        allocator.free([16])
    with pytest.raises(ValueError):
        allocator.free([-1])


def test_free_accepts_lists_arrays_and_tensors() -> None:
    allocator = KVSlotAllocator(16)
    slots = allocator.alloc(6)
    assert slots is not None
    allocator.free(slots[:2])
    allocator.free(slots[2:4].numpy())
    allocator.free(slots[4:].tolist())
    allocator.free([])
    assert allocator.available() == allocator.capacity


@pytest.mark.parametrize("page_size", [1, 4])
def test_alloc_continuing_fills_the_page_then_takes_fresh_pages(page_size: int) -> None:
    allocator = KVSlotAllocator(16 * page_size, page_size)
    first = allocator.alloc(page_size + 1)
    assert first is not None
    more = allocator.alloc_continuing(int(first[-1]), 2 * page_size)
    assert more is not None and more.shape == (2 * page_size,)
    seq = torch.cat([first, more])
    for i in range(seq.numel()):
        assert seq[i] % page_size == i % page_size
        if i % page_size:
            assert seq[i] == seq[i - 1] + 1
    assert allocator.available() == allocator.capacity - 4 * page_size  # 2 + 2 pages
    allocator.free(seq)
    assert allocator.available() == allocator.capacity


def test_alloc_continuing_within_the_page_needs_no_free_page() -> None:
    allocator = KVSlotAllocator(8, page_size=4)
    first = allocator.alloc(1)
    assert first is not None and allocator.available() == 0
    more = allocator.alloc_continuing(int(first[0]), 3)
    assert more is not None and more.tolist() == [5, 6, 7]
    assert allocator.alloc_continuing(int(more[-1]), 1) is None


def test_alloc_continuing_requires_an_allocated_slot() -> None:
    allocator = KVSlotAllocator(16, page_size=4)
    with pytest.raises(ValueError, match="not allocated"):
        allocator.alloc_continuing(5, 1)
    with pytest.raises(ValueError, match="not allocated"):
        allocator.alloc_continuing(0, 1)


def test_reset_frees_everything() -> None:
    allocator = KVSlotAllocator(16, page_size=2)
    assert allocator.alloc(10) is not None
    allocator.reset()
    assert allocator.available() == allocator.capacity
    slots = allocator.alloc(2)
    assert slots is not None and slots.tolist() == [2, 3]


def test_is_free_tracks_pages() -> None:
    allocator = KVSlotAllocator(16, page_size=4)
    slots = allocator.alloc(4)
    assert slots is not None
    assert not allocator.is_free(slots).any()
    allocator.free(slots[:1])
    assert allocator.is_free(slots).all()
    assert allocator.is_free(np.array([0])).tolist() == [False]  # padding is never free


@pytest.mark.parametrize(("num_slots", "page_size"), [(10, 4), (4, 4), (8, 0), (1, 1)])
def test_bad_pool_shapes_are_rejected(num_slots: int, page_size: int) -> None:
    with pytest.raises(ValueError):
        KVSlotAllocator(num_slots, page_size)
