"""``select``: score each choice by its logprobs after the prefix, with token healing (the
scoring math, shared with the compiled executor, is ``runtime.program.select_math``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from frontend_lang.backends.base import Backend, ChoiceLogprobs, Prompt
from frontend_lang.ir import Select
from runtime.dsl_api import UNCONDITIONAL_LIKELIHOOD_NORMALIZED, heal_boundary, pick


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
    unconditional = None
    if expr.choices_method == UNCONDITIONAL_LIKELIHOOD_NORMALIZED:
        unconditional = backend.unconditional_logprobs(choices)
    index, scores = pick(expr.choices_method, token_logprobs, unconditional)
    meta = {
        "choices": choices,
        "method": expr.choices_method,
        "scores": scores,
        "token_logprobs": token_logprobs,
        "healed_tokens": len(scoring.prefix_tokens) - boundary,
        "calls": scoring.meta,
    }
    return SelectResult(index, choices[index], scores, meta)


def check_scoring(scoring: ChoiceLogprobs, n_choices: int) -> None:
    """A backend answered with one row per choice and a logprob per token."""
    if len(scoring.choice_tokens) != n_choices or len(scoring.choice_logprobs) != n_choices:
        raise ValueError(f"the backend scored {len(scoring.choice_tokens)} of {n_choices} choices")
