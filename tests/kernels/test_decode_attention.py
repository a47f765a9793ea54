"""The triton split-K decode-attention kernel equals the torch reference on paged batches; both
equal a dense float64 oracle under a sliding window, reading no key outside it."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from arbor_kernels.reference import attention as reference
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kernels.kv_cases import (
    assert_close,
    dense_attention,
    paged_batch,
    poison_outside_windows,
)

# A single-token sequence, lengths ending mid-tile, and one spanning several tiles per split.
SEQ_LENS = [1, 19, 70, 33]


def _run_both(
    triton_ops: ModuleType,
    seq_lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    num_kv_splits: int,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch = paged_batch(seq_lens, [1] * len(seq_lens), kv_heads, head_dim, page_size, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    args = (batch.req_to_token, batch.req_pool_indices, batch.seq_lens, scale)
    out = triton_ops.decode_attention.decode_attention(
        q, batch.k_buffer, batch.v_buffer, *args, num_kv_splits=num_kv_splits, block_n=16
    )
    ref = batch.finite()
    expected = reference.decode_attention(q, ref.k_buffer, ref.v_buffer, *args)
    return out, expected


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (8, 2), (7, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(
    triton_ops: ModuleType, page_size: int, heads: int, kv_heads: int, dtype: torch.dtype
) -> None:
    out, expected = _run_both(triton_ops, SEQ_LENS, heads, kv_heads, 32, page_size, dtype, 3)
    assert out.dtype == dtype
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("num_kv_splits", [1, 2, 8])
def test_any_split_count(triton_ops: ModuleType, num_kv_splits: int) -> None:
    # 8 splits of short sequences leave most splits empty: they must weigh nothing.
    out, expected = _run_both(triton_ops, SEQ_LENS, 4, 2, 32, 16, torch.float32, num_kv_splits)
    assert_close(out, expected, torch.float32)


def test_float16_runs_the_native_16_bit_dot(triton_ops: ModuleType) -> None:
    out, expected = _run_both(triton_ops, SEQ_LENS, 8, 2, 32, 16, torch.float16, 3)
    assert_close(out, expected, torch.float16)


def test_head_dim_that_is_not_a_power_of_two(triton_ops: ModuleType) -> None:
    out, expected = _run_both(triton_ops, [5, 40], 4, 4, 24, 1, torch.float32, 2)
    assert_close(out, expected, torch.float32)


@settings(max_examples=12, deadline=None)
@given(
    seq_lens=st.lists(st.integers(1, 80), min_size=1, max_size=5),
    page_size=st.sampled_from([1, 4, 16]),
    group=st.sampled_from([1, 4, 7]),
    num_kv_splits=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_any_batch(
    triton_ops: ModuleType,
    seq_lens: list[int],
    page_size: int,
    group: int,
    num_kv_splits: int,
    seed: int,
) -> None:
    out, expected = _run_both(
        triton_ops, seq_lens, group, 1, 16, page_size, torch.float32, num_kv_splits, seed
    )
    assert_close(out, expected, torch.float32)


def test_launch_grids_depend_on_shapes_only(
    triton_ops: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a CUDA graph needs: a replay repeats the captured launches, so the grids must not
    depend on the lengths, and a launch must still read every key of sequences longer than
    those it was first launched with (split ranges come from seq_lens on the device)."""
    module = triton_ops.decode_attention
    grids: list[tuple[int, ...]] = []
    for name in ("_decode_partial_kernel", "_decode_reduce_kernel"):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, _GridRecorder(kernel, grids))
    batch = paged_batch(SEQ_LENS, [1] * len(SEQ_LENS), 2, 32, 16, torch.float32)
    q = torch.randn(len(SEQ_LENS), 4, 32, generator=torch.Generator().manual_seed(3))
    scale = 32**-0.5
    captured = torch.ones_like(batch.seq_lens)  # as at capture, where every row is padding
    for seq_lens in (captured, batch.seq_lens):
        out = module.decode_attention(
            q, batch.k_buffer, batch.v_buffer, batch.req_to_token, batch.req_pool_indices,
            seq_lens, scale, block_n=16,
        )  # fmt: skip
    assert len(grids) == 4 and grids[:2] == grids[2:]
    ref = batch.finite()
    expected = reference.decode_attention(
        q, ref.k_buffer, ref.v_buffer, batch.req_to_token, batch.req_pool_indices,
        batch.seq_lens, scale,
    )  # fmt: skip
    assert_close(out, expected, torch.float32)


# Windows of one token, shorter than most sequences, equal to two of them (19, 33), and longer
# than all; 3 splits of a window of 1 leave two splits empty.
WINDOWS = [1, 16, 19, 33, 64, 200]


def _windowed_case(
    seq_lens: list[int], heads: int, kv_heads: int, head_dim: int, window: int
) -> tuple[torch.Tensor, tuple[object, ...], torch.Tensor]:
    """Queries, the op's arguments after q (NaN in the pool outside every window), and the
    oracle's output."""
    batch = paged_batch(seq_lens, [1] * len(seq_lens), kv_heads, head_dim, 16, torch.float32, 4)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=torch.Generator().manual_seed(5))
    expected = dense_attention(q, batch, head_dim**-0.5, window).float()
    poisoned = poison_outside_windows(batch, window)
    args = (
        poisoned.k_buffer, poisoned.v_buffer, poisoned.req_to_token, poisoned.req_pool_indices,
        poisoned.seq_lens, head_dim**-0.5, window,
    )  # fmt: skip
    return q, args, expected


@pytest.mark.parametrize("window", WINDOWS)
def test_reference_window_matches_the_dense_oracle(window: int) -> None:
    q, args, expected = _windowed_case(SEQ_LENS, 8, 2, 32, window)
    assert_close(reference.decode_attention(q, *args), expected, torch.float32)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("num_kv_splits", [1, 3])
def test_triton_window_matches_the_dense_oracle(
    triton_ops: ModuleType, window: int, num_kv_splits: int
) -> None:
    q, args, expected = _windowed_case(SEQ_LENS, 8, 2, 32, window)
    out = triton_ops.decode_attention.decode_attention(
        q, *args, num_kv_splits=num_kv_splits, block_n=16
    )
    assert out.isfinite().all()  # nothing outside the windows was read
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("window", [0, 7, 512])
def test_gemma3_270m_heads(triton_ops: ModuleType, window: int) -> None:
    # Gemma 3 270M: 4 query heads on one KV head of dimension 256, at the default tile size.
    q, args, expected = _windowed_case([1, 30, 600], 4, 1, 256, window)
    assert_close(reference.decode_attention(q, *args), expected, torch.float32)
    out = triton_ops.decode_attention.decode_attention(q, *args)
    assert_close(out, expected, torch.float32)


class _GridRecorder:
    """Stands in for a triton kernel: records each launch's grid, then launches."""

    def __init__(self, kernel: object, grids: list[tuple[int, ...]]) -> None:
        self._kernel, self._grids = kernel, grids

    def __getitem__(self, grid: tuple[int, ...]) -> object:
        self._grids.append(grid)
        return self._kernel[grid]  # type: ignore[index]
