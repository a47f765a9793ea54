"""After a forward: record prompt logprobs, append sampled tokens, check stops, emit outputs.

Every per-request stage is isolated: an exception while handling one request's output fails
that request alone (``Req.fail_from``) and the others go on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from runtime.ipc import FinishReason, SpeculationStats, TokenOutput
from runtime.sampler import Logprob, SampleOutput, TopLogprobs, token_logprobs
from runtime.scheduler.stop_checker import PROMPT_TAIL, StopChecker

if TYPE_CHECKING:
    from runtime.scheduler.req import Req
    from runtime.scheduler.step_batch import StepBatch


@dataclass
class OutputCursor:
    """A request's logprobs and how much of its output was sent; written by the
    OutputProcessor only."""

    input_logprobs: list[tuple[float | None, int, TopLogprobs]] = field(default_factory=list)
    output_logprobs: list[tuple[float, int, TopLogprobs]] = field(default_factory=list)
    input_logprobs_done: bool = False  # its prompt's logprobs are all recorded
    sent_tokens: int = 0
    sent_output_logprobs: int = 0
    emit_steps: int = 0  # forward steps that gave it tokens


class OutputProcessor:
    def __init__(self, stop_checker: StopChecker, stream_interval: int) -> None:
        self.stop_checker = stop_checker
        self.stream_interval = max(1, stream_interval)

    def process(self, step: StepBatch, logits: torch.Tensor, sampled: SampleOutput) -> None:
        """logits: [N, V] the forward's rows (see StepBatch); sampled: tokens for
        ``step.sample_reqs`` in order."""
        for span in step.prompt_spans:
            try:
                self._record_prompt_logprobs(
                    span.req, logits[span.row : span.row + span.count], span.first_token
                )
            except Exception as exc:
                span.req.fail_from(exc, "computing prompt logprobs for")
        for req, _ in step.work:
            if req.kv.kv_len >= len(req.input_ids):
                req.out.input_logprobs_done = True
        for row, (req, token, logprob) in enumerate(
            zip(step.sample_reqs, sampled.token_ids, sampled.logprobs, strict=True)
        ):
            if row in sampled.failures:
                req.fail(*sampled.failures[row])
                continue
            if req.sampling.max_new_tokens == 0:  # scoring only: prompt logprobs, no output
                req.finish(FinishReason.cut(0))
                continue
            advanced = bool(sampled.grammar_accepted) and sampled.grammar_accepted[row]
            self.emit_tokens(req, [token], [logprob], grammar_advanced=advanced)

    def emit_tokens(
        self,
        req: Req,
        tokens: list[int],
        logprobs: list[Logprob | None],
        grammar_advanced: bool,
    ) -> None:
        """Append new tokens one by one until the request stops (the rest are dropped).

        grammar_advanced: the matcher already accepted them (a verified draft)."""
        req.out.emit_steps += 1
        last = len(tokens) - 1
        for i, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
            if req.finished:  # aborted while the step ran, or stopped
                return
            req.append_output(token)
            if logprob is not None:
                req.out.output_logprobs.append((logprob[0], token, logprob[1]))
            try:
                if not req.constraint.advance(token, grammar_advanced):
                    req.fail(500, f"the grammar rejected sampled token {token}")
                    return
                # An advanced matcher is already at the end of the emission: ask it only there.
                self.stop_checker.check(req, check_grammar=not grammar_advanced or i == last)
            except Exception as exc:
                req.fail_from(exc, "checking the grammar and stop conditions of")
                return

    @staticmethod
    def _record_prompt_logprobs(req: Req, rows: torch.Tensor, first_token: int) -> None:
        recorded = req.out.input_logprobs
        if not recorded and req.logprob_start_len == 0:
            recorded.append((None, req.input_ids[0], []))
        targets = req.input_ids[first_token : first_token + rows.shape[0]]
        top = [req.top_logprobs_num] * len(targets)
        for token, (value, entries) in zip(
            targets, token_logprobs(rows, targets, top), strict=True
        ):
            recorded.append((value, token, entries))

    def outputs_for(self, reqs: list[Req]) -> list[TokenOutput]:
        """TokenOutputs for finished requests, and for streaming ones with enough new tokens."""
        outputs = []
        for req in reqs:
            new = len(req.output_ids) - req.out.sent_tokens
            if not req.finished and not (req.stream and new >= self.stream_interval):
                continue
            outputs.append(self._output(req))
        return outputs

    @staticmethod
    def _output(req: Req) -> TokenOutput:
        params, cursor = req.sampling, req.out
        send_input_logprobs = req.return_logprob and cursor.sent_tokens == 0
        out = TokenOutput(
            rid=req.rid,
            new_token_ids=req.output_ids[cursor.sent_tokens :],
            finished_reason=req.finished_reason,
            prompt_tokens=len(req.input_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.kv.cached_tokens,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            stop=params.stop,
            stop_regex=params.stop_regex,
            no_stop_trim=params.no_stop_trim,
            prompt_tail_ids=req.input_ids[-PROMPT_TAIL:] if cursor.sent_tokens == 0 else None,
            grammar_notes=req.constraint.notes if req.finished else (),
            output_logprobs=cursor.output_logprobs[cursor.sent_output_logprobs :],
            input_logprobs=list(cursor.input_logprobs) if send_input_logprobs else None,
            spec=(
                SpeculationStats(cursor.emit_steps, req.draft.proposed, req.draft.accepted)
                if req.speculates
                else None
            ),
            times=req.phase_times() if req.finished else None,
        )
        cursor.sent_tokens = len(req.output_ids)
        cursor.sent_output_logprobs = len(cursor.output_logprobs)
        return out
