"""``select``: score each choice by its logprobs after the prefix, with token healing.

Token healing. The prefix is text, and where it ends is not always a natural token boundary:
"The answer is" + " yes" may tokenize with the prefix's last token merged into the choice, and
scoring " yes" after the prefix's own last token would charge the choice for a split the model
never sees in training. So we tokenize ``prefix + choice`` as a whole and find, over all
choices, the first token position where any of them departs from the prefix's own tokens.
Every choice is then scored from that common boundary: the healed choice is the prefix's text
from the boundary on plus the choice, in its natural tokens, and every choice is conditioned on
the same prefix tokens. When the prefix ends at a natural boundary nothing moves.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from frontend_lang.backends.base import Backend, ChoiceLogprobs, Prompt
from frontend_lang.ir import (
    GREEDY_TOKEN,
    TOKEN_LENGTH_NORMALIZED,
    UNCONDITIONAL_LIKELIHOOD_NORMALIZED,
    Select,
)


@dataclass(frozen=True)
class SelectResult:
    """The chosen choice and why: ``scores[i]`` is choice i's score under the method (for
    greedy_token, the mean token logprob; the choice is decided token by token)."""

    index: int
    choice: str
    scores: list[float]
    meta: dict[str, Any]


def run_select(backend: Backend, prompt: Prompt, expr: Select) -> SelectResult:
    """Score ``expr.choices`` after ``prompt`` with one batched backend call (two with the
    unconditional method) and pick the best; ties go to the earlier choice."""
    choices = list(expr.choices)
    scoring = backend.choice_logprobs(prompt, choices)
    check_scoring(scoring, len(choices))
    boundary = heal_boundary(scoring.prefix_tokens, scoring.choice_tokens)
    token_logprobs = [row[boundary:] for row in scoring.choice_logprobs]
    means = [_mean(row) for row in token_logprobs]
    if expr.choices_method == TOKEN_LENGTH_NORMALIZED:
        scores, index = means, _argmax(means)
    elif expr.choices_method == GREEDY_TOKEN:
        scores, index = means, greedy_token_index(token_logprobs)
    elif expr.choices_method == UNCONDITIONAL_LIKELIHOOD_NORMALIZED:
        unconditional = backend.unconditional_logprobs(choices)
        baseline = [_mean(u) if u else 0.0 for u in unconditional]
        scores = [m - b for m, b in zip(means, baseline, strict=True)]
        index = _argmax(scores)
    else:
        raise ValueError(f"unknown choices_method {expr.choices_method!r}")
    meta = {
        "choices": choices,
        "method": expr.choices_method,
        "scores": scores,
        "token_logprobs": token_logprobs,
        "healed_tokens": len(scoring.prefix_tokens) - boundary,
        "calls": scoring.meta,
    }
    return SelectResult(index, choices[index], scores, meta)


def heal_boundary(prefix_tokens: Sequence[Hashable], choice_tokens: list[list[Hashable]]) -> int:
    """The position (within the scoring window) from which every choice is scored: the
    shortest common prefix between the prefix's own tokens and any choice's tokens."""
    boundary = len(prefix_tokens)
    for tokens in choice_tokens:
        same = 0
        for a, b in zip(prefix_tokens, tokens, strict=False):
            if a != b:
                break
            same += 1
        boundary = min(boundary, same)
    return boundary


def greedy_token_index(token_logprobs: list[list[float]]) -> int:
    """Compare choices token by token: keep those with the best logprob at each position until
    one is left. A shorter choice is padded with its own mean logprob."""
    width = max(len(row) for row in token_logprobs)
    padded = [row + [_mean(row)] * (width - len(row)) for row in token_logprobs]
    alive = list(range(len(padded)))
    for position in range(width):
        best = max(padded[i][position] for i in alive)
        alive = [i for i in alive if padded[i][position] == best]
        if len(alive) == 1:
            break
    return alive[0]


def check_scoring(scoring: ChoiceLogprobs, n_choices: int) -> None:
    """A backend answered with one row per choice and a logprob per token."""
    if len(scoring.choice_tokens) != n_choices or len(scoring.choice_logprobs) != n_choices:
        raise ValueError(f"the backend scored {len(scoring.choice_tokens)} of {n_choices} choices")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("-inf")


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))
