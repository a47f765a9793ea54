"""The HTTP backends' clients (fl.RuntimeEndpoint, fl.OpenAI): one per thread (a pool shared
between threads handed out connections another thread closed), closed with their thread or at
shutdown."""

from __future__ import annotations

import gc
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import frontend_lang as fl


@pytest.mark.parametrize("kind", ["runtime_endpoint", "openai"])
def test_each_thread_gets_its_own_client_and_it_closes_with_the_thread(kind: str):
    endpoint: fl.RuntimeEndpoint | fl.OpenAI = (
        fl.RuntimeEndpoint("http://127.0.0.1:9")  # never contacted
        if kind == "runtime_endpoint"
        else fl.OpenAI(base_url="http://127.0.0.1:9/v1", model="m")
    )
    mine = endpoint.client
    assert endpoint.client is mine  # the same thread keeps its client
    seen: list = []
    threads = [threading.Thread(target=lambda: seen.append(endpoint.client)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({id(c) for c in seen} | {id(mine)}) == 5
    del threads
    gc.collect()
    assert all(_closed(client) for client in seen)  # their threads ended
    assert not _closed(mine)
    endpoint.shutdown()
    assert _closed(mine)


def _closed(client: Any) -> bool:
    return bool(client.is_closed()) if callable(client.is_closed) else bool(client.is_closed)


def test_many_threads_calling_a_live_server_all_succeed(endpoint_backend: fl.RuntimeEndpoint):
    def call(i: int) -> str:
        result = endpoint_backend._call(
            {"text": f"call {i}", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        )
        return str(result["text"])

    with ThreadPoolExecutor(16) as pool:
        assert len(list(pool.map(call, range(200)))) == 200
