"""Paged extend attention in triton: new tokens attend to their cached prefix and causally to
themselves, every key read through the request-to-slot table.

Grid: (query blocks of the whole packed batch, query heads). Query blocks are numbered across
requests (request b owns ``cdiv(extend_lens[b], BLOCK_M)`` consecutive block ids), so one launch
covers variable lengths without a host sync: the grid is an upper bound computed from shapes
and a program past the last request's blocks exits at once. Each program keeps a
``[BLOCK_M, D]`` query tile and runs an online softmax over key blocks of ``BLOCK_N`` positions:
the prefix unmasked, the diagonal blocks under the causal mask. GQA: query head h reads KV head
h // (H // Hkv). With a sliding window a program's key loop starts at its first query's window,
and every tile is masked on both sides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from arbor_kernels.dispatch import register
from arbor_kernels.triton_ops.launch import dot_dtype, dot_precision, padded_dim
from arbor_kernels.triton_ops.paged_tiles import load_kv_tile, online_softmax_step

_LOG2E = 1.4426950408889634


# batch_size is not specialized (a batch of 1 or of 16 would each compile a variant), and the
# request-lookup tile is at least MIN_BLOCK_B wide: new batch sizes mid-serving compile nothing.
@triton.jit(do_not_specialize=["batch_size", "window"])
def _extend_attention_kernel(
    q_ptr,  # [T, H, D]
    k_ptr,  # [S, Hkv, D]
    v_ptr,  # [S, Hkv, Dv]
    out_ptr,  # [T, H, Dv]
    req_to_token_ptr,  # [R, C]
    req_pool_indices_ptr,  # [B]
    seq_lens_ptr,  # [B]
    extend_lens_ptr,  # [B]
    extend_starts_ptr,  # [B], first packed row of each request
    block_ends_ptr,  # [B], cumulative count of query blocks
    batch_size,
    qk_scale,  # sm_scale * log2(e): the softmax runs in base 2
    window,  # read when WINDOWED: the query at position p sees keys p - window + 1 .. p
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_table,
    stride_pos,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    block_id = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP

    # Which request owns this query block: the number of requests whose blocks end at or
    # before it.
    offs_b = tl.arange(0, BLOCK_B)
    ends = tl.load(block_ends_ptr + offs_b, mask=offs_b < batch_size, other=2147483647)
    req = tl.sum((ends <= block_id).to(tl.int32), axis=0)
    if req >= batch_size:
        return
    extend_len = tl.load(extend_lens_ptr + req).to(tl.int32)
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    prefix_len = seq_len - extend_len
    first_block = tl.load(block_ends_ptr + req).to(tl.int32) - tl.cdiv(extend_len, BLOCK_M)
    m_start = (block_id - first_block) * BLOCK_M
    q_row0 = tl.load(extend_starts_ptr + req)
    # The request's row of the request-to-slot table, and its KV head's K and V.
    token_row_ptr = req_to_token_ptr + tl.load(req_pool_indices_ptr + req) * stride_table
    k_head_ptr = k_ptr + kv_head * stride_kh
    v_head_ptr = v_ptr + kv_head * stride_vh

    offs_m = m_start + tl.arange(0, BLOCK_M)  # query index within the request's new tokens
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_m = offs_m < extend_len
    mask_d = offs_d < HEAD_DIM
    mask_dv = offs_dv < HEAD_DIM_V
    q_rows = q_row0 + offs_m
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    ).to(DOT_DTYPE)  # [BLOCK_M, BLOCK_D]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # Query j sits at absolute position prefix_len + j and sees keys 0 .. prefix_len + j, or
    # prefix_len + j - window + 1 .. prefix_len + j under a window.
    q_pos = prefix_len + offs_m
    kv_end = prefix_len + tl.minimum(m_start + BLOCK_M, extend_len)
    if WINDOWED:
        kv_start = tl.maximum(prefix_len + m_start - window + 1, 0)
    else:
        kv_start = 0
    for n_start in range(kv_start, kv_end, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        k, v = load_kv_tile(
            token_row_ptr, k_head_ptr, v_head_ptr, offs_n, mask_n, offs_d, mask_d, offs_dv,
            mask_dv, stride_pos, stride_kt, stride_kd, stride_vt, stride_vd, DOT_DTYPE,
        )  # fmt: skip
        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if WINDOWED:
            # A row's window may begin past this tile: its max can still be -inf after it.
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        # Without a window every row sees key 0 in the first block, so its max is finite from
        # there on.
        qk = tl.where(visible, qk, float("-inf"))
        m_i, l_i, acc = online_softmax_step(
            qk, v, m_i, l_i, acc, DOT_DTYPE, DOT_PRECISION, MAY_BE_EMPTY=WINDOWED
        )

    if WINDOWED:
        # Rows past the request's last token (never stored) may have seen no key at all.
        l_i = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_dv[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_dv[None, :],
    )


MIN_BLOCK_B = 64


@register("extend_attention", "triton")
def extend_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    sm_scale: float,
    window: int = 0,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Same contract as ``kernels.ops.extend_attention``; all tensors on one device.

    Any strides. block_m/block_n (powers of two, >= 16) size the query and key tiles; the
    defaults (64 x 64, 64 x 32 past head dim 64, 32 x 16 past head dim 128) compile for sm_90
    without register spills at 8 warps. Returns [T, H, Dv] in q's dtype, without a host sync.
    """
    tokens, num_heads, head_dim = q.shape
    num_kv_heads, head_dim_v = k_buffer.shape[1], v_buffer.shape[-1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} KV heads")
    if window < 0:
        raise ValueError(f"window must be 0 (none) or positive, not {window}")
    out = torch.empty(tokens, num_heads, head_dim_v, dtype=q.dtype, device=q.device)
    batch = seq_lens.shape[0]
    widest = max(head_dim, head_dim_v)
    block_m = block_m or (64 if widest <= 128 else 32)
    block_n = block_n or (64 if widest <= 64 else 32 if widest <= 128 else 16)
    if tokens == 0 or batch == 0:
        return out
    extend_ends = torch.cumsum(extend_lens, 0)
    blocks = torch.div(extend_lens + block_m - 1, block_m, rounding_mode="floor")
    block_ends = torch.cumsum(blocks, 0)
    # sum_b cdiv(e_b, M) <= (T + B * (M - 1)) / M: enough programs for any split of T tokens.
    grid = ((tokens + batch * (block_m - 1)) // block_m, num_heads)
    _extend_attention_kernel[grid](
        q,
        k_buffer,
        v_buffer,
        out,
        req_to_token,
        req_pool_indices,
        seq_lens,
        extend_lens,
        extend_ends - extend_lens,
        block_ends,
        batch,
        sm_scale * _LOG2E,
        window,
        *q.stride(),
        *k_buffer.stride(),
        *v_buffer.stride(),
        out.stride(0),
        out.stride(1),
        *req_to_token.stride(),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_V=head_dim_v,
        BLOCK_D=padded_dim(head_dim),
        BLOCK_DV=padded_dim(head_dim_v),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_B=max(MIN_BLOCK_B, triton.next_power_of_2(batch)),
        DOT_DTYPE=dot_dtype(q.dtype, q.device),
        DOT_PRECISION=dot_precision(q.dtype),
        WINDOWED=window > 0,
        num_warps=8,
    )
    return out
