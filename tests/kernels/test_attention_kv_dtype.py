"""Attention over K/V stored in another dtype than q's (``--kv-cache-dtype``).

The torch reference casts each gathered sequence to q's dtype; the triton kernels convert
every loaded tile to the dot dtype. Tolerances for 16-bit K/V against float32 K/V (fp32 q,
unit-normal K/V and q, head dim 32): worst measured over 20 seeds, page sizes 1 and 16,
extend and decode, was 9.6e-3 for bfloat16 and 1.3e-3 for float16; the tests allow 2e-2 and
3e-3 (the rounding of K/V to 8 and 11 significant bits, not a kernel error).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
import torch
from arbor_kernels.reference import attention as reference

from tests.kernels.kv_cases import PagedBatch, assert_close, paged_batch

Attention = Callable[..., torch.Tensor]
REFERENCE = (reference.extend_attention, reference.decode_attention)
KV_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3}
SEQ_LENS = [1, 19, 70, 33, 130]
EXTEND_LENS = [1, 5, 70, 1, 64]


def _batch(page_size: int, seed: int) -> tuple[PagedBatch, torch.Tensor, torch.Tensor]:
    """A finite float32 paged batch and float32 queries for its extend and decode."""
    batch = paged_batch(SEQ_LENS, EXTEND_LENS, 2, 32, page_size, torch.float32, seed).finite()
    gen = torch.Generator().manual_seed(seed + 1)
    q_extend = torch.randn(sum(EXTEND_LENS), 8, 32, generator=gen)  # [T, H, D]
    q_decode = torch.randn(len(SEQ_LENS), 8, 32, generator=gen)  # [B, H, D]
    return batch, q_extend, q_decode


def _attend(
    impls: tuple[Attention, Attention], batch: PagedBatch, q_extend: torch.Tensor,
    q_decode: torch.Tensor, kv_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(extend, decode) outputs of ``impls`` with the batch's K/V stored in ``kv_dtype``."""
    extend_attention, decode_attention = impls
    k, v = batch.k_buffer.to(kv_dtype), batch.v_buffer.to(kv_dtype)
    table = (batch.req_to_token, batch.req_pool_indices, batch.seq_lens)
    scale = 32**-0.5
    extend = extend_attention(q_extend, k, v, *table, batch.extend_lens, scale)
    decode = decode_attention(q_decode, k, v, *table, scale)
    return extend, decode


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_reference_with_16_bit_kv_matches_float32_kv(page_size: int, kv_dtype: torch.dtype):
    batch, q_extend, q_decode = _batch(page_size, seed=3)
    expected = _attend(REFERENCE, batch, q_extend, q_decode, torch.float32)
    actual = _attend(REFERENCE, batch, q_extend, q_decode, kv_dtype)
    tol = KV_TOLERANCE[kv_dtype]
    for out, ref in zip(actual, expected, strict=True):
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, ref, atol=tol, rtol=0)
        # The stored K/V really were rounded: the outputs differ, just not by much.
        assert not torch.equal(out, ref)


# (q dtype, K/V dtype): fp32 models with 16-bit caches, and a fp16 model over a bf16 cache
# (fp16 runs the native 16-bit dot under the interpreter).
MIXED = [
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.float16, torch.bfloat16),
]


@pytest.mark.parametrize(("q_dtype", "kv_dtype"), MIXED)
def test_triton_reads_kv_of_another_dtype(
    triton_ops: ModuleType, q_dtype: torch.dtype, kv_dtype: torch.dtype
):
    batch, q_extend, q_decode = _batch(16, seed=5)
    q_extend, q_decode = q_extend.to(q_dtype), q_decode.to(q_dtype)
    triton = (
        triton_ops.extend_attention.extend_attention,
        triton_ops.decode_attention.decode_attention,
    )
    actual = _attend(triton, batch, q_extend, q_decode, kv_dtype)
    expected = _attend(REFERENCE, batch, q_extend, q_decode, kv_dtype)
    for out, ref in zip(actual, expected, strict=True):
        assert out.dtype == q_dtype
        assert_close(out, ref, q_dtype)
