"""How ``select`` picks a choice from its scores, shared by the DSL's interpreter
(``frontend_lang.scoring``) and the compiled executor (``runtime.program.executor``), so both
pick the same choice from the same logprobs. Pure Python: no torch, no tokenizer.

Token healing. The prefix is text, and where it ends is not always a natural token boundary:
"The answer is" + " yes" may tokenize with the prefix's last token merged into the choice, and
scoring " yes" after the prefix's own last token would charge the choice for a split the model
never sees in training. So ``prefix + choice`` is tokenized as a whole and, over all choices,
the first token position where any of them departs from the prefix's own tokens is found.
Every choice is then scored from that common boundary.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

TOKEN_LENGTH_NORMALIZED = "token_length_normalized"
GREEDY_TOKEN = "greedy_token"
UNCONDITIONAL_LIKELIHOOD_NORMALIZED = "unconditional_likelihood_normalized"
CHOICES_METHODS = (TOKEN_LENGTH_NORMALIZED, GREEDY_TOKEN, UNCONDITIONAL_LIKELIHOOD_NORMALIZED)

# How many prefix tokens select re-scores so token healing can move the prefix/choice boundary.
HEAL_WINDOW = 8


def heal_boundary(
    prefix_tokens: Sequence[Hashable], choice_tokens: Sequence[Sequence[Hashable]]
) -> int:
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


def pick(
    method: str,
    token_logprobs: list[list[float]],
    unconditional: list[list[float]] | None = None,
) -> tuple[int, list[float]]:
    """(index of the chosen choice, every choice's score) under ``method``; ``token_logprobs``
    are each choice's logprobs from the healed boundary, ``unconditional`` (for the
    unconditional method) each choice's logprobs with no prefix. Ties go to the earlier."""
    means = [mean(row) for row in token_logprobs]
    if method == TOKEN_LENGTH_NORMALIZED:
        return argmax(means), means
    if method == GREEDY_TOKEN:
        return greedy_token_index(token_logprobs), means
    if method == UNCONDITIONAL_LIKELIHOOD_NORMALIZED:
        if unconditional is None:
            raise ValueError("the unconditional method needs the choices' unconditional logprobs")
        baseline = [mean(u) if u else 0.0 for u in unconditional]
        scores = [m - b for m, b in zip(means, baseline, strict=True)]
        return argmax(scores), scores
    raise ValueError(f"unknown choices_method {method!r}")


def greedy_token_index(token_logprobs: list[list[float]]) -> int:
    """Compare choices token by token: keep those with the best logprob at each position until
    one is left. A shorter choice is padded with its own mean logprob."""
    width = max(len(row) for row in token_logprobs)
    padded = [row + [mean(row)] * (width - len(row)) for row in token_logprobs]
    alive = list(range(len(padded)))
    for position in range(width):
        best = max(padded[i][position] for i in alive)
        alive = [i for i in alive if padded[i][position] == best]
        if len(alive) == 1:
            break
    return alive[0]


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("-inf")


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))
