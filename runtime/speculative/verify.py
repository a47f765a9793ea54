"""Verifying a draft: the target's logits at each drafted position go through the request's
own sampling pipeline, and the longest prefix the model agrees with is kept, plus one token.

Row i of a draft's logits is processed as a token-by-token step at output length
len(output_ids) + i would be (penalties counting draft[:i], the grammar's mask at that
position, the stop-token mask below min_new_tokens). Greedy requests accept while the argmax
equals the draft token; sampled ones use the speculative rule against the distributions the
draft was drawn from (none: certain tokens), so outputs are exactly those of decoding token by
token, in distribution. A draft model's rows go through the same processing, so the rule's p
and q match.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import arbor_kernels as kernels
import torch

from grammar import allocate_bitmask, commit_draft, fill_draft_masks, verify_draft
from runtime.sampler import Logprob, Sampler, add_logit_bias, penalised, scaled, token_logprobs

if TYPE_CHECKING:
    from runtime.scheduler.req import Req


class Verified(NamedTuple):
    """What a verification keeps: the accepted draft tokens plus one, and their logprobs
    (None unless requested). The request's matcher, if any, stands past them."""

    tokens: list[int]
    logprobs: list[Logprob | None]


class DraftVerifier:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def mask(self, req: Req) -> torch.Tensor | Exception | None:
        """The grammar's masks [n + 1, W] at each position of ``req``'s draft (the matcher
        then stands past it, as ``verify`` expects), what filling them raised, or None
        (unconstrained)."""
        matcher = req.constraint.matcher
        if matcher is None:
            return None
        mask = allocate_bitmask(len(req.draft.tokens) + 1, self.sampler.vocab_size)
        try:
            fill_draft_masks(matcher, req.draft.tokens, mask, 0)
        except Exception as exc:
            return exc
        return mask

    def verify(self, req: Req, raw: torch.Tensor, mask: torch.Tensor | None) -> Verified | None:
        """Accept the longest prefix of ``req.draft.tokens`` the model agrees with, plus one
        token. raw: [n + 1, V] logits of the positions from the last sampled token through the
        draft; mask: what ``mask`` returned. None: the request failed (its reason is set)."""
        draft = req.draft.tokens
        logits = self.process(raw.clone(), req, draft, 0, mask)
        if req.sampling.is_greedy:
            verdict = verify_draft(draft, logits, True, lambda: 0.0)
        else:
            probs, uniform = self.probs(logits, req), lambda: req.draft.uniform(req.seed)
            verdict = verify_draft(draft, probs, False, uniform, req.draft.probs)
        tokens = draft[: verdict.accepted] + [verdict.next_token]
        logprobs: list[Logprob | None] = [None] * len(tokens)
        if req.return_logprob:
            top = [req.top_logprobs_num] * len(tokens)
            logprobs = list(token_logprobs(raw[: len(tokens)], tokens, top))
        matcher = req.constraint.matcher
        if matcher is not None and not commit_draft(matcher, draft, verdict):
            # The mask allowed a token the matcher refuses (see Sampler._advance_grammars):
            # draw that position again through the full pipeline, which re-checks it.
            position = len(tokens) - 1
            again = self.sampler.sample(raw[position : position + 1], [req], ahead=position)
            if again.failures:
                req.fail(*again.failures[0])
                return None
            tokens[-1], logprobs[-1] = again.token_ids[0], again.logprobs[0]
        return Verified(tokens, logprobs)

    def process(
        self,
        logits: torch.Tensor,
        req: Req,
        draft: Sequence[int],
        first: int,
        bitmask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Process, in place, rows of ``req``'s logits as its token-by-token steps would:
        row r predicts the token after draft[:first + r] (output length len(output_ids) +
        first + r). Bias, penalties (and DRY) counting those draft tokens too, the grammar's
        ``bitmask`` rows (None: unconstrained) and the stop-token mask below min_new_tokens."""
        params = req.sampling
        add_logit_bias(logits, params)
        if params.has_penalties:
            tensors = req.penalties.get(req, self.sampler.vocab_size, logits.device)
            counts, seen = (t.clone() for t in tensors)
            for i in range(first + logits.shape[0]):  # row i - first follows draft[:i]
                if i >= first:
                    logits[i - first] = penalised(logits[i - first], params, counts, seen)
                if i < len(draft):
                    counts[draft[i]] += 1
                    seen[draft[i]] = True
        if params.has_dry:
            self.sampler.apply_dry_rows(logits, req, draft[: first + logits.shape[0] - 1])
        if bitmask is not None:
            kernels.apply_token_bitmask(logits, bitmask.to(logits.device), None)
        for r in range(logits.shape[0]):
            self.sampler.mask_stop_below_min(logits[r], req, len(req.output_ids) + first + r)
        return logits

    @staticmethod
    def probs(logits: torch.Tensor, req: Req) -> torch.Tensor:
        """The distributions [m, V] a sampled request draws from, given processed ``logits``
        [m, V]: temperature, top-k, top-p, min-p, normalised (zero where filtered out)."""
        params = req.sampling
        n = logits.shape[0]
        probs = torch.softmax(scaled(logits, torch.tensor([[params.temperature]])), dim=-1)
        kept = kernels.filter_probs(
            probs,
            torch.full((n,), params.top_k, device=probs.device),
            torch.full((n,), params.top_p, device=probs.device),
            torch.full((n,), params.min_p, device=probs.device),
        )
        return kept / kept.sum(-1, keepdim=True)
