"""Backends for the DSL tests: the in-process Engine and a live ``arbor serve``, one of each per
session; semantic tests take ``backend`` and run against both."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import frontend_lang as fl
from runtime.server import ServerProcess


@pytest.fixture(scope="session")
def engine_backend(tiny_model_path: Path) -> Iterator[fl.Engine]:
    with fl.Engine(tiny_model_path, max_total_tokens=8192) as backend:
        yield backend


@pytest.fixture(scope="session")
def server_url(server: ServerProcess) -> str:
    """The URL of the session's live ``arbor serve`` on the tiny model (tests/conftest.py)."""
    return server.url


@pytest.fixture(scope="session")
def endpoint_backend(server_url: str) -> Iterator[fl.RuntimeEndpoint]:
    backend = fl.RuntimeEndpoint(server_url)
    yield backend
    backend.shutdown()


@pytest.fixture(params=["engine", "server"])
def backend(request: pytest.FixtureRequest) -> fl.Backend:
    """Each semantic test runs on the in-process Engine and on a live server."""
    name = "engine_backend" if request.param == "engine" else "endpoint_backend"
    return request.getfixturevalue(name)
