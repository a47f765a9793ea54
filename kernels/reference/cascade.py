"""Attention with log-sum-exp outputs, the pieces of shared-prefix (cascade) decode attention.

A decode request whose first P tokens are shared with other running requests attends in two
parts: over the shared prefix together with every other sharer (``shared_prefix_attention``)
and over its own suffix alone (``decode_attention_with_lse`` from ``kv_start = P``). Each part
is normalised over its own keys and carries its log-sum-exp; ``merge_attention_states`` weighs
them into attention over all keys. Scores and statistics are float32.
"""

from __future__ import annotations

import torch

from kernels.dispatch import register


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, H, D] over k [L, Hkv, D], v [L, Hkv, Dv]; returns out [N, H, Dv] f32, lse [N, H]."""
    n, heads, dim = q.shape
    kv_heads = k.shape[1]
    qg = q.float().view(n, kv_heads, heads // kv_heads, dim)
    scores = torch.einsum("nhgd,lhd->nhgl", qg, k.float()) * sm_scale
    if k.shape[0] == 0:
        out = torch.zeros(n, heads, v.shape[-1])
        return out, torch.full((n, heads), float("-inf"))
    lse = scores.logsumexp(-1)
    out = torch.einsum("nhgl,lhd->nhgd", (scores - lse[..., None]).exp(), v.float())
    return out.reshape(n, heads, -1), lse.reshape(n, heads)


@register("decode_attention_with_lse", "torch")
def decode_attention_with_lse(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_start: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty(q.shape[0], q.shape[1], v_buffer.shape[-1], dtype=q.dtype)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32)
    rows, starts, ends = req_pool_indices.tolist(), kv_start.tolist(), seq_lens.tolist()
    for b, (row, start, end) in enumerate(zip(rows, starts, ends, strict=True)):
        slots = req_to_token[row, start:end]
        o, s = _attend(q[b : b + 1], k_buffer[slots], v_buffer[slots], sm_scale)
        out[b], lse[b] = o[0].to(q.dtype), s[0]
    return out, lse


@register("shared_prefix_attention", "torch")
def shared_prefix_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    prefix_rows: torch.Tensor,
    sharer_offsets: torch.Tensor,
    prefix_lens: torch.Tensor,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty(q.shape[0], q.shape[1], v_buffer.shape[-1], dtype=q.dtype)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32)
    offsets = sharer_offsets.tolist()
    for g, (row, length) in enumerate(zip(prefix_rows.tolist(), prefix_lens.tolist(), strict=True)):
        lo, hi = offsets[g], offsets[g + 1]
        slots = req_to_token[row, :length]
        o, s = _attend(q[lo:hi], k_buffer[slots], v_buffer[slots], sm_scale)
        out[lo:hi], lse[lo:hi] = o.to(q.dtype), s
    return out, lse


@register("merge_attention_states", "torch")
def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> None:
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    wa, wb = (lse_a - top).exp(), (lse_b - top).exp()
    total = wa + wb
    merged = (wa[..., None] * out_a.float() + wb[..., None] * out_b.float()) / total.clamp_min(
        torch.finfo(torch.float32).tiny
    )[..., None]
    out_a.copy_(merged.to(out_a.dtype))
    lse_a.copy_(top + total.log())
