"""Validation at the edge (strict types, ranges the kernels hold, bounded lists, nesting and
surrogates), numerically safe sampling at extreme values, and request-id reuse — through the
same code the HTTP APIs use, and through the Engine."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime import Engine, InvalidSamplingParams, RequestError, SamplingParams
from runtime.request_checks import (
    MAX_JSON_DEPTH,
    InvalidRequestValue,
    check_json_value,
    json_nesting_depth,
)
from runtime.sampling_params import MAX_LOGIT_BIAS, RequestLimits
from tests.runtime.helpers import random_prompts

LIMITS = RequestLimits(vocab_size=4096, max_n=8)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"top_k": 2**64}, "top_k"),
        ({"top_k": 4097}, "top_k"),
        ({"top_k": 0}, "top_k"),
        ({"stop_regex": [5]}, "stop_regex"),
        ({"stop": 5}, "stop"),
        ({"stop": "\ud800"}, "stop"),
        ({"stop": ["x"] * 65}, "stop"),
        ({"stop": "x" * 1025}, "stop"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"stop_token_ids": [4096]}, "stop_token_ids"),
        ({"choice": 5}, "choice"),
        ({"choice": []}, "choice"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens"),
        ({"ignore_eos": "no"}, "ignore_eos"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"max_new_tokens": 16.0}, "max_new_tokens"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"n": 9}, "n"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {"4096": 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": math.nan}}, "logit_bias"),
        ({"logit_bias": {"5": math.inf}}, "logit_bias"),
        ({"regex": "a\udc00"}, "regex"),
        ({"regex": ""}, "regex"),
        ({"ebnf": ""}, "ebnf"),
        ({"json_schema": ""}, "json_schema"),
        ({"json_schema": {"type": "string", "pattern": "\ud800"}}, "json_schema"),
        ({"regex": "a", "ebnf": "root ::= 'a'"}, "ebnf"),
        ({"colour": "red"}, "colour"),
        ({"json_schema": {}, "json_format": "pretty"}, "json_format"),
        ({"json_schema": {}, "json_format": True}, "json_format"),
        ({"json_schema": {}, "grammar_max_whitespace": 65}, "grammar_max_whitespace"),
        ({"json_schema": {}, "json_format": "aligned", "grammar_max_whitespace": 0}, "json_format"),
    ],
)
def test_bad_sampling_params_name_their_field(params: dict[str, Any], field: str):
    with pytest.raises(InvalidSamplingParams) as caught:
        SamplingParams.from_dict(params, LIMITS)
    assert caught.value.field == field
    assert str(caught.value).startswith(f"sampling_params.{field}: ")


def test_seeds_wrap_within_int64_per_sample():
    params = SamplingParams.from_dict({"seed": 2**63 - 1, "n": 3}, LIMITS)
    seeds = [params.for_sample(j).seed for j in range(3)]
    assert seeds == [2**63 - 1, -(2**63), -(2**63) + 1]
    assert all(params.for_sample(j).n == 1 for j in range(3))


def test_logit_bias_is_clamped_but_bans_stay_bans():
    params = SamplingParams.from_dict({"logit_bias": {"5": 1e308, "6": -1e308, 7: -math.inf}})
    assert params.logit_bias == {5: MAX_LOGIT_BIAS, 6: -MAX_LOGIT_BIAS, 7: -math.inf}


def test_tiny_temperatures_are_greedy():
    assert SamplingParams.from_dict({"temperature": 1e-50}).is_greedy
    assert not SamplingParams.from_dict({"temperature": 0.01}).is_greedy


def test_nesting_depth_is_measured_without_parsing():
    deep = b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert json_nesting_depth(deep) == 100_001
    quoted = json.dumps({"text": "[" * 10_000, "b": [[1]]}).encode()
    assert json_nesting_depth(quoted) == 3
    assert json_nesting_depth(b'{"a": "\\"[[[["}') == 1


def test_values_are_checked_for_depth_and_surrogates_by_path():
    with pytest.raises(InvalidRequestValue) as caught:
        check_json_value({"messages": [{"content": "ok"}, {"content": "bad \udfff"}]})
    assert caught.value.field == "messages.1.content"
    nested: Any = "x"
    for _ in range(MAX_JSON_DEPTH + 1):
        nested = [nested]
    with pytest.raises(InvalidRequestValue, match="deeper than"):
        check_json_value(nested)


# ---- through the Engine ---------------------------------------------------------------------

PROMPT = random_prompts([9], seed=91)[0]


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> Iterator[Engine]:
    with Engine(tiny_model_path, max_total_tokens=4096, max_n=4) as eng:
        yield eng


def _ids(engine: Engine, params: dict[str, Any]) -> list[int]:
    return engine.generate(input_ids=PROMPT, sampling_params=params)["output_ids"]


def test_extreme_temperatures_and_biases_through_the_engine(engine: Engine):
    base = {"max_new_tokens": 8, "ignore_eos": True}
    greedy = _ids(engine, {**base, "temperature": 0})
    for tiny in (1e-50, 1e-40, 1e-6):
        assert _ids(engine, {**base, "temperature": tiny, "seed": 3}) == greedy
    for temperature in (0.0, 1.0, 2.0):
        forced = {**base, "temperature": temperature, "logit_bias": {"5": 1e308}}
        assert _ids(engine, forced) == [5] * 8
    # Two tokens pushed equally far keep their relative order (the limit distribution).
    first, second = greedy[0], (greedy[0] + 1) % 4096
    pushed = {**base, "max_new_tokens": 1, "temperature": 0}
    pushed["logit_bias"] = {str(first): 1e300, str(second): 1e300}
    assert _ids(engine, pushed) == [first]
    uniform = {**base, "temperature": 1e300, "seed": 1}
    assert len(_ids(engine, uniform)) == 8


def test_limits_apply_to_engine_requests(engine: Engine):
    with pytest.raises(InvalidSamplingParams, match="--max-n"):
        engine.generate(input_ids=PROMPT, sampling_params={"n": 5})
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.generate(input_ids=[1, 2, 99999], sampling_params={"max_new_tokens": 1})
    with pytest.raises(ValueError, match="lone surrogate"):
        engine.generate("abc\ud800", {"max_new_tokens": 1})


def test_a_reused_rid_gets_its_own_output(engine: Engine):
    """An id is free again as soon as its caller stops waiting; nothing of the old request
    reaches the new one, and nothing of it keeps running."""
    short = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    expected = _ids(engine, short)
    long = {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}
    for _ in range(10):
        stream = engine.generate(input_ids=random_prompts([5], seed=3)[0], sampling_params=long,
                                 stream=True, rid="same")  # fmt: skip
        next(stream)
        stream.close()
        again = engine.generate(input_ids=PROMPT, sampling_params=short, rid="same")
        assert again["output_ids"] == expected
        assert again["meta_info"]["id"] == "same"
    _wait_idle(engine)


def test_a_rid_in_use_is_refused(engine: Engine):
    long = {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}
    stream = engine.generate(input_ids=PROMPT, sampling_params=long, stream=True, rid="busy")
    next(stream)
    with pytest.raises(RequestError, match="already in use"):
        engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 1}, rid="busy")
    stream.close()
    _wait_idle(engine)


def _wait_idle(engine: Engine) -> None:
    import time

    deadline = time.monotonic() + 10
    while True:
        info = engine.get_server_info()
        if info["num_running_reqs"] == 0 and info["kv_used_tokens"] == 0:
            break
        assert time.monotonic() < deadline, info
        time.sleep(0.05)
    engine.check_invariants()
    assert engine.tokenizer_manager.num_tracked == 0


def test_engine_names_a_bad_json_format(engine: Engine):
    with pytest.raises(InvalidSamplingParams) as caught:
        engine.generate("x", {"json_schema": {"type": "object"}, "json_format": "pretty"})
    assert caught.value.field == "json_format"
