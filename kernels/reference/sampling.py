"""Token-bitmask application and filtered sampling in plain torch (the CPU path and the oracle)."""

from __future__ import annotations

import torch
from arbor_kernels.dispatch import register

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, offset) pairs over 63 bits


@register("apply_token_bitmask", "torch")
def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None
) -> None:
    """In place: logits[row, t] = -inf for every token t not allowed by the row's bitmask.

    logits: [B, V] float. bitmask: [N, W] int32, token t allowed iff bit t % 32 of word t // 32
    is set (xgrammar's layout); tokens past 32 * W are disallowed. indices: [N] int64 rows of
    logits the bitmask rows apply to (None: N == B, row i to row i). Other rows are untouched.
    """
    rows = logits if indices is None else logits[indices]
    vocab = logits.shape[-1]
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)  # [N, 32 * W]
    if allowed.shape[1] < vocab:
        pad = allowed.new_zeros(allowed.shape[0], vocab - allowed.shape[1])
        allowed = torch.cat([allowed, pad], dim=1)
    rows = rows.masked_fill(~allowed[:, :vocab], float("-inf"))
    if indices is None:
        logits.copy_(rows)
    else:
        logits[indices] = rows


@register("row_max_argmax", "torch")
def row_max_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's max [B], the first index holding it [B] int64) of logits [B, V]. A row with
    a NaN gives NaN (the sampler's signal of a broken row); ties go to the lowest index."""
    values, indices = logits.max(dim=-1)
    return values, indices


def filter_probs(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """The kept mass of each row (unnormalised) after top-k, then top-p, then min-p.

    Thresholds keep every token tied with the last one kept, so the result does not depend on
    how a sort orders equal probabilities.
    """
    vocab = probs.shape[-1]
    if not bool(((top_k > 0) & (top_k < vocab)).any() | (top_p < 1.0).any() | (min_p > 0.0).any()):
        return probs  # no row filters: skip the sort of [B, V]
    sorted_probs = probs.sort(dim=-1, descending=True).values  # [B, V]
    k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k).long()
    kth = sorted_probs.gather(1, (k - 1).unsqueeze(1))
    keep = probs >= kth
    kept_sorted = torch.where(sorted_probs >= kth, sorted_probs, 0.0)
    before = kept_sorted.cumsum(-1) - kept_sorted  # mass of the more probable tokens
    total = kept_sorted.sum(-1, keepdim=True)
    # A token stays while the mass before it is under top_p of the kept mass; the last such
    # token's probability is the cut. top_p >= 1 is off outright: the rounded cumsum can reach
    # the rounded total before the least probable tokens.
    count = (before < top_p.unsqueeze(1) * total).sum(-1, keepdim=True)
    top_p_cut = sorted_probs.gather(1, count.clamp(min=1) - 1)
    keep &= (probs >= top_p_cut) | (top_p.unsqueeze(1) >= 1.0)
    keep &= probs >= min_p.unsqueeze(1) * sorted_probs[:, :1]
    return torch.where(keep, probs, 0.0)


def row_uniform(seed: int, offset: int) -> float:
    """A uniform in [0, 1) that depends only on (seed, offset): batch-independent sampling."""
    gen = torch.Generator().manual_seed((seed * _MIX + offset) & ((1 << 63) - 1))
    return float(torch.rand((), generator=gen, dtype=torch.float64))


@register("sample_from_probs", "torch")
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
    kept = filter_probs(probs, top_k, top_p, min_p).double()
    cumulative = kept.cumsum(-1)  # token-id order: inverse CDF needs no sort
    uniforms = torch.tensor(
        [row_uniform(s, o) for s, o in zip(seeds.tolist(), offsets.tolist(), strict=True)],
        dtype=torch.float64,
        device=probs.device,
    )
    targets = uniforms * cumulative[:, -1]
    chosen = torch.searchsorted(cumulative, targets.unsqueeze(1), right=True).squeeze(1)
    # Rounding can land on a zero-mass token at the end; step back to the last kept one.
    last_kept = probs.shape[-1] - 1 - (kept > 0).flip(-1).float().argmax(-1)
    return torch.minimum(chosen, last_kept)
