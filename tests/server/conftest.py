"""One real server for the server tests (started on first use, stopped at the end)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.server_process import ServerProcess


@pytest.fixture(scope="session")
def server(tiny_model_path: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(tiny_model_path)
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()
