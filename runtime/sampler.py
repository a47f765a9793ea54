"""The sampling pipeline, batched: bias, penalties, grammar mask, temperature, top-k/p, min-p, draw.

The order is fixed (docs/architecture.md, step 3): logit_bias, repetition / presence /
frequency penalties, the DRY penalty (runtime/dry_penalty.py), the grammar mask and the
stop-token mask below min_new_tokens (which yields where the grammar allows only its end),
then temperature, top-k, top-p, min-p and the draw. Greedy rows (temperature below
GREEDY_TEMPERATURE, or top_k 1) take the argmax of the processed logits. A row's draw depends
only on its request's seed and output length, never on the batch.

Numerically safe: logits are scaled by the temperature after subtracting the row's maximum, so
no temperature or bias can overflow them (tiny temperatures give the argmax, huge biases the
limit distribution), and a row with nothing left to sample (every token banned or masked, or
NaN logits) is reported as that request's failure instead of reaching the draw.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import arbor_kernels as kernels
import torch

from runtime.dry_penalty import BreakerMask, apply_dry, draft_matches, no_breakers
from runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from runtime.scheduler.req import Req

GrammarMaskFn = Callable[[torch.Tensor, Sequence[Any]], None]
GrammarAcceptFn = Callable[[list[Any], list[int]], list[bool]]


# Temperatures above this act as it: beyond, float32 cannot tell the scaled logits apart.
_MAX_TEMPERATURE = 1e30
# Tokens a row may draw and see refused by its grammar matcher before the request fails.
_MAX_REDRAWS = 32

logger = logging.getLogger(__name__)

TopLogprobs = list[tuple[float, int]]  # (logprob, token), the most likely first
Logprob = tuple[float, TopLogprobs]  # a token's logprob and its row's top entries


class PenaltyCounts:
    """A request's output token counts [V] float32 and the tokens seen in its prompt or
    output [V] bool, for the penalties: built by the sampler when first needed, then
    advanced by each output token."""

    def __init__(self) -> None:
        self.tensors: tuple[torch.Tensor, torch.Tensor] | None = None

    def get(self, req: Req, vocab_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        if self.tensors is None:
            counts = torch.zeros(vocab_size, device=device)
            seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            seen[torch.tensor(req.input_ids, device=device)] = True
            if req.output_ids:
                out = torch.tensor(req.output_ids, device=device)
                counts.index_add_(0, out, torch.ones(len(out), device=device))
                seen[out] = True
            self.tensors = (counts, seen)
        return self.tensors

    def add(self, token: int) -> None:
        if self.tensors is not None:
            counts, seen = self.tensors
            counts[token] += 1
            seen[token] = True


@dataclass
class SampleOutput:
    token_ids: list[int]
    # For rows whose request returns logprobs: (logprob, [(logprob, token), ...] top entries).
    logprobs: list[Logprob | None]
    # Rows that could not be sampled: row -> (HTTP status, message). Their token is meaningless.
    failures: dict[int, tuple[int, str]] = field(default_factory=dict)
    # Rows whose grammar matcher has already accepted their token (see Sampler.sample).
    grammar_accepted: list[bool] = field(default_factory=list)


class Sampler:
    def __init__(
        self,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        grammar_mask: GrammarMaskFn | None = None,
        grammar_accept: GrammarAcceptFn | None = None,
        dry_breakers: BreakerMask | None = None,
    ) -> None:
        """grammar_mask: applies the constrained rows' masks (GrammarManager.apply_masks);
        grammar_accept: advances matchers by their tokens, all at once
        (GrammarBackend.accept_tokens). Without them, rows are unconstrained. dry_breakers:
        the tokens [V] that are DRY sequence breakers, per breaker list
        (dry_penalty.tokenizer_breakers); without it no token is one."""
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.grammar_mask = grammar_mask
        self.grammar_accept = grammar_accept
        self.dry_breakers = dry_breakers or no_breakers(vocab_size)

    def sample(
        self, logits: torch.Tensor, reqs: Sequence[Req], in_place: bool = False, ahead: int = 0
    ) -> SampleOutput:
        """logits: [N, V] float32, row i for reqs[i]'s next token, ``ahead`` tokens past its
        outputs (a verified draft's). Modifies ``logits`` only with ``in_place`` (a copy the
        caller will not read again: saves a copy of [N, V]).

        Constrained rows' matchers accept their tokens here (``grammar_accepted``). If this
        raises, no matcher has changed yet, so the rows can be sampled again one by one.
        """
        wants_logprobs = [i for i, r in enumerate(reqs) if r.return_logprob]
        # The model's own distribution, before any processing, for the requests that ask.
        raw = take_rows(logits, wants_logprobs) if wants_logprobs else None
        if not in_place:
            logits = logits.clone()
        self._apply_bias_and_penalties(logits, reqs, ahead)
        if self.grammar_mask is not None and any(r.constraint.masks_next_token for r in reqs):
            self.grammar_mask(logits, reqs)
        for i, req in enumerate(reqs):
            self.mask_stop_below_min(logits[i], req, len(req.output_ids) + ahead)
        # One pass gives each row's max (to find rows with nothing to sample) and its argmax
        # (the greedy rows' token).
        top, tokens = kernels.row_max_argmax(logits)
        failures = _unsampleable_rows(top, reqs)
        for row in failures:
            logits[row] = 0.0  # drawn from (uniformly) so the batch stays valid, then dropped
        tokens = self._draw(logits, reqs, tokens, ahead)
        accepted = self._advance_grammars(logits, tokens, reqs, failures, ahead)
        try:
            logprobs = self._logprobs(raw, wants_logprobs, tokens, reqs)
        except Exception:  # matchers have moved: fail the rows instead of raising
            logger.exception("computing logprobs failed")
            logprobs = [None] * len(reqs)
            for row in wants_logprobs:
                failures[row] = (500, "internal error while computing logprobs")
        return SampleOutput(tokens.tolist(), logprobs, failures, accepted)

    def _advance_grammars(
        self,
        logits: torch.Tensor,
        tokens: torch.Tensor,
        reqs: Sequence[Req],
        failures: dict[int, tuple[int, str]],
        ahead: int,
    ) -> list[bool]:
        """Advance each constrained row's matcher by its token; never raises.

        xgrammar 0.2.8's mask can allow a token its matcher then refuses (measured: after
        ``{"\\"q\\"":"",`` with additionalProperties, ``\"\"\"\\n`` passes the mask).
        Such a token is banned from its row and the row drawn again from the rest of the
        masked distribution, so outputs stay within the grammar. ``failures`` gets the rows
        that cannot be advanced.
        """
        accepted = [False] * len(reqs)
        matchers = [r.constraint.matcher for r in reqs]
        rows = [i for i, m in enumerate(matchers) if m is not None and i not in failures]
        if self.grammar_accept is not None and len(rows) > 1:
            try:  # the batch first; refused rows (their matchers unchanged) redraw below
                batch = self.grammar_accept([matchers[i] for i in rows], tokens[rows].tolist())
                for row, ok in zip(rows, batch, strict=True):
                    accepted[row] = ok
            except Exception:
                logger.exception("accepting the batch's tokens failed; accepting them one by one")
        for row in rows:
            req = reqs[row]
            if accepted[row]:
                continue
            try:
                accepted[row] = self._accept_or_redraw(logits, tokens, row, req, ahead)
            except Exception:
                logger.exception("advancing the grammar of request %s failed", req.rid)
                accepted[row] = False
            if not accepted[row]:
                failures[row] = (500, "internal error while advancing the grammar of this request")
        return accepted

    def _accept_or_redraw(
        self, logits: torch.Tensor, tokens: torch.Tensor, row: int, req: Req, ahead: int
    ) -> bool:
        grammar = req.constraint.matcher
        assert grammar is not None, "only constrained rows are accepted"
        for _ in range(_MAX_REDRAWS):
            if grammar.accept_token(int(tokens[row])):
                return True
            logits[row, int(tokens[row])] = float("-inf")
            if not bool((logits[row] > float("-inf")).any()):
                return False
            tokens[row] = self._draw(logits[row : row + 1], [req], None, ahead)[0]
        return False

    def _stop_ids(self, req: Req) -> list[int]:
        ids = list(req.sampling.stop_token_ids)
        return ids if req.sampling.ignore_eos else ids + self.eos_token_ids

    def _apply_bias_and_penalties(
        self, logits: torch.Tensor, reqs: Sequence[Req], ahead: int = 0
    ) -> None:
        for i, req in enumerate(reqs):
            params = req.sampling
            if params.logit_bias:  # most rows have none: no slice view for them
                add_logit_bias(logits[i : i + 1], params)
            if params.has_penalties:
                counts, seen = req.penalties.get(req, self.vocab_size, logits.device)
                logits[i] = penalised(logits[i], params, counts, seen)
            if params.has_dry:
                self.apply_dry_rows(logits[i : i + 1], req, req.draft.tokens[:ahead])

    def apply_dry_rows(self, logits: torch.Tensor, req: Req, draft: Sequence[int]) -> None:
        """The DRY penalty on ``logits`` [m, V] in place: row r predicts the token after the
        request's context, then ``draft[:len(draft) - m + 1 + r]`` (its last row follows the
        whole draft). Advances ``req.dry`` to the context, never into the draft. The context
        is the prompt and the outputs, or the outputs alone with ``dry_output_only``."""
        params = req.sampling
        breakers = self.dry_breakers(params.dry_sequence_breakers)
        context = req.token_ids.array()
        if params.dry_output_only:
            context = context[len(req.input_ids) :]
        matches = req.dry.current(context, params, breakers)
        prefixes = draft_matches(matches, draft, params, breakers)[-logits.shape[0] :]
        for row, prefix in zip(logits, prefixes, strict=True):
            apply_dry(row, prefix, params, breakers)

    def mask_stop_below_min(self, row: torch.Tensor, req: Req, produced: int) -> None:
        """Forbid stop tokens while fewer than min_new_tokens are out (row [V], in place) —
        unless the grammar allows nothing else: its end wins over min_new_tokens."""
        if produced >= req.sampling.min_new_tokens:
            return
        stop_ids = self._stop_ids(req)
        masked = row.clone()
        masked[stop_ids] = float("-inf")
        if not req.constraint.masks_next_token or bool(torch.isfinite(masked).any()):
            row.copy_(masked)

    def _draw(
        self,
        logits: torch.Tensor,
        reqs: Sequence[Req],
        argmax: torch.Tensor | None = None,
        ahead: int = 0,
    ) -> torch.Tensor:
        """One token per row: the argmax for greedy rows (``argmax``: already computed),
        a filtered, seeded draw for the others. Scoring-only rows (max_new_tokens 0: the token
        is never emitted) take the argmax too: a draw would sort their whole row for nothing."""
        tokens = logits.argmax(-1) if argmax is None else argmax
        rows = [
            i
            for i, r in enumerate(reqs)
            if not r.sampling.is_greedy and r.sampling.max_new_tokens != 0
        ]
        if not rows:
            return tokens
        device = logits.device
        params = [reqs[i].sampling for i in rows]
        temps = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
        probs = torch.softmax(scaled(take_rows(logits, rows), temps), dim=-1)
        sampled = kernels.sample_from_probs(
            probs,
            torch.tensor([p.top_k for p in params], device=device),
            torch.tensor([p.top_p for p in params], device=device),
            torch.tensor([p.min_p for p in params], device=device),
            torch.tensor([reqs[i].seed for i in rows], device=device),
            torch.tensor([len(reqs[i].output_ids) + ahead for i in rows], device=device),
        )
        tokens[rows] = sampled
        return tokens

    @staticmethod
    def _logprobs(
        raw: torch.Tensor | None, rows: list[int], tokens: torch.Tensor, reqs: Sequence[Req]
    ) -> list[Logprob | None]:
        """Logprobs of the model's own distribution for the requests that ask: ``raw`` holds
        their unprocessed logits rows, ``rows`` their positions in the batch."""
        out: list[Logprob | None] = [None] * len(reqs)
        if raw is not None:
            top = [reqs[i].top_logprobs_num for i in rows]
            for i, entry in zip(rows, token_logprobs(raw, tokens[rows], top), strict=True):
                out[i] = entry
        return out


def take_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """A copy of ``logits``' rows ``rows`` ([len(rows), V]), as ``logits[rows]`` gives, at a
    fraction of its cost: indexing with a Python list took ~150 us for one 49K-vocab row on
    CPU, ``index_select`` ~8 us (once per sampled step, at batch 1 a visible share of it)."""
    return logits.index_select(0, torch.tensor(rows, dtype=torch.int64, device=logits.device))


def add_logit_bias(logits: torch.Tensor, params: SamplingParams) -> None:
    """Add ``params.logit_bias`` to each row of ``logits`` [m, V], in place."""
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=logits.device)
        logits[:, ids] += torch.tensor(list(params.logit_bias.values()), device=logits.device)


def penalised(
    row: torch.Tensor, params: SamplingParams, counts: torch.Tensor, seen: torch.Tensor
) -> torch.Tensor:
    """``row`` [V] with the repetition, frequency and presence penalties of ``params`` given
    the output token ``counts`` [V] and the tokens ``seen`` [V] in prompt or output."""
    if params.repetition_penalty != 1.0:
        penalised = torch.where(
            row > 0, row / params.repetition_penalty, row * params.repetition_penalty
        )
        row = torch.where(seen, penalised, row)
    row = row - params.frequency_penalty * counts
    row = row - params.presence_penalty * (counts > 0).float()
    # A tiny repetition penalty divides a logit into +inf; keep it the largest finite.
    return row.clamp(max=torch.finfo(row.dtype).max)


def scaled(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """(logits - row max) / temperature: [N, V] logits, [N, 1] temperatures (each at least
    GREEDY_TEMPERATURE). Every finite entry ends in [-inf, 0], so nothing overflows."""
    top = logits.max(dim=-1, keepdim=True).values
    temps = temperatures.to(logits.device).clamp(max=_MAX_TEMPERATURE)
    return (logits - top) / temps


def _unsampleable_rows(top: torch.Tensor, reqs: Sequence[Req]) -> dict[int, tuple[int, str]]:
    """Rows that leave no token to sample, with the reason, from each processed row's max
    ``top`` [N]: NaN if any entry of the row is, -inf if every entry is."""
    broken = torch.isnan(top)
    empty = top == float("-inf")
    failures: dict[int, tuple[int, str]] = {}
    for row in (broken | empty).nonzero().flatten().tolist():
        if bool(broken[row]):
            failures[row] = (500, "the model produced NaN logits for this request")
        elif reqs[row].constraint.masks_next_token:
            failures[row] = (
                400,
                "no token is allowed: the constraint admits none here given logit_bias, "
                "stop_token_ids and min_new_tokens",
            )
        else:
            failures[row] = (400, "no token is allowed: logit_bias bans every token")
    return failures


def token_logprobs(
    rows: torch.Tensor, tokens: Sequence[int] | torch.Tensor, top: Sequence[int]
) -> list[Logprob]:
    """Row i's logprob of tokens[i] and its top[i] most likely entries, from logits [m, V]."""
    table = torch.log_softmax(rows, dim=-1)
    ids = torch.as_tensor(tokens, device=table.device).unsqueeze(1)
    chosen = table.gather(1, ids).squeeze(1).tolist()
    return [
        (value, top_logprobs(table[i], k))
        for i, (value, k) in enumerate(zip(chosen, top, strict=True))
    ]


def top_logprobs(logprobs: torch.Tensor, k: int) -> TopLogprobs:
    """The k most likely (logprob, token) pairs of one row [V]."""
    if k <= 0:
        return []
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]))
    return list(zip(values.tolist(), ids.tolist(), strict=True))
