"""Drafts: tokens proposed after a step and verified by the next one, in the same forward as
the request's next token.

Two kinds of proposers share one verify path (verify.py):

- jump-forward: what a constrained request's grammar forces next (certain tokens);
- the speculative proposers (proposers.py): ``--speculative-algorithm ngram`` (the radix
  tree's continuation, else prompt lookup) or ``draft`` (a small draft model).

A draft costs one logits row (and KV slot) per position, so its length follows what the model
agrees with. Jump-forward drafts (``Backoff``): the limit doubles after a full acceptance,
drops to one past the agreed part otherwise, and outright rejections in a row pause drafting
exponentially. Speculation (runtime/speculative/policy.py): each request drafts as many tokens
as its acceptance rate makes worth their measured cost on this device, probing now and then
when none is. The two adapt apart: a model that splits forced text otherwise than the
grammar does is no reason to stop looking up its prompt.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import arbor_kernels as kernels
import torch

from runtime.speculative.ngram import DEFAULT_MAX_MATCH, DEFAULT_MIN_MATCH
from runtime.speculative.policy import PRIOR_COST, Acceptance, VerifyCost
from runtime.speculative.proposers import (
    DRAFT_MODEL,
    NGRAM,
    TREE,
    DraftModelProposer,
    NgramProposer,
    Proposer,
)
from runtime.speculative.verify import DraftVerifier, Verified

if TYPE_CHECKING:
    from radix_cache import RadixCache
    from runtime.sampling_params import SamplingParams
    from runtime.scheduler.req import Req
    from runtime.speculative.draft_worker import DraftModelWorker

__all__ = ["DRAFT_MODEL", "JUMP", "NGRAM", "TREE", "DraftManager", "DraftState"]

# A first jump-forward draft is this long at most; the longest verified in one step; the
# longest pause.
INITIAL_DRAFT_LIMIT = 4
MAX_DRAFT_TOKENS = 16
MAX_DRAFT_COOLDOWN = 64

JUMP = "jump"
SPECULATIVE_SOURCES = (TREE, NGRAM, DRAFT_MODEL)
# Salt that puts drafting and verification uniforms in a stream apart from the sampling draws.
_DRAFT_STREAM = 0x5DEECE66D


def _first_prior(source: str) -> Acceptance:
    """The acceptance estimate a source starts from: a tree continuation is what the model
    wrote after this very sequence before, so greedy requests take it all (9 in 10); the
    others, 3 in 5."""
    return Acceptance(decay=0.99, prior_hits=4.5) if source == TREE else Acceptance(decay=0.99)


@dataclass
class Backoff:
    """How far one proposer drafts for one request, from what the model accepted before."""

    limit: int  # longest draft to propose next
    ceiling: int  # the longest ever
    misses: int = 0  # drafts in a row the model rejected outright
    cooldown: int = 0  # steps to wait before proposing again after a miss

    def ready(self) -> bool:
        """Whether to propose this step (a paused proposer counts the step down)."""
        if self.cooldown:
            self.cooldown -= 1
            return False
        return True

    def adapt(self, proposed: int, accepted: int) -> None:
        if accepted == proposed:
            self.limit = min(2 * self.limit, self.ceiling)
        else:
            self.limit = min(accepted + 1, self.ceiling)
        self.misses = self.misses + 1 if accepted == 0 else 0
        if self.misses:
            self.cooldown = min(2**self.misses, MAX_DRAFT_COOLDOWN)


@dataclass
class DraftState:
    """One request's drafting: the tokens the next step verifies, who proposed them, and how
    far each proposer drafts."""

    tokens: list[int] = field(default_factory=list)  # to verify next
    # [len(tokens), V] the distributions a sampled draft model drew them from; None: certain.
    probs: torch.Tensor | None = None
    source: str = ""  # JUMP or one of SPECULATIVE_SOURCES
    draws: int = 0  # uniforms used drafting and verifying (a stream apart from sampling)
    jump: Backoff = field(default_factory=lambda: Backoff(INITIAL_DRAFT_LIMIT, MAX_DRAFT_TOKENS))
    # Per speculative source, what this request accepted (started from the server's rate).
    spec: dict[str, Acceptance] = field(default_factory=dict)
    # Speculation's totals for this request: tokens proposed, and accepted by the target.
    proposed: int = 0
    accepted: int = 0

    def set(self, tokens: list[int], source: str, probs: torch.Tensor | None = None) -> None:
        self.tokens, self.source, self.probs = tokens, source, probs

    def clear(self) -> None:
        self.tokens, self.source, self.probs = [], "", None

    def uniform(self, seed: int) -> float:
        """The next U[0, 1) of the request's drafting and verifying stream (``seed``: the
        request's), apart from its sampling draws."""
        self.draws += 1
        return kernels.row_uniform(seed ^ _DRAFT_STREAM, self.draws)


@dataclass(frozen=True)
class SpeculationConfig:
    """The server's speculative decoding (ServerArgs.speculative_*)."""

    algorithm: str  # NGRAM or DRAFT_MODEL
    num_draft_tokens: int = 4
    adaptive: bool = True  # False: draft num_draft_tokens every step (policy "always")
    ngram_min_match: int = DEFAULT_MIN_MATCH
    ngram_max_match: int = DEFAULT_MAX_MATCH


class DraftManager:
    """Proposes, masks and verifies the drafts of a scheduler's requests.

    tree: the radix cache the ngram proposer reads (None: disabled). jump_forward: draft what
    grammars force. speculation: also speculate (None: off); draft_worker: the draft model
    for ``speculation.algorithm == "draft"``."""

    def __init__(
        self,
        verifier: DraftVerifier,
        tree: RadixCache | None,
        jump_forward: bool = True,
        speculation: SpeculationConfig | None = None,
        draft_worker: DraftModelWorker | None = None,
        device_type: str = "cpu",
    ) -> None:
        self.verifier = verifier
        self.jump_forward = jump_forward
        self.speculation = speculation
        self.draft_worker = draft_worker
        # What a draft token costs here: the scheduler feeds it each forward's time.
        self.cost = VerifyCost(PRIOR_COST.get(device_type, PRIOR_COST["cuda"]))
        # Acceptance over every request, per source: whether drafting pays here at all, and
        # where a new request's estimate starts (see policy.py).
        self.overall = {source: _first_prior(source) for source in SPECULATIVE_SOURCES}
        self.proposer: Proposer | None = None
        if speculation is not None and speculation.algorithm == DRAFT_MODEL:
            assert draft_worker is not None, "draft-model speculation needs its worker"
            self.proposer = DraftModelProposer(draft_worker, verifier, self.cost)
        elif speculation is not None:
            min_match, max_match = speculation.ngram_min_match, speculation.ngram_max_match
            self.proposer = NgramProposer(tree, min_match, max_match)

    # ---- proposing ---------------------------------------------------------------------

    def speculates(self, params: SamplingParams) -> bool:
        """Whether speculation is on for a request (the server's and the request's choice)."""
        return self.speculation is not None and not params.no_speculation

    def propose(self, reqs: Sequence[Req]) -> None:
        """Give each request that will decode next step the draft to verify then: what its
        grammar forces, else a speculation. A failure fails its request alone."""
        if not self.jump_forward and self.speculation is None:
            return
        wanted: list[tuple[Req, int]] = []
        for req in reqs:
            try:
                ceiling = self._jump_or_ceiling(req)
            except Exception as exc:
                req.draft.clear()
                req.fail_from(exc, "drafting the continuation of")
                continue
            if ceiling:
                wanted.append((req, ceiling))
        if not wanted:
            return
        assert self.proposer is not None and self.speculation is not None
        cost = self.cost.relative(len(reqs))
        most = self.speculation.num_draft_tokens
        probe = {s: self.overall[s].worth(cost, most) > 0 for s in SPECULATIVE_SOURCES}

        def length(req: Req, source: str, ceiling: int) -> int:
            assert self.speculation is not None
            if not self.speculation.adaptive:
                return ceiling
            estimate = req.draft.spec.get(source)
            if estimate is None:  # a new request: what the server's requests accept so far
                estimate = req.draft.spec[source] = Acceptance()
                estimate.start_from(self.overall[source])
            return estimate.length(cost, ceiling, probe[source])

        for (req, _), proposal in zip(wanted, self.proposer.propose(wanted, length), strict=True):
            if proposal.tokens:
                req.draft.set(*proposal)

    def _jump_or_ceiling(self, req: Req) -> int:
        """Draft what ``req``'s grammar forces, if anything; else how many tokens it may
        speculate (0: none)."""
        if req.finished or req.pending_len != 1 or req.draft.tokens:
            return 0
        budget = req.remaining_new_tokens - 1
        matcher = req.constraint.matcher
        if budget <= 0 or (matcher is not None and matcher.is_terminated()):
            return 0
        state = req.draft
        if self.jump_forward and matcher is not None and state.jump.ready():
            forced = matcher.jump_forward_tokens(min(budget, state.jump.limit))
            if forced:
                state.set(forced, JUMP)
                return 0
        gate = req.constraint.gate
        if not req.speculates or (gate is not None and gate.opening):
            return 0
        assert self.speculation is not None
        return min(budget, self.speculation.num_draft_tokens)

    # ---- verifying ---------------------------------------------------------------------

    def verify(
        self, req: Req, rows: torch.Tensor, mask: torch.Tensor | Exception | None
    ) -> Verified | None:
        """What ``req`` keeps of its draft (rows: its positions' logits; mask: what
        ``verifier.mask`` gave for it), learning from it how far to draft; the caller drops
        the KV of the rest and emits the tokens. None: the request failed."""
        started = time.perf_counter()
        if isinstance(mask, Exception):
            raise mask
        verified = self.verifier.verify(req, rows, mask)
        if verified is None:
            return None
        state = req.draft
        proposed, accepted = len(state.tokens), len(verified.tokens) - 1
        if state.source == JUMP:
            state.jump.adapt(proposed=proposed, accepted=accepted)
        else:
            estimate = state.spec.setdefault(state.source, Acceptance())
            estimate.record(proposed=proposed, accepted=accepted)
            self.overall[state.source].record(proposed=proposed, accepted=accepted)
            self.cost.observe_verify(time.perf_counter() - started)
            state.proposed += proposed
            state.accepted += accepted
        state.clear()
        return verified

    def info(self) -> dict[str, Any]:
        """What ``get_server_info`` reports of speculation beyond the counters: the measured
        costs (relative to a request's share of a decode step at batch 16, as the policy
        sees them) and the draft model's own counters."""
        if self.speculation is None:
            return {}
        per_token, per_draft = self.cost.relative(16)
        info: dict[str, Any] = {
            "spec_cost_per_token_b16": per_token,
            "spec_cost_per_draft_b16": per_draft,
            **{f"spec_accept_rate_{s}": self.overall[s].rate for s in SPECULATIVE_SOURCES},
        }
        if self.draft_worker is not None:
            info["draft_model"] = dict(self.draft_worker.stats)
        return info

    def check_invariants(self) -> None:
        if self.draft_worker is not None:
            self.draft_worker.check_invariants()

    def flush(self) -> bool:
        return self.draft_worker.flush() if self.draft_worker is not None else True

    def release(self, req: Req, keep_in_cache: bool) -> None:
        """``req`` gives its KV back (finished, aborted or retracted): so does its draft
        model state, kept in the draft's cache when the target keeps its own."""
        if self.draft_worker is not None:
            self.draft_worker.release(req.rid, keep_in_cache)
