"""``GrammarBackend.accept_tokens``: xgrammar's batch call matches one-by-one acceptance."""

from __future__ import annotations

from typing import Any

from grammar import GrammarBackend, GrammarSpec


def test_batch_accept_matches_one_by_one(backend: GrammarBackend, tokenizer: Any) -> None:
    compiled = backend.compile(GrammarSpec.for_regex("ab|ac"))
    (a,) = tokenizer.encode("a", add_special_tokens=False)
    (b,) = tokenizer.encode("b", add_special_tokens=False)
    (z,) = tokenizer.encode("z", add_special_tokens=False)
    matchers = [compiled.new_matcher() for _ in range(3)]
    assert backend.accept_tokens(matchers, [a, z, a]) == [True, False, True]
    # The refused token left its matcher at the start: it still takes "a", then "b".
    assert backend.accept_tokens(matchers, [b, a, b]) == [True, True, True]
    assert all(m.is_terminated() is False for m in matchers)
