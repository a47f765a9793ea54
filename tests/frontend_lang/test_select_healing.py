"""select: the healed boundary between prefix and choice, and the greedy-token rule."""

from __future__ import annotations

import pytest

import frontend_lang as fl
from runtime.program.select_math import greedy_token_index, heal_boundary


def test_heal_boundary_is_the_first_departure_over_all_choices():
    prefix = [5, 6, 7]
    assert heal_boundary(prefix, [[5, 6, 7, 8], [5, 6, 7, 9, 9]]) == 3  # natural boundary
    assert heal_boundary(prefix, [[5, 6, 7, 8], [5, 6, 10]]) == 2  # one choice merges 7
    assert heal_boundary(prefix, [[5, 11], [5, 6, 7, 8]]) == 1
    assert heal_boundary([], [[1], [2]]) == 0


def test_greedy_token_keeps_the_best_at_each_position():
    assert greedy_token_index([[-1.0, -5.0], [-1.0, -2.0], [-3.0]]) == 1
    # A shorter choice is padded with its mean: -1.0 loses to -0.5 at position 1.
    assert greedy_token_index([[-1.0], [-1.0, -0.5]]) == 1
    assert greedy_token_index([[-2.0, -9.0], [-2.5, -0.1]]) == 0
    assert greedy_token_index([[-1.0], [-1.0]]) == 0  # ties: the earlier choice


@fl.function
def answer(s: fl.ProgramState, prefix: str, choices: list[str]) -> None:
    s += prefix + fl.select("pick", choices=choices)


def test_a_trailing_space_does_not_change_the_scores(backend: fl.Backend, engine_backend):
    """ "The answer is " + "yes" and "The answer is" + " yes" are the same text; the first ends
    the prefix mid-token (" " merges with "yes" into " y"+"es"). Healing scores both alike."""
    tokenizer = engine_backend.engine.tokenizer
    split = tokenizer("The answer is ").input_ids
    whole = tokenizer("The answer is yes").input_ids
    assert split[:-1] == whole[: len(split) - 1] and split[-1] != whole[len(split) - 1]

    spaced = answer.run(prefix="The answer is ", choices=["yes", "no"], backend=backend)
    natural = answer.run(prefix="The answer is", choices=[" yes", " no"], backend=backend)
    healed, plain = spaced.get_meta_info("pick"), natural.get_meta_info("pick")
    assert healed["healed_tokens"] == 1 and plain["healed_tokens"] == 0
    assert healed["scores"] == pytest.approx(plain["scores"], abs=1e-4)
    assert spaced["pick"] == natural["pick"].lstrip()

    # Without healing, "yes" would be scored as its own tokens after the lone " " token.
    naive = engine_backend.engine.generate(
        input_ids=split + tokenizer("yes", add_special_tokens=False).input_ids,
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=len(split),
    )
    naive_lps = [lp for lp, _ in naive["meta_info"]["input_token_logprobs"]]
    assert sum(naive_lps) / len(naive_lps) != pytest.approx(healed["scores"][0], abs=1e-3)
