"""Filtered sampling in triton without a sort: top-k / top-p / min-p thresholds by radix
selection over the probability bits, then an inverse-CDF draw in token-id order.

Grid (B,): one program per row, streaming the row in BLOCK_V tiles. Every filter keeps the
tokens at or above a value, so together they keep ``{t : p_t >= threshold}`` with threshold
the largest of the three:

- top-k: the k-th largest probability. Non-negative float32 values order like their int32
  bit patterns, so the value is found exactly, 4 bits per pass (8 passes), by counting for 16
  candidate prefixes at once how many tokens lie at or above each.
- top-p: the largest value v whose mass ``sum(p_t >= v)`` still reaches top_p of the top-k
  mass, found the same way with masses instead of counts. Above the k-th value that mass
  counts only top-k tokens, and below it the top-k threshold wins anyway. Equal values are
  all kept or all dropped, as in ``kernels.reference.sampling.filter_probs``.
- min-p: min_p times the row maximum.

The draw takes u = philox(seed, offset) in [0, 1) (``tl.rand``) and returns the first token
whose running kept mass exceeds u times the kept total, so a row's token depends only on its
probabilities, seed and offset, never on the rest of the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from arbor_kernels.dispatch import register

_RADIX_BITS = 4


@triton.jit
def _load_tile(row_ptr, start, vocab_size, stride_col, BLOCK_V: tl.constexpr):
    """Probabilities of tokens start .. start + BLOCK_V, their ids, and their int32 keys
    (the float bits: monotone for non-negative floats; -1 past the vocabulary)."""
    offs = start + tl.arange(0, BLOCK_V)
    in_vocab = offs < vocab_size
    p = tl.load(row_ptr + offs * stride_col, mask=in_vocab, other=0.0).to(tl.float32)
    p = tl.maximum(p, 0.0)
    keys = tl.where(in_vocab, p.to(tl.int32, bitcast=True), -1)
    return p, offs, keys


@triton.jit
def _select_digit(scores, limit, candidates, prefix, shift):
    """Extend ``prefix`` by the largest digit whose candidate still has ``scores >= limit``
    and a positive score (some token at or above it: a limit of 0 must not run past the max).

    Scores fall as the candidate grows; digit 0 (the prefix itself) is kept even when float
    rounding says otherwise, since it met the bound at the previous level.
    """
    valid = candidates >= 0  # at the top level, digits >= 8 would set the sign bit
    passing = tl.sum(((scores >= limit) & (scores > 0) & valid).to(tl.int32), axis=0)
    return prefix | (tl.maximum(passing - 1, 0) << shift)


@triton.jit
def _radix_select(
    row_ptr, vocab_size, stride_col, limit, BY_MASS: tl.constexpr, BLOCK_V: tl.constexpr
):
    """The largest value v whose tokens at or above it still reach ``limit``: in number (the
    k-th largest probability of the row, 1 <= k <= V, exactly) or, ``BY_MASS``, in summed
    probability (the top-p cut: sum(p_t : p_t >= v) >= limit)."""
    digits = tl.arange(0, 16)
    prefix = tl.zeros([], tl.int32)
    for level in tl.static_range(8):
        shift = 28 - 4 * level
        candidates = prefix | (digits << shift)
        if BY_MASS:
            totals = tl.zeros([16], tl.float32)
        else:
            totals = tl.zeros([16], tl.int32)
        for start in range(0, vocab_size, BLOCK_V):
            p, _, keys = _load_tile(row_ptr, start, vocab_size, stride_col, BLOCK_V)
            at_or_above = keys[:, None] >= candidates[None, :]
            if BY_MASS:
                totals += tl.sum(tl.where(at_or_above, p[:, None], 0.0), axis=0)
            else:
                totals += tl.sum(at_or_above.to(tl.int32), axis=0)
        prefix = _select_digit(totals, limit, candidates, prefix, shift)
    return prefix.to(tl.float32, bitcast=True)


@triton.jit
def _mass_at_or_above(row_ptr, vocab_size, stride_col, threshold, BLOCK_V: tl.constexpr):
    total = tl.zeros([], tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        p, _, _ = _load_tile(row_ptr, start, vocab_size, stride_col, BLOCK_V)
        total += tl.sum(tl.where(p >= threshold, p, 0.0), axis=0)
    return total


@triton.jit
def _filtered_sample_kernel(
    probs_ptr,  # [B, V] float32
    top_k_ptr,  # [B] int64
    top_p_ptr,  # [B] float32
    min_p_ptr,  # [B] float32
    seeds_ptr,  # [B] int64
    offsets_ptr,  # [B] int64
    tokens_ptr,  # [B] int64 out
    thresholds_ptr,  # [B] float32 out: the row keeps {t : p_t >= threshold}
    vocab_size,
    stride_row,
    stride_col,
    DRAW: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = probs_ptr + row.to(tl.int64) * stride_row
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)

    row_max = tl.zeros([], tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        p, _, _ = _load_tile(row_ptr, start, vocab_size, stride_col, BLOCK_V)
        row_max = tl.maximum(row_max, tl.max(p, axis=0))

    threshold = tl.zeros([], tl.float32)
    if (top_k > 0) & (top_k < vocab_size):
        threshold = _radix_select(
            row_ptr, vocab_size, stride_col, top_k.to(tl.int32), False, BLOCK_V
        )
    if top_p < 1.0:
        top_k_mass = _mass_at_or_above(row_ptr, vocab_size, stride_col, threshold, BLOCK_V)
        cut = _radix_select(row_ptr, vocab_size, stride_col, top_p * top_k_mass, True, BLOCK_V)
        threshold = tl.maximum(threshold, cut)
    threshold = tl.maximum(threshold, min_p * row_max)
    tl.store(thresholds_ptr + row, threshold)

    if DRAW:
        kept_mass = _mass_at_or_above(row_ptr, vocab_size, stride_col, threshold, BLOCK_V)
        target = tl.rand(tl.load(seeds_ptr + row), tl.load(offsets_ptr + row)) * kept_mass
        running = tl.zeros([], tl.float32)
        chosen = tl.zeros([], tl.int64) + vocab_size
        last_kept = tl.zeros([], tl.int64)
        for start in range(0, vocab_size, BLOCK_V):
            p, offs, _ = _load_tile(row_ptr, start, vocab_size, stride_col, BLOCK_V)
            kept = tl.where(p >= threshold, p, 0.0)
            cumulative = running + tl.cumsum(kept, axis=0)
            crossing = (cumulative > target) & (kept > 0.0)
            chosen = tl.minimum(chosen, tl.min(tl.where(crossing, offs, vocab_size), axis=0))
            last_kept = tl.maximum(last_kept, tl.max(tl.where(kept > 0.0, offs, 0), axis=0))
            running += tl.sum(kept, axis=0)
        # Rounding can leave u * total just past the running sum; the last kept token wins then.
        tl.store(tokens_ptr + row, tl.where(chosen < vocab_size, chosen, last_kept))


def _launch(
    probs: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor | None,
    offsets: torch.Tensor | None,
    block_v: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, vocab = probs.shape
    tokens = torch.empty(batch, dtype=torch.int64, device=probs.device)
    thresholds = torch.empty(batch, dtype=torch.float32, device=probs.device)
    if batch == 0:
        return tokens, thresholds
    draw = seeds is not None and offsets is not None
    _filtered_sample_kernel[(batch,)](
        probs,
        top_k,
        top_p.float(),
        min_p.float(),
        seeds if draw else top_k,
        offsets if draw else top_k,
        tokens,
        thresholds,
        vocab,
        *probs.stride(),
        DRAW=draw,
        BLOCK_V=block_v or min(1024, max(16, triton.next_power_of_2(vocab))),
        num_warps=8,
    )
    return tokens, thresholds


def keep_thresholds(
    probs: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    block_v: int | None = None,
) -> torch.Tensor:
    """[B] float32: row b keeps exactly the tokens t with probs[b, t] >= threshold[b] (those
    of positive probability carry mass). Arguments as in ``kernels.ops.sample_from_probs``."""
    return _launch(probs, top_k, top_p, min_p, None, None, block_v)[1]


@register("sample_from_probs", "triton")
def sample_from_probs(
    probs: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    block_v: int | None = None,
) -> torch.Tensor:
    """Same contract as ``kernels.ops.sample_from_probs`` (a different random stream than the
    torch reference: the same (seed, offset) need not give the same token on both).

    block_v: tokens per tile (a power of two >= 16; None: up to 1024). Returns [B] int64.
    """
    return _launch(probs, top_k, top_p, min_p, seeds, offsets, block_v)[0]
