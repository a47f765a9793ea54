"""decode_self_attention (QKV split, q/k norm, rotary, K/V write and decode attention in one
op): the native kernel equals its torch reference, and equals the unfused native ops exactly,
so that a model's greedy output does not move when it switches to the fused op."""

from __future__ import annotations

import arbor_kernels as kernels
import pytest
import torch
from arbor_kernels import cpu_native
from arbor_kernels.reference import attention as reference
from arbor_kernels.reference import elementwise as elementwise_ref

from tests.kernels.kv_cases import (
    PagedBatch,
    assert_close,
    paged_batch,
    poison_outside_windows,
)

DIM = 32
SEQ_LENS = [1, 19, 70, 300]  # each request's last token is the new one


def _case(
    heads: int, kv_heads: int, page_size: int, kv_dtype: torch.dtype, dtype: torch.dtype
) -> tuple[PagedBatch, list[torch.Tensor]]:
    """A paged batch and the op's arguments before the pool: qkv, cos, sin."""
    batch = paged_batch(SEQ_LENS, [1] * len(SEQ_LENS), kv_heads, DIM, page_size, kv_dtype, 7)
    gen = torch.Generator().manual_seed(8)
    qkv = torch.randn(len(SEQ_LENS), (heads + 2 * kv_heads) * DIM, generator=gen).to(dtype)
    positions = batch.seq_lens - 1
    inv_freq = 1.0 / (10000 ** (torch.arange(0, DIM, 2).float() / DIM))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return batch, [qkv, emb.cos(), emb.sin()]


def _slots(batch: PagedBatch) -> torch.Tensor:
    return batch.req_to_token[batch.req_pool_indices, batch.seq_lens - 1]


def _norm_weights(qk_norm: bool, dtype: torch.dtype) -> list[torch.Tensor]:
    if not qk_norm:
        return [torch.empty(0, dtype=dtype), torch.empty(0, dtype=dtype)]
    gen = torch.Generator().manual_seed(9)
    return [torch.rand(DIM, generator=gen).to(dtype) + 0.5 for _ in range(2)]


def _native() -> object:
    if not kernels.native_available():
        pytest.fail("native CPU kernels are not built: run `python -m arbor_kernels.cpu_native`")
    return cpu_native.load()


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (9, 3), (7, 1)])
@pytest.mark.parametrize(
    ("dtype", "kv_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
    ],
)
def test_native_matches_reference(
    heads: int,
    kv_heads: int,
    page_size: int,
    qk_norm: bool,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
) -> None:
    ext = _native()
    batch, (qkv, cos, sin) = _case(heads, kv_heads, page_size, kv_dtype, dtype)
    slots = _slots(batch)
    norms = _norm_weights(qk_norm, dtype)
    table = (batch.req_to_token, batch.req_pool_indices, batch.seq_lens, DIM**-0.5)
    got = ext.decode_self_attention(  # type: ignore[attr-defined]
        qkv, cos, sin, *norms, 1e-6, batch.k_buffer, batch.v_buffer, slots, *table, 0
    )
    ref = batch.finite()  # the native kernel reads the NaN-poisoned pool in place
    want = reference.decode_self_attention(
        qkv, cos, sin, *norms, 1e-6, ref.k_buffer, ref.v_buffer, slots, *table
    )
    assert got.shape == (len(SEQ_LENS), heads * DIM) and got.dtype == dtype
    assert_close(got, want, dtype)
    # The new tokens' K/V landed at their slots, rotated K and plain V, in the pool's dtype.
    assert_close(batch.k_buffer[slots].float(), ref.k_buffer[slots].float(), dtype)
    assert torch.equal(batch.v_buffer[slots], ref.v_buffer[slots])
    v_new = qkv.view(len(SEQ_LENS), -1, DIM)[:, heads + kv_heads :]
    assert torch.equal(batch.v_buffer[slots], v_new.to(kv_dtype))


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_equals_the_unfused_native_ops_bit_for_bit(
    qk_norm: bool, dtype: torch.dtype
) -> None:
    ext = _native()
    heads, kv_heads = 9, 3
    fused, (qkv, cos, sin) = _case(heads, kv_heads, 1, dtype, dtype)
    unfused, _ = _case(heads, kv_heads, 1, dtype, dtype)
    slots = _slots(fused)
    norms = _norm_weights(qk_norm, dtype)
    table = (fused.req_to_token, fused.req_pool_indices, fused.seq_lens, DIM**-0.5)
    got = ext.decode_self_attention(  # type: ignore[attr-defined]
        qkv, cos, sin, *norms, 1e-6, fused.k_buffer, fused.v_buffer, slots, *table, 0
    )
    tokens = qkv.shape[0]
    q, k, v = qkv.split([heads * DIM, kv_heads * DIM, kv_heads * DIM], dim=-1)
    q, k = q.view(tokens, heads, DIM), k.view(tokens, kv_heads, DIM)
    if qk_norm:
        q, k = ext.rms_norm(q, norms[0], 1e-6), ext.rms_norm(k, norms[1], 1e-6)  # type: ignore[attr-defined]
    q, k = ext.apply_rotary_emb(q, k, cos, sin)  # type: ignore[attr-defined]
    unfused.k_buffer[slots] = k
    unfused.v_buffer[slots] = v.reshape(tokens, kv_heads, DIM)
    want, _ = ext.decode_attention(  # type: ignore[attr-defined]
        q, unfused.k_buffer, unfused.v_buffer, *table[:2], torch.empty(0, dtype=torch.int64),
        *table[2:], 0,
    )  # fmt: skip
    assert torch.equal(got, want.reshape(tokens, -1))
    assert torch.equal(fused.k_buffer[slots], unfused.k_buffer[slots])


def test_the_reference_rotates_before_writing() -> None:
    # The oracle itself, against the reference ops one by one (a wrong head order or a
    # skipped rotation would still agree between two copies of the same mistake).
    batch, (qkv, cos, sin) = _case(4, 2, 1, torch.float32, torch.float32)
    ref = batch.finite()
    slots = _slots(ref)
    norms = _norm_weights(False, torch.float32)
    table = (ref.req_to_token, ref.req_pool_indices, ref.seq_lens, DIM**-0.5)
    out = reference.decode_self_attention(
        qkv, cos, sin, *norms, 1e-6, ref.k_buffer, ref.v_buffer, slots, *table
    )
    q = qkv[:, : 4 * DIM].view(-1, 4, DIM)
    k = qkv[:, 4 * DIM : 6 * DIM].view(-1, 2, DIM)
    q_rot, k_rot = elementwise_ref.apply_rotary_emb(q, k, cos, sin)
    assert torch.equal(ref.k_buffer[slots], k_rot)
    want = reference.decode_attention(q_rot, ref.k_buffer, ref.v_buffer, *table)
    assert torch.equal(out, want.reshape(len(SEQ_LENS), -1))


@pytest.mark.parametrize("window", [1, 19, 64, 1000])
def test_native_window_matches_reference(window: int) -> None:
    # Lengths 1, 19, 70, 300: a window of one token, equal to one sequence, shorter and longer.
    ext = _native()
    batch, (qkv, cos, sin) = _case(8, 2, 16, torch.float32, torch.float32)
    slots = _slots(batch)
    norms = _norm_weights(True, torch.float32)
    table = (batch.req_to_token, batch.req_pool_indices, batch.seq_lens, DIM**-0.5, window)
    poisoned = poison_outside_windows(batch, window)
    got = ext.decode_self_attention(  # type: ignore[attr-defined]
        qkv, cos, sin, *norms, 1e-6, poisoned.k_buffer, poisoned.v_buffer, slots, *table
    )
    assert got.isfinite().all()  # nothing outside the windows was read
    ref = batch.finite()
    want = reference.decode_self_attention(
        qkv, cos, sin, *norms, 1e-6, ref.k_buffer, ref.v_buffer, slots, *table
    )
    assert_close(got, want, torch.float32)
