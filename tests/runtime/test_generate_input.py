"""One generate call validated and expanded the same way for the Engine and the HTTP APIs."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.errors import RequestError
from runtime.generate_input import (
    GenerateInput,
    LogprobOptions,
    SubRequest,
    expand,
)
from runtime.request_checks import InvalidRequestValue
from runtime.sampling_params import InvalidSamplingParams, RequestLimits, SamplingParams

LIMITS = RequestLimits(vocab_size=100, max_n=8)
NO_LOGPROBS = LogprobOptions()


def _parse(
    text: Any = None,
    input_ids: Any = None,
    sampling_params: Any = None,
    rid: Any = None,
    logprobs: LogprobOptions = NO_LOGPROBS,
    text_field: str = "text",
) -> GenerateInput:
    return GenerateInput.parse(
        text, input_ids, sampling_params, rid, logprobs, LIMITS, text_field=text_field
    )


async def _fake_tokenize(text: str, field: str) -> list[int]:
    return [len(text) % 100, 1]


def _subs(request: GenerateInput) -> list[SubRequest]:
    return asyncio.run(request.sub_requests(_fake_tokenize))


@pytest.mark.parametrize(
    ("text", "rid", "n", "expected"),
    [
        pytest.param("a", "r", 1, ["r"], id="one-prompt"),
        pytest.param("a", "r", 3, ["r-0", "r-1", "r-2"], id="one-prompt-n3"),
        pytest.param(["a"], "r", 1, ["r-0"], id="batch-of-one"),
        pytest.param(["a", "b"], "r", 1, ["r-0", "r-1"], id="batch"),
        pytest.param(["a", "b"], "r", 2, ["r-0-0", "r-0-1", "r-1-0", "r-1-1"], id="batch-n2"),
        pytest.param(["a", "b"], ["x", "y"], 1, ["x", "y"], id="rid-per-prompt"),
        pytest.param(["a", "b"], ["x", "y"], 2, ["x-0", "x-1", "y-0", "y-1"], id="rid-list-n2"),
        pytest.param(["a", "b"], None, 2, [None] * 4, id="no-rid"),
    ],
)
def test_sub_request_ids_follow_the_shape_of_the_request(
    text: Any, rid: Any, n: int, expected: list[str | None]
) -> None:
    subs = _subs(_parse(text, sampling_params={"n": n}, rid=rid))
    assert [sub.rid for sub in subs] == expected


def test_token_id_prompts_are_named_like_text_prompts() -> None:
    by_ids = _subs(_parse(input_ids=[[1, 2], [3]], sampling_params={"n": 2}, rid="r"))
    by_text = _subs(_parse(["a", "b"], sampling_params={"n": 2}, rid="r"))
    assert [s.rid for s in by_ids] == [s.rid for s in by_text]
    assert [s.input_ids for s in by_ids] == [[1, 2], [1, 2], [3], [3]]


def test_expansion_is_prompt_major_with_seed_plus_j_per_sample() -> None:
    params = [{"n": 2, "seed": 10}, {"n": 3, "seed": 2**63 - 2}]
    request = _parse(input_ids=[[1], [2]], sampling_params=params)
    subs = _subs(request)
    assert [(s.prompt_index, s.sample_index) for s in subs] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
        (1, 2),
    ]
    assert [s.input_ids for s in subs] == [[1], [1], [2], [2], [2]]
    assert [s.sampling.seed for s in subs] == [10, 11, 2**63 - 2, 2**63 - 1, -(2**63)]
    assert all(s.sampling.n == 1 for s in subs)


def test_one_sampling_params_apply_to_every_prompt() -> None:
    request = _parse(["a", "b", "c"], sampling_params={"temperature": 0.5})
    assert [p.temperature for p in request.sampling] == [0.5] * 3
    assert request.is_batch and len(_subs(request)) == 3


def test_a_single_prompt_is_not_a_batch() -> None:
    assert not _parse("a").is_batch
    assert not _parse(input_ids=[1, 2]).is_batch
    assert _parse(["a"]).is_batch
    assert _parse(input_ids=[[1, 2]]).is_batch


def test_logprob_options_reach_every_sub_request() -> None:
    logprobs = LogprobOptions(True, 0, 5)
    subs = _subs(_parse(["a", "b"], sampling_params={"n": 2}, logprobs=logprobs))
    assert all(sub.logprobs == logprobs for sub in subs)


def test_texts_are_tokenized_under_their_field_names() -> None:
    fields: list[str] = []

    async def tokenize(text: str, field: str) -> list[int]:
        fields.append(field)
        return [1]

    asyncio.run(_parse(["a", "b"], text_field="prompt").sub_requests(tokenize))
    asyncio.run(_parse("a").sub_requests(tokenize))
    assert fields == ["prompt.0", "prompt.1", "text"]


def test_expand_without_ids_for_the_openai_apis() -> None:
    sampling = SamplingParams(n=2, seed=1)
    subs = expand([[1], [2, 3]], [sampling, sampling])
    assert [s.rid for s in subs] == [None] * 4
    assert [s.input_ids for s in subs] == [[1], [1], [2, 3], [2, 3]]
    assert [s.sampling.seed for s in subs] == [1, 2, 1, 2]
    assert all(s.logprobs == NO_LOGPROBS for s in subs)


@pytest.mark.parametrize(
    ("kwargs", "field", "message"),
    [
        pytest.param({}, "text", "give text or input_ids", id="neither"),
        pytest.param({"text_field": "prompt"}, "prompt", "give prompt or input_ids", id="engine"),
        pytest.param({"text": "a", "input_ids": [1]}, "input_ids", "not both", id="both"),
        pytest.param({"text": []}, "text", "the batch is empty", id="empty-text-batch"),
        pytest.param(
            {"text": ["a", "b"], "sampling_params": [{}]},
            "sampling_params",
            "1 given for 2 prompts",
            id="sampling-params-count",
        ),
        pytest.param(
            {"text": ["a", "b"], "rid": ["x"]}, "rid", "1 given for 2 prompts", id="rid-count"
        ),
        pytest.param({"text": ["a", 5]}, "text.1", "expected text, got int", id="not-text"),
        pytest.param(
            {"text": ["a", 5], "text_field": "prompt"}, "prompt.1", "expected text", id="prompt"
        ),
        pytest.param({"text": "a\ud800"}, "text", "lone surrogate", id="surrogate"),
        pytest.param(
            {"input_ids": [[1], [2, 100]]}, "input_ids.1", "outside the vocabulary", id="vocab"
        ),
        pytest.param({"input_ids": [1, 200]}, "input_ids", "outside the vocabulary", id="vocab1"),
        pytest.param({"input_ids": [[1], 2]}, "input_ids.1", "list of token ids", id="ragged"),
        pytest.param(
            {"text": "a", "logprobs": LogprobOptions(True, -2, 0)},
            "logprob_start_len",
            "-1 (none) or >= 0",
            id="logprob-start",
        ),
        pytest.param(
            {"text": "a", "logprobs": LogprobOptions(True, -1, 5000)},
            "top_logprobs_num",
            "[0, 1024]",
            id="top-logprobs",
        ),
    ],
)
def test_invalid_requests_name_the_field(kwargs: dict[str, Any], field: str, message: str) -> None:
    with pytest.raises(InvalidRequestValue, match=re.escape(message)) as info:
        _parse(**kwargs)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
    assert isinstance(info.value, RequestError) and info.value.status_code == 400


def test_invalid_sampling_params_name_the_parameter() -> None:
    with pytest.raises(InvalidSamplingParams) as info:
        _parse(["a", "b"], sampling_params=[{}, {"n": 9}])
    assert info.value.field == "n"
    with pytest.raises(InvalidSamplingParams, match="must be an object"):
        _parse("a", sampling_params="greedy")


@given(
    ns=st.lists(st.integers(1, 8), min_size=1, max_size=6),
    batch=st.booleans(),
    rid=st.sampled_from(["r", "req-7"]),
    seed=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
)
def test_expansion_matches_a_reference(ns: list[int], batch: bool, rid: str, seed: int | None):
    """Every sample of every prompt once, in prompt-major order, with distinct ids that start
    with the caller's rid, and seed + j wrapped within int64."""
    if not batch:
        ns = ns[:1]
    params = [{"n": n, "seed": seed} for n in ns]
    texts = [f"prompt {i}" for i in range(len(ns))]
    request = _parse(texts if batch else texts[0], sampling_params=params, rid=rid)
    subs = _subs(request)
    expected = [(i, j) for i, n in enumerate(ns) for j in range(n)]
    assert [(s.prompt_index, s.sample_index) for s in subs] == expected
    ids = [s.rid for s in subs]
    assert len(set(ids)) == len(ids)
    for sub in subs:
        assert sub.rid is not None and sub.rid.startswith(rid)
        parts = sub.rid[len(rid) :].split("-")[1:]
        expected_parts = ([str(sub.prompt_index)] if batch else []) + (
            [str(sub.sample_index)] if ns[sub.prompt_index] > 1 else []
        )
        assert parts == expected_parts
        if seed is not None:
            assert sub.sampling.seed == (seed + sub.sample_index + 2**63) % 2**64 - 2**63


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (True, "token ids must be integers, got True"),
        (2.0, "token ids must be integers, got 2.0"),
        (-1, "token id -1 at index 77 is outside the vocabulary [0, 100)"),
        (100, "token id 100 at index 77 is outside the vocabulary [0, 100)"),
        ("7", "token ids must be integers, got '7'"),
    ],
)
def test_a_bad_token_id_anywhere_in_a_long_prompt_is_named(bad: Any, message: str):
    """The fast path for lists of ints must not let a bool, a float or an out-of-range id
    through, wherever it sits; numpy integers are accepted."""
    import numpy as np

    from runtime.request_checks import check_token_ids

    ids: list[Any] = list(range(100)) * 3
    check_token_ids(ids, 100, "input_ids")
    check_token_ids([np.int64(3), *ids], 100, "input_ids")
    ids[77] = bad
    with pytest.raises(InvalidRequestValue, match=re.escape(message)):
        check_token_ids(ids, 100, "input_ids")
