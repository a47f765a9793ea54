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


def _requests(batch: PagedBatch) -> list[tuple[int, int, int]]:
    """(req_to_token row, seq_len, extend_len) of each request."""
    return list(
        zip(
            batch.req_pool_indices.tolist(),
            batch.seq_lens.tolist(),
            batch.extend_lens.tolist(),
            strict=True,
        )
    )


def dense_attention(
    q: torch.Tensor, batch: PagedBatch, sm_scale: float, window: int = 0
) -> torch.Tensor:
    """The oracle, in float64: each request's K/V gathered whole and the scores masked, so that
    query j of request b, at position p = seq_len - extend_len + j, sees key positions k with
    k <= p and, when window > 0, k > p - window.

    q: [T, H, D], the queries of ``batch.extend_lens`` packed (one per request for decode).
    Returns [T, H, Dv] float64."""
    outputs = []
    start = 0
    for row, seq_len, ext in _requests(batch):
        slots = batch.req_to_token[row, :seq_len]
        group = q.shape[1] // batch.k_buffer.shape[1]
        k = batch.k_buffer[slots].double().repeat_interleave(group, dim=1)  # [L, H, D]
        v = batch.v_buffer[slots].double().repeat_interleave(group, dim=1)  # [L, H, Dv]
        scores = torch.einsum("ehd,lhd->hel", q[start : start + ext].double(), k) * sm_scale
        positions = torch.arange(seq_len - ext, seq_len)[:, None]
        keys = torch.arange(seq_len)[None, :]
        visible = keys <= positions
        if window > 0:
            visible &= keys > positions - window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        outputs.append(torch.einsum("hel,lhd->ehd", probs, v))
        start += ext
    return torch.cat(outputs)


def poison_outside_windows(batch: PagedBatch, window: int) -> PagedBatch:
    """A copy of ``batch`` whose K/V at the positions no query's window reaches (before the
    first new token's window) hold NaN: a kernel that reads one of them returns NaN. Window 0
    (none) poisons nothing more."""
    k_buffer, v_buffer = batch.k_buffer.clone(), batch.v_buffer.clone()
    for row, seq_len, ext in _requests(batch) if window > 0 else []:
        unseen = batch.req_to_token[row, : max(0, seq_len - ext - window + 1)]
        k_buffer[unseen] = float("nan")
        v_buffer[unseen] = float("nan")
    return PagedBatch(
        k_buffer,
        v_buffer,
        batch.req_to_token,
        batch.req_pool_indices,
        batch.seq_lens,
        batch.extend_lens,
    )
