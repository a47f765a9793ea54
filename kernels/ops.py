"""The ops the runtime calls. Each forwards to the implementation ``dispatch.resolve`` picks."""

from __future__ import annotations

import torch

from kernels.dispatch import resolve


def extend_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """Causal attention of a packed batch of new tokens over their cached prefix and themselves.

    q: [T, H, D], the new tokens of B requests packed back to back (T = sum(extend_lens)).
    k_buffer, v_buffer: [S, Hkv, D] one layer's KV pool; H must be a multiple of Hkv (GQA).
    req_to_token: [R, C] int; row ``req_pool_indices[b]`` holds request b's slots by position.
    seq_lens, extend_lens: [B] int; request b's prefix length is seq_lens[b] - extend_lens[b].
    Precondition: the new tokens' K/V are already written at their slots.
    Returns [T, H, Dv].
    """
    return resolve("extend_attention", q.device)(
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, extend_lens, sm_scale
    )


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """One new token per request attending to all seq_lens[b] tokens of its sequence.

    q: [B, H, D]; other arguments as in ``extend_attention`` (the new token's K/V already
    written, and counted in seq_lens). Returns [B, H, Dv].
    """
    return resolve("decode_attention", q.device)(
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale
    )


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
    """Decode attention over positions [kv_start[b], seq_lens[b]) of each sequence only.

    Arguments as in ``decode_attention``, plus kv_start [B] int64. Returns (out [B, H, Dv] in
    q's dtype, normalised over those keys; lse [B, H] float32, the natural log-sum-exp of the
    scaled scores, -inf for an empty range).
    """
    return resolve("decode_attention_with_lse", q.device)(
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, kv_start, seq_lens, sm_scale
    )


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
    """Decode queries of G groups of requests, each group attending to the prefix it shares.

    q: [N, H, D], group g's queries at rows sharer_offsets[g] .. sharer_offsets[g + 1]
    ([G + 1] int64); they attend to positions [0, prefix_lens[g]) of req_to_token row
    prefix_rows[g] ([G] int64 each). The prefix's K/V is read once per block of sharers, not
    once per sharer. Returns (out, lse) as ``decode_attention_with_lse``.
    """
    return resolve("shared_prefix_attention", q.device)(
        q, k_buffer, v_buffer, req_to_token, prefix_rows, sharer_offsets, prefix_lens, sm_scale
    )


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> None:
    """In place on (out_a [N, H, Dv] contiguous, lse_a [N, H] float32): merge attention state b,
    computed over other keys, so that a becomes attention over the union of both key sets."""
    resolve("merge_attention_states", out_a.device)(out_a, lse_a, out_b, lse_b)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 and cast back to x's dtype before scaling."""
    return resolve("rms_norm", x.device)(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    return resolve("fused_add_rms_norm", x.device)(x, residual, weight, eps)


def apply_rotary_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, Hkv, D] by cos/sin [T, D] (rotate-half layout, float32)."""
    return resolve("apply_rotary_emb", q.device)(q, k, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] holding gate then up; returns silu(gate) * up, [T, I]."""
    return resolve("silu_and_mul", x.device)(x)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None
) -> None:
    """In place: logits[row, t] = -inf for every token t not allowed by the row's bitmask.

    logits: [B, V] float. bitmask: [N, W] int32, token t allowed iff bit t % 32 of word t // 32
    is set (xgrammar's layout); tokens past 32 * W are disallowed. indices: [N] int64 rows of
    logits the bitmask rows apply to (None: N == B, row i to row i). Other rows are untouched.
    """
    resolve("apply_token_bitmask", logits.device)(logits, bitmask, indices)


def row_max_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's max [B], the first index holding it [B] int64) of logits [B, V]. A row with
    a NaN gives NaN (the sampler's signal of a broken row); ties go to the lowest index."""
    values, indices = resolve("row_max_argmax", logits.device)(logits)
    return values, indices


def sample_from_probs(
    probs: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """One token per row from probs [B, V] float32 (rows sum to 1), after filtering.

    Filters, in order, on each row: top_k [B] int64 (<= 0 or >= V: off) keeps tokens at least
    as probable as the k-th most probable; top_p [B] float32 (1.0: off) keeps the most probable
    tokens whose mass (of the top-k mass) first reaches top_p; min_p [B] float32 (0: off) keeps
    tokens with prob >= min_p * max prob. Ties with the last kept value are kept. The draw for
    a row depends only on (seeds[b], offsets[b]) [B] int64, never on the other rows.
    Returns [B] int64 token ids.
    """
    return resolve("sample_from_probs", probs.device)(probs, top_k, top_p, min_p, seeds, offsets)
