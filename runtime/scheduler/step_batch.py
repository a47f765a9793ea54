"""One scheduler step's work: which requests run how many tokens, and which logit rows matter."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.forward_batch import ForwardBatch
from runtime.model_runner import ModelRunner
from runtime.scheduler.req import Req


@dataclass
class PromptLogprobSpan:
    """Logit rows [row, row + count) predict prompt tokens [first_token, first_token + count)."""

    req: Req
    row: int
    count: int
    first_token: int


@dataclass
class DraftRows:
    """A drafting request's logit rows [row, row + len(req.draft.tokens) + 1): one per position
    from its last sampled token through its draft."""

    req: Req
    row: int


@dataclass
class StepBatch:
    """``work``: (request, new tokens) with every multi-token entry before the one-token ones.

    Slots for the new tokens are already allocated, so each request's kv_len already counts
    them: this step computes positions [kv_len - n, kv_len).
    """

    work: list[tuple[Req, int]]
    sample_reqs: list[Req] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    prompt_spans: list[PromptLogprobSpan] = field(default_factory=list)
    drafts: list[DraftRows] = field(default_factory=list)

    @classmethod
    def from_parts(cls, prefill: list[tuple[Req, int]], decodes: list[Req]) -> StepBatch:
        work = prefill + [(r, r.step_len) for r in decodes]
        return cls([w for w in work if w[1] > 1] + [w for w in work if w[1] == 1])

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.work)

    def to_forward_batch(self, runner: ModelRunner) -> ForwardBatch:
        """Pack the work and decide the logit rows: each request that reaches the end of its
        known tokens samples from its last row; a request verifying a draft gets a row per
        position; prompt-logprob requests also get the rows that predict their prompt tokens
        from ``logprob_start_len`` on."""
        logit_rows: list[int] = []
        offset = 0
        for req, n in self.work:
            start = req.kv.kv_len - n
            if req.wants_prompt_logprobs and not req.out.input_logprobs_done:
                first = max(req.logprob_start_len - 1, start)
                last = min(req.kv.kv_len, len(req.input_ids) - 1)
                if last > first:
                    self.prompt_spans.append(
                        PromptLogprobSpan(req, len(logit_rows), last - first, first + 1)
                    )
                    logit_rows.extend(range(offset + first - start, offset + last - start))
            if req.draft.tokens:
                self.drafts.append(DraftRows(req, len(logit_rows)))
                logit_rows.extend(range(offset, offset + n))
            elif req.kv.kv_len == len(req.token_ids):
                self.sample_reqs.append(req)
                self.sample_rows.append(len(logit_rows))
                logit_rows.append(offset + n - 1)
            offset += n
        rows = [req.kv.row for req, _ in self.work]
        assert None not in rows, "every request in a step is admitted"
        return runner.build_batch(
            rows,  # type: ignore[arg-type]
            [req.kv.kv_len - n for req, n in self.work],
            [req.step_tokens(n) for req, n in self.work],
            # On the CPU: build_batch sees whether these are one row per request (CUDA graphs).
            logits=torch.tensor(logit_rows, dtype=torch.int64),
        )
