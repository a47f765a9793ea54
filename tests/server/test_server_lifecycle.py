"""Server processes: API-key auth, clean shutdown on SIGTERM, exit when the scheduler dies."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from runtime.server import ServerProcess
from tests.server.server_process import POOL, pid_alive

pytestmark = pytest.mark.timeout(300)

API_KEY = "sk-test-arbor"


@pytest.fixture(scope="module")
def servers(tiny_model_path: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """Two servers started together: one with an API key, one to crash."""
    with_key = ServerProcess(tiny_model_path, *POOL, api_key=API_KEY)
    to_crash = ServerProcess(tiny_model_path, *POOL)
    try:
        with_key.wait_ready()
        to_crash.wait_ready()
        yield with_key, to_crash
    finally:
        with_key.stop()
        to_crash.stop()


def test_api_key_is_required(servers: tuple[ServerProcess, ServerProcess]):
    server = servers[0]
    body = {"text": "x", "sampling_params": {"max_new_tokens": 2}}
    refused = httpx.post(f"{server.url}/generate", json=body, timeout=30)
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"
    wrong = {"Authorization": "Bearer nope"}
    assert httpx.get(f"{server.url}/v1/models", headers=wrong, timeout=30).status_code == 401
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    accepted = httpx.post(f"{server.url}/generate", json=body, headers=server.headers, timeout=30)
    assert accepted.status_code == 200
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", timeout=30) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, timeout=30) as client:
        assert client.models.list().data


def test_dashboard_and_cache_tree_need_the_key_a_browser_can_give(
    servers: tuple[ServerProcess, ServerProcess],
):
    server = servers[0]
    basic = httpx.BasicAuth("anyone", API_KEY)
    for path in ("/dashboard", "/dashboard/static/dashboard.js", "/cache_tree"):
        refused = httpx.get(f"{server.url}{path}", timeout=30)
        assert refused.status_code == 401
        assert refused.headers["www-authenticate"].startswith("Basic")  # the browser asks
        assert httpx.get(f"{server.url}{path}", headers=server.headers).status_code == 200
        assert httpx.get(f"{server.url}{path}", auth=basic, timeout=30).status_code == 200
        wrong = httpx.BasicAuth("anyone", "nope")
        assert httpx.get(f"{server.url}{path}", auth=wrong, timeout=30).status_code == 401
    # Basic credentials open the read-only pages only, never the API.
    body = {"text": "x", "sampling_params": {"max_new_tokens": 1}}
    post = httpx.post(f"{server.url}/generate", json=body, auth=basic, timeout=30)
    assert post.status_code == 401 and "www-authenticate" not in post.headers
    assert httpx.get(f"{server.url}/get_server_info", auth=basic).status_code == 401


def test_sigterm_stops_all_three_and_removes_the_sockets(
    servers: tuple[ServerProcess, ServerProcess],
):
    server = servers[0]
    info = server.server_info()
    # The scheduler process froze its startup heap out of the collector's full passes.
    assert info["gc_frozen_objects"] > 10_000
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(30) == 0
    assert not Path(info["ipc_dir"]).exists()
    assert not pid_alive(info["scheduler_pid"])
    assert not pid_alive(info["detokenizer_pid"])


def test_killed_scheduler_makes_the_server_exit_non_zero(
    servers: tuple[ServerProcess, ServerProcess],
):
    server = servers[1]
    info = server.server_info()
    outcome: dict[str, object] = {}

    def in_flight() -> None:  # a request running when the scheduler dies must not hang
        body = {"text": "x", "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
        try:
            outcome["status"] = httpx.post(
                f"{server.url}/generate", json=body, timeout=30
            ).status_code
        except httpx.HTTPError as exc:
            outcome["status"] = type(exc).__name__

    client = threading.Thread(target=in_flight)
    client.start()
    time.sleep(0.5)
    os.kill(info["scheduler_pid"], signal.SIGKILL)
    started = time.monotonic()
    code = server.process.wait(15)
    assert code != 0
    assert time.monotonic() - started < 10
    client.join(15)
    assert outcome["status"] in (503, "RemoteProtocolError", "ConnectError", "ReadError")
    assert not pid_alive(info["detokenizer_pid"])
    assert not Path(info["ipc_dir"]).exists()
    assert "the scheduler process exited with code -9" in server.log_text()
