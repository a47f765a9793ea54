"""Servers the server tests share (each started on first use, stopped at the end; the plain
tiny-model ``server`` is in tests/conftest.py), and an OpenAI client of the plain one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from runtime.server import ServerProcess
from tests.server.server_process import ADMIN_KEY, API_KEY, POOL


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


# A module that starts its own ``server`` with ``--api-key`` and ``--admin-api-key ADMIN_KEY``
# (the tenant tests) talks to it through these two.
@pytest.fixture(scope="module")
def tenant(server: ServerProcess) -> Iterator[httpx.Client]:
    """A client holding the API key every tenant shares."""
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def admin(server: ServerProcess) -> Iterator[httpx.Client]:
    """A client holding the operator's key."""
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def claude(keyed_server: ServerProcess) -> Iterator[anthropic.Anthropic]:
    """The anthropic client of ``keyed_server`` (the Messages API tests)."""
    url = keyed_server.url
    with anthropic.Anthropic(base_url=url, api_key=API_KEY, timeout=120.0, max_retries=0) as c:
        yield c
