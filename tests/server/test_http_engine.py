"""The benchmarks' HttpEngine (the workloads' Engine calls over HTTP) under concurrent threads,
as run_batch and dp_bench drive it: every call gets a client of its own."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.suite.systems.http_engine import HttpEngine
from runtime.server import ServerProcess

PARAMS = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def test_concurrent_calls_from_many_threads(server: ServerProcess, tiny_model_path: Path) -> None:
    engine = HttpEngine(server.url, str(tiny_model_path))
    try:
        prompts = [f"Thread {i} says" for i in range(12)]
        expected = {p: engine.generate(p, sampling_params=PARAMS)["text"] for p in prompts}
        start = threading.Barrier(len(prompts))

        def call(prompt: str) -> tuple[str, str]:
            start.wait(timeout=30)
            whole = engine.generate(prompt, sampling_params=PARAMS)["text"]
            events = list(engine.generate(prompt, stream=True, sampling_params=PARAMS))
            return whole, events[-1]["text"]  # each event is the cumulative result

        with ThreadPoolExecutor(len(prompts)) as pool:
            results = dict(zip(prompts, pool.map(call, prompts), strict=True))
        for prompt, (whole, streamed) in results.items():
            assert whole == expected[prompt]
            assert streamed == expected[prompt]
        assert engine._clients.size > 1  # the calls overlapped, each on its own client
        assert engine.get_server_info()["max_total_tokens"] > 0
    finally:
        engine.close()
