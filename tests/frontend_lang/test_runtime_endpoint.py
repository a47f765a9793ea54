"""The HTTP backends' clients (fl.RuntimeEndpoint, fl.OpenAI): each call leases a whole client
(a pool shared between threads handed out connections another thread closed), and clients are
reused across calls and threads."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

import frontend_lang as fl
from frontend_lang.backends.client_pool import ClientPool


class _Client:
    def __init__(self) -> None:
        self.closed = False


def test_concurrent_calls_get_distinct_clients_and_later_calls_reuse_them():
    pool = ClientPool(_Client, lambda c: setattr(c, "closed", True))
    inside = threading.Barrier(4)
    seen: list[_Client] = []

    def call() -> None:
        with pool.lease() as client:
            seen.append(client)
            inside.wait(timeout=10)  # all four hold a client at once

    threads = [threading.Thread(target=call) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({id(c) for c in seen}) == 4 and pool.size == 4
    def one_call() -> None:
        with pool.lease():
            pass

    for _ in range(3):  # new short-lived threads, one call each: warm clients, none made
        thread = threading.Thread(target=one_call)
        thread.start()
        thread.join()
    assert pool.size == 4
    with pool.lease() as held:
        pool.close_all()
        assert not held.closed  # in use: closed when its call ends
    assert held.closed and all(c.closed for c in seen)
    with pytest.raises(RuntimeError, match="shut down"), pool.lease():
        pass


def test_many_threads_calling_a_live_server_all_succeed(endpoint_backend: fl.RuntimeEndpoint):
    def call(i: int) -> str:
        result = endpoint_backend._call(
            {"text": f"call {i}", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        )
        return str(result["text"])

    with ThreadPoolExecutor(16) as pool:
        assert len(list(pool.map(call, range(200)))) == 200
    assert endpoint_backend._clients.size <= 16
