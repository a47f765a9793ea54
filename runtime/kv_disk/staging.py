"""Host memory for chunk payloads on their way to the writer thread, allocated once and reused.

A chunk copied out of the pool into freshly allocated host memory pays a page fault for every
4 KB page it touches (the allocator maps large blocks anew and unmaps them when the writer
frees them): on SmolLM2 that was most of the write path's cost on the scheduler's thread, more
than the copy itself. ``StagingArena`` keeps ``capacity`` chunk-sized entries in one tensor,
zeroed (its pages faulted in) once, when it is made, and hands out entries that the writer gives
back when it is done with them.

Threads: one thread takes entries (the scheduler's); any thread gives them back.
"""

from __future__ import annotations

from collections import deque

import torch


class StagingArena:
    """``capacity`` host buffers of ``chunk_shape`` in ``dtype``, in one tensor."""

    def __init__(self, chunk_shape: tuple[int, ...], dtype: torch.dtype, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"a staging arena needs a positive capacity, got {capacity}")
        self.chunk_shape = chunk_shape
        self.dtype = dtype
        self.capacity = capacity
        # All entries, [capacity, *chunk_shape]: zeroed now, so no copy pays its page faults.
        self.buffer = torch.zeros((capacity, *chunk_shape), dtype=dtype)
        # deque's append and popleft are atomic: the writer appends while the taker pops.
        self._free: deque[int] = deque(range(capacity))

    def available(self) -> int:
        return len(self._free)

    def take(self, count: int) -> list[int] | None:
        """``count`` free entries (their indices into ``buffer``), or None (nothing taken)
        when fewer are free. Called from one thread only."""
        if count > len(self._free):
            return None
        return [self._free.popleft() for _ in range(count)]

    def give_back(self, entry: int) -> None:
        """Return an entry taken before; its contents may be overwritten from now on."""
        self._free.append(entry)
