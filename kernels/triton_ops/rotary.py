"""Rotary position embedding (rotate-half layout) in triton, q and k in one launch.

Grid (T,): a program loads its token's cos/sin once and rotates every query head and every
key head of that token as ``[heads, D / 2]`` tiles: out = x * cos + rotate_half(x) * sin.
cos/sin are rounded to q's dtype first, as the torch reference does; the products are then
taken in float32 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from arbor_kernels.dispatch import register


@triton.jit
def _rotate_heads(
    x_ptr,
    out_ptr,
    stride_h,
    stride_d,
    num_heads,
    cos_lo,
    cos_hi,
    sin_lo,
    sin_hi,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Rotate one token's ``num_heads`` heads of x into out (contiguous [heads, 2 * HALF])."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h < num_heads)[:, None] & (offs_d < HALF)[None, :]
    lo_ptrs = x_ptr + offs_h[:, None] * stride_h + offs_d[None, :] * stride_d
    x_lo = tl.load(lo_ptrs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_HALF]
    x_hi = tl.load(lo_ptrs + HALF * stride_d, mask=mask, other=0.0).to(tl.float32)
    out_lo = x_lo * cos_lo[None, :] - x_hi * sin_lo[None, :]
    out_hi = x_hi * cos_hi[None, :] + x_lo * sin_hi[None, :]
    out_ptrs = out_ptr + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    tl.store(out_ptrs, out_lo.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptrs + HALF, out_hi.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # [T, H, D]
    k_ptr,  # [T, Hkv, D]
    cos_ptr,  # [T, D] float32
    sin_ptr,  # [T, D] float32
    q_out_ptr,  # [T, H, D] contiguous
    k_out_ptr,  # [T, Hkv, D] contiguous
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_ct,
    stride_cd,
    stride_st,
    stride_sd,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    dtype = q_out_ptr.dtype.element_ty
    cos_row = cos_ptr + token * stride_ct
    sin_row = sin_ptr + token * stride_st
    cos_lo = tl.load(cos_row + offs_d * stride_cd, mask=mask_d, other=0.0).to(dtype).to(tl.float32)
    cos_hi = tl.load(cos_row + (HALF + offs_d) * stride_cd, mask=mask_d, other=0.0)
    cos_hi = cos_hi.to(dtype).to(tl.float32)
    sin_lo = tl.load(sin_row + offs_d * stride_sd, mask=mask_d, other=0.0).to(dtype).to(tl.float32)
    sin_hi = tl.load(sin_row + (HALF + offs_d) * stride_sd, mask=mask_d, other=0.0)
    sin_hi = sin_hi.to(dtype).to(tl.float32)
    _rotate_heads(
        q_ptr + token * stride_qt,
        q_out_ptr + token * NUM_Q_HEADS * 2 * HALF,
        stride_qh,
        stride_qd,
        NUM_Q_HEADS,
        cos_lo,
        cos_hi,
        sin_lo,
        sin_hi,
        HALF,
        BLOCK_HQ,
        BLOCK_HALF,
    )
    _rotate_heads(
        k_ptr + token * stride_kt,
        k_out_ptr + token * NUM_K_HEADS * 2 * HALF,
        stride_kh,
        stride_kd,
        NUM_K_HEADS,
        cos_lo,
        cos_hi,
        sin_lo,
        sin_hi,
        HALF,
        BLOCK_HK,
        BLOCK_HALF,
    )


@register("apply_rotary_emb", "triton", graph_safe=True)
def apply_rotary_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``kernels.ops.apply_rotary_emb`` (even D, any strides, q and k of one
    dtype). Returns new contiguous tensors; q and k are not modified."""
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head dim, got {head_dim}")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rotary_kernel[(tokens,)](
        q,
        k,
        cos,
        sin,
        q_out,
        k_out,
        *q.stride(),
        *k.stride(),
        *cos.stride(),
        *sin.stride(),
        NUM_Q_HEADS=num_heads,
        NUM_K_HEADS=num_kv_heads,
        HALF=half,
        BLOCK_HQ=triton.next_power_of_2(num_heads),
        BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
    )
    return q_out, k_out
