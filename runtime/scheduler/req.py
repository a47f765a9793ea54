"""The scheduler's view of one request: its status, its tokens, and the parts its managers own.

Each part is written by one manager only, in the module that defines it; every other module
reads it or calls its methods:

- ``kv`` (``KVPlacement``, runtime/kv_accounting.py): where its KV lives;
- ``constraint`` (``ConstraintState``, grammar_manager.py): its matcher, reasoning gate and
  stop regexes;
- ``out`` (``OutputCursor``, output_processor.py): logprobs recorded and outputs sent;
- ``penalties`` (``PenaltyCounts``, sampler.py): token counts for the penalties;
- ``dry`` (``DryState``, dry_penalty.py, written by the sampler): DRY's match lengths;
- ``draft`` (``DraftState``, runtime/speculative/drafts.py): the draft to verify next.
"""

from __future__ import annotations

import enum
import logging
import time

from runtime.dry_penalty import DryState
from runtime.ipc import FinishReason, GenerateRequest, PhaseTimes, ProgramStep
from runtime.kv_accounting import KVPlacement
from runtime.sampler import PenaltyCounts
from runtime.sampling_params import SamplingParams
from runtime.scheduler.grammar_manager import ConstraintState
from runtime.scheduler.output_processor import OutputCursor
from runtime.scheduler.token_array import TokenArray
from runtime.speculative.drafts import DraftState

logger = logging.getLogger(__name__)


class Status(enum.Enum):
    """Where a request is in its life; the scheduler moves it between its queues."""

    CONSTRAINING = "grammar-pending"  # in the grammar queue, its constraint compiling
    WAITING = "waiting"  # in the waiting queue, never admitted
    RUNNING = "running"  # admitted: it holds KV and runs each step
    RETRACTED = "retracted"  # back in the waiting queue, its outputs so far kept
    FINISHED = "finished"  # ``finished_reason`` says why


class Req:
    """A request from arrival to finish.

    ``token_ids``: the prompt, then the outputs, one growing array (``input_ids`` is the
    prompt as it came, ``output_ids`` the outputs as a list for the detokenizer).
    """

    def __init__(self, msg: GenerateRequest, seed: int, speculates: bool = False) -> None:
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
        # What of its KV stays cached (pinned) after it finishes, and for how long.
        self.pin = msg.pin
        self.seed = seed
        self.speculates = speculates  # speculative decoding is on for it
        self.arrival = time.monotonic()
        # When it was first admitted, got its first output token, finished (PhaseTimes).
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.status = Status.WAITING
        self.finished_reason: FinishReason | None = None
        self.token_ids = TokenArray(msg.input_ids)
        self.output_ids: list[int] = []
        self.kv = KVPlacement()
        self.constraint = ConstraintState()
        self.out = OutputCursor()
        self.penalties = PenaltyCounts()
        self.dry = DryState()
        self.draft = DraftState()

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def pending_len(self) -> int:
        """Tokens of ``token_ids`` that still need KV before the next token can be sampled."""
        return len(self.token_ids) - self.kv.kv_len

    @property
    def step_len(self) -> int:
        """Tokens a decode step runs: the last sampled token plus the draft to verify."""
        return 1 + len(self.draft.tokens)

    def step_tokens(self, n: int) -> list[int]:
        """The ids of the n positions ending at kv_len (a draft follows ``token_ids``); copies
        only those n, however long the sequence."""
        start, end, known = self.kv.kv_len - n, self.kv.kv_len, len(self.token_ids)
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
        if self.wants_prompt_logprobs and not self.out.input_logprobs_done:
            limit = min(limit, max(self.logprob_start_len - 1, 0))
        return limit

    def append_output(self, token: int) -> None:
        if not self.output_ids:
            self.first_token_at = time.monotonic()
        self.output_ids.append(token)
        self.token_ids.append(token)
        self.penalties.add(token)

    def finish(self, reason: FinishReason) -> None:
        if self.finished_reason is None:
            self.finished_reason, self.status = reason, Status.FINISHED
            self.finished_at = time.monotonic()

    def phase_times(self) -> PhaseTimes:
        """Its queue, prefill and decode times so far (up to now while it runs)."""
        end = self.finished_at if self.finished_at is not None else time.monotonic()
        admitted = end if self.admitted_at is None else self.admitted_at
        first = end if self.first_token_at is None else self.first_token_at
        return PhaseTimes(
            queue_s=admitted - self.arrival,
            prefill_s=max(first - admitted, 0.0),
            decode_s=max(end - first, 0.0),
        )

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

    def retract(self) -> None:
        """Back to the queue (its KV released): outputs so far are kept, its draft is not."""
        self.status = Status.RETRACTED
        self.draft.clear()

    def __repr__(self) -> str:
        ins, outs = len(self.input_ids), len(self.output_ids)
        return f"Req({self.rid}, {self.status.value}, in={ins}, out={outs}, kv={self.kv.kv_len})"
