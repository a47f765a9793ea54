"""The reply envelope's list of calls refuses a repeated call: once a call in
``{"tool_calls": [...]}`` closes equal to an earlier one, only the list's end may follow."""

from __future__ import annotations

from typing import Any

import torch

from grammar import GrammarService, GrammarSpec
from grammar.backend import allocate_bitmask
from grammar.distinct_calls import CallListScanner, DistinctCallsGuard, guard_masks

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"name": "get_weather", "parameters": CITY}]
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ROME = '{"name": "get_weather", "arguments": {"city": "Rome"}}'


def _calls(*calls: str) -> str:
    return '{"tool_calls": [' + ", ".join(calls) + "]}"


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def _admits(service: GrammarService, spec: GrammarSpec, tokenizer: Any, text: str) -> bool:
    matcher = service.compile(spec).new_matcher()
    ids = [*_ids(tokenizer, text), tokenizer.eos_token_id]
    return all(matcher.accept_token(t) for t in ids) and matcher.is_terminated()


def _allowed(matcher: Any, vocab_size: int, token: int) -> bool:
    bitmask = allocate_bitmask(1, vocab_size)
    matcher.fill_mask(bitmask, 0)
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def test_scanner_sees_a_repeat_in_any_layout():
    scanner = CallListScanner()
    scanner.feed(b'{"tool_calls": [' + PARIS.encode())
    assert not scanner.must_close
    scanner.feed(b',\n  {"name":"get_weather","arguments":{"city":"Rome"}}')
    assert not scanner.must_close  # a different call
    scanner.feed(b', {"name": "get_weather",\n "arguments": {"city":  "Paris"} }')
    assert scanner.must_close  # the first call again, spaced otherwise
    scanner.feed(b" ]")
    assert not scanner.must_close
    spaced = CallListScanner()  # whitespace inside a string is part of the value
    spaced.feed(b'{"tool_calls": [{"a": "x y"}, {"a": "xy"}')
    assert not spaced.must_close


def test_envelope_refuses_calls_after_a_repeat(service: GrammarService, tokenizer: Any):
    spec = GrammarSpec.for_tool_calls(TOOLS, "auto", parallel=True, format="generic")
    assert _admits(service, spec, tokenizer, _calls(PARIS, ROME))
    assert _admits(service, spec, tokenizer, _calls(PARIS, PARIS))  # the repeat, then the end
    assert not _admits(service, spec, tokenizer, _calls(PARIS, PARIS, ROME))
    assert not _admits(service, spec, tokenizer, _calls(PARIS, ROME, PARIS, ROME))
    assert not _admits(service, spec, tokenizer, _calls(*[PARIS] * 5))
    single = GrammarSpec.for_tool_calls(TOOLS, "required", parallel=True, format="generic")
    assert service.compile(single).new_matcher().guard is None  # not an envelope


def test_mask_allows_only_the_end_after_a_repeat(
    service: GrammarService, tokenizer: Any, backend: Any
):
    spec = GrammarSpec.for_tool_calls(TOOLS, "auto", parallel=True, format="generic")
    matcher = service.compile(spec).new_matcher()
    comma, close = _ids(tokenizer, ",")[0], _ids(tokenizer, "]")[0]
    assert all(matcher.accept_token(t) for t in _ids(tokenizer, _calls(PARIS, ROME)[:-2]))
    assert _allowed(matcher, backend.vocab_size, comma)  # two different calls: more may follow
    repeat = _ids(tokenizer, ", " + ROME)
    assert all(matcher.accept_token(t) for t in repeat)
    assert not _allowed(matcher, backend.vocab_size, comma)
    assert _allowed(matcher, backend.vocab_size, close)
    assert not matcher.accept_token(comma)
    matcher.rollback(len(repeat))  # back before the repeat: the list is open again
    assert _allowed(matcher, backend.vocab_size, comma)
    assert matcher.accept_token(comma)


def test_batched_fill_and_accept_keep_the_guard(
    service: GrammarService, tokenizer: Any, backend: Any
):
    """The backend's batch paths (a native fill from 8 matchers up, a native accept) narrow
    and feed a guarded matcher as its own calls do."""
    spec = GrammarSpec.for_tool_calls(TOOLS, "auto", parallel=True, format="generic")
    matchers = [service.compile(spec).new_matcher() for _ in range(8)]
    text = _calls(PARIS, PARIS)[:-2]
    for token in _ids(tokenizer, text):
        assert backend.accept_tokens(matchers, [token] * 8) == [True] * 8
    bitmask = allocate_bitmask(8, backend.vocab_size)
    backend.fill_masks(matchers, bitmask, list(range(8)))
    comma, close = _ids(tokenizer, ",")[0], _ids(tokenizer, "]")[0]
    for row in range(8):
        assert not (int(bitmask[row, comma // 32]) >> (comma % 32)) & 1
        assert (int(bitmask[row, close // 32]) >> (close % 32)) & 1
    assert backend.accept_tokens(matchers, [comma] * 8) == [False] * 8


def test_no_token_closes_a_repeat_and_starts_another_call():
    """While a call reads as an earlier one, a token like ``"}},`` (close it, then ``,``) is
    masked: the repeat must close in smaller tokens, where the guard sees it."""
    vocab = [b'{"tool_calls": [', PARIS.encode()[:-3], b'"}},', b'"', b"}", b",", b"]", b"x"]
    guard = DistinctCallsGuard(vocab, guard_masks(vocab, 1))
    joined, quote, brace, comma, close = 2, 3, 4, 5, 6
    for token in (0, 1, quote, brace, brace, comma, 1):  # PARIS, then the repeat's start
        assert not guard.refuses(token)
        guard.accepted(token)
    assert guard.refuses(joined) and not guard.refuses(quote)
    bitmask = torch.full((1, 1), -1, dtype=torch.int32)
    guard.restrict(bitmask, 0)
    assert not (int(bitmask[0, 0]) >> joined) & 1 and (int(bitmask[0, 0]) >> quote) & 1
    for token in (quote, brace, brace):  # the repeat closes: only the list's end may follow
        guard.accepted(token)
    assert guard.refuses(comma) and not guard.refuses(close)
    guard.rolled_back(4)  # back before the repeat, then something else: nothing is masked
    guard.accepted(7)
    assert not guard.refuses(joined)
