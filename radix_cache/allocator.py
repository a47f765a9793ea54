"""KV slot allocator: a free list of fixed-size pages over one pool of token slots."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

PADDING_PAGE = 0
MAX_POOL_SLOTS = 2**31  # the radix tree stores slot indices as int32


class DoubleFreeError(ValueError):
    """A page was freed that is already free (or is the reserved padding page)."""


SlotsLike = torch.Tensor | np.ndarray | Sequence[int]


def as_slot_array(slots: SlotsLike) -> np.ndarray:
    """1-D int64 numpy view or copy of slot indices given as a CPU tensor, array or list."""
    if isinstance(slots, torch.Tensor):
        slots = slots.detach().cpu().numpy()
    arr = np.asarray(slots)
    if arr.ndim != 1:
        raise ValueError(f"slot indices must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"slot indices must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """np.unique(values), several times faster than it for int arrays (it hashes)."""
    ordered = np.sort(values)
    first_of_run = np.ones(ordered.size, dtype=bool)
    first_of_run[1:] = ordered[1:] != ordered[:-1]
    return ordered[first_of_run]


class KVSlotAllocator:
    """Hands out the token slots of one KV pool in whole pages.

    The pool has ``num_slots`` token slots; page ``p`` holds slots
    ``[p * page_size, (p + 1) * page_size)``. Page 0 is the padding page: its slots (slot 0 in
    particular) are never handed out, so a model runner can point padded tokens at slot 0.
    ``capacity`` (``num_slots - page_size``) is the number of slots that can ever be allocated
    and is the total that cache accounting adds up to.

    Slot tensors are 1-D int64 CPU tensors. ``alloc`` and ``free`` cost O(pages) and never touch
    KV data. A request that holds slots with ``page_size > 1`` must keep token ``i`` of its
    sequence at offset ``i % page_size`` of its page: ``alloc`` from a page boundary and
    ``alloc_continuing`` after that preserve this.
    """

    def __init__(self, num_slots: int, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_slots % page_size or num_slots < 2 * page_size:
            raise ValueError(
                f"num_slots ({num_slots}) must be a multiple of page_size ({page_size}) and hold "
                "at least two pages (page 0 is reserved for padding)"
            )
        if num_slots > MAX_POOL_SLOTS:
            raise ValueError(f"num_slots must be <= {MAX_POOL_SLOTS}, got {num_slots}")
        self.num_slots = num_slots
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self._page_offsets = np.arange(page_size, dtype=np.int64)
        self._free_pages = np.empty(self.num_pages - 1, dtype=np.int64)  # a stack, top at the end
        self._num_free_pages = 0
        self._page_is_free = np.zeros(self.num_pages, dtype=bool)
        self.reset()

    @property
    def capacity(self) -> int:
        """Slots that can be allocated: every page but the padding page."""
        return self.num_slots - self.page_size

    def available(self) -> int:
        """Free slots, in whole pages (free pages * page_size)."""
        return self._num_free_pages * self.page_size

    def reset(self) -> None:
        """Mark every page but the padding page free. Slots held anywhere become invalid."""
        # Descending on the stack so a fresh pool hands out pages 1, 2, 3, ... in order.
        self._free_pages[:] = np.arange(self.num_pages - 1, PADDING_PAGE, -1)
        self._num_free_pages = self.num_pages - 1
        self._page_is_free[:] = True
        self._page_is_free[PADDING_PAGE] = False

    def alloc(self, n_tokens: int) -> torch.Tensor | None:
        """Return ``n_tokens`` slots (int64, shape ``(n_tokens,)``) from ceil(n/page_size) whole
        fresh pages, each page's slots contiguous and in order; None if too few pages are free.

        The caller owns all those pages, including the unused tail of the last one.
        """
        if n_tokens < 0:
            raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
        pages = self._take_pages(-(-n_tokens // self.page_size))
        if pages is None:
            return None
        return torch.from_numpy(self._slots_of_pages(pages)[:n_tokens])

    def alloc_continuing(self, last_slot: int, n_tokens: int) -> torch.Tensor | None:
        """Return ``n_tokens`` slots continuing a sequence whose last slot is ``last_slot``: first
        the rest of ``last_slot``'s page, then fresh pages. None if too few pages are free.

        Precondition: the caller owns ``last_slot``'s page (it is allocated, not in the tree).
        """
        if n_tokens < 0:
            raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
        self._check_allocated(last_slot)
        head = min(self.page_size - 1 - last_slot % self.page_size, n_tokens)
        rest = n_tokens - head
        pages = self._take_pages(-(-rest // self.page_size))
        if pages is None:
            return None
        head_slots = np.arange(last_slot + 1, last_slot + 1 + head, dtype=np.int64)
        return torch.from_numpy(np.concatenate([head_slots, self._slots_of_pages(pages)[:rest]]))

    def free(self, slots: SlotsLike) -> None:
        """Return to the free list every page that any of ``slots`` belongs to.

        Precondition: the caller owns each of those pages entirely (no other request or tree
        node holds a slot in them). Raises DoubleFreeError, changing nothing, if a page is
        already free, is the padding page, or (page_size 1) a slot repeats; ValueError if a slot
        is outside the pool.
        """
        arr = as_slot_array(slots)
        if arr.size == 0:
            return
        if arr.min() < 0 or arr.max() >= self.num_slots:
            raise ValueError(f"slot indices must lie in [0, {self.num_slots}), got {arr}")
        pages = sorted_unique(arr // self.page_size)
        if self.page_size == 1 and pages.size != arr.size:
            raise DoubleFreeError("the same slot appears twice in one free() call")
        if pages[0] == PADDING_PAGE:  # pages is sorted
            raise DoubleFreeError("page 0 is the reserved padding page and is never allocated")
        already_free = pages[self._page_is_free[pages]]
        if already_free.size:
            raise DoubleFreeError(f"page(s) {already_free[:8].tolist()} freed twice")
        self._page_is_free[pages] = True
        self._free_pages[self._num_free_pages : self._num_free_pages + pages.size] = pages
        self._num_free_pages += pages.size

    def is_free(self, slots: SlotsLike) -> torch.Tensor:
        """Bool tensor, same shape as ``slots``: whether each slot's page is on the free list."""
        arr = as_slot_array(slots)
        return torch.from_numpy(self._page_is_free[arr // self.page_size])

    def any_free(self, slots: SlotsLike) -> bool:
        """Whether any of ``slots`` lies in a free page (``is_free(slots).any()``, without the
        tensor: the radix tree asks this on every insert)."""
        arr = as_slot_array(slots)
        pages = arr if self.page_size == 1 else arr // self.page_size
        return bool(np.count_nonzero(self._page_is_free[pages]))  # faster than .any() here

    def _take_pages(self, n_pages: int) -> np.ndarray | None:
        if n_pages > self._num_free_pages:
            return None
        top = self._num_free_pages
        pages = self._free_pages[top - n_pages : top][::-1].copy()
        self._num_free_pages -= n_pages
        self._page_is_free[pages] = False
        return pages

    def _slots_of_pages(self, pages: np.ndarray) -> np.ndarray:
        return (pages[:, None] * self.page_size + self._page_offsets).reshape(-1)

    def _check_allocated(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is outside the pool [0, {self.num_slots})")
        page = slot // self.page_size
        if page == PADDING_PAGE or self._page_is_free[page]:
            raise ValueError(f"slot {slot} is not allocated; cannot continue after it")
