"""``arbor serve --tp 2``: one request end to end with the tokens of a single-rank engine, and
no rank process left behind when the server stops or its scheduler is killed."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from runtime import Engine
from runtime.server import ServerProcess
from tests.server.server_process import POOL, pid_alive

pytestmark = pytest.mark.timeout(300)

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def servers(tiny_model_path: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """Two --tp 2 servers started together: one to stop, one whose scheduler is killed."""
    started = [ServerProcess(tiny_model_path, *POOL, "--tp", "2") for _ in range(2)]
    try:
        for server in started:
            server.wait_ready()
        yield started[0], started[1]
    finally:
        for server in started:
            server.stop()


def _all_pids(info: dict) -> list[int]:
    return [info["scheduler_pid"], info["detokenizer_pid"], *info["tp_worker_pids"]]


def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(pid_alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_tp2_server_answers_like_one_rank_and_stops_every_rank(
    servers: tuple[ServerProcess, ServerProcess], tiny_model_path: Path
) -> None:
    server = servers[0]
    info = server.server_info()
    assert info["tp_size"] == 2 and len(info["tp_worker_pids"]) == 1
    body = {"text": "def tree(x):", "sampling_params": GREEDY}
    response = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    with Engine(tiny_model_path, max_total_tokens=8192) as engine:
        expected = engine.generate("def tree(x):", GREEDY)
    assert response.json()["output_ids"] == expected["output_ids"]
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(30) == 0
    assert _gone_within(_all_pids(info), 5)


def test_killed_scheduler_takes_its_rank_processes_with_it(
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    server = servers[1]
    info = server.server_info()
    workers = info["tp_worker_pids"]
    assert workers and all(pid_alive(pid) for pid in workers)
    os.kill(info["scheduler_pid"], signal.SIGKILL)
    assert server.process.wait(15) != 0
    assert _gone_within(workers, 5)
