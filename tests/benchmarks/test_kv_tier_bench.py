"""kv_tier_bench's working set: the tokens of the trie of every call's prompt and output."""

from __future__ import annotations

from benchmarks.kv_tier_bench import distinct_prefix_tokens
from benchmarks.suite.trace import Call


def test_working_set_counts_each_shared_prefix_once() -> None:
    calls = [
        Call((1, 2, 3), (4, 5), 0, 0),
        Call((1, 2, 3, 4, 5, 6), (7,), 0, 1),  # its first five tokens are the first call's
        Call((1, 9), (), 1, 0),
        Call((8,), (2,), 2, 0),
    ]
    assert distinct_prefix_tokens(calls) == 5 + 2 + 1 + 2
    assert distinct_prefix_tokens([]) == 0
