"""Backends for the DSL tests: the in-process Engine and a live ``arbor serve``, one of each per
session; semantic tests take ``backend`` and run against both."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import frontend_lang as fl

REPO = Path(__file__).resolve().parents[2]
ARBOR = Path(sys.executable).parent / "arbor"
SERVER_START_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def engine_backend(tiny_model_path: Path) -> Iterator[fl.Engine]:
    with fl.Engine(tiny_model_path, max_total_tokens=8192) as backend:
        yield backend


@pytest.fixture(scope="session")
def server_url(tiny_model_path: Path) -> Iterator[str]:
    """A live ``arbor serve`` on the tiny model, on loopback; always terminated."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w+", prefix="arbor-serve-", suffix=".log", delete=False)
    command = [str(ARBOR), "serve", "--model-path", str(tiny_model_path), "--port", str(port)]
    command += ["--max-total-tokens", "8192"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        _wait_healthy(url, process, log.name)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=20)
        log.close()
        Path(log.name).unlink(missing_ok=True)


def _wait_healthy(url: str, process: subprocess.Popen[bytes], log_path: str) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    tail = Path(log_path).read_text(errors="replace")[-3000:]
    raise RuntimeError(f"arbor serve did not become healthy at {url}; its log ends:\n{tail}")


@pytest.fixture(scope="session")
def endpoint_backend(server_url: str) -> Iterator[fl.RuntimeEndpoint]:
    backend = fl.RuntimeEndpoint(server_url)
    yield backend
    backend.shutdown()


@pytest.fixture(params=["engine", "server"])
def backend(request: pytest.FixtureRequest) -> fl.Backend:
    """Each semantic test runs on the in-process Engine and on a live server."""
    name = "engine_backend" if request.param == "engine" else "endpoint_backend"
    return request.getfixturevalue(name)
