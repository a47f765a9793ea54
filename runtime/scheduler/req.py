"""The scheduler's view of one request: its tokens, KV placement, sampling state and outputs."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from grammar import GrammarMatcher, StopRegex
from radix_cache import TreeNode
from runtime.ipc import FinishReason, GenerateRequest, ProgramStep
from runtime.sampling_params import SamplingParams
from runtime.scheduler.draft_manager import DraftState
from runtime.scheduler.token_array import TokenArray

if TYPE_CHECKING:
    import torch

    from runtime.incremental_decoder import IncrementalDecoder
    from runtime.scheduler.grammar_manager import PendingConstraint
    from runtime.scheduler.reasoning_gate import ReasoningGate

logger = logging.getLogger(__name__)


class Req:
    """A request from arrival to finish.

    ``token_ids``: the prompt, then the outputs, one growing array (``input_ids`` is the
    prompt as it came, ``output_ids`` the outputs as a list for the detokenizer).

    KV state while admitted: positions [0, kv_len) of ``token_ids`` have KV at the slots in row
    ``row`` of the request-to-slot table; [0, cached_len) are owned by the radix tree and pinned
    by a lock on ``last_node``; [cached_len, kv_len) are the request's private slots (with
    page_size > 1 its pages, including the unused tail of the last one).
    """

    def __init__(self, msg: GenerateRequest, seed: int) -> None:
        self.rid = msg.rid
        self.input_ids = msg.input_ids
        self.sampling: SamplingParams = msg.sampling_params
        self.return_logprob = msg.return_logprob
        self.logprob_start_len = msg.logprob_start_len
        self.top_logprobs_num = msg.top_logprobs_num
        self.stream = msg.stream
        # A step of a compiled DSL program: where its KV continues from and is pinned to.
        self.program: ProgramStep | None = msg.program
        # Its radix-tree namespace: KV is shared only between requests of the same salt.
        self.cache_salt = msg.cache_salt
        self.seed = seed
        self.token_ids = TokenArray(msg.input_ids)
        self.output_ids: list[int] = []
        # KV placement
        self.row: int | None = None
        self.kv_len = 0
        self.cached_len = 0
        self.last_node: TreeNode | None = None
        self.cached_tokens = 0  # prompt tokens served from the cache, for the client
        # A loan in this step (KVCacheManager.lend): the cached length this request had before
        # it borrowed a step-mate's slots (None: no loan), and whether it lent its own.
        self.loan_start: int | None = None
        self.lends = False
        # State
        # A grammar matcher once compiled (and the reasoning is over); the gate holding it while
        # the model thinks; the preparation while it waits in the grammar queue.
        self.grammar: GrammarMatcher | None = None
        self.reasoning_gate: ReasoningGate | None = None
        self.grammar_pending: PendingConstraint | None = None
        self.draft = DraftState()  # the draft to verify next, and how far to draft
        self.emit_steps = 0  # forward steps that gave this request tokens
        self.speculates = False  # set by the scheduler: speculative decoding is on for it
        self.finished_reason: FinishReason | None = None
        self.arrival = time.monotonic()
        self.retractions = 0
        # Logprobs and output bookkeeping
        self.input_logprobs: list[tuple[float | None, int, list[tuple[float, int]]]] = []
        self.output_logprobs: list[tuple[float, int, list[tuple[float, int]]]] = []
        self.sent_tokens = 0
        self.sent_output_logprobs = 0
        self.input_logprobs_done = False
        # Penalties: per-token counts and seen flags over the vocabulary, [vocab] each.
        self.token_counts: tuple[torch.Tensor, torch.Tensor] | None = None
        self.stop_matcher: StopRegex | None = None  # prepared with the grammar
        self.stop_decoder: IncrementalDecoder | None = None  # its text, once checked

    @property
    def masks_next_token(self) -> bool:
        """Whether a grammar mask applies to the next token (see GrammarManager.apply_masks)."""
        gate = self.reasoning_gate
        return self.grammar is not None or (gate is not None and gate.opening)

    @property
    def pending_len(self) -> int:
        """Tokens of ``token_ids`` that still need KV before the next token can be sampled."""
        return len(self.token_ids) - self.kv_len

    @property
    def step_len(self) -> int:
        """Tokens a decode step runs: the last sampled token plus the draft to verify."""
        return 1 + len(self.draft.tokens)

    def step_tokens(self, n: int) -> list[int]:
        """The ids of the n positions ending at kv_len (a draft follows ``token_ids``); copies
        only those n, however long the sequence."""
        start, end, known = self.kv_len - n, self.kv_len, len(self.token_ids)
        if end <= known:
            return self.token_ids.tolist(start, end)
        draft = self.draft.tokens[max(start - known, 0) : end - known]
        return self.token_ids.tolist(start, known) + draft if start < known else draft

    @property
    def remaining_new_tokens(self) -> int:
        return self.sampling.max_new_tokens - len(self.output_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.return_logprob and 0 <= self.logprob_start_len < len(self.input_ids)

    @property
    def match_limit(self) -> int:
        """How much of ``token_ids`` a cache match may cover: at least one token must run to
        give logits, and prompt logprobs from ``logprob_start_len`` need the logits before it."""
        limit = len(self.token_ids) - 1
        if self.wants_prompt_logprobs and not self.input_logprobs_done:
            limit = min(limit, max(self.logprob_start_len - 1, 0))
        return limit

    def append_output(self, token: int) -> None:
        self.output_ids.append(token)
        self.token_ids.append(token)
        if self.token_counts is not None:  # penalty state, once the sampler has built it
            counts, seen = self.token_counts
            counts[token] += 1
            seen[token] = True

    def finish(self, reason: FinishReason) -> None:
        if self.finished_reason is None:
            self.finished_reason = reason

    def fail(self, status_code: int, message: str, param: str | None = None) -> None:
        """Finish with an error its caller gets as HTTP ``status_code`` (RequestError), about
        sampling parameter ``param`` if given."""
        self.finish(FinishReason.error(status_code, message, param))

    def fail_from(self, exc: BaseException, stage: str) -> None:
        """Finish because ``exc`` was raised while ``stage`` (e.g. "sampling") for this request
        alone: a ValueError is the request's fault (400, its message); anything else is ours
        (500, logged with its traceback, never shown to the client)."""
        if isinstance(exc, ValueError):
            self.fail(400, str(exc))
            return
        logger.error("request %s failed while %s", self.rid, stage, exc_info=exc)
        self.fail(500, f"internal error while {stage} this request; the server log has details")

    @property
    def aborted(self) -> bool:
        """Whether the caller aborted it (its KV is then not kept either)."""
        reason = self.finished_reason
        return reason is not None and reason.type == "abort" and not reason.failed

    @property
    def failed(self) -> bool:
        """Whether it finished with an error (its KV is then not worth caching)."""
        reason = self.finished_reason
        return reason is not None and reason.failed

    def reset_for_retract(self) -> None:
        """Back to the queue: outputs so far are kept; KV placement starts over."""
        self.row, self.kv_len, self.cached_len, self.last_node = None, 0, 0, None
        self.draft.clear()
        self.retractions += 1

    def __repr__(self) -> str:
        ins, outs = len(self.input_ids), len(self.output_ids)
        return f"Req({self.rid}, in={ins}, out={outs}, kv={self.kv_len})"
