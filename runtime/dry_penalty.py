"""The DRY ("Don't Repeat Yourself") penalty: a sequence-level guard against loops.

A token that would continue a repeat of an earlier stretch of the context is made less likely
in proportion to how long that repeat already is: if the last L tokens of the context (the
request's prompt and outputs, or with ``dry_output_only`` its outputs alone, within its last
``dry_penalty_last_n`` tokens) also occur earlier, followed by token t, and L >=
``dry_allowed_length``, then t's logit loses
``dry_multiplier * dry_base ** (L - dry_allowed_length)`` (the longest such L per token; the
penalty is capped at ``MAX_DRY_PENALTY``). A sequence breaker (a token whose text contains one
of ``dry_sequence_breakers``) ends every match: no repeat runs across one, and a breaker is
never penalised as the continuation. This is the sampler of text-generation-webui and
llama.cpp (parameters of the same names and defaults); breakers are matched per token, so a
breaker string only ever spread over several tokens does not break.

Cost: each request keeps its match lengths (``DryState``), so a decode step costs a few
vectorised passes over the window however long the repeat; the first step builds them in one
pass plus one small pass per token of the longest match.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from runtime.sampling_params import SamplingParams

# Penalties beyond this act as it: the token is then as good as banned (MAX_LOGIT_BIAS).
MAX_DRY_PENALTY = 1e4
# Catching up on more tokens than this at once (a prompt, a retraction) rebuilds the matches.
_MAX_INCREMENTAL = 8
# Match lengths past allowed_length + this add nothing more (keeps the power small).
_MAX_EXPONENT = 4096

BreakerMask = Callable[[tuple[str, ...]], np.ndarray]


@dataclass(frozen=True)
class SuffixMatches:
    """A context window and, for each position i of it but the last, ``lengths[i]``: how many
    tokens the stretch ending at i shares with the window's end, counted back from both and
    stopped at a breaker or the window's start. ``lengths[-1]`` is unused (always 0)."""

    tokens: np.ndarray  # [n] int64
    lengths: np.ndarray  # [n] int64

    @classmethod
    def build(cls, tokens: np.ndarray, breakers: np.ndarray) -> SuffixMatches:
        """From scratch: one pass over the window, then one per token of the longest match."""
        tokens = tokens.astype(np.int64, copy=False)
        n = len(tokens)
        lengths = np.zeros(n, dtype=np.int64)
        if n < 2:
            return cls(tokens, lengths)
        tail_breaks = np.flatnonzero(breakers[tokens])
        limit = n - 1 - int(tail_breaks[-1]) if tail_breaks.size else n  # tokens since a breaker
        candidates = np.arange(n - 1)
        for back in range(limit):
            candidates = candidates[candidates >= back]
            candidates = candidates[tokens[candidates - back] == tokens[n - 1 - back]]
            if candidates.size == 0:
                break
            lengths[candidates] += 1
        return cls(tokens, lengths)

    def extended(self, token: int, is_breaker: bool, window: int) -> SuffixMatches:
        """The matches after appending ``token``; the window keeps its last ``window`` tokens
        (-1: all). A stretch ending at i matches one token longer if its token equals the new
        one and the stretch ending at i - 1 matched."""
        n = len(self.tokens)
        tokens = np.append(self.tokens, token)
        lengths = np.zeros(n + 1, dtype=np.int64)
        if not is_breaker and n:
            before = np.zeros(n, dtype=np.int64)
            before[1:] = self.lengths[: n - 1]
            lengths[:n] = np.where(self.tokens == token, before + 1, 0)
        if 0 < window < n + 1:
            drop = n + 1 - window
            tokens, lengths = tokens[drop:], lengths[drop:]
            np.minimum(lengths, np.arange(1, window + 1), out=lengths)
        return SuffixMatches(tokens, lengths)

    def penalties(
        self, params: SamplingParams, breakers: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The penalised tokens [k] and their penalties [k] float32, or None if there are
        none: each token that followed a match of at least ``dry_allowed_length``, with the
        penalty of its longest one."""
        n = len(self.tokens)
        if n < 2:
            return None
        allowed = params.dry_allowed_length
        ends = np.flatnonzero(self.lengths[: n - 1] >= allowed)
        if ends.size == 0:
            return None
        following = self.tokens[ends + 1]
        lengths = self.lengths[ends]
        kept = ~breakers[following]
        following, lengths = following[kept], lengths[kept]
        if following.size == 0:
            return None
        order = np.argsort(lengths, kind="stable")[::-1]  # longest first: unique keeps it
        tokens, first = np.unique(following[order], return_index=True)
        longest = lengths[order][first]
        return tokens, dry_penalty(longest, params)


def dry_penalty(lengths: np.ndarray, params: SamplingParams) -> np.ndarray:
    """multiplier * base ** (length - allowed_length) per match length, capped."""
    exponent = np.minimum(lengths - params.dry_allowed_length, _MAX_EXPONENT).astype(np.float64)
    with np.errstate(over="ignore"):  # an overflow is inf, which the cap turns into the cap
        penalty = params.dry_multiplier * np.power(params.dry_base, exponent)
    return np.minimum(penalty, MAX_DRY_PENALTY).astype(np.float32)


class DryState:
    """A request's ``SuffixMatches`` over its context so far, kept by the sampler and
    advanced by the tokens added since (a request part: only the sampler writes it)."""

    def __init__(self) -> None:
        self.matches: SuffixMatches | None = None
        self.seen = 0  # context tokens the matches cover

    def current(
        self, context: np.ndarray, params: SamplingParams, breakers: np.ndarray
    ) -> SuffixMatches:
        """The matches at the end of ``context`` [n] (the request's prompt and outputs)."""
        window = params.dry_penalty_last_n
        added = len(context) - self.seen
        if self.matches is None or added < 0 or added > _MAX_INCREMENTAL:
            start = 0 if window < 0 else max(len(context) - window, 0)
            self.matches = SuffixMatches.build(np.asarray(context[start:]), breakers)
        else:
            for token in context[self.seen :].tolist():
                self.matches = self.matches.extended(token, bool(breakers[token]), window)
        self.seen = len(context)
        return self.matches


def apply_dry(
    row: torch.Tensor, matches: SuffixMatches, params: SamplingParams, breakers: np.ndarray
) -> None:
    """Subtract the DRY penalties of ``matches`` from logits ``row`` [V], in place."""
    found = matches.penalties(params, breakers)
    if found is None:
        return
    tokens, penalty = found
    index = torch.from_numpy(tokens).to(row.device)
    row.index_add_(0, index, torch.from_numpy(-penalty).to(row.device, row.dtype))


def draft_matches(
    matches: SuffixMatches, draft: Sequence[int], params: SamplingParams, breakers: np.ndarray
) -> list[SuffixMatches]:
    """The matches after each prefix of ``draft``: [after draft[:0], ..., after draft]."""
    out = [matches]
    for token in draft:
        matches = matches.extended(token, bool(breakers[token]), params.dry_penalty_last_n)
        out.append(matches)
    return out


def no_breakers(vocab_size: int) -> BreakerMask:
    """A BreakerMask for a sampler without a tokenizer: no token breaks a match."""
    mask = np.zeros(vocab_size, dtype=bool)
    return lambda breakers: mask


def tokenizer_breakers(tokenizer: Any, vocab_size: int) -> BreakerMask:
    """A BreakerMask [V] bool from the tokenizer: the tokens whose text contains a breaker.
    Each token's text is decoded once, on first use (~1 s for a 50K vocabulary); the masks
    of the last few breaker lists are kept."""
    texts: list[str] = []

    @lru_cache(maxsize=16)
    def mask(breakers: tuple[str, ...]) -> np.ndarray:
        if not texts:
            count = min(len(tokenizer), vocab_size)
            texts.extend(tokenizer.batch_decode([[i] for i in range(count)]))
        out = np.zeros(vocab_size, dtype=bool)
        for token, text in enumerate(texts):
            out[token] = any(b in text for b in breakers)
        out.flags.writeable = False
        return out

    return mask
