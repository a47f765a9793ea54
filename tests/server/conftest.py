"""One real server for the server tests (started on first use, stopped at the end)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.server import ServerProcess
from tests.server.server_process import POOL


@pytest.fixture(scope="session")
def server(tiny_model_path: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(tiny_model_path, *POOL)
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()
