"""The reply envelope's list of calls refuses a repeated call: once a call in
``{"tool_calls": [...]}`` closes equal to an earlier one, only the list's end may follow."""

from __future__ import annotations

from typing import Any

from grammar import GrammarService, GrammarSpec
from grammar.backend import allocate_bitmask
from grammar.distinct_calls import CallListScanner

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
