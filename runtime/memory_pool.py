"""KV memory: per-layer K/V buffers over token slots, and the request-to-slot table.

Slots are token-granular indices into the buffers; pages of ``page_size`` consecutive slots
are the allocation unit (the allocator lives in ``radix_cache``; it never hands out page 0, so
``PADDING_SLOT`` is free for padded tokens to write to). Attention reads a request's
KV through its row of the request-to-slot table, so KV never moves once written.
The K/V dtype may differ from the model's compute dtype (``--kv-cache-dtype``): the pool casts
on write and the attention kernels cast what they read to the query's dtype.
"""

from __future__ import annotations

import os

import torch

# Padded tokens write their K/V here: radix_cache's allocator reserves page 0 (PADDING_PAGE).
PADDING_SLOT = 0
# ``--kv-cache-dtype`` names other than ``auto``, which keeps the model's compute dtype.
KV_CACHE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_kv_cache_dtype(name: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV pool stores: ``compute_dtype`` for ``auto``, else the named one."""
    if name == "auto":
        return compute_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"unknown kv_cache_dtype {name!r}; choose auto, {', '.join(KV_CACHE_DTYPES)}"
        )
    return KV_CACHE_DTYPES[name]


class KVPool:
    """K and V buffers, each ``[num_slots, num_kv_heads, head_dim]`` per layer, in ``dtype``.

    With ``window_layers`` (window KV memory, radix_cache/swa.py), those layers' buffers hold
    ``num_window_slots`` instead, indexed by window slots: ``attach_window_map`` gives the
    pool the allocator's full-page -> window-page map, from which each batch translates its
    slots for those layers (``ForwardBatch.window``).
    """

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        window_layers: frozenset[int] = frozenset(),
        num_window_slots: int = 0,
    ) -> None:
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.dtype = dtype
        self.window_layers = window_layers
        self.num_window_slots = num_window_slots
        self.window_page_map: torch.Tensor | None = None
        self.window_page_size = 1
        # Left unwritten (torch.empty): the OS commits a page of a CPU pool when a token is
        # first written to it, so a server takes memory as its cache grows, not at start.
        # Attention reads only the slots of a sequence's written positions (every kernel stops
        # at seq_lens; the triton ones mask the loads past it); a padded row reads the padding
        # slot after writing it. The padding slot is zeroed anyway, so that no read of it can
        # ever meet garbage (0 * NaN is NaN).
        shapes = [
            (num_window_slots if layer in window_layers else num_slots, num_kv_heads, head_dim)
            for layer in range(num_layers)
        ]
        self.k_buffers = [torch.empty(shape, dtype=dtype, device=device) for shape in shapes]
        self.v_buffers = [torch.empty(shape, dtype=dtype, device=device) for shape in shapes]
        if os.environ.get("ARBOR_KV_POISON") == "1" and dtype.is_floating_point:
            # Tests set this: every unwritten slot holds NaN, so a kernel or a batch that reads
            # one fails every time instead of on whatever the allocator left there.
            for buffer in self.k_buffers + self.v_buffers:
                buffer.fill_(float("nan"))
        for buffer in self.k_buffers + self.v_buffers:
            buffer[PADDING_SLOT].zero_()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v: [T, Hkv, D] at slots: [T], cast to the pool's dtype."""
        self.k_buffers[layer][slots] = k.to(self.dtype)
        self.v_buffers[layer][slots] = v.to(self.dtype)

    def attach_window_map(self, page_map: torch.Tensor, page_size: int) -> None:
        """Translate the window layers' slots through ``page_map`` (a host tensor the
        allocator updates in place: full page -> window page)."""
        assert self.window_layers, "this pool keeps every layer's KV by full slots"
        self.window_page_map, self.window_page_size = page_map, page_size

    @property
    def bytes(self) -> int:
        return sum(buffer.numel() * buffer.element_size() for buffer in self.k_buffers) * 2


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host ``tensor`` on ``device`` without waiting for the GPU: staged in pinned memory
    and queued on the current stream (a copy from pageable memory first waits for all the
    stream's work, i.e. for the forward in flight). The tensor itself on the CPU."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class ReqToTokenPool:
    """Rows of slot indices, one row per running request, indexed by position in the sequence.

    ``max_requests`` rows are handed out; one more, ``padding_row``, never is: it stays zero,
    so a padded decode row (CUDA graphs pad batches to a captured size) reads and writes only
    slot 0, in the padding page the KV slot allocator never hands out.
    """

    def __init__(
        self,
        max_requests: int,
        max_context_len: int,
        device: torch.device,
        record_writes: bool = False,
    ) -> None:
        self.max_context_len = max_context_len
        # With record_writes, every write is also kept here until ``take_writes``: a
        # tensor-parallel leader replays them on its workers' copies of the table.
        self._writes: list[tuple[int, int, list[int]]] | None = [] if record_writes else None
        self.padding_row = max_requests
        # Zero-filled so padded reads always index a real slot.
        self.req_to_token = torch.zeros(
            (max_requests + 1, max_context_len), dtype=torch.int64, device=device
        )
        # The scheduler reads the table on the host (which slots a request holds, where its
        # last page ends): on a GPU it keeps a copy there, so no read waits for the forward in
        # flight. On the CPU it is the table itself.
        self.host = (
            self.req_to_token
            if self.req_to_token.device.type == "cpu"
            else torch.zeros((max_requests + 1, max_context_len), dtype=torch.int64)
        )
        self._free_rows = list(range(max_requests - 1, -1, -1))

    def alloc(self) -> int | None:
        """A free row index, or None when every row is in use."""
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def available(self) -> int:
        return len(self._free_rows)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Record that positions [start, start + len(slots)) of row's sequence live at slots."""
        end = start + slots.numel()
        if end > self.max_context_len:
            raise ValueError(
                f"sequence of {end} tokens exceeds context length {self.max_context_len}"
            )
        slots = slots.to(device="cpu", dtype=torch.int64)
        self.host[row, start:end] = slots
        if self.host is not self.req_to_token:
            self.req_to_token[row, start:end] = to_device(slots, self.req_to_token.device)
        if self._writes is not None:
            self._writes.append((row, start, slots.tolist()))

    def take_writes(self) -> list[tuple[int, int, list[int]]]:
        """The (row, start, slots) writes since the last call, oldest first (record_writes)."""
        assert self._writes is not None, "this table does not record its writes"
        writes, self._writes = self._writes, []
        return writes

    def replay(self, writes: list[tuple[int, int, list[int]]]) -> None:
        """Apply another table's writes (``take_writes``) to this one."""
        for row, start, slots in writes:
            self.write(row, start, torch.tensor(slots, dtype=torch.int64))
