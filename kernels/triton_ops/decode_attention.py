"""Paged decode attention in triton, split-K (flash-decoding): one new token per request.

Stage 1, grid (B, Hkv, num_kv_splits): a program takes one request, one KV head with all the
query heads that share it (GQA: a ``[BLOCK_H, D]`` query tile, BLOCK_H >= 16 for ``tl.dot``),
and one contiguous split of the request's positions, and writes the split's normalised partial
output and its log-sum-exp. Stage 2, grid (B, H): combines the splits, weighting each by
exp(lse - max lse); empty splits (short sequences) carry lse = -inf and weigh nothing.
Split lengths are computed in the kernel from seq_lens, so there is no host sync. With a
sliding window the splits cut only the last ``window`` positions: earlier keys are not read.

CUDA-graph safe (registered so): the launch reads nothing but shapes on the host. The grids
depend on (B, H, Hkv, num_kv_splits), and the default split count on B, Hkv and the device
only, so a graph captured at batch size B replays with the same grids. No maximum context
bound is baked in either: each split's range and the key loop's bounds come from ``seq_lens``
on the device, so a replay with longer sequences than at capture reads all of them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from arbor_kernels.dispatch import register
from arbor_kernels.triton_ops.launch import dot_dtype, dot_precision, padded_dim
from arbor_kernels.triton_ops.paged_tiles import load_kv_tile, online_softmax_step

_LOG2E = 1.4426950408889634
# The most splits the occupancy rule picks; the reduce kernel's tile covers them all, so one
# compiled variant serves every batch size.
MAX_KV_SPLITS = 16


# The split count changes with the batch size; as a runtime value (not a constexpr, not
# specialized) it costs no compile when a new batch size shows up mid-serving.
@triton.jit(do_not_specialize=["num_kv_splits", "window"])
def _decode_partial_kernel(
    q_ptr,  # [B, H, D]
    k_ptr,  # [S, Hkv, D]
    v_ptr,  # [S, Hkv, Dv]
    mid_out_ptr,  # [B, H, num_kv_splits, Dv] float32
    mid_lse_ptr,  # [B, H, num_kv_splits] float32, base-2 log-sum-exp
    req_to_token_ptr,  # [R, C]
    req_pool_indices_ptr,  # [B]
    seq_lens_ptr,  # [B]
    qk_scale,  # sm_scale * log2(e)
    window,  # read when WINDOWED: the query at seq_len - 1 sees the last `window` positions
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_table,
    stride_pos,
    num_kv_splits,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    # The request's row of the request-to-slot table, and its KV head's K and V.
    token_row_ptr = req_to_token_ptr + tl.load(req_pool_indices_ptr + req) * stride_table
    k_head_ptr = k_ptr + kv_head * stride_kh
    v_head_ptr = v_ptr + kv_head * stride_vh
    # The splits cover positions [first, seq_len), in whole BLOCK_N tiles so only the last tile
    # is ragged.
    if WINDOWED:
        first = tl.maximum(seq_len - window, 0)
    else:
        first = 0
    split_len = tl.cdiv(tl.cdiv(seq_len - first, num_kv_splits), BLOCK_N) * BLOCK_N
    kv_start = first + split * split_len
    kv_end = tl.minimum(kv_start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + offs_h
    mask_h = offs_h < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < HEAD_DIM
    mask_dv = offs_dv < HEAD_DIM_V
    q = tl.load(
        q_ptr + req * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    ).to(DOT_DTYPE)  # [BLOCK_H, BLOCK_D]

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for n_start in range(kv_start, kv_end, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        k, v = load_kv_tile(
            token_row_ptr, k_head_ptr, v_head_ptr, offs_n, mask_n, offs_d, mask_d, offs_dv,
            mask_dv, stride_pos, stride_kt, stride_kd, stride_vt, stride_vd, DOT_DTYPE,
        )  # fmt: skip
        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N]
        qk = tl.where(mask_n[None, :], qk, float("-inf"))  # every tile has a valid key
        m_i, l_i, acc = online_softmax_step(
            qk, v, m_i, l_i, acc, DOT_DTYPE, DOT_PRECISION, MAY_BE_EMPTY=False
        )

    has_keys = kv_end > kv_start
    l_safe = tl.where(has_keys, l_i, 1.0)
    lse = tl.where(has_keys, m_i + tl.math.log2(l_safe), float("-inf"))
    out = acc / l_safe[:, None]
    mid_row = (req * GROUP * tl.num_programs(1) + heads) * num_kv_splits + split
    tl.store(mid_lse_ptr + mid_row, lse, mask=mask_h)
    tl.store(
        mid_out_ptr + mid_row[:, None] * HEAD_DIM_V + offs_dv[None, :],
        out,
        mask=mask_h[:, None] & mask_dv[None, :],
    )


@triton.jit(do_not_specialize=["num_kv_splits"])
def _decode_reduce_kernel(
    mid_out_ptr,  # [B, H, num_kv_splits, Dv] float32
    mid_lse_ptr,  # [B, H, num_kv_splits] float32
    out_ptr,  # [B, H, Dv]
    stride_ob,
    stride_oh,
    stride_od,
    num_kv_splits,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    row = req * tl.num_programs(1) + head
    offs_s = tl.arange(0, BLOCK_SPLITS)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_s = offs_s < num_kv_splits
    mask_dv = offs_dv < HEAD_DIM_V
    lse = tl.load(mid_lse_ptr + row * num_kv_splits + offs_s, mask=mask_s, other=float("-inf"))
    weights = tl.math.exp2(lse - tl.max(lse, axis=0))  # split 0 always has keys: max is finite
    partial = tl.load(
        mid_out_ptr + (row * num_kv_splits + offs_s[:, None]) * HEAD_DIM_V + offs_dv[None, :],
        mask=mask_s[:, None] & mask_dv[None, :],
        other=0.0,
    )  # [BLOCK_SPLITS, BLOCK_DV]
    out = tl.sum(partial * weights[:, None], axis=0) / tl.sum(weights, axis=0)
    tl.store(
        out_ptr + req * stride_ob + head * stride_oh + offs_dv * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=mask_dv,
    )


def default_kv_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Enough splits that stage 1 has about four programs per streaming multiprocessor."""
    if device.type != "cuda":
        return 4
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_KV_SPLITS, triton.cdiv(4 * sms, batch * num_kv_heads)))


@register("decode_attention", "triton", graph_safe=True)
def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    window: int = 0,
    num_kv_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Same contract as ``kernels.ops.decode_attention``; all tensors on one device, any strides.

    num_kv_splits: how many splits stage 1 cuts each sequence into (None: by occupancy).
    block_n: keys per tile (a power of two >= 16; None: 64, or 32 past head dim 128, which
    compiles for sm_90 without register spills at head dim 256). Returns [B, H, Dv] in q's
    dtype, without a host sync.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads, head_dim_v = k_buffer.shape[1], v_buffer.shape[-1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} KV heads")
    if window < 0:
        raise ValueError(f"window must be 0 (none) or positive, not {window}")
    out = torch.empty(batch, num_heads, head_dim_v, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    splits = num_kv_splits or default_kv_splits(batch, num_kv_heads, q.device)
    block_n = block_n or (64 if max(head_dim, head_dim_v) <= 128 else 32)
    group = num_heads // num_kv_heads
    mid_shape = (batch, num_heads, splits)
    mid_out = torch.empty(*mid_shape, head_dim_v, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(mid_shape, dtype=torch.float32, device=q.device)
    _decode_partial_kernel[(batch, num_kv_heads, splits)](
        q,
        k_buffer,
        v_buffer,
        mid_out,
        mid_lse,
        req_to_token,
        req_pool_indices,
        seq_lens,
        sm_scale * _LOG2E,
        window,
        *q.stride(),
        *k_buffer.stride(),
        *v_buffer.stride(),
        *req_to_token.stride(),
        splits,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_V=head_dim_v,
        BLOCK_D=padded_dim(head_dim),
        BLOCK_DV=padded_dim(head_dim_v),
        BLOCK_H=padded_dim(group),
        BLOCK_N=block_n,
        DOT_DTYPE=dot_dtype(q.dtype, q.device),
        DOT_PRECISION=dot_precision(q.dtype),
        WINDOWED=window > 0,
        num_warps=4 if max(head_dim, head_dim_v) <= 64 else 8,  # 8: no spills at D = 128
    )
    _decode_reduce_kernel[(batch, num_heads)](
        mid_out,
        mid_lse,
        out,
        *out.stride(),
        splits,
        HEAD_DIM_V=head_dim_v,
        BLOCK_SPLITS=max(MAX_KV_SPLITS, triton.next_power_of_2(splits)),
        BLOCK_DV=triton.next_power_of_2(head_dim_v),
    )
    return out
