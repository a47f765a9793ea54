"""Engine: every sampling and stopping parameter changes what it should, and only that."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from runtime import Engine, InvalidSamplingParams
from tests.runtime.helpers import hf_greedy, hf_logprobs, random_prompts

PROMPT = random_prompts([12], seed=11)[0]
N = 24


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path):
    with Engine(tiny_model_path, max_total_tokens=8192, debug_invariants=True) as eng:
        yield eng


def gen(engine: Engine, prompt: list[int] = PROMPT, **params) -> dict:
    return engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": N, **params})


def sampled(engine: Engine, **params) -> list[int]:
    return gen(engine, **{"temperature": 1.0, "ignore_eos": True, **params})["output_ids"]


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine: Engine):
    alone = sampled(engine, seed=42)
    others = random_prompts([5, 30, 17], seed=12)
    batch = engine.generate(
        input_ids=[others[0], PROMPT, others[1], others[2]],
        sampling_params=[
            {"max_new_tokens": N, "temperature": 1.0, "ignore_eos": True, **extra}
            for extra in ({}, {"seed": 42}, {"seed": 7}, {"temperature": 0})
        ],
    )
    assert batch[1]["output_ids"] == alone
    assert sampled(engine, seed=43) != alone


def test_temperature_zero_is_greedy_and_temperature_matters(engine: Engine, tiny_model_path):
    assert gen(engine, temperature=0, ignore_eos=True)["output_ids"] == hf_greedy(
        tiny_model_path, PROMPT, N
    )
    assert sampled(engine, seed=1) != sampled(engine, seed=1, temperature=0.3)


def test_top_k_one_is_greedy(engine: Engine):
    greedy = gen(engine, temperature=0, ignore_eos=True)["output_ids"]
    assert sampled(engine, seed=3, top_k=1) == greedy
    assert sampled(engine, seed=3) != greedy


def test_small_top_p_and_large_min_p_collapse_to_greedy(engine: Engine):
    greedy = gen(engine, temperature=0, ignore_eos=True)["output_ids"]
    assert sampled(engine, seed=4, top_p=1e-6) == greedy
    assert sampled(engine, seed=4, min_p=0.999) == greedy
    assert sampled(engine, seed=4, top_p=0.9) != greedy


def test_top_k_limits_choices_to_the_k_most_likely(engine: Engine, tiny_model_path):
    out = gen(engine, temperature=1.0, top_k=2, seed=5, ignore_eos=True)["output_ids"]
    logprobs = hf_logprobs(tiny_model_path, PROMPT + out)
    for i, token in enumerate(out):
        top2 = logprobs[len(PROMPT) - 1 + i].topk(2).indices.tolist()
        assert token in top2


def test_logit_bias_forces_a_token(engine: Engine):
    out = gen(engine, temperature=0, logit_bias={"777": 100.0}, ignore_eos=True)["output_ids"]
    assert out == [777] * N


def test_repetition_presence_and_frequency_penalties_reduce_repeats(engine: Engine):
    """The tiny qwen-style loops repeat tokens under greedy decoding; each penalty must change
    the output and lower the number of repeated tokens."""
    base = gen(engine, temperature=0, ignore_eos=True, max_new_tokens=48)["output_ids"]
    repeats = len(base) - len(set(base))
    for name, value in (
        ("repetition_penalty", 1.8),
        ("presence_penalty", 2.0),
        ("frequency_penalty", 2.0),
    ):
        out = gen(engine, temperature=0, ignore_eos=True, max_new_tokens=48, **{name: value})[
            "output_ids"
        ]
        assert out != base, name
        assert len(out) - len(set(out)) <= repeats, name


def test_min_new_tokens_and_eos(engine: Engine):
    eos = engine.scheduler.runner.config.eos_token_ids[0]
    # A huge bias on EOS ends the output at once...
    first = gen(engine, temperature=0, logit_bias={str(eos): 100.0})
    assert first["output_ids"] == [eos]
    assert first["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    # ...unless min_new_tokens holds it off, or ignore_eos is set.
    held = gen(engine, temperature=0, logit_bias={str(eos): 100.0}, min_new_tokens=5)
    assert len(held["output_ids"]) == 6 and held["output_ids"][-1] == eos
    ignored = gen(engine, temperature=0, logit_bias={str(eos): 100.0}, ignore_eos=True)
    assert len(ignored["output_ids"]) == N


def test_max_new_tokens_gives_finish_reason_length(engine: Engine):
    out = gen(engine, temperature=0, ignore_eos=True, max_new_tokens=5)
    assert len(out["output_ids"]) == 5
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


def test_stop_token_ids(engine: Engine):
    greedy = gen(engine, temperature=0, ignore_eos=True)["output_ids"]
    stop_at = greedy[6]
    out = gen(engine, temperature=0, ignore_eos=True, stop_token_ids=[stop_at])
    assert out["output_ids"] == greedy[: greedy.index(stop_at) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}


def test_stop_string_split_across_tokens_is_matched_and_trimmed(engine: Engine):
    full = gen(engine, temperature=0, ignore_eos=True)
    ids, text = full["output_ids"], full["text"]
    tokenizer = engine.tokenizer
    # A stop string made of the end of token 5's text and the start of token 6's.
    a, b = tokenizer.decode(ids[:6]), tokenizer.decode(ids[:7])
    assert len(a) >= 2 and len(b) > len(a) + 1, "choose tokens with text"
    stop = a[-2:] + b[len(a) : len(a) + 2]
    assert stop in text
    out = gen(engine, temperature=0, ignore_eos=True, stop=[stop])
    assert out["text"] == text[: text.index(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert len(out["output_ids"]) == 7
    kept = gen(engine, temperature=0, ignore_eos=True, stop=[stop], no_stop_trim=True)
    assert kept["text"].endswith(stop) or stop in kept["text"]


def test_streaming_never_shows_the_start_of_a_stop_string(engine: Engine):
    full = gen(engine, temperature=0, ignore_eos=True)["text"]
    stop = full[10:16]
    chunks = list(
        engine.generate(
            input_ids=PROMPT,
            stream=True,
            sampling_params={
                "max_new_tokens": N,
                "temperature": 0,
                "ignore_eos": True,
                "stop": [stop],
            },
        )
    )
    streamed = "".join(c["delta"] for c in chunks)
    assert streamed == full[: full.index(stop)] == chunks[-1]["text"]


def test_skip_special_tokens(engine: Engine):
    im_end = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    params = dict(temperature=0, logit_bias={str(im_end): 100.0}, ignore_eos=True, max_new_tokens=3)
    assert gen(engine, **params)["text"] == ""
    assert gen(engine, skip_special_tokens=False, **params)["text"] == "<|im_end|>" * 3


def test_n_samples_share_the_prompt(engine: Engine):
    prompt = random_prompts([60], seed=13)[0]
    outs = engine.generate(
        input_ids=prompt,
        sampling_params={
            "max_new_tokens": N,
            "temperature": 1.0,
            "n": 3,
            "seed": 9,
            "ignore_eos": True,
        },
    )
    assert len(outs) == 3
    assert len({tuple(o["output_ids"]) for o in outs}) == 3
    assert sorted(o["meta_info"]["cached_tokens"] for o in outs)[1:] == [59, 59]


def test_prompt_logprobs_equal_a_direct_forward(engine: Engine, tiny_model_path):
    prompt = random_prompts([30], seed=14)[0]
    out = engine.generate(
        input_ids=prompt,
        return_logprob=True,
        logprob_start_len=10,
        top_logprobs_num=3,
        sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
    )
    meta = out["meta_info"]
    reference = hf_logprobs(tiny_model_path, prompt + out["output_ids"])
    input_lps = meta["input_token_logprobs"]
    assert [t for _, t in input_lps] == prompt[10:]
    for i, (lp, token) in enumerate(input_lps):
        assert math.isclose(lp, reference[9 + i, token].item(), abs_tol=1e-4)
    for i, (lp, token) in enumerate(meta["output_token_logprobs"]):
        assert math.isclose(lp, reference[len(prompt) - 1 + i, token].item(), abs_tol=1e-4)
    top = meta["output_top_logprobs"][0]
    assert [t for _, t in top] == reference[len(prompt) - 1].topk(3).indices.tolist()


def test_prompt_logprobs_from_zero_reuse_nothing_but_are_exact(engine: Engine, tiny_model_path):
    prompt = random_prompts([20], seed=15)[0]
    engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1})
    out = engine.generate(
        input_ids=prompt,
        return_logprob=True,
        logprob_start_len=0,
        sampling_params={"max_new_tokens": 1},
    )
    lps = out["meta_info"]["input_token_logprobs"]
    assert lps[0] == (None, prompt[0])
    reference = hf_logprobs(tiny_model_path, prompt)
    assert torch.allclose(
        torch.tensor([lp for lp, _ in lps[1:]]),
        reference[torch.arange(19), torch.tensor(prompt[1:])],
        atol=1e-4,
    )


def test_max_new_tokens_zero_scores_the_prompt_only(engine: Engine, tiny_model_path):
    prompt = random_prompts([15], seed=16)[0]
    out = engine.generate(
        input_ids=prompt,
        return_logprob=True,
        logprob_start_len=5,
        sampling_params={"max_new_tokens": 0},
    )
    assert out["output_ids"] == [] and out["text"] == ""
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    lps = [lp for lp, _ in out["meta_info"]["input_token_logprobs"]]
    reference = hf_logprobs(tiny_model_path, prompt)
    assert torch.allclose(
        torch.tensor(lps), reference[torch.arange(4, 14), torch.tensor(prompt[5:])], atol=1e-4
    )


def test_abort_of_a_running_request_frees_its_memory(engine: Engine):
    stream = engine.generate(
        input_ids=PROMPT,
        stream=True,
        rid="to-abort",
        sampling_params={"max_new_tokens": 500, "ignore_eos": True},
    )
    next(stream)
    assert engine.get_server_info()["num_running_reqs"] == 1
    engine.abort("to-abort")
    chunks = list(stream)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    info = engine.get_server_info()
    assert info["num_running_reqs"] == 0 and info["kv_used_tokens"] == 0
    engine.check_invariants()


def test_invalid_sampling_params_name_the_field(engine: Engine):
    with pytest.raises(InvalidSamplingParams, match="top_p"):
        gen(engine, top_p=1.5)
    with pytest.raises(InvalidSamplingParams, match="temperature"):
        gen(engine, temperature=-1)
    with pytest.raises(InvalidSamplingParams, match="bogus"):
        gen(engine, bogus=1)
    with pytest.raises(ValueError, match="logit_bias"):
        gen(engine, logit_bias={"999999": 1.0})
    assert gen(engine, temperature=0)["output_ids"]  # the engine keeps serving
