"""Engine API surface: async generation, streaming, server info, argument errors."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from runtime import Engine
from tests.runtime.helpers import random_prompts

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
# ServerArgs fields whose defaults (None or auto) the scheduler fills in where the device is known.
DEVICE_DEPENDENT = (
    "device", "dtype", "kv_cache_dtype", "context_length", "max_total_tokens",
    "max_prefill_tokens", "chunked_prefill_size", "cuda_graph_max_bs",
)  # fmt: skip


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path):
    with Engine(tiny_model_path, max_total_tokens=4096) as eng:
        yield eng


def test_async_generate_matches_generate(engine: Engine):
    prompts = random_prompts([5, 9], seed=20)
    expected = engine.generate(input_ids=prompts, sampling_params=GREEDY)

    async def run() -> tuple[list[dict], list[dict]]:
        batch = await engine.async_generate(input_ids=prompts, sampling_params=GREEDY)
        chunks = [
            c
            async for c in await engine.async_generate(
                input_ids=prompts[0], sampling_params=GREEDY, stream=True
            )
        ]
        return batch, chunks

    batch, chunks = asyncio.run(run())
    assert [r["output_ids"] for r in batch] == [r["output_ids"] for r in expected]
    assert chunks[-1]["output_ids"] == expected[0]["output_ids"]
    assert "".join(c["delta"] for c in chunks) == expected[0]["text"]
    assert len(chunks) > 1


def test_unknown_generate_option_is_a_type_error(engine: Engine):
    with pytest.raises(TypeError, match="max_tokens"):
        engine.generate("x", GREEDY, max_tokens=4)  # type: ignore[call-arg]

    async def run() -> None:
        await engine.async_generate("x", GREEDY, stream=True, logprobs=True)  # type: ignore[call-arg]

    with pytest.raises(TypeError, match="logprobs"):
        asyncio.run(run())


def test_text_prompts_are_tokenized_with_bos(engine: Engine):
    out = engine.generate("def f(x):", GREEDY)
    ids = engine.tokenizer("def f(x):").input_ids
    assert ids[0] == engine.tokenizer.bos_token_id
    assert out["meta_info"]["prompt_tokens"] == len(ids)


def test_server_info_reports_usage_and_args(engine: Engine):
    engine.generate(input_ids=random_prompts([30], seed=21)[0], sampling_params=GREEDY)
    info = engine.get_server_info()
    assert info["max_total_tokens"] == 4096 and info["model_path"]
    assert info["num_running_reqs"] == 0 and info["kv_used_tokens"] == 0
    assert info["kv_cached_tokens"] > 0 and info["gen_throughput"] > 0


def test_server_info_reports_the_device_defaults_as_resolved(engine: Engine):
    info = engine.get_server_info()
    assert (info["device"], info["dtype"], info["kv_cache_dtype"]) == ("cpu", "float32", "fp32")
    assert (info["max_prefill_tokens"], info["chunked_prefill_size"]) == (2048, 1024)
    assert info["cuda_graph_max_bs"] == 128  # min(max_running_requests, 160)
    assert info["context_length"] == 8192 and info["max_total_tokens"] == 4096
    assert [name for name in DEVICE_DEPENDENT if info[name] in (None, "auto")] == []


def test_abort_of_a_waiting_request(tiny_model_path: Path):
    with Engine(tiny_model_path, max_total_tokens=4096, max_running_requests=1) as eng:
        first = eng.generate(
            input_ids=[5, 6, 7],
            stream=True,
            rid="first",
            sampling_params={"max_new_tokens": 400, "ignore_eos": True},
        )
        next(first)
        second = eng.generate(
            input_ids=[8, 9],
            stream=True,
            rid="second",
            sampling_params={"max_new_tokens": 5, "ignore_eos": True},
        )
        import threading

        chunks: list[dict] = []
        reader = threading.Thread(target=lambda: chunks.extend(second))
        reader.start()
        assert eng.get_server_info()["num_waiting_reqs"] == 1
        eng.abort("second")
        reader.join(timeout=30)
        assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        assert chunks[-1]["output_ids"] == []
        eng.abort("first")
        list(first)
        eng.check_invariants()


def test_unknown_server_argument_is_named(tiny_model_path: Path):
    with pytest.raises(TypeError, match="max_totl_tokens"):
        Engine(tiny_model_path, max_totl_tokens=10)


def test_context_length_is_enforced(tiny_model_path: Path):
    with Engine(tiny_model_path, max_total_tokens=4096, context_length=64) as eng:
        with pytest.raises(ValueError, match="context length is 64"):
            eng.generate(input_ids=list(range(10, 80)), sampling_params=GREEDY)
        out = eng.generate(
            input_ids=list(range(10, 60)),
            sampling_params={"max_new_tokens": 100, "ignore_eos": True},
        )
        assert len(out["output_ids"]) == 14  # clamped to the context
