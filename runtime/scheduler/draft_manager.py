"""Jump-forward drafts: what a grammar forces next, proposed after a step and verified by the
next one in the same forward as the request's next token.

A draft costs one logits row per position, so its length follows what the model agrees with
(``DraftState.adapt``): the limit doubles after a full acceptance, drops to one past the agreed
part otherwise, and outright rejections in a row pause drafting exponentially (a model that
prefers another split of the same text than the grammar's tokenization).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from grammar import DraftVerdict, allocate_bitmask, commit_draft, fill_draft_masks

if TYPE_CHECKING:
    from runtime.sampler import Sampler
    from runtime.scheduler.kv_manager import KVCacheManager
    from runtime.scheduler.output_processor import OutputProcessor
    from runtime.scheduler.req import Req

# A first draft is this long at most; the longest verified in one step; the longest pause.
INITIAL_DRAFT_LIMIT = 4
MAX_DRAFT_TOKENS = 16
MAX_DRAFT_COOLDOWN = 64


@dataclass
class DraftState:
    """One request's drafting: the tokens the next step verifies and how far to draft."""

    tokens: list[int] = field(default_factory=list)  # jump-forward tokens to verify next
    draws: int = 0  # uniforms used verifying drafts (a stream apart from sampling)
    limit: int = INITIAL_DRAFT_LIMIT  # longest draft to propose next
    misses: int = 0  # drafts in a row the model rejected outright
    cooldown: int = 0  # steps to wait before proposing again after a miss

    def adapt(self, proposed: int, accepted: int) -> None:
        if accepted == proposed:
            self.limit = min(2 * self.limit, MAX_DRAFT_TOKENS)
        else:
            self.limit = accepted + 1
        self.misses = self.misses + 1 if accepted == 0 else 0
        if self.misses:
            self.cooldown = min(2**self.misses, MAX_DRAFT_COOLDOWN)


class DraftManager:
    """Proposes, masks and verifies the drafts of a scheduler's requests.

    ``count(proposed, accepted, emitted)`` receives each verification's numbers for the
    scheduler's stats."""

    def __init__(
        self,
        sampler: Sampler,
        kv: KVCacheManager,
        outputs: OutputProcessor,
        vocab_size: int,
        count: Callable[[int, int, int], None],
    ) -> None:
        self.sampler = sampler
        self.kv = kv
        self.outputs = outputs
        self.vocab_size = vocab_size
        self.count = count

    def propose(self, req: Req) -> None:
        """Let the grammar propose the continuation it forces, for the next step to verify."""
        if req.grammar is None or req.finished_reason is not None or req.pending_len != 1:
            return
        if req.sampling.has_penalties or req.grammar.is_terminated():
            return  # penalties depend on every token before; drafts would need them per row
        state = req.draft
        if state.cooldown:
            state.cooldown -= 1
            return
        budget = min(req.remaining_new_tokens - 1, state.limit)
        if budget > 0:
            state.tokens = req.grammar.jump_forward_tokens(budget)

    def mask(self, req: Req) -> torch.Tensor | Exception:
        """The grammar's masks at each position of the draft (the matcher then stands past
        it, as ``verify`` expects), or what filling them raised."""
        mask = allocate_bitmask(len(req.draft.tokens) + 1, self.vocab_size)
        assert req.grammar is not None, "only constrained requests draft"
        try:
            fill_draft_masks(req.grammar, req.draft.tokens, mask, 0)
        except Exception as exc:
            return exc
        return mask

    def verify(
        self, req: Req, rows: torch.Tensor, filled: torch.Tensor | Exception | None = None
    ) -> None:
        """Accept what the model agrees with of the draft (rows: its positions' logits), drop
        the KV of the rest, and emit the accepted tokens plus one. filled: the draft's masks
        from ``mask`` (None: fill them here)."""
        draft = req.draft.tokens
        mask = self.mask(req) if filled is None else filled
        if isinstance(mask, Exception):
            raise mask
        tokens, logprobs = self.sampler.verify_draft(rows, req, mask)
        assert req.grammar is not None, "only constrained requests draft"
        if not commit_draft(req.grammar, draft, DraftVerdict(len(tokens) - 1, tokens[-1])):
            # The mask allowed a token the matcher refuses (see Sampler._advance_grammars):
            # draw that position again through the full pipeline, which re-checks it.
            position = len(tokens) - 1
            req.output_ids.extend(draft[:position])  # the drawn row sees the right history
            try:
                again = self.sampler.sample(rows[position : position + 1], [req])
            finally:
                del req.output_ids[len(req.output_ids) - position :]
            if again.failures:
                req.fail(*again.failures[0])
                return
            tokens[-1] = again.token_ids[0]
            logprobs[-1] = again.logprobs[0]
        self.kv.truncate(req, req.kv_len - (len(draft) + 1 - len(tokens)))
        req.draft.adapt(proposed=len(draft), accepted=len(tokens) - 1)
        req.draft.tokens = []
        self.count(len(draft), len(tokens) - 1, len(tokens))
        self.outputs.emit_tokens(req, tokens, logprobs, grammar_advanced=True)
