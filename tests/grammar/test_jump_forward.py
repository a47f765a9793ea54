"""Jump-forward: forced text is drafted, verified by the model, and never changes the output."""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import arbor_kernels as kernels
import pytest
import torch

from grammar import (
    CompiledGrammar,
    DraftVerdict,
    GrammarMatcher,
    GrammarOptions,
    GrammarService,
    GrammarSpec,
    allocate_bitmask,
    commit_draft,
    fill_draft_masks,
    verify_draft,
)
from tests.grammar.decoder import ConstrainedDecoder
from tests.grammar.schema_corpus import SCHEMAS, validate_output

LONG_KEYS = dict(SCHEMAS)["long_fixed_keys"]
# Compact JSON forces the most text (aligned JSON lets the model choose the whitespace after
# "{" and ","): the layout these tests draft from.
COMPACT = GrammarOptions(json_format="compact")


def test_forced_string_and_draft_tokens(service: GrammarService, tokenizer: Any) -> None:
    matcher = service.compile(GrammarSpec.for_json_schema(LONG_KEYS, COMPACT)).new_matcher()
    forced = matcher.jump_forward_string()
    assert forced == '{"customer_identification_number":'
    draft = matcher.jump_forward_tokens(64)
    assert len(draft) > 1 and forced.startswith(tokenizer.decode(draft))
    assert matcher.jump_forward_string() == forced  # drafting does not move the matcher
    assert matcher.jump_forward_tokens(2) == draft[:2]
    for token in draft:
        assert matcher.accept_token(token)


def test_no_draft_inside_a_utf8_character(service: GrammarService, tokenizer: Any) -> None:
    text = "日本語テキスト"
    matcher = service.compile(GrammarSpec.for_choice([text, "x"])).new_matcher()
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(tokenizer.decode(ids[:1])) == 1 and tokenizer.decode(ids[:1]) != text[0]
    assert matcher.accept_token(ids[0])  # one byte of a three-byte character
    assert matcher.jump_forward_string() == "" and matcher.jump_forward_tokens(8) == []
    for token in ids[1:3]:
        assert matcher.accept_token(token)
    assert matcher.jump_forward_string() == text[1:]


def test_draft_mask_rows_and_commit(service: GrammarService, tokenizer: Any) -> None:
    compiled = service.compile(GrammarSpec.for_json_schema(LONG_KEYS, COMPACT))
    matcher = compiled.new_matcher()
    draft = matcher.jump_forward_tokens(8)
    bitmask = allocate_bitmask(len(draft) + 1, tokenizer.vocab_size)
    fill_draft_masks(matcher, draft, bitmask, 0)
    reference = compiled.new_matcher()
    expected = allocate_bitmask(1, tokenizer.vocab_size)
    for i, token in enumerate([*draft, None]):
        reference.fill_mask(expected, 0)
        assert torch.equal(bitmask[i], expected[0])
        if token is not None:
            reference.accept_token(token)
    # The model accepts draft[:k] and corrects draft[k]: the matcher follows the emitted text.
    k = next(i for i in range(len(draft)) if _other_allowed(bitmask[i], draft[i]) is not None)
    correction = _other_allowed(bitmask[k], draft[k])
    assert correction is not None and commit_draft(matcher, draft, DraftVerdict(k, correction))
    replay = compiled.new_matcher()
    assert all(replay.accept_token(t) for t in [*draft[:k], correction])
    assert matcher.jump_forward_string() == replay.jump_forward_string()
    with pytest.raises(ValueError, match="not allowed"):
        fill_draft_masks(compiled.new_matcher(), [draft[1]], bitmask, 0)


def _other_allowed(row: torch.Tensor, exclude: int) -> int | None:
    for token in range(row.shape[0] * 32):
        if token != exclude and (int(row[token // 32]) >> (token % 32)) & 1:
            return token
    return None


def test_verify_draft_greedy() -> None:
    scores = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    assert verify_draft([1, 0], scores, True, random.random) == DraftVerdict(2, 2)
    assert verify_draft([1, 2], scores, True, random.random) == DraftVerdict(1, 0)
    assert verify_draft([2, 0], scores, True, random.random) == DraftVerdict(0, 1)
    with pytest.raises(ValueError, match="score rows"):
        verify_draft([1], scores, True, random.random)


def test_verify_draft_sampling_extremes() -> None:
    probs = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    assert verify_draft([1, 0], probs, False, random.Random(0).random) == DraftVerdict(2, 2)
    never = torch.tensor([[0.5, 0.0, 0.5], [1.0, 0.0, 0.0]])
    verdict = verify_draft([1], never, False, random.Random(0).random)
    assert verdict.accepted == 0 and verdict.next_token in (0, 2)


SCHEMA_NAMES = ["long_fixed_keys", "event", "nested_objects", "oneof_disjoint", "const_object"]


@pytest.mark.parametrize("name", SCHEMA_NAMES)
def test_greedy_output_identical_with_jump_forward(
    name: str, decoder: ConstrainedDecoder, service: GrammarService
) -> None:
    schema = dict(SCHEMAS)[name]
    compiled = service.compile(GrammarSpec.for_json_schema(schema))
    plain = decoder.generate_jump_forward(compiled, 96, jump_forward=False)
    fast = decoder.generate_jump_forward(compiled, 96, jump_forward=True)
    assert fast.token_ids == plain.token_ids
    assert fast.terminated == plain.terminated
    assert fast.forward_steps <= plain.forward_steps
    if plain.terminated:
        validate_output(schema, plain.text)
    if name == "long_fixed_keys":
        compact = service.compile(GrammarSpec.for_json_schema(schema, COMPACT))
        plain = decoder.generate_jump_forward(compact, 96, jump_forward=False)
        fast = decoder.generate_jump_forward(compact, 96, jump_forward=True)
        assert fast.token_ids == plain.token_ids
        assert fast.forward_steps < 0.75 * plain.forward_steps, (fast, plain)


def test_greedy_tool_call_identical_with_jump_forward(
    decoder: ConstrainedDecoder, service: GrammarService
) -> None:
    tools = [
        {
            "name": "lookup_customer_record",
            "parameters": {
                "type": "object",
                "properties": {"id": {"type": "integer"}},
                "required": ["id"],
            },
        }
    ]
    compiled = service.compile(GrammarSpec.for_tool_calls(tools, parallel=False))
    plain = decoder.generate_jump_forward(compiled, 64, jump_forward=False)
    fast = decoder.generate_jump_forward(compiled, 64, jump_forward=True)
    assert fast.token_ids == plain.token_ids
    assert fast.forward_steps < plain.forward_steps


def test_sampled_jump_forward_output_is_valid(
    decoder: ConstrainedDecoder, service: GrammarService
) -> None:
    schema = dict(SCHEMAS)["event"]
    compiled = service.compile(GrammarSpec.for_json_schema(schema))
    for seed in range(3):
        result = decoder.generate_jump_forward(compiled, 160, True, temperature=1.0, seed=seed)
        if result.terminated:
            validate_output(schema, result.text)


# --- The distribution is exactly token-by-token constrained decoding's ----------------------


def _toy_logits(prefix: list[int], vocab: int) -> torch.Tensor:
    """A deterministic stand-in model: logits depend on the whole prefix."""
    seed = hash(tuple(prefix)) % (2**62)
    return 2.0 * torch.randn(vocab, generator=torch.Generator().manual_seed(seed))


def _masked_probs(matcher: GrammarMatcher, prefix: list[int], vocab: int) -> torch.Tensor:
    bitmask = allocate_bitmask(1, vocab)
    matcher.fill_mask(bitmask, 0)
    logits = _toy_logits(prefix, vocab).unsqueeze(0)
    kernels.apply_token_bitmask(logits, bitmask)
    return torch.softmax(logits[0].double(), -1)


def _exact_distribution(compiled: CompiledGrammar, vocab: int) -> dict[tuple[int, ...], float]:
    """Token-by-token constrained decoding's probability of every complete output."""
    result: dict[tuple[int, ...], float] = {}

    def visit(matcher: GrammarMatcher, prefix: list[int], mass: float) -> None:
        if matcher.is_terminated():
            result[tuple(prefix)] = mass
            return
        probs = _masked_probs(matcher, prefix, vocab)
        for token in probs.nonzero().flatten().tolist():
            assert matcher.accept_token(token)
            visit(matcher, [*prefix, token], mass * float(probs[token]))
            matcher.rollback(1)

    visit(compiled.new_matcher(), [], 1.0)
    return result


def _sample_with_jump_forward(
    compiled: CompiledGrammar, vocab: int, rng: random.Random, stats: Counter[str]
) -> tuple[int, ...]:
    matcher = compiled.new_matcher()
    prefix: list[int] = []
    while not matcher.is_terminated():
        draft = matcher.jump_forward_tokens(8)
        if not draft:
            probs = _masked_probs(matcher, prefix, vocab)
            token = int(
                torch.multinomial(
                    probs, 1, generator=torch.Generator().manual_seed(rng.getrandbits(62))
                )
            )
            assert matcher.accept_token(token)
            prefix.append(token)
            continue
        bitmask = allocate_bitmask(len(draft) + 1, vocab)
        fill_draft_masks(matcher, draft, bitmask, 0)
        logits = torch.stack(
            [_toy_logits(prefix + draft[:i], vocab) for i in range(len(draft) + 1)]
        )
        kernels.apply_token_bitmask(logits, bitmask)
        verdict = verify_draft(draft, torch.softmax(logits.double(), -1), False, rng.random)
        assert commit_draft(matcher, draft, verdict)
        stats["drafts"] += 1
        stats["rejected"] += verdict.accepted < len(draft)
        prefix += [*draft[: verdict.accepted], verdict.next_token]
    return tuple(prefix)


def _chi_square_p_value(statistic: float, dof: int) -> float:
    """Upper tail of chi-square (Wilson-Hilferty normal approximation)."""
    z = ((statistic / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_sampled_distribution_matches_token_by_token(
    service: GrammarService, tokenizer: Any
) -> None:
    vocab = 4096
    compiled = service.compile(GrammarSpec.for_regex("ab(c|d)ef(g|hh)"))
    exact = _exact_distribution(compiled, vocab)
    assert abs(sum(exact.values()) - 1.0) < 1e-9 and len(exact) >= 4
    rng, stats, samples = random.Random(1234), Counter[str](), 4000
    counts = Counter(_sample_with_jump_forward(compiled, vocab, rng, stats) for _ in range(samples))
    assert set(counts) <= set(exact)
    assert stats["drafts"] > samples and stats["rejected"] > 100  # drafts were used and refused
    bins: list[tuple[float, int]] = []
    rest_expected, rest_observed = 0.0, 0
    for outcome, p in exact.items():
        if p * samples >= 5:
            bins.append((p * samples, counts[outcome]))
        else:
            rest_expected += p * samples
            rest_observed += counts[outcome]
    if rest_expected > 0:
        bins.append((rest_expected, rest_observed))
    statistic = sum((observed - expected) ** 2 / expected for expected, observed in bins)
    assert len(bins) >= 3
    assert _chi_square_p_value(statistic, len(bins) - 1) > 1e-3, (statistic, bins)
