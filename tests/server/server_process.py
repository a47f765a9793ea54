"""Start and stop a real ``arbor serve`` (three processes) on a free loopback port."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 150.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """``python -m runtime.cli serve`` in a subprocess; its output goes to a log file."""

    def __init__(self, model_path: Path, *extra_args: str, api_key: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile(prefix="arbor-serve-", suffix=".log", delete=False)
        command = [
            sys.executable,
            "-m",
            "runtime.cli",
            "serve",
            "--model-path",
            str(model_path),
            "--port",
            str(self.port),
            "--max-total-tokens",
            "8192",
            "--log-level",
            "warning",
            *extra_args,
        ]
        if api_key:
            command += ["--api-key", api_key]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.process = subprocess.Popen(
            command, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, env=env
        )

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Poll /health until 200; fail with the server's log if it exits or takes too long."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited early:\n{self.log_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server was not ready in {timeout} s:\n{self.log_text()}")

    def server_info(self) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/get_server_info", headers=self.headers, timeout=10.0)
        response.raise_for_status()
        return response.json()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.log.close()

    def log_text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-5000:]


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def sse_payloads(lines: Iterator[str]) -> Iterator[Any]:
    """The JSON payloads of a server-sent event stream, up to ``data: [DONE]`` (which must
    come last)."""
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        if data == "[DONE]":
            return
        yield json.loads(data)
    raise AssertionError("the stream ended without data: [DONE]")
