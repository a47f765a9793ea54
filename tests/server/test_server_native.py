"""The native API of the real server: /generate equals Engine.generate; control endpoints."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from runtime import Engine
from runtime.server import ServerProcess
from tests.server.server_process import sse_payloads

pytestmark = pytest.mark.timeout(300)

GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Tree:\n    def"]


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> Iterator[Engine]:
    with Engine(tiny_model_path, max_total_tokens=8192) as eng:
        yield eng


def _generate(server: ServerProcess, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/generate", json=body, timeout=60.0)


def test_single_equals_engine(server: ServerProcess, engine: Engine):
    response = _generate(server, {"text": PROMPTS[0], "sampling_params": GREEDY})
    assert response.status_code == 200, response.text
    result = response.json()
    expected = engine.generate(PROMPTS[0], GREEDY)
    assert result["output_ids"] == expected["output_ids"]
    assert result["text"] == expected["text"]
    meta = result["meta_info"]
    assert meta["completion_tokens"] == 16
    assert meta["prompt_tokens"] == expected["meta_info"]["prompt_tokens"]
    assert meta["finish_reason"] == {"type": "length", "length": 16}
    assert meta["e2e_latency"] > 0
    # The scheduler's split of the request's time: 16 tokens took some decoding, and the three
    # phases (in the scheduler) fit in the whole request (from the server's arrival).
    phases = [meta["queue_time"], meta["prefill_time"], meta["decode_time"]]
    assert min(phases) >= 0 and meta["prefill_time"] > 0 and meta["decode_time"] > 0
    assert sum(phases) <= meta["e2e_latency"]


def test_batch_equals_engine(server: ServerProcess, engine: Engine):
    expected = engine.generate(PROMPTS, GREEDY)
    by_text = _generate(server, {"text": PROMPTS, "sampling_params": GREEDY}).json()
    assert [r["output_ids"] for r in by_text] == [e["output_ids"] for e in expected]
    assert [r["text"] for r in by_text] == [e["text"] for e in expected]
    ids = [engine.tokenizer(p).input_ids for p in PROMPTS]
    by_ids = _generate(server, {"input_ids": ids, "sampling_params": [GREEDY] * 3}).json()
    assert [r["output_ids"] for r in by_ids] == [e["output_ids"] for e in expected]


def test_stream_equals_engine(server: ServerProcess, engine: Engine):
    body = {"text": PROMPTS[1], "sampling_params": GREEDY, "stream": True}
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60.0) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        chunks = list(sse_payloads(response.iter_lines()))
    expected = engine.generate(PROMPTS[1], GREEDY)
    assert len(chunks) > 1
    assert chunks[-1]["output_ids"] == expected["output_ids"]
    assert chunks[-1]["text"] == expected["text"]
    assert "".join(c["delta"] for c in chunks) == expected["text"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert all("decode_time" not in c["meta_info"] for c in chunks[:-1])  # at the end only
    assert chunks[-1]["meta_info"]["decode_time"] > 0


def test_n_samples_and_seed(server: ServerProcess):
    params = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "n": 2, "seed": 7}
    first = _generate(server, {"text": PROMPTS[0], "sampling_params": params}).json()
    again = _generate(server, {"text": PROMPTS[0], "sampling_params": params}).json()
    assert isinstance(first, list) and len(first) == 2
    assert [r["output_ids"] for r in first] == [r["output_ids"] for r in again]
    assert all(len(r["output_ids"]) == 8 for r in first)


@pytest.mark.parametrize(
    ("text", "rid", "n"),
    [
        pytest.param(PROMPTS[0], "one", 2, id="one-prompt-n2"),
        pytest.param(PROMPTS[:2], "batch", 1, id="batch"),
        pytest.param(PROMPTS[:2], "batch-n", 2, id="batch-n2"),
        pytest.param(PROMPTS[:2], ["first", "second"], 2, id="rid-per-prompt"),
    ],
)
def test_sub_request_ids_agree_with_engine(
    server: ServerProcess, engine: Engine, text: str | list[str], rid: str | list[str], n: int
):
    """The server and the Engine name each prompt's samples alike (runtime/generate_input.py)."""
    params = {**GREEDY, "max_new_tokens": 2, "n": n}
    response = _generate(server, {"text": text, "sampling_params": params, "rid": rid})
    assert response.status_code == 200, response.text
    served = [r["meta_info"]["id"] for r in response.json()]
    results = engine.generate(text, params, rid=rid)
    per_prompt = results if isinstance(text, list) else [results]
    in_engine = []
    for samples in per_prompt:
        in_engine += [r["meta_info"]["id"] for r in (samples if n > 1 else [samples])]
    assert served == in_engine
    prompts = len(text) if isinstance(text, list) else 1
    assert len(set(served)) == prompts * n
    if isinstance(text, list) and isinstance(rid, str):
        assert served[0] == (f"{rid}-0-0" if n > 1 else f"{rid}-0")
    if isinstance(text, str):
        assert served == [f"{rid}-{j}" for j in range(n)]


def test_bad_batches_name_the_field(server: ServerProcess):
    refused = [
        ({"text": [], "sampling_params": GREEDY}, "text"),
        ({"text": PROMPTS[:2], "rid": ["only-one"]}, "rid"),
        ({"text": PROMPTS[:2], "sampling_params": [GREEDY]}, "sampling_params"),
        ({"input_ids": [[1, 2], [3, 10**6]]}, "input_ids.1"),
        ({"text": "x", "input_ids": [1]}, "input_ids"),
        ({}, "text"),
    ]
    for body, param in refused:
        response = _generate(server, body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == param, (body, response.text)


def test_logprobs_with_text(server: ServerProcess, engine: Engine):
    options = {"return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 0}
    body = {"text": PROMPTS[2], "sampling_params": GREEDY, **options}
    meta = _generate(server, {**body, "return_text_in_logprobs": True}).json()["meta_info"]
    expected = engine.generate(PROMPTS[2], GREEDY, **options)["meta_info"]
    prompt_len = expected["prompt_tokens"]
    assert len(meta["input_token_logprobs"]) == prompt_len
    assert len(meta["output_token_logprobs"]) == 16
    for (logprob, token, text), (ref_logprob, ref_token) in zip(
        meta["output_token_logprobs"], expected["output_token_logprobs"], strict=True
    ):
        assert token == ref_token and logprob == pytest.approx(ref_logprob, abs=1e-4)
        assert text == engine.tokenizer.decode([token])
    assert all(len(top) == 3 for top in meta["output_top_logprobs"])
    assert all(len(entry) == 3 for top in meta["output_top_logprobs"] for entry in top)


def test_info_and_flush(server: ServerProcess):
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    model = httpx.get(f"{server.url}/get_model_info", timeout=10).json()
    assert model["is_generation"] is True and model["context_length"] == 8192
    info = server.server_info()
    for key in ("scheduler_pid", "detokenizer_pid", "kv_usage", "cache_hit_rate", "page_size"):
        assert key in info
    assert "api_key" not in info
    # The configuration as the scheduler runs it: device defaults filled in, not None or auto.
    assert (info["device"], info["dtype"], info["kv_cache_dtype"]) == ("cpu", "float32", "fp32")
    assert (info["max_prefill_tokens"], info["chunked_prefill_size"]) == (2048, 1024)
    assert info["cuda_graph_max_bs"] > 0 and info["max_total_tokens"] > 0
    assert info["port"] == server.port and info["tool_call_format"] == "hermes"
    flushed = httpx.post(f"{server.url}/flush_cache", timeout=10)
    assert flushed.status_code == 200 and flushed.json()["success"] is True
    assert server.server_info()["kv_cached_tokens"] == 0


def test_abort_request_ends_the_request(server: ServerProcess):
    body = {
        "text": PROMPTS[0],
        "rid": "abort-me",
        "stream": True,
        "sampling_params": {**GREEDY, "max_new_tokens": 4000},
    }
    chunks: list[dict] = []
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60.0) as response:
        lines = response.iter_lines()
        payloads = sse_payloads(lines)
        chunks.append(next(payloads))
        aborter = threading.Thread(
            target=httpx.post,
            args=(f"{server.url}/abort_request",),
            kwargs={"json": {"rid": "abort-me"}, "timeout": 10},
        )
        aborter.start()
        chunks.extend(payloads)
        aborter.join()
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert chunks[-1]["meta_info"]["completion_tokens"] < 4000


def test_constrained_generation_and_bad_constraint(server: ServerProcess):
    regex = r"(yes|no), [0-9]{2}"
    params = {"temperature": 0, "max_new_tokens": 16, "regex": regex}
    result = _generate(server, {"text": "Answer:", "sampling_params": params}).json()
    assert re.fullmatch(regex, result["text"]), result["text"]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = {"temperature": 0, "max_new_tokens": 40, "json_schema": json.dumps(schema)}
    result = _generate(server, {"text": "JSON:", "sampling_params": params}).json()
    assert isinstance(json.loads(result["text"])["n"], int)
    bad = _generate(server, {"text": "x", "sampling_params": {"regex": "(unclosed"}})
    assert bad.status_code == 400 and bad.json()["error"]["message"]
