"""``arbor serve`` as a child process on a free loopback port, always stopped afterwards."""

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

REPO = Path(__file__).resolve().parents[2]


class ServerProcess:
    """``python -m runtime.cli serve --host 127.0.0.1 --port <free> ...``; use it as a context
    manager: entering waits until ``/health`` answers 200, leaving stops the server (SIGTERM,
    then SIGKILL after ``stop_timeout_s``) even when the body raised. The server's output goes
    to a temporary log file, shown when it fails to start and removed afterwards."""

    def __init__(self, model_path: str, *serve_args: str, startup_timeout_s: float = 180.0) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [
            sys.executable, "-m", "runtime.cli", "serve", "--model-path", model_path,
            "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning",
            *serve_args,
        ]  # fmt: skip
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = 15.0
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = Path(tempfile.mkstemp(prefix="arbor-bench-serve-", suffix=".log")[1])

    def __enter__(self) -> ServerProcess:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env
            )
        try:
            self._wait_ready()
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

    def _wait_ready(self) -> None:
        assert self.process is not None
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

    def stop(self) -> None:
        """SIGTERM (the server stops its children), SIGKILL if it does not exit in time."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def pids(self, server_info: dict[str, Any]) -> tuple[int, ...]:
        """The server's three processes, given its ``/get_server_info``."""
        assert self.process is not None
        children = (server_info.get("scheduler_pid"), server_info.get("detokenizer_pid"))
        return (self.process.pid, *(int(pid) for pid in children if pid))

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]
