"""Engine: batching, prefix caching, chunked prefill and memory pressure leave outputs unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime import Engine
from tests.runtime.helpers import hf_greedy, random_prompts

GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path):
    with Engine(tiny_model_path, max_total_tokens=8192, debug_invariants=True) as eng:
        yield eng


def _ids(results: list[dict]) -> list[list[int]]:
    return [r["output_ids"] for r in results]


def test_batched_greedy_equals_alone_equals_transformers(engine: Engine, tiny_model_path: Path):
    prompts = random_prompts([3, 9, 17, 30, 45, 64, 100, 150], seed=1)
    batched = _ids(engine.generate(input_ids=prompts, sampling_params=GREEDY))
    engine.flush_cache()
    alone = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
    assert batched == alone
    for prompt, out in zip(prompts, batched, strict=True):
        assert out == hf_greedy(tiny_model_path, prompt, 24)


@pytest.mark.parametrize("page_size", [1, 4])
def test_shared_prefix_is_cached_and_changes_nothing(tiny_model_path: Path, page_size: int):
    shared, tail_a, tail_b = random_prompts([50, 7, 11], seed=2)
    with Engine(
        tiny_model_path, max_total_tokens=4096, page_size=page_size, debug_invariants=True
    ) as eng:
        first = eng.generate(input_ids=shared + tail_a, sampling_params=GREEDY)
        second = eng.generate(input_ids=shared + tail_b, sampling_params=GREEDY)
        eng.check_invariants()
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] == 50 - 50 % page_size
    with Engine(tiny_model_path, max_total_tokens=4096, disable_radix_cache=True) as eng:
        uncached = eng.generate(input_ids=shared + tail_b, sampling_params=GREEDY)
    assert uncached["meta_info"]["cached_tokens"] == 0
    assert second["output_ids"] == uncached["output_ids"]


def test_repeated_prompt_hits_all_but_last_token(engine: Engine):
    prompt = random_prompts([40], seed=3)[0]
    engine.generate(input_ids=prompt, sampling_params=GREEDY)
    again = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] == 39


def test_chunked_prefill_gives_the_same_tokens(tiny_model_path: Path):
    prompt = random_prompts([200], seed=4)[0]
    outputs = []
    for chunk in (16, 0):
        with Engine(
            tiny_model_path,
            max_total_tokens=4096,
            chunked_prefill_size=chunk,
            debug_invariants=True,
        ) as eng:
            outputs.append(eng.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"])
    assert outputs[0] == outputs[1]


def test_decodes_keep_running_during_a_long_chunked_prefill(tiny_model_path: Path):
    """A long prompt arriving mid-stream is prefilled in chunks between decode steps."""
    long_prompt, short_prompt = random_prompts([600, 5], seed=5)
    with Engine(tiny_model_path, max_total_tokens=4096, chunked_prefill_size=32) as eng:
        stream = eng.generate(
            input_ids=short_prompt, stream=True, sampling_params={**GREEDY, "max_new_tokens": 40}
        )
        next(stream)
        import threading

        result: dict = {}
        thread = threading.Thread(
            target=lambda: result.update(
                eng.generate(input_ids=long_prompt, sampling_params={**GREEDY, "max_new_tokens": 1})
            )
        )
        thread.start()
        chunks = list(stream)
        thread.join()
        steps = eng.get_server_info()["forward_steps"]
    assert chunks[-1]["meta_info"]["completion_tokens"] == 40
    assert result["meta_info"]["completion_tokens"] == 1
    # 600 tokens in chunks of 32 is 19 chunks; run one after another with 40 decodes that is
    # about 59 forwards, interleaved about 41.
    assert steps < 55


@pytest.mark.parametrize("page_size", [1, 4])
def test_memory_pressure_retracts_and_finishes_everything(tiny_model_path: Path, page_size: int):
    prompts = random_prompts([20 + 3 * i for i in range(32)], seed=6)
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    with Engine(tiny_model_path, max_total_tokens=4096, page_size=page_size) as eng:
        expected = _ids(eng.generate(input_ids=prompts, sampling_params=params))
    with Engine(
        tiny_model_path,
        max_total_tokens=640,
        page_size=page_size,
        chunked_prefill_size=64,
        debug_invariants=True,
    ) as eng:
        pressured = _ids(eng.generate(input_ids=prompts, sampling_params=params))
        info = eng.get_server_info()
        eng.check_invariants()
        assert eng.flush_cache()
        after_flush = eng.get_server_info()
    assert pressured == expected
    assert info["num_retracted_reqs"] > 0
    assert after_flush["kv_free_tokens"] == after_flush["max_total_tokens"]


def test_request_larger_than_the_pool_gets_an_error(tiny_model_path: Path):
    with Engine(tiny_model_path, max_total_tokens=64) as eng:
        with pytest.raises(ValueError, match="KV pool holds 64"):
            eng.generate(input_ids=list(range(10, 110)), sampling_params=GREEDY)
        # A prompt that fits but whose output outgrows the pool finishes with an error too.
        with pytest.raises(ValueError, match="more KV than the pool"):
            eng.generate(
                input_ids=list(range(10, 50)), sampling_params={**GREEDY, "max_new_tokens": 100}
            )
        assert eng.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)["output_ids"]
        eng.check_invariants()


@pytest.mark.parametrize("policy", ["fcfs", "dfs-weight"])
def test_schedule_policies_agree(tiny_model_path: Path, policy: str):
    shared = random_prompts([40], seed=7)[0]
    prompts = [shared + tail for tail in random_prompts([3, 8, 5, 12], seed=8)]
    with Engine(
        tiny_model_path, max_total_tokens=4096, schedule_policy=policy, debug_invariants=True
    ) as eng:
        outs = _ids(eng.generate(input_ids=prompts, sampling_params=GREEDY))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out == hf_greedy(tiny_model_path, prompt, 24)


def test_in_batch_prefix_sharing_computes_the_prefix_once(tiny_model_path: Path):
    shared = random_prompts([120], seed=9)[0]
    prompts = [shared + tail for tail in random_prompts([4, 6, 5], seed=10)]
    with Engine(tiny_model_path, max_total_tokens=4096) as eng:
        results = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    cached = sorted(r["meta_info"]["cached_tokens"] for r in results)
    assert cached == [0, 120, 120]


@pytest.mark.parametrize("page_size", [1, 4])
def test_requests_lending_a_prefix_in_one_step_match_each_alone(
    tiny_model_path: Path, page_size: int
):
    """One batch of prompts sharing uncached prefixes (nested: some share 37 tokens, some 20):
    the first admitted computes each shared part and the others read its slots in the same
    forward (KVCacheManager.lend). Tokens and prompt logprobs equal each prompt run alone
    without a cache, with chunked prefill in play and the invariants checked every step."""
    shared = random_prompts([37], seed=11)[0]
    tails = random_prompts([1, 3, 6, 2, 9, 5], seed=12)
    prompts = [shared + t for t in tails[:4]] + [shared[:20] + t for t in tails[4:]]
    kwargs = {"return_logprob": True, "logprob_start_len": 22}
    with Engine(
        tiny_model_path, max_total_tokens=4096, page_size=page_size, chunked_prefill_size=48,
        debug_invariants=True,
    ) as eng:  # fmt: skip
        together = eng.generate(input_ids=prompts, sampling_params=GREEDY, **kwargs)
        eng.check_invariants()
    with Engine(tiny_model_path, max_total_tokens=4096, disable_radix_cache=True) as eng:
        alone = [eng.generate(input_ids=p, sampling_params=GREEDY, **kwargs) for p in prompts]
    assert _ids(together) == _ids(alone)
    for a, b in zip(together, alone, strict=True):
        got, want = a["meta_info"]["input_token_logprobs"], b["meta_info"]["input_token_logprobs"]
        assert [t for _, t in got] == [t for _, t in want]
        assert torch.allclose(
            torch.tensor([v for v, _ in got]), torch.tensor([v for v, _ in want]), atol=1e-5
        )
    # Borrowed prefix tokens count as cached: every prompt but the first of each group.
    assert sum(r["meta_info"]["cached_tokens"] > 0 for r in together) >= len(prompts) - 2
