"""Numbers a run is judged by: throughput, TTFT / ITL percentiles, cache hit rates."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from benchmarks.suite.trace import Call, SystemRun, Timing

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) with linear interpolation between the closest ranks
    (numpy's default method); NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def ttfts(timings: Sequence[Timing]) -> list[float]:
    """Time to first token per call that generated any: first token time minus arrival."""
    return [t.token_times[0] - t.arrival for t in timings if t.token_times]


def inter_token_latencies(timings: Sequence[Timing]) -> list[float]:
    """Every gap between consecutive output tokens of a call, over all calls. Tokens that
    reach the client together (one streamed chunk) have a gap of 0."""
    return [
        later - earlier
        for t in timings
        for earlier, later in zip(t.token_times, t.token_times[1:], strict=False)
    ]


def optimal_hit_rate(calls: Sequence[Call]) -> float:
    """The prompt-token hit rate of an ideal, unbounded prefix cache, for calls in the order
    they were sent.

    Call i may reuse the longest prefix of its prompt shared with the full token sequence
    (prompt + output) of any call sent before it, capped at ``len(prompt) - 1`` because one
    token must run to produce logits. The rate is the sum of those prefixes over the sum of
    all prompt lengths (scoring calls included). Requires ``calls`` in sending order."""
    root: dict[int, Any] = {}
    hits = total = 0
    for call in calls:
        node, matched = root, 0
        for token in call.prompt_ids:
            if token not in node:
                break
            node = node[token]
            matched += 1
        hits += min(matched, max(len(call.prompt_ids) - 1, 0))
        total += len(call.prompt_ids)
        node = root
        for token in (*call.prompt_ids, *call.output_ids):
            node = node.setdefault(token, {})
    return hits / total if total else 0.0


def summarize(run: SystemRun) -> dict[str, Any]:
    """The run's numbers: calls, output tokens, wall time, output tokens/s, calls/s, groups/s,
    TTFT percentiles (s), ITL percentiles (ms), cache hit rate, other processes' CPU share."""
    output_tokens = sum(len(t.token_times) for t in run.timings)
    first, gaps = ttfts(run.timings), inter_token_latencies(run.timings)
    groups = len({c.group for c in run.calls})
    wall = max(run.wall_s, 1e-9)
    return {
        "system": run.system,
        "calls": len(run.calls),
        "groups": groups,
        "prompt_tokens": sum(len(c.prompt_ids) for c in run.calls),
        "output_tokens": output_tokens,
        "wall_s": run.wall_s,
        "output_tokens_per_s": output_tokens / wall,
        "requests_per_s": len(run.calls) / wall,
        "groups_per_s": groups / wall,
        **{f"ttft_p{q}_s": percentile(first, q) for q in PERCENTILES},
        **{f"itl_p{q}_ms": percentile(gaps, q) * 1000 for q in PERCENTILES},
        "cache_hit_rate": run.cache_hit_rate,
        "other_cpu_share": run.other_cpu_share,
        "note": run.note,
    }


def output_agreement(reference: SystemRun, other: SystemRun) -> float | None:
    """Fraction of unconstrained generating calls where ``other`` produced exactly the tokens
    ``reference`` did (same weights, greedy: a check that both ran the same model); None when
    there are no such calls."""
    pairs = [
        (a, b)
        for call, a, b in zip(reference.calls, reference.outputs, other.outputs, strict=True)
        if call.output_len and not call.constrained
    ]
    if not pairs:
        return None
    return sum(a == b for a, b in pairs) / len(pairs)
