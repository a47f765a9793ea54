"""Drafts: tokens proposed after a step and verified by the next one, in the same forward as
the request's next token.

Three proposers share one verify path (``verify``):

- jump-forward: what a constrained request's grammar forces next (certain tokens);
- ``--speculative-algorithm ngram``: what followed the same sequence in the radix tree (an
  earlier request's output), else prompt lookup in the request's own tokens
  (runtime/speculative/ngram.py); filtered through the request's grammar;
- ``--speculative-algorithm draft``: a small draft model (runtime/speculative/draft_worker.py)
  drawing each token through the request's own sampling pipeline, so its distribution q is
  known and the speculative rule keeps outputs distributed as the target's.

A draft costs one logits row (and KV slot) per position, so its length follows what the model
agrees with. Jump-forward drafts (``Backoff``): the limit doubles after a full acceptance,
drops to one past the agreed part otherwise, and outright rejections in a row pause drafting
exponentially. Speculation (runtime/speculative/policy.py): each request drafts as many tokens
as its acceptance rate makes worth their measured cost on this device, probing now and then
when none is. The two adapt apart: a model that splits forced text otherwise than the
grammar does is no reason to stop looking up its prompt.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from grammar import DraftVerdict, allocate_bitmask, commit_draft, fill_draft_masks
from runtime.speculative.ngram import DEFAULT_MAX_MATCH, DEFAULT_MIN_MATCH, propose_ngram
from runtime.speculative.policy import PRIOR_COST, Acceptance, VerifyCost

if TYPE_CHECKING:
    from runtime.sampler import Sampler
    from runtime.sampling_params import SamplingParams
    from runtime.scheduler.kv_manager import KVCacheManager
    from runtime.scheduler.output_processor import OutputProcessor
    from runtime.scheduler.req import Req
    from runtime.speculative.draft_worker import DraftModelWorker

logger = logging.getLogger(__name__)

# A first jump-forward draft is this long at most; the longest verified in one step; the
# longest pause.
INITIAL_DRAFT_LIMIT = 4
MAX_DRAFT_TOKENS = 16
MAX_DRAFT_COOLDOWN = 64

JUMP, NGRAM, DRAFT_MODEL = "jump", "ngram", "draft"
TREE = "tree"  # an ngram draft from the radix tree's continuation of the sequence
SPECULATIVE_SOURCES = (TREE, NGRAM, DRAFT_MODEL)


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


@dataclass(frozen=True)
class SpeculationConfig:
    """The server's speculative decoding (ServerArgs.speculative_*)."""

    algorithm: str  # NGRAM or DRAFT_MODEL
    num_draft_tokens: int = 4
    adaptive: bool = True  # False: draft num_draft_tokens every step (policy "always")
    ngram_min_match: int = DEFAULT_MIN_MATCH
    ngram_max_match: int = DEFAULT_MAX_MATCH


# count(source, proposed, accepted, emitted): one verification's numbers, for the stats.
CountFn = Callable[[str, int, int, int], None]


class DraftManager:
    """Proposes, masks and verifies the drafts of a scheduler's requests.

    jump_forward: draft what grammars force. speculation: also speculate (None: off);
    draft_worker: the draft model for ``speculation.algorithm == "draft"``."""

    def __init__(
        self,
        sampler: Sampler,
        kv: KVCacheManager,
        outputs: OutputProcessor,
        vocab_size: int,
        count: CountFn,
        jump_forward: bool = True,
        speculation: SpeculationConfig | None = None,
        draft_worker: DraftModelWorker | None = None,
        device_type: str = "cpu",
    ) -> None:
        self.sampler = sampler
        self.kv = kv
        self.outputs = outputs
        self.vocab_size = vocab_size
        self.count = count
        self.jump_forward = jump_forward
        self.speculation = speculation
        self.draft_worker = draft_worker
        # What a draft token costs here: the scheduler feeds it each forward's time.
        self.cost = VerifyCost(PRIOR_COST.get(device_type, PRIOR_COST["cuda"]))
        # Acceptance over every request, per source: whether drafting pays here at all, and
        # where a new request's estimate starts (see policy.py).
        self.overall = {source: _first_prior(source) for source in SPECULATIVE_SOURCES}
        if speculation is not None and speculation.algorithm == DRAFT_MODEL:
            assert draft_worker is not None, "draft-model speculation needs its worker"

    # ---- proposing ---------------------------------------------------------------------

    def speculates(self, params: SamplingParams) -> bool:
        """Whether speculation is on for a request (the server's and the request's choice)."""
        return self.speculation is not None and not params.no_speculation

    def propose(self, reqs: Sequence[Req]) -> None:
        """Give each request that will decode next step the draft to verify then: what its
        grammar forces, else a speculation. A failure fails its request alone; a failing
        draft model only costs this step's model drafts."""
        if not self.jump_forward and self.speculation is None:
            return
        for_model: list[tuple[Req, int]] = []
        cost, probe = (0.0, 0.0), dict.fromkeys(SPECULATIVE_SOURCES, False)
        if self.speculation is not None:
            cost = self.cost.relative(len(reqs))
            ceiling = self.speculation.num_draft_tokens
            probe = {s: self.overall[s].worth(cost, ceiling) > 0 for s in SPECULATIVE_SOURCES}
        for req in reqs:
            try:
                wanted = self._propose_one(req, cost, probe)
            except Exception as exc:
                req.draft.clear()
                req.fail_from(exc, "drafting the continuation of")
                continue
            if wanted:
                for_model.append((req, wanted))
        if for_model:
            self._propose_with_model(for_model)

    def _propose_one(self, req: Req, cost: tuple[float, float], probe: dict[str, bool]) -> int:
        """Draft for ``req`` from its grammar or its own tokens; returns how many tokens to
        ask the draft model for instead (0: none). cost: a draft token's and a draft's,
        relative to a request's share of a step (``VerifyCost.relative``); probe: per source,
        whether a request whose drafts do not pay may still try one token now and then."""
        if req.finished or req.pending_len != 1 or req.draft.tokens:
            return 0
        budget = req.remaining_new_tokens - 1
        grammar = req.constraint.matcher
        if budget <= 0 or (grammar is not None and grammar.is_terminated()):
            return 0
        state = req.draft
        if self.jump_forward and grammar is not None and state.jump.ready():
            forced = grammar.jump_forward_tokens(min(budget, state.jump.limit))
            if forced:
                state.set(forced, JUMP)
                return 0
        gate = req.constraint.gate
        if not req.speculates or (gate is not None and gate.opening):
            return 0
        assert self.speculation is not None
        ceiling = min(budget, self.speculation.num_draft_tokens)
        if self.speculation.algorithm == DRAFT_MODEL:
            return self._length(req, DRAFT_MODEL, cost, ceiling, probe)
        # ngram: what an earlier request went on with after this very sequence (the radix
        # tree's continuation: exactly what the model wrote then, e.g. a prompt asked again
        # or a retried request), else what followed the latest earlier occurrence of the
        # sequence's tail in its own tokens. Each has its own acceptance estimate. The tree is
        # read in the request's salt only: another tenant's continuation would both leak it
        # (accepted drafts come back sooner) and be a cross-tenant cache hit.
        tokens = req.token_ids.array()
        tree = self.kv.tree
        cached = tree.continuation(tokens, ceiling, req.cache_salt) if tree is not None else None
        if cached is not None and cached.size:
            wanted = self._length(req, TREE, cost, int(cached.size), probe)
            found = self._admissible(req, cached[:wanted].tolist())
            if found:
                state.set(found, TREE)
            return 0
        wanted = self._length(req, NGRAM, cost, ceiling, probe)
        if wanted:
            min_match, max_match = (
                self.speculation.ngram_min_match,
                self.speculation.ngram_max_match,
            )
            found = self._admissible(req, propose_ngram(tokens, wanted, min_match, max_match))
            if found:
                state.set(found, NGRAM)
        return 0

    def _length(
        self,
        req: Req,
        source: str,
        cost: tuple[float, float],
        ceiling: int,
        probe: dict[str, bool],
    ) -> int:
        """How many tokens ``req`` drafts from ``source`` now (policy.py; always the ceiling
        under the "always" policy)."""
        assert self.speculation is not None
        if not self.speculation.adaptive:
            return ceiling
        estimate = req.draft.spec.get(source)
        if estimate is None:  # a new request: what the server's requests accept so far
            estimate = req.draft.spec[source] = Acceptance()
            estimate.start_from(self.overall[source])
        return estimate.length(cost, ceiling, probe[source])

    @staticmethod
    def _admissible(req: Req, tokens: list[int]) -> list[int]:
        """The part of a guessed draft its request could emit: up to the first token its
        grammar refuses, and before the end of its reasoning (the grammar starts after it, and
        a verify row past it would need the grammar's mask), and before the token that ends
        the grammar (no mask follows it)."""
        gate = req.constraint.gate
        if gate is not None and gate.end_token in tokens:
            tokens = tokens[: tokens.index(gate.end_token)]
        grammar = req.constraint.matcher
        if grammar is None or not tokens:
            return tokens
        accepted = 0
        for token in tokens:
            if not grammar.accept_token(token):
                break
            accepted += 1
            if grammar.is_terminated():  # no verify row may follow the grammar's end
                grammar.rollback(accepted)
                return tokens[: accepted - 1]
        grammar.rollback(accepted)
        return tokens[:accepted]

    def _propose_with_model(self, wanted: list[tuple[Req, int]]) -> None:
        """Ask the draft model for each request's tokens, batched, drawing each through the
        request's own pipeline (``_choose``)."""
        from runtime.speculative.draft_worker import DraftJob

        assert self.draft_worker is not None
        drafted: list[list[int]] = [[] for _ in wanted]
        probs: list[list[torch.Tensor]] = [[] for _ in wanted]

        def choose(logits: torch.Tensor, active: list[int], step: int) -> list[int]:
            chosen = []
            for j, index in enumerate(active):
                req = wanted[index][0]
                try:
                    token, q = self._choose(req, logits[j : j + 1], drafted[index])
                except Exception:
                    logger.exception("drafting a token for request %s failed", req.rid)
                    token, q = -1, None
                if token >= 0:
                    drafted[index].append(token)
                    if q is not None:
                        probs[index].append(q)
                chosen.append(token)
            return chosen

        jobs = [DraftJob(req.rid, req.token_ids.array(), n, req.cache_salt) for req, n in wanted]
        started = time.perf_counter()
        failed = False
        try:
            self.draft_worker.propose(jobs, choose)
        except Exception:
            logger.exception("the draft model failed; no model drafts this step")
            failed = True
        for (req, _), tokens in zip(wanted, drafted, strict=True):
            if req.constraint.matcher is not None and tokens:  # choose advanced it past each token
                req.constraint.matcher.rollback(len(tokens))
        if failed:
            drafted = [[] for _ in wanted]
        self.cost.observe_draft(time.perf_counter() - started, len(wanted))
        for (req, _), tokens, q in zip(wanted, drafted, probs, strict=True):
            if tokens:
                req.draft.set(tokens, DRAFT_MODEL, torch.stack(q) if q else None)

    def _choose(
        self, req: Req, row: torch.Tensor, drafted: list[int]
    ) -> tuple[int, torch.Tensor | None]:
        """The next draft token of ``req`` from the draft model's logits ``row`` [1, V'] after
        ``drafted``, and the distribution it was drawn from (None for greedy requests):
        processed like the target's rows (``Sampler.process_draft_rows``), under the grammar
        (which then stands past the token). -1: stop drafting."""
        row = _to_vocab(row.float(), self.vocab_size)
        mask = None
        if req.constraint.matcher is not None:
            mask = allocate_bitmask(1, self.vocab_size)
            req.constraint.matcher.fill_mask(mask, 0)
        logits = self.sampler.process_draft_rows(row, req, drafted, len(drafted), mask)
        if not bool(torch.isfinite(logits).any()):
            return -1, None
        q = None
        if req.sampling.is_greedy:
            token = int(logits[0].argmax())
        else:
            q = self.sampler.draft_probs(logits, req)[0]
            if not bool(torch.isfinite(q).all()):
                return -1, None
            token = self.sampler.draw_draft_token(q, req)
        gate = req.constraint.gate
        if gate is not None and token == gate.end_token:
            return -1, None
        grammar = req.constraint.matcher
        if grammar is not None:
            if not grammar.accept_token(token):
                return -1, None
            if grammar.is_terminated():  # no verify row may follow the grammar's end
                grammar.rollback(1)
                return -1, None
        return token, q

    # ---- verifying ---------------------------------------------------------------------

    def mask(self, req: Req) -> torch.Tensor | Exception | None:
        """The grammar's masks at each position of the draft (the matcher then stands past
        it, as ``verify`` expects), what filling them raised, or None (unconstrained)."""
        if req.constraint.matcher is None:
            return None
        mask = allocate_bitmask(len(req.draft.tokens) + 1, self.vocab_size)
        try:
            fill_draft_masks(req.constraint.matcher, req.draft.tokens, mask, 0)
        except Exception as exc:
            return exc
        return mask

    def verify(
        self, req: Req, rows: torch.Tensor, filled: torch.Tensor | Exception | None | bool = False
    ) -> None:
        """Accept what the model agrees with of the draft (rows: its positions' logits), drop
        the KV of the rest, and emit the accepted tokens plus one. filled: what ``mask``
        returned for this draft (False: call it here)."""
        started = time.perf_counter()
        draft = req.draft.tokens
        mask = self.mask(req) if filled is False else filled
        if isinstance(mask, Exception):
            raise mask
        assert not isinstance(mask, bool)
        constrained = req.constraint.matcher is not None
        tokens, logprobs = self.sampler.verify_draft(rows, req, mask)
        if constrained:
            assert req.constraint.matcher is not None
            if not commit_draft(
                req.constraint.matcher, draft, DraftVerdict(len(tokens) - 1, tokens[-1])
            ):
                # The mask allowed a token the matcher refuses (see Sampler._advance_grammars):
                # draw that position again through the full pipeline, which re-checks it.
                position = len(tokens) - 1
                again = self.sampler.sample(rows[position : position + 1], [req], ahead=position)
                if again.failures:
                    req.fail(*again.failures[0])
                    return
                tokens[-1] = again.token_ids[0]
                logprobs[-1] = again.logprobs[0]
        self.kv.truncate(req, req.kv.kv_len - (len(draft) + 1 - len(tokens)))
        state = req.draft
        accepted = len(tokens) - 1
        if state.source == JUMP:
            state.jump.adapt(proposed=len(draft), accepted=accepted)
        else:
            estimate = state.spec.setdefault(state.source, Acceptance())
            estimate.record(proposed=len(draft), accepted=accepted)
            self.overall[state.source].record(proposed=len(draft), accepted=accepted)
            self.cost.observe_verify(time.perf_counter() - started)
            state.proposed += len(draft)
            state.accepted += accepted
        self.count(state.source, len(draft), accepted, len(tokens))
        state.clear()
        self.outputs.emit_tokens(req, tokens, logprobs, grammar_advanced=constrained)

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


def _to_vocab(row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A draft model's logits [1, V'] over the target's vocabulary [1, V]: a padded draft
    vocabulary is cut, a shorter one extended with -inf (tokens it cannot propose)."""
    width = row.shape[-1]
    if width == vocab_size:
        return row.clone()
    if width > vocab_size:
        return row[:, :vocab_size].clone()
    pad = torch.full((1, vocab_size - width), float("-inf"), device=row.device)
    return torch.cat([row, pad], dim=1)
