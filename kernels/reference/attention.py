"""Paged attention in plain torch: K/V are read from the pool through the request-to-slot table.

The pool may store K/V in another dtype than q's (``--kv-cache-dtype``): each sequence's
gathered rows are cast to q's dtype, so only those rows are converted, never the pool.
These loop over requests on the host (``.tolist()``), so they are not CUDA-graph safe.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from arbor_kernels.dispatch import register
from arbor_kernels.reference.elementwise import apply_rotary_emb, rms_norm


@register("extend_attention", "torch")
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
) -> torch.Tensor:
    """Causal attention of a packed batch of new tokens over their cached prefix and themselves.

    q: [T, H, D], the new tokens of B requests packed back to back (T = sum(extend_lens)).
    k_buffer, v_buffer: [S, Hkv, D] one layer's KV pool; H must be a multiple of Hkv (GQA).
    req_to_token: [R, C] int; row ``req_pool_indices[b]`` holds request b's slots by position.
    seq_lens, extend_lens: [B] int; request b's prefix length is seq_lens[b] - extend_lens[b].
    window: sliding window, or 0 for none: the query at absolute position p sees the key
    positions k with p - window < k <= p (window keys at most, itself included).
    Precondition: the new tokens' K/V are already written at their slots.
    Returns [T, H, Dv].
    """
    out = torch.empty(q.shape[0], q.shape[1], v_buffer.shape[-1], dtype=q.dtype, device=q.device)
    start = 0
    for row, seq_len, ext in zip(
        req_pool_indices.tolist(), seq_lens.tolist(), extend_lens.tolist(), strict=True
    ):
        prefix = seq_len - ext
        # Keys before the first query's window are seen by no query: not gathered at all.
        first = max(0, prefix - window + 1) if window > 0 else 0
        slots = req_to_token[row, first:seq_len]
        # [1, Hkv, seq_len - first, D]
        k = k_buffer.index_select(0, slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
        v = v_buffer.index_select(0, slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
        qi = q[start : start + ext].transpose(0, 1).unsqueeze(0)  # [1, H, ext, D]
        if prefix == 0 and window == 0:
            o = F.scaled_dot_product_attention(
                qi, k, v, is_causal=True, scale=sm_scale, enable_gqa=True
            )
        else:
            # Query j sits at absolute position prefix + j and sees keys 0 .. prefix + j, or
            # prefix + j - window + 1 .. prefix + j under a window (columns count from first).
            mask = torch.ones(ext, seq_len - first, dtype=torch.bool, device=q.device)
            mask = mask.tril(diagonal=prefix - first)
            if window > 0:
                mask = mask.triu(diagonal=prefix - first - window + 1)
            o = F.scaled_dot_product_attention(
                qi, k, v, attn_mask=mask, scale=sm_scale, enable_gqa=True
            )
        out[start : start + ext] = o[0].transpose(0, 1)
        start += ext
    return out


@register("decode_attention", "torch")
def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    window: int = 0,
) -> torch.Tensor:
    """One new token per request attending to all seq_lens[b] tokens of its sequence, or to
    the last ``window`` of them when window > 0 (the query sits at position seq_lens[b] - 1).

    q: [B, H, D]; other arguments as in ``extend_attention`` (the new token's K/V already
    written, and counted in seq_lens). Returns [B, H, Dv].
    """
    # One request at a time: padding a batch to its longest sequence and gathering through a
    # 2-D index costs ~10x more on CPU (measured at batch 128, lengths 48-1280) than gathering
    # each sequence's exact rows with index_select.
    out = torch.empty(q.shape[0], q.shape[1], v_buffer.shape[-1], dtype=q.dtype, device=q.device)
    for b, (row, seq_len) in enumerate(
        zip(req_pool_indices.tolist(), seq_lens.tolist(), strict=True)
    ):
        first = max(0, seq_len - window) if window > 0 else 0
        slots = req_to_token[row, first:seq_len]
        # [1, Hkv, L, D]
        k = k_buffer.index_select(0, slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
        v = v_buffer.index_select(0, slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            q[b : b + 1].unsqueeze(2), k, v, scale=sm_scale, enable_gqa=True
        )  # [1, H, 1, D]
        out[b] = o[0, :, 0]
    return out


@register("decode_self_attention", "torch")
def decode_self_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out_cache_loc: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    window: int = 0,
) -> torch.Tensor:
    """A decode batch's attention from its QKV projection, in one op (the per-token path of a
    deep model at batch 1 is otherwise a dozen small ops a layer).

    qkv: [B, (H + 2 Hkv) D], each request's one new token: q heads, then k, then v.
    cos, sin: [B, D] float32 (rotate-half layout). q_norm_weight, k_norm_weight: [D] each to
    RMSNorm every q and k head (with ``eps``) before the rotation, or both empty for none.
    Writes each request's rotated K and its V at slot ``out_cache_loc[b]`` of k_buffer,
    v_buffer ([S, Hkv, D], cast to their dtype), then attends as ``decode_attention`` does
    (seq_lens counting the new token, ``window`` as there). Returns [B, H * D] in qkv's dtype.
    """
    batch, dim, kv_heads = qkv.shape[0], k_buffer.shape[-1], k_buffer.shape[1]
    heads = qkv.shape[1] // dim - 2 * kv_heads
    q, k, v = qkv.view(batch, -1, dim).split([heads, kv_heads, kv_heads], dim=1)
    if q_norm_weight.numel() > 0:
        q, k = rms_norm(q, q_norm_weight, eps), rms_norm(k, k_norm_weight, eps)
    q, k = apply_rotary_emb(q, k, cos, sin)
    k_buffer[out_cache_loc] = k.to(k_buffer.dtype)
    v_buffer[out_cache_loc] = v.to(v_buffer.dtype)
    out = decode_attention(
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale, window
    )  # [B, H, D]
    return out.reshape(batch, heads * dim)
