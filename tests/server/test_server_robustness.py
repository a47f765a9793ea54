"""The real server under concurrency, disconnects and bad input."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import httpx
import pytest

from runtime.server import ServerProcess
from tests.server.server_process import sse_payloads

pytestmark = pytest.mark.timeout(300)

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
LONG = {"temperature": 0, "max_new_tokens": 4000, "ignore_eos": True}


async def _stream_text(client: httpx.AsyncClient, prompt: str, params: dict) -> dict[str, Any]:
    body = {"text": prompt, "sampling_params": params, "stream": True}
    async with client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200, await response.aread()
        lines = [line async for line in response.aiter_lines()]
    chunks = list(sse_payloads(iter(lines)))
    return chunks[-1]


def _wait_idle(server: ServerProcess, within: float) -> dict[str, Any]:
    """Poll /get_server_info until no request runs and no KV is held; the info at that time."""
    deadline = time.monotonic() + within
    while True:
        info = server.server_info()
        idle = info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
        if idle and info["kv_used_tokens"] == 0:
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"KV still held {within} s after the disconnect: {info}")
        time.sleep(0.05)


def _wait_running(server: ServerProcess) -> None:
    deadline = time.monotonic() + 30
    while server.server_info()["num_running_reqs"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)


def test_32_concurrent_streams_equal_alone(server: ServerProcess):
    prompts = [f"def handler_{i}(request):\n    " for i in range(32)]

    async def run() -> tuple[list[dict], list[dict]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120.0) as client:
            together = await asyncio.gather(*(_stream_text(client, p, GREEDY) for p in prompts))
            alone = [await _stream_text(client, p, GREEDY) for p in prompts]
        return together, alone

    together, alone = asyncio.run(run())
    assert [r["output_ids"] for r in together] == [r["output_ids"] for r in alone]
    assert [r["text"] for r in together] == [r["text"] for r in alone]
    assert all(r["meta_info"]["completion_tokens"] == 12 for r in together)


def test_disconnected_stream_frees_its_kv(server: ServerProcess):
    body = {"text": "while True:", "sampling_params": LONG, "stream": True}
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=30.0) as response:
        lines = response.iter_lines()
        next(sse_payloads(lines))
        assert server.server_info()["kv_used_tokens"] > 0
    _wait_idle(server, within=1.0)


def test_disconnected_non_streaming_request_frees_its_kv(server: ServerProcess):
    body = {"text": "for item in items:", "sampling_params": LONG}
    with httpx.Client(timeout=httpx.Timeout(30.0, read=0.5)) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post(f"{server.url}/generate", json=body)  # gives up, closes the socket
    _wait_idle(server, within=1.0)


def test_bad_inputs_get_4xx_while_good_request_completes(server: ServerProcess):
    limit = server.server_info()["max_request_bytes"]
    bad_requests: list[tuple[str, dict[str, Any], int, str | None]] = [
        ("/generate", {"json": {"input_ids": [5] * 9000}}, 400, None),
        (
            "/generate",
            {"json": {"text": "x", "sampling_params": {"temperature": -1}}},
            400,
            "sampling_params.temperature",
        ),
        (
            "/generate",
            {"json": {"text": "x", "sampling_params": {"top_k": 0}}},
            400,
            "sampling_params.top_k",
        ),
        ("/generate", {"json": {"text": "x", "colour": "red"}}, 400, "colour"),
        ("/generate", {"content": b'{"text": "x", '}, 400, None),
        ("/generate", {"content": b"[1, 2]"}, 400, None),
        ("/generate", {"json": {"text": "x" * (limit + 10)}}, 413, None),
        ("/v1/completions", {"json": {"model": "m", "prompt": "x"}}, 404, "model"),
        ("/no/such/route", {"json": {}}, 404, None),
    ]

    async def run() -> tuple[dict, list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60.0) as client:
            good = asyncio.create_task(
                _stream_text(client, "import json\n", {**GREEDY, "max_new_tokens": 48})
            )
            responses = [await client.post(path, **kwargs) for path, kwargs, _, _ in bad_requests]
            return await good, responses

    good, responses = asyncio.run(run())
    for (path, _, status, param), response in zip(bad_requests, responses, strict=True):
        assert response.status_code == status, (path, response.text)
        error = response.json()["error"]
        assert error["message"] and error["type"]
        if param is not None:
            assert error["param"] == param, error
    assert "context length" in responses[0].json()["error"]["message"]
    assert good["meta_info"]["completion_tokens"] == 48
    assert good["meta_info"]["finish_reason"]["type"] == "length"


def test_metrics_in_prometheus_format(server: ServerProcess):
    body = {"text": "print(", "sampling_params": GREEDY, "stream": True}
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60.0) as response:
        list(sse_payloads(response.iter_lines()))
    text = httpx.get(f"{server.url}/metrics", timeout=10.0).text
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.fullmatch(r"# (HELP|TYPE) arbor_\w+ .+", line), line
            continue
        name, value = line.rsplit(" ", 1)
        samples[name] = float(value)
    assert samples['arbor_requests_total{finish_reason="length"}'] >= 1
    assert samples["arbor_generation_tokens_total"] >= 12
    assert samples["arbor_prompt_tokens_total"] >= 1
    assert samples['arbor_time_to_first_token_seconds_bucket{le="+Inf"}'] >= 1
    assert samples["arbor_inter_token_latency_seconds_count"] >= 11
    for gauge in ("num_running_reqs", "num_queue_reqs", "kv_usage", "cache_hit_rate"):
        assert f"arbor_{gauge}" in samples
    assert json.dumps(samples)  # every value parsed as a number
