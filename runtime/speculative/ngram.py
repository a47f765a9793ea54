"""Prompt lookup: propose what followed the latest earlier occurrence of the sequence's tail.

Extraction, RAG, code editing and multi-turn chats repeat their context: when the last few
tokens of a request appeared before (in its prompt or its own output), what came after them
then is a good guess of what comes next now. Nothing is indexed: each call scans the
request's token array with numpy (one comparison pass, then a few narrowing passes over the
candidates), about 10 µs for 4k tokens, and holds no memory between calls.
"""

from __future__ import annotations

import numpy as np

# The tail lengths matched, longest first: short tails match by chance, long ones rarely.
DEFAULT_MIN_MATCH = 2
DEFAULT_MAX_MATCH = 5


def propose_ngram(
    tokens: np.ndarray,
    num_tokens: int,
    min_match: int = DEFAULT_MIN_MATCH,
    max_match: int = DEFAULT_MAX_MATCH,
) -> list[int]:
    """Up to ``num_tokens`` tokens to follow ``tokens`` [L]: the continuation of the latest
    earlier occurrence of the longest tail of length min_match..max_match, or [] if none.

    When the occurrence ends right before the tail (a loop, e.g. ``x y z x y z``), the
    continuation runs into the tail and is extended with the loop's period.
    """
    length = tokens.shape[0]
    if num_tokens <= 0 or length <= min_match:
        return []
    # Candidate ends e (the continuation starts at e) whose previous token is the last token.
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1]) + 1
    best = -1
    for matched in range(1, max_match + 1):
        if matched >= min_match and ends.size:
            best = int(ends[-1])  # the latest of the longest tails matched so far
        if matched == max_match or not ends.size:
            break
        # Keep the candidates whose tail of matched + 1 tokens also matches.
        ends = ends[ends > matched]
        ends = ends[tokens[ends - matched - 1] == tokens[length - matched - 1]]
    if best < 0:
        return []
    period = length - best
    return [int(tokens[best + i % period]) for i in range(num_tokens)]
