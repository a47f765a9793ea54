"""Helpers for the server tests; the server itself is ``runtime.server.ServerProcess``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Every test server gets the same KV pool, and says ready without the warm-up's chat and
# grammar requests (seconds of CPU a start; tests/server/test_cold_start.py runs them).
POOL = ("--max-total-tokens", "8192", "--skip-server-warmup")
# The key of the shared keyed server (tests/server/conftest.py).
API_KEY = "arbor-test-key"
# The operator key of servers started with --admin-api-key (the `admin` fixture holds it).
ADMIN_KEY = "arbor-test-admin-key"


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
