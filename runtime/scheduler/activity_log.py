"""What the scheduler did lately, for observers (the live dashboard): the composition of the
last forward steps and the last finished requests, in bounded rings.

Recording is an append of a small tuple (a request's token ids are kept as the view its
``TokenArray`` already holds, not copied); everything else happens when someone asks.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:  # the HTTP process unpickles the step records: keep this module light
    from radix_cache import TreeNode
    from runtime.scheduler.req import Req

STEPS_KEPT = 120
REQUESTS_KEPT = 32


class StepRecord(NamedTuple):
    """One forward step: ``prefill_tokens`` new prompt tokens of ``prefill_reqs`` requests
    (chunks included) and ``decode_rows`` decoding requests; ``retracted`` requests went back
    to the queue before it ran."""

    step: int
    at: float  # time.time()
    prefill_tokens: int
    prefill_reqs: int
    decode_rows: int
    retracted: int
    running: int
    waiting: int


class RequestRecord(NamedTuple):
    rid: str  # the scheduler's id (the tokenizer manager knows the caller's label)
    finished_at: float  # time.time()
    latency_s: float  # arrival at the scheduler to finish
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: dict[str, Any] | None
    token_ids: np.ndarray  # prompt + output, a read-only view
    locked_node: TreeNode | None  # the deepest node of its cached prefix, as it last locked it
    cache_salt: str | None = None  # its tree namespace


class ActivityLog:
    def __init__(self, steps_kept: int = STEPS_KEPT, requests_kept: int = REQUESTS_KEPT) -> None:
        self._steps: deque[StepRecord] = deque(maxlen=steps_kept)
        self._requests: deque[RequestRecord] = deque(maxlen=requests_kept)
        self._step_count = 0

    def record_step(
        self,
        prefill: list[tuple[Req, int]],
        decodes: list[Req],
        retracted: int,
        running: int,
        waiting: int,
    ) -> None:
        """A forward step about to run ``prefill`` (request, new tokens) and ``decodes``."""
        self._step_count += 1
        self._steps.append(
            StepRecord(
                self._step_count,
                time.time(),
                sum(n for _, n in prefill),
                len(prefill),
                len(decodes),
                retracted,
                running,
                waiting,
            )
        )

    def record_finished(self, req: Req) -> None:
        """``req`` has finished (its final output is being sent; its KV not released yet)."""
        reason = req.finished_reason
        self._requests.append(
            RequestRecord(
                req.rid,
                time.time(),
                time.monotonic() - req.arrival,
                len(req.input_ids),
                req.kv.cached_tokens,
                len(req.output_ids),
                reason.to_dict() if reason is not None else None,
                req.token_ids.prefix(len(req.token_ids)),
                req.kv.last_node,
                req.cache_salt,
            )
        )

    def steps(self) -> list[StepRecord]:
        """The last forward steps, oldest first."""
        return list(self._steps)

    def requests(self) -> list[RequestRecord]:
        """The last finished requests, oldest first."""
        return list(self._requests)
