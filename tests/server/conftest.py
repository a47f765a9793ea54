"""Servers the server tests share (each started on first use, stopped at the end; the plain
tiny-model ``server`` is in tests/conftest.py), and an OpenAI client of the plain one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from runtime.server import ServerProcess
from tests.server.server_process import API_KEY, POOL


@pytest.fixture(scope="session")
def keyed_server(tiny_model_path: Path) -> Iterator[ServerProcess]:
    """The tiny model behind ``--api-key API_KEY`` (the Messages API and authentication tests)."""
    with ServerProcess(tiny_model_path, *POOL, api_key=API_KEY) as process:
        yield process


@pytest.fixture(scope="session")
def r1_server(thinking_model_path: Path) -> Iterator[ServerProcess]:
    """The thinking model with ``--reasoning-parser deepseek-r1`` (the reasoning and Messages
    API tests)."""
    with ServerProcess(thinking_model_path, *POOL, "--reasoning-parser", "deepseek-r1") as process:
        yield process


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
