"""Slow clients cannot hold the server: a request head must arrive within --header-timeout-s
(however it trickles in) and a body within --body-timeout-s (408)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from runtime.server import ServerProcess
from tests.server.server_process import POOL

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server(tiny_model_path: Path) -> Iterator[ServerProcess]:
    with ServerProcess(
        tiny_model_path, *POOL, "--header-timeout-s", "1", "--body-timeout-s", "1"
    ) as process:
        yield process


def _connect(server: ServerProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.settimeout(10)
    return sock


def test_a_trickled_request_head_is_cut_off(server: ServerProcess):
    with _connect(server) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        closed = False
        for byte in b"Host: 127.0.0.1\r\nX-Slow: " + b"a" * 40:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            time.sleep(0.2)
            if time.monotonic() - started > 5:
                break
        if not closed:
            closed = sock.recv(1024) == b""
        assert closed, "the connection outlived the header deadline"
        assert time.monotonic() - started < 5
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_a_slow_body_gets_408(server: ServerProcess):
    with _connect(server) as sock:
        head = (
            b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n"
        )
        sock.sendall(head + b'{"text": "x"')
        reply = b""
        while b"did not arrive within" not in reply and (chunk := sock.recv(4096)):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert b"did not arrive within" in reply


def test_a_prompt_request_still_works(server: ServerProcess):
    body = {"text": "x = ", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    response = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
