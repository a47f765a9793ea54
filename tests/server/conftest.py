"""One real server for the server tests (started on first use, stopped at the end), and an
OpenAI client of it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
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


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60.0) as c:
        yield c


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    """The name of the server's one model."""
    models = client.models.list().data
    assert len(models) == 1
    return models[0].id
