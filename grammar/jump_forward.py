"""Jump-forward as verified drafting: the grammar proposes, the model disposes.

When the grammar forces a continuation, its tokens are a draft. The scheduler runs
``[last_token, *draft]`` through the model in one extend step, masks each position with the
grammar state it would have token by token (``fill_draft_masks``), and ``verify_draft``
accepts the longest prefix the model agrees with under the speculative-decoding rule for a
point-mass draft: greedy accepts while the argmax equals the draft token; sampling accepts
draft token t with probability p(t) under the request's processed distribution p, and on
rejection samples from p with t removed, renormalised. Either way each emitted token has
exactly the distribution of token-by-token constrained decoding. After all n draft tokens are
accepted the last position supplies a bonus token, so a step emits between 1 and n + 1
tokens. ``commit_draft`` then brings the matcher to the emitted sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from grammar.backend import GrammarMatcher


@dataclass(frozen=True)
class DraftVerdict:
    """accepted: how many draft tokens the model agreed with (0..n). next_token: the token
    after them (the correction on rejection, the bonus token when all were accepted)."""

    accepted: int
    next_token: int


def fill_draft_masks(
    matcher: GrammarMatcher, draft: Sequence[int], bitmask: torch.Tensor, first_row: int
) -> None:
    """Fill rows first_row .. first_row + n of ``bitmask`` for the n + 1 verify positions.

    Row first_row + i masks the token after draft[:i]. Leaves ``matcher`` advanced past the
    whole draft (``commit_draft`` rolls back what the model rejects). Precondition: the
    draft came from ``matcher.jump_forward_tokens`` in the current state.
    """
    for i, token in enumerate(draft):
        matcher.fill_mask(bitmask, first_row + i)
        if not matcher.accept_token(token):
            raise ValueError(f"draft token {token} at position {i} is not allowed by the grammar")
    matcher.fill_mask(bitmask, first_row + len(draft))


def verify_draft(
    draft: Sequence[int],
    scores: torch.Tensor,
    greedy: bool,
    uniform: Callable[[], float],
    draft_probs: torch.Tensor | None = None,
) -> DraftVerdict:
    """Accept a prefix of ``draft`` and pick the next token.

    scores: [n + 1, V], row i for the token after draft[:i], already masked by the grammar.
    greedy: rows are processed logits; accept while argmax == draft token. Otherwise rows
    are the request's target probabilities p (after temperature, top-k, top-p, min-p;
    normalised, zero where masked), and the standard speculative rule keeps the output
    distributed as p: draft[i] is accepted with probability min(1, p/q), and the first
    rejected position draws from the residual max(p - q, 0), normalised. draft_probs: [n, V]
    the distributions q the draft tokens were drawn from; None: each token was certain
    (q is a point mass, as for grammar-forced or looked-up tokens). uniform: independent
    U[0, 1) draws (seeded per request by the caller); not called when greedy.
    """
    if scores.shape[0] != len(draft) + 1:
        raise ValueError(f"need {len(draft) + 1} score rows for a {len(draft)}-token draft")
    if draft_probs is not None and draft_probs.shape[0] < len(draft):
        raise ValueError(f"need {len(draft)} draft distributions for a {len(draft)}-token draft")
    if greedy:
        best = scores.argmax(-1).tolist()
        for i, token in enumerate(draft):
            if best[i] != token:
                return DraftVerdict(i, best[i])
        return DraftVerdict(len(draft), best[len(draft)])
    probs = scores.double()
    for i, token in enumerate(draft):
        p_token = float(probs[i, token])
        q_token = 1.0 if draft_probs is None else float(draft_probs[i, token])
        if q_token > 0.0 and uniform() * q_token < p_token:
            continue
        if draft_probs is None:
            residual = probs[i].clone()
            residual[token] = 0.0
        else:
            residual = (probs[i] - draft_probs[i].to(probs)).clamp_(min=0.0)
            if float(residual.sum()) <= 0.0:  # p == q up to rounding: any draw from p is right
                residual = probs[i]
        return DraftVerdict(i, sample_inverse_cdf(residual, uniform()))
    return DraftVerdict(len(draft), sample_inverse_cdf(probs[len(draft)], uniform()))


def commit_draft(matcher: GrammarMatcher, draft: Sequence[int], verdict: DraftVerdict) -> bool:
    """After ``fill_draft_masks``: roll back the rejected draft tokens and accept next_token.

    Returns the result of accepting next_token (it is True when the token was sampled under
    the mask). The emitted tokens are ``draft[:verdict.accepted] + [verdict.next_token]``.
    """
    matcher.rollback(len(draft) - verdict.accepted)
    return matcher.accept_token(verdict.next_token)


def sample_inverse_cdf(weights: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from unnormalised non-negative ``weights`` [V] with uniform ``u``."""
    cumulative = weights.cumsum(0)
    total = float(cumulative[-1])
    if total <= 0.0:
        raise ValueError("cannot sample: the distribution has no mass")
    target = torch.tensor([u * total], dtype=cumulative.dtype)
    index = min(int(torch.searchsorted(cumulative, target, right=True)), weights.shape[0] - 1)
    while float(weights[index]) == 0.0:  # rounding ran past the last token with mass
        index -= 1
    return index
