"""The DRY repetition penalty: its math against a direct reading of its definition, breakers,
the request fields, and what it does to greedy decoding in the engine (alone, batched, under a
grammar, without the overlap scheduler, with speculative decoding)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime import Engine, InvalidSamplingParams
from runtime.dry_penalty import (
    MAX_DRY_PENALTY,
    DryState,
    SuffixMatches,
    dry_penalty,
    tokenizer_breakers,
)
from runtime.sampler import Sampler
from runtime.sampling_params import DEFAULT_DRY_BREAKERS, SamplingParams
from runtime.scheduler.token_array import TokenArray
from tests.runtime.helpers import hf_logprobs, random_prompts

PROMPT = random_prompts([12], seed=11)[0]  # the tiny model loops on it under greedy decoding
N = 48
DRY = {"dry_multiplier": 0.8, "dry_sequence_breakers": []}


def params(**fields: object) -> SamplingParams:
    return SamplingParams.from_dict({"dry_multiplier": 0.8, **fields})


def reference(
    context: list[int], p: SamplingParams, breakers: set[int] = frozenset()
) -> dict[int, float]:
    """The definition, read directly: for each earlier occurrence of the last token, walk back
    while both stretches agree and hold no breaker; the token after the occurrence would
    repeat a stretch that long."""
    if p.dry_penalty_last_n > 0:
        context = context[-p.dry_penalty_last_n :]
    n, longest = len(context), {}
    if n == 0 or context[-1] in breakers:
        return {}
    for i in range(n - 1):
        following = context[i + 1]
        if context[i] != context[-1] or following in breakers:
            continue
        length = 1
        while i - length >= 0:
            back = context[n - 1 - length]
            if context[i - length] != back or back in breakers:
                break
            length += 1
        if length >= p.dry_allowed_length:
            longest[following] = max(longest.get(following, 0), length)
    return {
        t: p.dry_multiplier * p.dry_base ** (length - p.dry_allowed_length)
        for t, length in longest.items()
    }


def penalties(context: list[int], p: SamplingParams, breakers: set[int] = frozenset()) -> dict:
    mask = np.zeros(64, dtype=bool)
    mask[list(breakers)] = True
    found = SuffixMatches.build(np.array(context), mask).penalties(p, mask)
    return {} if found is None else {int(t): float(v) for t, v in zip(*found, strict=True)}


def test_penalty_math_on_a_hand_made_sequence():
    # [5 6 7] repeats; the token that followed it, 8, would repeat 3 tokens.
    assert penalties([5, 6, 7, 8, 9, 5, 6, 7], params()) == pytest.approx({8: 0.8 * 1.75})
    assert penalties([5, 6, 7, 8, 9, 5, 6, 7], params(dry_allowed_length=3)) == pytest.approx(
        {8: 0.8}
    )
    assert penalties([5, 6, 7, 8, 9, 5, 6, 7], params(dry_allowed_length=4)) == {}
    # The longest match wins: the stretch ending at index 6 matches 7 tokens back.
    loop = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
    assert penalties(loop, params(dry_base=2.0)) == pytest.approx({4: 0.8 * 2.0**5})
    assert penalties(loop[-7:], params()) == pytest.approx({4: 0.8 * 1.75})
    assert reference(loop, params(dry_penalty_last_n=7)) == pytest.approx({4: 0.8 * 1.75})
    assert reference(loop, params(dry_base=2.0)) == pytest.approx({4: 0.8 * 2.0**5})


def test_breakers_end_a_match_and_are_never_penalised():
    # Without breakers, [1 2 B 1 2] repeats five tokens; with B a breaker, only [1 2] counts.
    context = [1, 2, 9, 1, 2, 7, 1, 2, 9, 1, 2]
    assert penalties(context, params()) == pytest.approx({7: 0.8 * 1.75**3, 9: 0.8})
    assert penalties(context, params(), {9}) == pytest.approx({7: 0.8})
    # A stretch that ended on a breaker: nothing repeats past it.
    assert penalties([1, 2, 3, 9, 1, 2, 3, 9], params(), {9}) == {}


def test_penalty_is_capped_without_overflow():
    huge = dry_penalty(np.array([2, 10, 10**6]), params(dry_base=1000.0, dry_multiplier=1000.0))
    assert huge.tolist() == pytest.approx([1000.0, MAX_DRY_PENALTY, MAX_DRY_PENALTY])


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    allowed=st.integers(1, 3),
    window=st.sampled_from([-1, 3, 8]),
    breaker=st.sampled_from([None, 0]),
    start=st.integers(1, 40),
)
def test_kept_state_equals_the_definition(tokens, allowed, window, breaker, start):
    """Token by token (and in catch-up steps), the kept state gives the definition's
    penalties."""
    p = params(dry_allowed_length=allowed, dry_penalty_last_n=window, dry_base=2.0)
    breakers = set() if breaker is None else {breaker}
    mask = np.zeros(4, dtype=bool)
    mask[list(breakers)] = True
    state = DryState()
    for end in range(min(start, len(tokens)), len(tokens) + 1):
        found = state.current(np.array(tokens[:end]), p, mask).penalties(p, mask)
        got = {} if found is None else {int(t): float(v) for t, v in zip(*found, strict=True)}
        assert got == pytest.approx(reference(tokens[:end], p, breakers))


def test_breaker_tokens_are_those_whose_text_contains_a_breaker():
    class Vocab:
        texts = ["a", 'b"', "\n", "c:d", "e", "*"]

        def __len__(self) -> int:
            return len(self.texts)

        def batch_decode(self, ids: list[list[int]]) -> list[str]:
            return [self.texts[i[0]] for i in ids]

    mask = tokenizer_breakers(Vocab(), 8)
    assert (
        mask(DEFAULT_DRY_BREAKERS).tolist() == [False, True, True, True, False, True] + [False] * 2
    )
    assert mask(("e",)).tolist() == [False, False, False, False, True, False, False, False]
    assert not mask(()).any()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("dry_multiplier", -0.1),
        ("dry_multiplier", 1e4),
        ("dry_base", 0.9),
        ("dry_allowed_length", 0),
        ("dry_penalty_last_n", -2),
        ("dry_sequence_breakers", [""]),
        ("dry_sequence_breakers", "\n"),
        ("dry_sequence_breakers", ["x"] * 65),
    ],
)
def test_out_of_range_fields_are_refused_by_name(field, value):
    with pytest.raises(InvalidSamplingParams) as error:
        SamplingParams.from_dict({field: value})
    assert error.value.field == field


def test_defaults_are_llama_cpp_s_and_off():
    p = SamplingParams.from_dict({})
    assert (p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_penalty_last_n) == (
        0.0,
        1.75,
        2,
        -1,
    )
    assert p.dry_sequence_breakers == ("\n", ":", '"', "*") and not p.has_dry
    assert params().has_dry and not params(dry_penalty_last_n=0).has_dry
    assert SamplingParams.from_dict({"dry_sequence_breakers": []}).dry_sequence_breakers == ()


# ---- in the engine (the tiny test model) -------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path):
    with Engine(tiny_model_path, max_total_tokens=8192) as eng:
        yield eng


def greedy(engine: Engine, prompt: list[int] = PROMPT, **fields: object) -> list[int]:
    sampling = {"max_new_tokens": N, "temperature": 0, "ignore_eos": True, **fields}
    return engine.generate(input_ids=prompt, sampling_params=sampling)["output_ids"]


def repeated_trigrams(ids: list[int]) -> int:
    grams = [tuple(ids[i : i + 3]) for i in range(len(ids) - 2)]
    return len(grams) - len(set(grams))


def test_greedy_output_is_the_argmax_of_the_penalised_logits(engine: Engine, tiny_model_path):
    base = greedy(engine)
    out = greedy(engine, **DRY)
    assert out != base
    assert repeated_trigrams(out) < repeated_trigrams(base)
    # Every token is the argmax of the model's distribution minus the definition's penalty.
    p = SamplingParams.from_dict(DRY)
    logprobs = hf_logprobs(tiny_model_path, PROMPT + out)
    for i, token in enumerate(out):
        row = logprobs[len(PROMPT) - 1 + i].clone()
        for t, penalty in reference(PROMPT + out[:i], p).items():
            row[t] -= penalty
        assert int(row.argmax()) == token, i


def test_output_only_looks_for_repeats_in_the_output_alone(engine: Engine, tiny_model_path):
    """With ``dry_output_only`` the prompt is never a repeat's source: each token is the argmax
    of the model's distribution minus the definition's penalty over the outputs so far. The
    prompt ends inside the model's own loop, so the full context's penalty differs."""
    prompt = PROMPT + greedy(engine)[:28]
    fields = {**DRY, "dry_output_only": True}
    out = greedy(engine, prompt, **fields)
    assert out != greedy(engine, prompt, **DRY)
    p = SamplingParams.from_dict(fields)
    logprobs = hf_logprobs(tiny_model_path, prompt + out)
    for i, token in enumerate(out):
        row = logprobs[len(prompt) - 1 + i].clone()
        for t, penalty in reference(out[:i], p).items():
            row[t] -= penalty
        assert int(row.argmax()) == token, i


def test_batch_rows_are_independent(engine: Engine):
    other = random_prompts([20], seed=5)[0]
    batch = engine.generate(
        input_ids=[PROMPT, PROMPT, other],
        sampling_params=[
            {"max_new_tokens": N, "temperature": 0, "ignore_eos": True, **extra}
            for extra in (DRY, {}, {"dry_multiplier": 1.5, "dry_allowed_length": 3})
        ],
    )
    assert batch[0]["output_ids"] == greedy(engine, **DRY)
    assert batch[1]["output_ids"] == greedy(engine)
    assert batch[2]["output_ids"] == greedy(engine, other, dry_multiplier=1.5, dry_allowed_length=3)


def test_a_grammar_keeps_its_output_whatever_the_penalty(engine: Engine):
    """The grammar forces a repeat: DRY penalises the only allowed token, which stays the only
    one (the masked tokens stay masked), and the output still matches."""
    pattern = "(ab){8}c"
    strong = {"dry_multiplier": 100.0, "dry_base": 3.0, "dry_sequence_breakers": []}
    out = engine.generate(
        input_ids=PROMPT, sampling_params={"regex": pattern, "temperature": 0, **strong}
    )
    assert re.fullmatch(pattern, out["text"])
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_same_output_without_overlap_and_with_speculation(engine: Engine, tiny_model_path):
    expected = greedy(engine, **DRY)
    with Engine(tiny_model_path, max_total_tokens=8192, disable_overlap_schedule=True) as plain:
        assert greedy(plain, **DRY) == expected
    with Engine(tiny_model_path, max_total_tokens=8192, speculative_algorithm="ngram") as spec:
        first = greedy(spec, **DRY)
        # The second run drafts the first's continuation from the tree: verification must
        # apply the penalty at each drafted position to accept it.
        again = spec.generate(
            input_ids=PROMPT,
            sampling_params={"max_new_tokens": N, "temperature": 0, "ignore_eos": True, **DRY},
        )
    assert first == again["output_ids"] == expected
    assert again["meta_info"]["spec_accepted_tokens"] > 0


def test_penalty_changes_logits_only_where_a_repeat_continues():
    """Sampler level: the penalty is subtracted from the continuation's logit alone."""

    sampler = Sampler(vocab_size=16, eos_token_ids=[0])
    logits = torch.zeros(1, 16)
    sampler.apply_dry_rows(logits, FakeReq([5, 6, 7, 8, 9, 5, 6, 7]), [])  # type: ignore[arg-type]
    expected = torch.zeros(16)
    expected[8] = -0.8 * 1.75
    assert torch.allclose(logits[0], expected)


class FakeReq:
    def __init__(self, ids: list[int], prompt_len: int = 0, **fields: object) -> None:
        self.sampling = params(dry_sequence_breakers=[], **fields)
        self.input_ids = ids[:prompt_len]
        self.token_ids = TokenArray(ids)
        self.dry = DryState()


def test_output_only_ignores_repeats_of_the_prompt():
    """The same tokens: a repeat of the prompt is penalised by default, not with
    ``dry_output_only``; a repeat inside the outputs is penalised either way."""
    sampler = Sampler(vocab_size=16, eos_token_ids=[0])
    ids = [5, 6, 7, 8, 9, 5, 6, 7]
    for prompt_len, output_only, penalised in [
        (5, False, {8: 0.8 * 1.75}),
        (5, True, {}),
        (0, True, {8: 0.8 * 1.75}),
        (1, True, {8: 0.8}),  # the first 5 is the prompt's: the repeat is [6, 7], 2 long
        (3, True, {}),
    ]:
        logits = torch.zeros(1, 16)
        req = FakeReq(ids, prompt_len, dry_output_only=output_only)
        sampler.apply_dry_rows(logits, req, [])  # type: ignore[arg-type]
        expected = torch.zeros(16)
        for token, penalty in penalised.items():
            expected[token] = -penalty
        assert torch.allclose(logits[0], expected), (prompt_len, output_only)
