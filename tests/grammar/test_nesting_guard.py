"""``json_object`` refuses an object that copies its parent into itself: once a nested object has
written the enclosing object's text up to the member that holds it, that member's value may not
open an object or a list again. A list whose last three elements are one object or list
repeated may only end. Every other output is left as the grammar allows it."""

from __future__ import annotations

from typing import Any

import torch

from grammar import GrammarService, GrammarSpec
from grammar.backend import allocate_bitmask
from grammar.nesting_guard import NestingGuard, NestingScanner, NestingVocabulary

HEAD = '{"name": "Lian", "date": "2025-01-01", "guests": '
COPY = HEAD + '[{"name": "Lian", "date": "2025-01-01", "guests": '


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def _admits(service: GrammarService, tokenizer: Any, text: str) -> bool:
    matcher = service.compile(GrammarSpec.for_json_object()).new_matcher()
    ids = [*_ids(tokenizer, text), tokenizer.eos_token_id]
    return all(matcher.accept_token(t) for t in ids) and matcher.is_terminated()


def test_scanner_finds_the_copy_in_any_layout():
    scanner = NestingScanner()
    scanner.feed(COPY.encode())
    assert scanner.remaining() == b""
    aligned = NestingScanner()
    aligned.feed(b'{\n  "a": 1,\n  "b": [\n    {\n      "a": 1,\n      "b"')
    assert aligned.remaining() == b":"  # a copy so far: the colon is what is left
    keys_only = NestingScanner()  # no whole member before the nesting one: no copy
    keys_only.feed(b'{"data": {"data": ')
    assert keys_only.remaining() is None
    other = NestingScanner()  # another value before the member: not a copy
    other.feed(HEAD.encode() + b'[{"name": "Chen", "date": "2025-01-01", "guests": ')
    assert other.remaining() is None
    spaced = NestingScanner()  # whitespace inside a string is part of the value
    spaced.feed(b'{"a": "x y", "b": {"a": "xy", "b": ')
    assert spaced.remaining() is None
    top = NestingScanner()  # the outermost object has no parent to copy
    top.feed(b'{"a": ')
    assert top.remaining() is None


def test_json_object_ends_a_copy_with_a_scalar(service: GrammarService, tokenizer: Any):
    assert _admits(service, tokenizer, COPY + '2}], "time": "17:30"}')
    assert _admits(service, tokenizer, COPY + '"two"}]}')
    assert not _admits(service, tokenizer, COPY + "[]}]}")
    assert not _admits(service, tokenizer, COPY + '{"name": "Lian"}}]}')
    # Not a copy: nesting stays free.
    assert _admits(service, tokenizer, HEAD + '[{"name": "Chen", "guests": [{"x": 1}]}]}')
    assert _admits(service, tokenizer, '{"a": {"a": {"a": {"b": []}}}}')
    assert _admits(service, tokenizer, '{"a": 1, "b": [{"a": 2, "b": [{"a": 2}]}]}')
    assert _admits(service, tokenizer, '{"a": [[1, [2]], {"b": {"c": [{}]}}]}')


def test_mask_refuses_only_the_openers_at_the_copy(
    service: GrammarService, tokenizer: Any, backend: Any
):
    matcher = service.compile(GrammarSpec.for_json_object()).new_matcher()
    assert matcher.guard is not None
    ids = _ids(tokenizer, COPY.rstrip())
    assert all(matcher.accept_token(t) for t in ids)
    bitmask = allocate_bitmask(1, backend.vocab_size)
    matcher.fill_mask(bitmask, 0)

    def allowed(token: int) -> bool:
        return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)

    for opener in ("[", "{", " [", " {"):
        token = _ids(tokenizer, opener)
        assert len(token) == 1 and not allowed(token[0]), opener
    for scalar in ("2", ' "', " true", " null"):
        assert allowed(_ids(tokenizer, scalar)[0]), scalar
    matcher.rollback(len(ids) - len(_ids(tokenizer, HEAD.rstrip())))  # back at the parent
    matcher.fill_mask(bitmask, 0)
    assert allowed(_ids(tokenizer, " [")[0])


def test_no_token_finishes_the_copy_and_opens_a_container():
    """While the nested object reads as its template, a token like ``": [`` (the copy's last
    bytes, then an opener) is refused; the same bytes without the opener are not."""
    vocab = [b'{"a": 1, "b": [{"a": 1, "b', b'": [', b'":', b" [", b" 3", b'"', b"}"]
    guard = NestingGuard(NestingVocabulary(vocab))
    joined, colon, opener, scalar = 1, 2, 3, 4
    guard.accepted(0)
    assert guard.refuses(joined) and not guard.refuses(colon)
    bitmask = torch.full((1, 1), -1, dtype=torch.int32)
    guard.restrict(bitmask, 0)
    assert not (int(bitmask[0, 0]) >> joined) & 1 and (int(bitmask[0, 0]) >> colon) & 1
    guard.accepted(colon)
    assert guard.refuses(opener) and not guard.refuses(scalar)
    guard.rolled_back(1)
    assert not guard.refuses(opener)


def test_restrict_never_leaves_nothing():
    """Where the grammar allows only an opener (a schema that requires one), the mask is kept."""
    vocab = [b'{"x": 0, "a": [{"x": 0, "a": ', b"[", b"1"]
    guard = NestingGuard(NestingVocabulary(vocab))
    guard.accepted(0)
    only_opener = torch.tensor([[0b010]], dtype=torch.int32)
    guard.restrict(only_opener, 0)
    assert int(only_opener[0, 0]) == 0b010
    both = torch.tensor([[0b110]], dtype=torch.int32)
    guard.restrict(both, 0)
    assert int(both[0, 0]) == 0b100


def test_scanner_counts_repeated_elements():
    scanner = NestingScanner()
    scanner.feed(b'{"g": [{}, { }, {}')
    assert scanner.must_close_list()
    scanner.feed(b"]")
    assert not scanner.must_close_list()
    for text in (b'{"g": [{}, {}, 1, {}', b'{"g": [{"a": 1}, {"a": 2}, {"a": 1}', b"[1, 1, 1"):
        other = NestingScanner()
        other.feed(text)
        assert not other.must_close_list(), text
    twice = NestingScanner()
    twice.feed(b"[[1], [1], [")
    assert twice.may_repeat() and not twice.must_close_list()


def test_json_object_ends_a_list_of_one_repeated_element(service: GrammarService, tokenizer: Any):
    assert _admits(service, tokenizer, '{"g": [{}, {}, {}]}')
    assert not _admits(service, tokenizer, '{"g": [{}, {}, {}, {}]}')
    assert not _admits(service, tokenizer, '{"g": [[1], [1], [1], [2]]}')
    assert _admits(service, tokenizer, '{"g": [[1], [1], [2], [2], [1]]}')
    assert _admits(service, tokenizer, '{"g": [0, 0, 0, 0, 0], "h": ["a", "a", "a", "a"]}')


def test_no_token_closes_a_third_repeat_and_writes_a_separator():
    vocab = [b'{"g": [{"a": 1}, {"a": 1}, {"a": 1', b"}, {", b"}", b",", b"]", b"2"]
    guard = NestingGuard(NestingVocabulary(vocab))
    joined, brace, comma, close, other = 1, 2, 3, 4, 5
    guard.accepted(0)
    assert guard.refuses(joined) and not guard.refuses(brace)
    guard.accepted(brace)
    assert guard.refuses(comma) and not guard.refuses(close)
    guard.rolled_back(2)  # back inside the third element: write another value
    guard.accepted(other)
    guard.accepted(brace)
    assert not guard.refuses(comma)


def test_packed_masks_are_built_once_per_refused_set():
    """The scheduler thread builds a refused set's packed mask once (a 49K vocabulary costs
    ~0.8 ms a build), and a tokenizer token past the model's mask has no bit to clear."""
    vocab = [b'{"a": 1, "b": [{"a": 1, "b', b'": [', b'":', b" [", b" 3"] + [b"[x"] * 40
    vocabulary = NestingVocabulary(vocab)
    first = NestingGuard(vocabulary)
    first.accepted(0)
    masks = [torch.full((1, 1), -1, dtype=torch.int32) for _ in range(2)]
    first.restrict(masks[0], 0)
    second = NestingGuard(vocabulary)
    second.accepted(0)
    second.restrict(masks[1], 0)
    assert torch.equal(masks[0], masks[1]) and not (int(masks[0][0, 0]) >> 1) & 1
    assert len(vocabulary._masks) == 1  # one refused set, one mask, shared by both guards
    refused = vocabulary.refused(b"", in_string=False, escaped=False)
    assert any(i >= 32 for i in refused)  # tokens 32.. lie past a one-word mask
    assert int(vocabulary.packed_without(refused, 1)[0]) != -1
