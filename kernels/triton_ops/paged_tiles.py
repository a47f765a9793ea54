"""Tile steps shared by the paged attention kernels (inlined into them by triton)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(
    token_row_ptr,
    k_head_ptr,
    v_head_ptr,
    offs_n,
    mask_n,
    offs_d,
    mask_d,
    offs_dv,
    mask_dv,
    stride_pos,
    stride_kt,
    stride_kd,
    stride_vt,
    stride_vd,
    DOT_DTYPE: tl.constexpr,
):
    """K^T [BLOCK_D, BLOCK_N] and V [BLOCK_N, BLOCK_DV] of positions ``offs_n`` of one
    sequence, read through its request-to-slot row (``token_row_ptr``) from one KV head
    (``k_head_ptr``, ``v_head_ptr``: the pools offset to that head); masked entries are 0."""
    slots = tl.load(token_row_ptr + offs_n * stride_pos, mask=mask_n, other=0)
    k = tl.load(
        k_head_ptr + slots[None, :] * stride_kt + offs_d[:, None] * stride_kd,
        mask=mask_n[None, :] & mask_d[:, None],
        other=0.0,
    ).to(DOT_DTYPE)
    v = tl.load(
        v_head_ptr + slots[:, None] * stride_vt + offs_dv[None, :] * stride_vd,
        mask=mask_n[:, None] & mask_dv[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    return k, v


@triton.jit
def online_softmax_step(
    qk,
    v,
    m_i,
    l_i,
    acc,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MAY_BE_EMPTY: tl.constexpr,
):
    """Fold one tile of base-2 scores ``qk`` [ROWS, BLOCK_N] (-inf where masked) and its V into
    the running max, sum and output accumulator. Unless MAY_BE_EMPTY, every row must be finite
    somewhere by now; with it, a row that has seen no key yet keeps max -inf, sum and output 0
    (at the cost of one select per row)."""
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    if MAY_BE_EMPTY:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # exp2(-inf - 0) = 0, not NaN
    else:
        m_ref = m_new
    p = tl.math.exp2(qk - m_ref[:, None])
    alpha = tl.math.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
