"""``arbor serve`` as a child process on a free loopback port: for tests, benchmarks and scripts.

    with ServerProcess(model_path, "--max-total-tokens", "8192") as server:
        httpx.post(f"{server.url}/generate", json={...})

``model_path`` None serves the built-in model; ``cli_module`` is the module run as ``python -m``
(tests wrap ``runtime.cli`` to install hooks first). Constructing one starts the server;
``wait_ready`` (or entering the context) waits until ``/health`` answers 200; ``stop`` (or
leaving the context, even on an error) sends SIGTERM — the server then stops its own children
— and SIGKILL if it has not exited in time. The server's output goes to a temporary log file,
quoted when it fails to start.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    def __init__(
        self,
        model_path: str | Path | None,
        *serve_args: str,
        api_key: str | None = None,
        startup_timeout_s: float = 180.0,
        stop_timeout_s: float = 15.0,
        cli_module: str = "runtime.cli",
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        command = [
            sys.executable, "-m", cli_module, "serve",
            *(["--model-path", str(model_path)] if model_path else []),
            "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning",
            *serve_args,
        ]  # fmt: skip
        if api_key:
            command += ["--api-key", api_key]
        self.log_path = Path(tempfile.mkstemp(prefix="arbor-serve-", suffix=".log")[1])
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self) -> None:
        """Return once /health is 200; raise with the log's end if the server exits first or
        is not ready within ``startup_timeout_s``."""
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"arbor serve exited early:\n{self.log_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(
            f"arbor serve not ready in {self.startup_timeout_s} s:\n{self.log_text()}"
        )

    def server_info(self) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/get_server_info", headers=self.headers, timeout=10.0)
        response.raise_for_status()
        return response.json()

    def pids(self, server_info: dict[str, Any]) -> tuple[int, ...]:
        """The server's three processes, given its ``/get_server_info``."""
        children = (server_info.get("scheduler_pid"), server_info.get("detokenizer_pid"))
        return (self.process.pid, *(int(pid) for pid in children if pid))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def __enter__(self) -> ServerProcess:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()
        self.log_path.unlink(missing_ok=True)
