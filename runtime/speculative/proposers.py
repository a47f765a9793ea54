"""What speculative decoding drafts from: the proposers, one per ``--speculative-algorithm``.

A proposer guesses how requests about to decode go on; the target verifies the guess in the
forward that also runs each request's next token (verify.py). ``ngram``: the radix tree's
continuation of the sequence, else prompt lookup in its own tokens (ngram.py). ``draft``: a
small draft model (draft_worker.py) drawing each token through the request's own pipeline, so
the distribution q it drew from is known to the speculative rule.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from grammar import allocate_bitmask, sample_inverse_cdf
from radix_cache import RadixCache
from runtime.speculative.draft_worker import DraftJob, DraftModelWorker
from runtime.speculative.ngram import propose_ngram
from runtime.speculative.policy import VerifyCost
from runtime.speculative.verify import DraftVerifier

if TYPE_CHECKING:
    from runtime.scheduler.req import Req

logger = logging.getLogger(__name__)

NGRAM, DRAFT_MODEL = "ngram", "draft"
TREE = "tree"  # an ngram draft from the radix tree's continuation of the sequence

# length(req, source, ceiling): how many tokens to draft for ``req`` from ``source`` now, at
# most ``ceiling`` (0: none); the acceptance policy decides (policy.py).
LengthFn = Callable[["Req", str, int], int]


class Proposal(NamedTuple):
    tokens: list[int]
    source: str  # one of the sources above
    probs: torch.Tensor | None = None  # [len(tokens), V] the draws' distributions; None: certain


class Proposer(ABC):
    sources: tuple[str, ...]

    @abstractmethod
    def propose(self, wanted: Sequence[tuple[Req, int]], length: LengthFn) -> list[Proposal]:
        """A proposal for each (request, most tokens it may draft) (empty tokens: none). The
        requests decode next; each one's matcher stands where it stood when this returns, and
        every proposed token is one its grammar admits. A failure for one request fails it
        alone (a failing draft model only costs this step's drafts)."""


class NgramProposer(Proposer):
    """What an earlier request went on with after this very sequence (the radix tree's
    continuation: exactly what the model wrote then, e.g. a prompt asked again or a retried
    request), else what followed the latest earlier occurrence of the sequence's tail in its
    own tokens. Each has its own acceptance estimate. The tree is read in the request's salt
    only: another tenant's continuation would both leak it (accepted drafts come back sooner)
    and be a cross-tenant cache hit."""

    sources = (TREE, NGRAM)

    def __init__(self, tree: RadixCache | None, min_match: int, max_match: int) -> None:
        self.tree, self.min_match, self.max_match = tree, min_match, max_match

    def propose(self, wanted: Sequence[tuple[Req, int]], length: LengthFn) -> list[Proposal]:
        proposals = []
        for req, ceiling in wanted:
            try:
                proposals.append(self._propose_one(req, ceiling, length))
            except Exception as exc:
                req.fail_from(exc, "drafting the continuation of")
                proposals.append(Proposal([], NGRAM))
        return proposals

    def _propose_one(self, req: Req, ceiling: int, length: LengthFn) -> Proposal:
        tokens = req.token_ids.array()
        tree = self.tree
        cached = tree.continuation(tokens, ceiling, req.cache_salt) if tree is not None else None
        if cached is not None and cached.size:
            n = length(req, TREE, int(cached.size))
            return Proposal(admissible(req, cached[:n].tolist()), TREE)
        n = length(req, NGRAM, ceiling)
        found = propose_ngram(tokens, n, self.min_match, self.max_match) if n else []
        return Proposal(admissible(req, found), NGRAM)


def admissible(req: Req, tokens: list[int]) -> list[int]:
    """The part of a guessed draft its request could emit: up to the first token its grammar
    refuses, and before the end of its reasoning (the grammar starts after it, and a verify
    row past it would need the grammar's mask), and before the token that ends the grammar
    (no mask follows it)."""
    gate = req.constraint.gate
    if gate is not None and gate.end_token in tokens:
        tokens = tokens[: tokens.index(gate.end_token)]
    matcher = req.constraint.matcher
    if matcher is None or not tokens:
        return tokens
    accepted = 0
    for token in tokens:
        if not matcher.accept_token(token):
            break
        accepted += 1
        if matcher.is_terminated():  # no verify row may follow the grammar's end
            matcher.rollback(accepted)
            return tokens[: accepted - 1]
    matcher.rollback(accepted)
    return tokens[:accepted]


class DraftModelProposer(Proposer):
    """Drafts with a small model, batched over the requests; its time per request drafted for
    feeds ``cost``."""

    sources = (DRAFT_MODEL,)

    def __init__(self, worker: DraftModelWorker, verifier: DraftVerifier, cost: VerifyCost):
        self.worker, self.verifier, self.cost = worker, verifier, cost

    def propose(self, wanted: Sequence[tuple[Req, int]], length: LengthFn) -> list[Proposal]:
        asked = [(req, length(req, DRAFT_MODEL, ceiling)) for req, ceiling in wanted]
        drafted: list[list[int]] = [[] for _ in asked]
        probs: list[list[torch.Tensor]] = [[] for _ in asked]
        batch = [i for i, (_, n) in enumerate(asked) if n]  # job j drafts for asked[batch[j]]

        def choose(logits: torch.Tensor, active: list[int], step: int) -> list[int]:
            chosen = []
            for j, job in enumerate(active):
                req, index = asked[batch[job]][0], batch[job]
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

        if not batch:
            return [Proposal([], DRAFT_MODEL) for _ in asked]
        jobs = [DraftJob(req.rid, req.token_ids.array(), n, req.cache_salt) for req, n in asked]
        started = time.perf_counter()
        failed = False
        try:
            self.worker.propose([jobs[i] for i in batch], choose)
        except Exception:
            logger.exception("the draft model failed; no model drafts this step")
            failed = True
        for (req, _), tokens in zip(asked, drafted, strict=True):
            if req.constraint.matcher is not None and tokens:  # _choose advanced it past each
                req.constraint.matcher.rollback(len(tokens))
        self.cost.observe_draft(time.perf_counter() - started, len(batch))
        return [
            Proposal([] if failed else tokens, DRAFT_MODEL, torch.stack(q) if q else None)
            for tokens, q in zip(drafted, probs, strict=True)
        ]

    def _choose(
        self, req: Req, row: torch.Tensor, drafted: list[int]
    ) -> tuple[int, torch.Tensor | None]:
        """The next draft token of ``req`` from the draft model's logits ``row`` [1, V'] after
        ``drafted``, and the distribution it was drawn from (None for greedy requests):
        processed like the target's rows (``DraftVerifier.process``), under the grammar
        (which then stands past the token). -1: stop drafting."""
        vocab_size = self.verifier.sampler.vocab_size
        row = _to_vocab(row.float(), vocab_size)
        matcher = req.constraint.matcher
        mask = None
        if matcher is not None:
            mask = allocate_bitmask(1, vocab_size)
            matcher.fill_mask(mask, 0)
        logits = self.verifier.process(row, req, drafted, len(drafted), mask)
        if not bool(torch.isfinite(logits).any()):
            return -1, None
        q = None
        if req.sampling.is_greedy:
            token = int(logits[0].argmax())
        else:
            q = self.verifier.probs(logits, req)[0]
            if not bool(torch.isfinite(q).all()):
                return -1, None
            token = sample_inverse_cdf(q.double(), req.draft.uniform(req.seed))
        gate = req.constraint.gate
        if gate is not None and token == gate.end_token:
            return -1, None
        if matcher is not None:
            if not matcher.accept_token(token):
                return -1, None
            if matcher.is_terminated():  # no verify row may follow the grammar's end
                matcher.rollback(1)
                return -1, None
        return token, q


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
