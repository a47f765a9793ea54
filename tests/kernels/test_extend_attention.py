"""The triton extend-attention kernel equals the torch reference on paged, packed batches; both
equal a dense float64 oracle under a sliding window, reading no key outside it."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
import torch
from arbor_kernels.reference import attention as reference
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kernels.kv_cases import (
    PagedBatch,
    assert_close,
    dense_attention,
    paged_batch,
    poison_outside_windows,
)

# (prefix_len, extend_len) per request: empty prefixes, single new tokens, prefixes and
# extensions that end mid-tile and that span several 16-wide tiles.
MIXED_BATCH = [(0, 21), (13, 1), (5, 35), (40, 7), (16, 16)]


def _run_both(
    triton_ops: ModuleType,
    requests: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    head_dim_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    seq_lens = [p + e for p, e in requests]
    extend_lens = [e for _, e in requests]
    batch = paged_batch(
        seq_lens, extend_lens, kv_heads, head_dim, page_size, dtype, seed, head_dim_v
    )
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(extend_lens), heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    out = triton_ops.extend_attention.extend_attention(
        q,
        batch.k_buffer,
        batch.v_buffer,
        batch.req_to_token,
        batch.req_pool_indices,
        batch.seq_lens,
        batch.extend_lens,
        scale,
        block_m=16,
        block_n=16,
    )
    ref = batch.finite()
    expected = reference.extend_attention(
        q,
        ref.k_buffer,
        ref.v_buffer,
        ref.req_to_token,
        ref.req_pool_indices,
        ref.seq_lens,
        ref.extend_lens,
        scale,
    )
    return out, expected


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (8, 2), (7, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(
    triton_ops: ModuleType, page_size: int, heads: int, kv_heads: int, dtype: torch.dtype
) -> None:
    out, expected = _run_both(triton_ops, MIXED_BATCH, heads, kv_heads, 32, page_size, dtype)
    assert out.dtype == dtype
    assert out.shape == expected.shape
    assert_close(out, expected, dtype)


def test_float16_runs_the_native_16_bit_dot(triton_ops: ModuleType) -> None:
    # float16 tiles go into tl.dot as float16, the path bfloat16 takes on a GPU.
    out, expected = _run_both(triton_ops, MIXED_BATCH, 8, 2, 32, 16, torch.float16)
    assert_close(out, expected, torch.float16)


def test_head_dims_that_are_not_powers_of_two(triton_ops: ModuleType) -> None:
    out, expected = _run_both(
        triton_ops, [(9, 12), (0, 3)], 4, 2, 24, 16, torch.float32, head_dim_v=40
    )
    assert out.shape == (15, 4, 40)
    assert_close(out, expected, torch.float32)


def test_strided_query_from_a_fused_projection(triton_ops: ModuleType) -> None:
    batch = paged_batch([16, 4], [10, 4], 2, 16, 1, torch.float32)
    qkv = torch.randn(14, 4 * 16 + 2 * 2 * 16)
    q = qkv[:, : 4 * 16].view(14, 4, 16)  # row stride 128, not 64
    args = (batch.req_to_token, batch.req_pool_indices, batch.seq_lens, batch.extend_lens, 0.25)
    out = triton_ops.extend_attention.extend_attention(
        q, batch.k_buffer, batch.v_buffer, *args, block_m=16, block_n=16
    )
    ref = batch.finite()
    expected = reference.extend_attention(q.contiguous(), ref.k_buffer, ref.v_buffer, *args)
    assert_close(out, expected, torch.float32)


@settings(max_examples=12, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 24)), min_size=1, max_size=4),
    page_size=st.sampled_from([1, 4, 16]),
    group=st.sampled_from([1, 3, 4]),
    seed=st.integers(0, 2**16),
)
def test_any_batch_composition(
    triton_ops: ModuleType,
    requests: list[tuple[int, int]],
    page_size: int,
    group: int,
    seed: int,
) -> None:
    out, expected = _run_both(
        triton_ops, requests, 2 * group, 2, 16, page_size, torch.float32, seed
    )
    assert_close(out, expected, torch.float32)


# Sequence lengths 21, 14, 40, 47, 32: windows of one token, shorter than every sequence,
# equal to the second and the last, and longer than all.
WINDOWS = [1, 5, 14, 32, 100]


def _windowed_case(
    requests: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, window: int
) -> tuple[torch.Tensor, PagedBatch, torch.Tensor]:
    """Queries, the paged batch with NaN outside every window, and the oracle's output."""
    seq_lens, extend_lens = [p + e for p, e in requests], [e for _, e in requests]
    batch = paged_batch(seq_lens, extend_lens, kv_heads, head_dim, 16, torch.float32, seed=2)
    q = torch.randn(sum(extend_lens), heads, head_dim, generator=torch.Generator().manual_seed(3))
    expected = dense_attention(q, batch, head_dim**-0.5, window).float()
    return q, poison_outside_windows(batch, window), expected


def _args(batch: PagedBatch, head_dim: int, window: int) -> tuple[Any, ...]:
    """extend_attention's arguments after q."""
    return (
        batch.k_buffer,
        batch.v_buffer,
        batch.req_to_token,
        batch.req_pool_indices,
        batch.seq_lens,
        batch.extend_lens,
        head_dim**-0.5,
        window,
    )


@pytest.mark.parametrize("window", WINDOWS)
def test_reference_window_matches_the_dense_oracle(window: int) -> None:
    q, batch, expected = _windowed_case(MIXED_BATCH, 8, 2, 32, window)
    out = reference.extend_attention(q, *_args(batch, 32, window))
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("window", WINDOWS)
def test_triton_window_matches_the_dense_oracle(triton_ops: ModuleType, window: int) -> None:
    q, batch, expected = _windowed_case(MIXED_BATCH, 8, 2, 32, window)
    out = triton_ops.extend_attention.extend_attention(
        q, *_args(batch, 32, window), block_m=16, block_n=16
    )
    assert out.isfinite().all()  # nothing outside the windows was read
    assert_close(out, expected, torch.float32)


def test_no_window_matches_the_dense_oracle(triton_ops: ModuleType) -> None:
    q, batch, expected = _windowed_case(MIXED_BATCH, 8, 2, 32, 0)
    extend = triton_ops.extend_attention.extend_attention
    assert_close(reference.extend_attention(q, *_args(batch, 32, 0)), expected, torch.float32)
    assert_close(extend(q, *_args(batch, 32, 0), block_m=16), expected, torch.float32)


@pytest.mark.parametrize("window", [0, 7, 512])
def test_gemma3_270m_heads(triton_ops: ModuleType, window: int) -> None:
    # Gemma 3 270M: 4 query heads on one KV head of dimension 256, at the default tile sizes.
    q, batch, expected = _windowed_case([(0, 9), (30, 5)], 4, 1, 256, window)
    args = _args(batch, 256, window)
    assert_close(reference.extend_attention(q, *args), expected, torch.float32)
    assert_close(triton_ops.extend_attention.extend_attention(q, *args), expected, torch.float32)
