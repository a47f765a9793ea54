"""The reasoning gate's states, the sampling params that ask for it, and the mask bit it adds."""

from __future__ import annotations

import pytest
import torch

from grammar import allocate_bitmask, allow_token
from runtime.sampling_params import InvalidSamplingParams, SamplingParams
from runtime.scheduler.reasoning_gate import reasoning_gate

START, END, NEWLINE, WORD = 10, 11, 12, 13
SCHEMA = {"type": "boolean"}


class FakeMatcher:
    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed
        self.accepted: list[int] = []

    def accept_token(self, token: int) -> bool:
        if token not in self.allowed:
            return False
        self.accepted.append(token)
        return True


def _blank(token: int) -> bool:
    return token == NEWLINE


def _params(**reasoning: int) -> SamplingParams:
    return SamplingParams.from_dict({"json_schema": SCHEMA, **reasoning}, 100)


def test_without_an_end_token_there_is_no_gate():
    assert reasoning_gate(_params(), [WORD], FakeMatcher(set()), _blank) is None


def test_a_prompt_that_closed_the_reasoning_is_constrained_from_the_start():
    for prompt in ([WORD, START, END], [WORD, START, END, NEWLINE, NEWLINE]):
        params = _params(reasoning_end_token_id=END, reasoning_start_token_id=START)
        assert reasoning_gate(params, prompt, FakeMatcher(set()), _blank) is None


@pytest.mark.parametrize(
    ("prompt", "start", "opening"),
    [
        ([WORD, START, NEWLINE], START, False),  # the template opened the reasoning
        ([WORD, START], None, False),
        ([WORD], None, False),  # deepseek-r1 style: the output starts inside it
        ([WORD, END, WORD], START, True),  # qwen3 style: the model may open it or not
        ([NEWLINE], START, True),
    ],
)
def test_where_the_output_starts(prompt: list[int], start: int | None, opening: bool):
    reasoning = {"reasoning_end_token_id": END}
    if start is not None:
        reasoning["reasoning_start_token_id"] = start
    gate = reasoning_gate(_params(**reasoning), prompt, FakeMatcher(set()), _blank)
    assert gate is not None and gate.opening is opening


def test_thinking_waits_for_the_end_token_which_the_matcher_never_sees():
    matcher = FakeMatcher({WORD})
    gate = reasoning_gate(_params(reasoning_end_token_id=END), [WORD], matcher, _blank)
    assert gate is not None
    assert [gate.advance(t) for t in (WORD, START, NEWLINE, END)] == [False] * 3 + [True]
    assert matcher.accepted == []


def test_opening_goes_to_thinking_on_the_start_token_and_to_the_grammar_otherwise():
    params = _params(reasoning_end_token_id=END, reasoning_start_token_id=START)
    gate = reasoning_gate(params, [WORD], FakeMatcher({WORD}), _blank)
    assert gate is not None and gate.opening
    assert gate.advance(START) is False and not gate.opening
    assert gate.advance(WORD) is False and gate.advance(END) is True

    matcher = FakeMatcher({WORD})
    gate = reasoning_gate(params, [WORD], matcher, _blank)
    assert gate is not None and gate.advance(WORD) is True
    assert matcher.accepted == [WORD]  # the answer's first token is the grammar's

    gate = reasoning_gate(params, [WORD], FakeMatcher(set()), _blank)
    assert gate is not None
    with pytest.raises(RuntimeError, match="rejected its first token"):
        gate.advance(WORD)


@pytest.mark.parametrize(
    ("params", "field", "message"),
    [
        ({"reasoning_end_token_id": END}, "reasoning_end_token_id", "needs a constraint"),
        (
            {"json_schema": SCHEMA, "reasoning_start_token_id": START},
            "reasoning_start_token_id",
            "needs reasoning_end_token_id",
        ),
        (
            {"json_schema": SCHEMA, "reasoning_end_token_id": END, "reasoning_start_token_id": END},
            "reasoning_start_token_id",
            "must differ",
        ),
        (
            {"json_schema": SCHEMA, "reasoning_end_token_id": 100},
            "reasoning_end_token_id",
            "outside the vocabulary",
        ),
        ({"regex": "a", "reasoning_end_token_id": -1}, "reasoning_end_token_id", "greater"),
        ({"regex": "a", "reasoning_end_token_id": "11"}, "reasoning_end_token_id", "integer"),
    ],
)
def test_invalid_reasoning_tokens_name_the_field(params: dict, field: str, message: str):
    with pytest.raises(InvalidSamplingParams, match=message) as info:
        SamplingParams.from_dict(params, 100)
    assert info.value.field == field


@pytest.mark.parametrize("token", [0, 5, 31, 32, 63, 64, 99])
def test_allow_token_sets_exactly_that_bit(token: int):
    mask = allocate_bitmask(2, 100)
    mask.zero_()
    allow_token(mask, 1, token)
    bits = [(int(mask[1, t // 32]) >> (t % 32)) & 1 for t in range(100)]
    assert [t for t, bit in enumerate(bits) if bit] == [token]
    assert not mask[0].any() and mask.dtype == torch.int32
