"""Paged KV batches for the attention kernel tests, laid out as the runtime lays them out.

Slots come in pages of ``page_size`` consecutive slots, handed out in shuffled page order;
``req_to_token`` rows are permuted against the batch order. Every slot that no request's
first seq_len positions maps to holds NaN, and every table entry past a request's seq_len
points at such a slot: a kernel that reads one key too many returns NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    k_buffer: torch.Tensor  # [S, Hkv, D]
    v_buffer: torch.Tensor  # [S, Hkv, Dv]
    req_to_token: torch.Tensor  # [R, C] int64
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64
    extend_lens: torch.Tensor  # [B] int64

    def finite(self) -> PagedBatch:
        """The same batch with the NaN poison replaced by zeros, for the torch reference (its
        padded gathers multiply masked-out NaN values by zero weights)."""
        return PagedBatch(
            self.k_buffer.nan_to_num(0.0),
            self.v_buffer.nan_to_num(0.0),
            self.req_to_token,
            self.req_pool_indices,
            self.seq_lens,
            self.extend_lens,
        )


def paged_batch(
    seq_lens: list[int],
    extend_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    head_dim_v: int | None = None,
) -> PagedBatch:
    """K/V for requests of ``seq_lens`` tokens, the last ``extend_lens`` of them new."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_req = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_req) + 2  # spare pages stay poisoned
    num_slots = num_pages * page_size
    context = max(pages_per_req) * page_size + page_size
    order = torch.randperm(num_pages, generator=gen)
    rows = torch.randperm(len(seq_lens) + 2, generator=gen)[: len(seq_lens)]
    spare_slot = int(order[-1]) * page_size
    req_to_token = torch.full((len(seq_lens) + 2, context), spare_slot, dtype=torch.int64)
    shape_k = (num_slots, num_kv_heads, head_dim)
    shape_v = (num_slots, num_kv_heads, head_dim_v or head_dim)
    k_buffer = torch.full(shape_k, float("nan"))
    v_buffer = torch.full(shape_v, float("nan"))
    next_page = 0
    for row, seq_len, pages in zip(rows.tolist(), seq_lens, pages_per_req, strict=True):
        page_ids = order[next_page : next_page + pages]
        next_page += pages
        slots = (page_ids[:, None] * page_size + torch.arange(page_size)).flatten()[:seq_len]
        req_to_token[row, :seq_len] = slots
        k_buffer[slots] = torch.randn(seq_len, *shape_k[1:], generator=gen)
        v_buffer[slots] = torch.randn(seq_len, *shape_v[1:], generator=gen)
    return PagedBatch(
        k_buffer.to(dtype),
        v_buffer.to(dtype),
        req_to_token,
        rows,
        torch.tensor(seq_lens, dtype=torch.int64),
        torch.tensor(extend_lens, dtype=torch.int64),
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """torch.testing.assert_close at tolerances for ``dtype`` (a few units in the last place)."""
    tolerances = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
    tol = tolerances[dtype]
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)
