"""A ``llama-server`` child process: its command line, started, waited for until ``/health``
says ok, and always stopped (on leaving the ``with`` block, and at interpreter exit should
that be skipped)."""

from __future__ import annotations

import atexit
import contextlib
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import httpx

HEALTH_TIMEOUT_S = 180.0
STOP_GRACE_S = 10.0
LOG_TAIL_LINES = 20


class ServerError(RuntimeError):
    """llama-server did not start, died, or answered with an error (the message says which,
    with the end of its log where that helps)."""


@dataclass(frozen=True)
class ServerConfig:
    """How ``llama-server`` is started: ``slots`` parallel sequences with ``slot_context``
    tokens of KV each, ``threads`` for decoding and batched prompt processing."""

    binary: Path
    gguf: Path
    slots: int
    slot_context: int
    threads: int
    port: int
    host: str = "127.0.0.1"
    extra_flags: tuple[str, ...] = ()  # what this machine needs (llama_cpp_load.server_flags)

    @property
    def context(self) -> int:
        """``-c``: llama-server divides it evenly across the slots."""
        return self.slots * self.slot_context

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [
            str(self.binary), "--model", str(self.gguf), "--host", self.host,
            "--port", str(self.port), "--parallel", str(self.slots), "--ctx-size",
            str(self.context), "--cont-batching", "--threads", str(self.threads),
            "--threads-batch", str(self.threads), "--no-webui", *self.extra_flags,
        ]  # fmt: skip


class LlamaServer:
    """``with LlamaServer(command, url) as server``: the process is up and healthy inside the
    block and gone after it. Its output goes to a temporary log file, removed after a clean
    stop and named in the error when it fails to start."""

    def __init__(self, command: list[str], url: str) -> None:
        self.command = command
        self.url = url
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None

    @property
    def pid(self) -> int:
        if self.process is None:
            raise ServerError("llama-server is not running")
        return self.process.pid

    def __enter__(self) -> LlamaServer:
        handle, name = tempfile.mkstemp(prefix="arbor-llama-server-", suffix=".log")
        self.log_path = Path(name)
        with open(handle, "wb") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        atexit.register(self.stop)
        try:
            self.wait_healthy()
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
        if kind is None and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)

    def wait_healthy(self, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
        """Poll ``GET /health`` until 200 (503 means the model is still loading)."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(base_url=self.url, timeout=5.0) as client:
            while time.monotonic() < deadline:
                if self.process is not None and self.process.poll() is not None:
                    raise ServerError(
                        f"llama-server exited with {self.process.returncode} while starting; "
                        f"{self.log_tail()}"
                    )
                with contextlib.suppress(httpx.TransportError):
                    if client.get("/health").status_code == 200:
                        return
                time.sleep(0.2)
        raise ServerError(f"llama-server not healthy after {timeout_s:.0f} s; {self.log_tail()}")

    def stop(self) -> None:
        """Terminate (then kill after ``STOP_GRACE_S``); safe to call more than once."""
        process, self.process = self.process, None
        atexit.unregister(self.stop)
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "no log"
        lines = self.log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        return f"last lines of {self.log_path}:\n" + "\n".join(lines)
