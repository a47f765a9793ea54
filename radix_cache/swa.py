"""Sliding-window KV memory: a second, smaller pool for the layers that attend within a window.

A model whose layers attend within a window (Gemma 3: five layers of six see the last 512
tokens) needs those layers' K/V only for the last ``window`` positions of each sequence. The
full-attention layers keep every token, in the pool of full slots the tree and the tables
index; the windowed layers keep theirs in a pool of *window slots*, mapped page by page from
the full slots: full page ``p`` has its window K/V in window page ``swa_page[p]`` (0: none,
page 0 being the padding page of both pools). ``HybridSlotAllocator`` hands out both at once,
so every caller of ``KVSlotAllocator`` works unchanged, and drops a page's window half
(``drop_window``) when no query can see it any more. A token whose window half was dropped
still has its full half: a cached prefix keeps serving the full layers, and a match may only
end where the window before it is whole (``window_valid_length``).

``evict_window_kv`` frees the window half of cached nodes, least recently used first, sparing
the positions a running request or a pin may still read through its window.

Invariant: every window page but page 0 is either free or the image of exactly one allocated
full page.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from radix_cache.allocator import PADDING_PAGE, KVSlotAllocator, SlotsLike, as_slot_array
from radix_cache.node import TreeNode


class HybridSlotAllocator(KVSlotAllocator):
    """Full slots (``KVSlotAllocator``'s, for the full-attention layers), each page with a
    window page beside it while the windowed layers may still read it.

    ``alloc``/``alloc_continuing`` give fresh full pages a window page each and fail (None)
    when either pool is short; ``free`` gives back both halves. ``available`` counts full
    slots; ``window_available`` the window pool's. ``window``: the widest window of the
    model's windowed layers (a query at position p reads back to p - window + 1).
    """

    def __init__(
        self, num_slots: int, num_window_slots: int, window: int, page_size: int = 1
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window  # the widest window of the model's windowed layers
        self.window_pool = KVSlotAllocator(num_window_slots, page_size)
        # swa_page[p]: the window page of full page p (0: none). Shared with the model runner
        # as a tensor (``window_page_map``) on the CPU: no copy per forward. (Made before the
        # base class's constructor, whose reset clears it.)
        self.swa_page = np.zeros(max(num_slots // max(page_size, 1), 1), dtype=np.int64)
        self.window_page_map = torch.from_numpy(self.swa_page)
        super().__init__(num_slots, page_size)
        self.window_peak = 0  # the most window slots ever in use at once

    @property
    def window_capacity(self) -> int:
        return self.window_pool.capacity

    def window_available(self) -> int:
        return self.window_pool.available()

    def reset(self) -> None:
        super().reset()
        self.swa_page[:] = 0
        self.window_pool.reset()

    def _take_pages(self, n_pages: int) -> np.ndarray | None:
        if n_pages > self.window_pool._num_free_pages:
            return None
        pages = super()._take_pages(n_pages)
        if pages is None:
            return None
        window_pages = self.window_pool._take_pages(n_pages)
        assert window_pages is not None
        self.swa_page[pages] = window_pages
        used = self.window_capacity - self.window_pool.available()
        self.window_peak = max(self.window_peak, used)
        return pages

    def free(self, slots: SlotsLike) -> None:
        arr = as_slot_array(slots)
        super().free(arr)  # validates first: raises having changed nothing
        if arr.size:
            self._drop_pages(np.unique(arr // self.page_size))

    def drop_window(self, slots: SlotsLike) -> int:
        """Free the window half of the pages of ``slots`` (still allocated; the caller owns
        them or the tree does, and no query will read them through a window again). Returns
        the window slots freed."""
        arr = as_slot_array(slots)
        if arr.size == 0:
            return 0
        return self._drop_pages(np.unique(arr // self.page_size))

    def _drop_pages(self, pages: np.ndarray) -> int:
        window_pages = self.swa_page[pages]
        held = window_pages != PADDING_PAGE
        if not held.any():
            return 0
        dropped = window_pages[held]
        self.swa_page[pages[held]] = PADDING_PAGE
        self.window_pool.free(dropped * self.page_size)
        return int(dropped.size) * self.page_size

    def adopt_window(self, into: SlotsLike, source: SlotsLike) -> None:
        """Where a page of ``into`` (the tree's copy of some tokens) has no window half and the
        page of ``source`` at the same offset (a request's copy of the same tokens, about to be
        freed) has one, move it over. Both the same length, aligned alike."""
        into_pages = as_slot_array(into)[:: self.page_size] // self.page_size
        source_pages = as_slot_array(source)[:: self.page_size] // self.page_size
        moves = (self.swa_page[into_pages] == PADDING_PAGE) & (
            self.swa_page[source_pages] != PADDING_PAGE
        )
        if moves.any():
            self.swa_page[into_pages[moves]] = self.swa_page[source_pages[moves]]
            self.swa_page[source_pages[moves]] = PADDING_PAGE

    def has_window(self, slots: SlotsLike) -> np.ndarray:
        """Bool per slot: whether its page still has its window half."""
        return self.swa_page[as_slot_array(slots) // self.page_size] != PADDING_PAGE

    def window_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """The window slots of full ``slots`` (a CPU int64 tensor of any shape); slots without
        a window half map into the padding page."""
        return window_slots(self.window_page_map, slots, self.page_size)

    def check_window_invariants(self) -> None:
        """Raise unless every window page is free or the image of one allocated full page."""
        mapped = self.swa_page[self.swa_page != PADDING_PAGE]
        if np.unique(mapped).size != mapped.size:
            raise AssertionError("a window page is mapped from two full pages")
        if self._page_is_free[self.swa_page != PADDING_PAGE].any():
            raise AssertionError("a free full page still holds a window page")
        if self.window_pool._page_is_free[mapped].any():
            raise AssertionError("a mapped window page is on the free list")
        if mapped.size * self.page_size + self.window_pool.available() != self.window_capacity:
            raise AssertionError(
                f"window KV leak: mapped {mapped.size * self.page_size} + free "
                f"{self.window_pool.available()} != capacity {self.window_capacity}"
            )


def window_slots(page_map: torch.Tensor, slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """``slots`` (full) translated through ``page_map`` (full page -> window page)."""
    if page_size == 1:
        return page_map[slots]
    return page_map[slots // page_size] * page_size + slots % page_size


def window_valid_length(has_window: np.ndarray, length: int, window: int, page_size: int) -> int:
    """The longest prefix, at most ``length`` and page-aligned, at whose end the windowed layers
    have the K/V of every position a query there can see: the last ``window - 1`` positions
    before it (``has_window[i]``: position i has its window half). O(length)."""
    missing = np.flatnonzero(~has_window[:length])
    end = length
    # Walk back over the missing positions: each one forces the end to or before it.
    for position in missing[::-1]:
        if position < end - (window - 1):
            break
        end = int(position) - int(position) % page_size
    return end


# droppable[node]: how many of a node's leading tokens may lose their window half (a multiple
# of the page size; a node not in it: all of them). The rest some query still reads.
Droppable = dict[TreeNode, int]


def droppable_slots(node: TreeNode, droppable: Droppable) -> np.ndarray:
    """The slots of ``node`` whose window half may be dropped."""
    return node.slots[: droppable.get(node, node.key.size)]


def window_held(
    nodes: Iterable[TreeNode], allocator: HybridSlotAllocator, droppable: Droppable
) -> int:
    """Window slots the droppable part of ``nodes`` holds (``evict_window_kv`` can free them)."""
    page = allocator.page_size
    return page * sum(
        int(allocator.has_window(droppable_slots(node, droppable)[::page]).sum()) for node in nodes
    )


def evict_window_kv(
    nodes: Iterable[TreeNode], allocator: HybridSlotAllocator, num_tokens: int,
    droppable: Droppable,
) -> int:  # fmt: skip
    """Drop the window half of the droppable part of cached ``nodes``, least recently used
    first, until ``num_tokens`` window slots are free or nothing is left. Returns the window
    slots freed."""
    page = allocator.page_size
    candidates = [
        node for node in nodes
        if allocator.has_window(droppable_slots(node, droppable)[::page]).any()
    ]  # fmt: skip
    candidates.sort(key=lambda node: node.last_access)
    freed = 0
    for node in candidates:
        if freed >= num_tokens:
            break
        freed += allocator.drop_window(droppable_slots(node, droppable))
    return freed
