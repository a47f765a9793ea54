"""The KV disk tier through ``arbor serve`` (issue 40): SIGTERM saves what the pool holds, a
server restarted on the folder serves it from disk, /metrics and /get_server_info count it,
and ``/flush_cache?disk=true`` empties it; a FIFO in the tier costs a request a miss, never a
hang (issue 51)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from runtime.kv_disk import chunk_keys
from runtime.kv_disk.folder import chunk_path
from runtime.scheduler.disk_tier import CHUNK_TOKENS
from runtime.server import ServerProcess
from tests.runtime.helpers import random_prompts

SERVE = ("--max-total-tokens", "2048", "--kv-disk-load-policy", "always")


def _generate(server: ServerProcess, prompt: list[int]) -> dict[str, Any]:
    body = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
    }
    response = httpx.post(f"{server.url}/generate", json=body, timeout=60.0)
    response.raise_for_status()
    return response.json()


def _metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10.0).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def _chunk_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file() and p.stat().st_size > 4096]


def test_sigterm_saves_and_a_restart_serves_from_disk(tiny_model_path: Path, tmp_path: Path):
    (prompt,) = random_prompts([300], seed=400)
    tier = ("--kv-disk-path", str(tmp_path), *SERVE)
    with ServerProcess(tiny_model_path, *tier) as server:
        first = _generate(server, prompt)
        assert first["meta_info"]["cached_tokens"] == 0
    chunks = 299 // CHUNK_TOKENS  # whole chunks of the 299 matchable tokens
    assert len(_chunk_files(tmp_path)) == chunks
    with ServerProcess(tiny_model_path, *tier) as server:
        again = _generate(server, prompt)
        assert again["output_ids"] == first["output_ids"]
        assert again["meta_info"]["cached_tokens"] == chunks * CHUNK_TOKENS
        assert _metric(server, "arbor_kv_disk_loads_total") == chunks
        assert _metric(server, "arbor_kv_disk_hits_tokens_total") == chunks * CHUNK_TOKENS
        assert _metric(server, "arbor_kv_disk_used_bytes") > 0
        assert server.server_info()["kv_disk_loads"] == chunks
        response = httpx.post(f"{server.url}/flush_cache?disk=true", timeout=10.0)
        assert response.status_code == 200
        assert _chunk_files(tmp_path) == []
        assert _generate(server, prompt)["meta_info"]["cached_tokens"] == 0


def _release_fifo_readers(fifo: Path, seconds: float) -> None:
    """Open ``fifo`` for writing, and close it, for ``seconds``: each reader blocked opening it
    goes on, so a test that found a hang fails instead of hanging."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass  # no reader is waiting right now
        time.sleep(0.05)


def test_a_fifo_in_the_tier_does_not_hang_the_server(tiny_model_path: Path, tmp_path: Path):
    (prompt,) = random_prompts([300], seed=401)
    tier = ("--kv-disk-path", str(tmp_path), *SERVE, "--kv-disk-write-policy", "write_through")
    with ServerProcess(tiny_model_path, *tier) as server:
        first = _generate(server, prompt)
        # written as the tree takes them, by the writer thread
        paths = [
            chunk_path(tmp_path / "replica0", key)
            for key in chunk_keys(np.asarray(prompt), CHUNK_TOKENS, None)
        ]
        deadline = time.monotonic() + 30
        while not all(p.exists() for p in paths) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(p.exists() for p in paths)
        assert httpx.post(f"{server.url}/flush_cache", timeout=10.0).status_code == 200
        path = paths[2]
        path.unlink()
        os.mkfifo(path)
        try:
            again = _generate(server, prompt)  # bounded: 60 s
        except httpx.TimeoutException:
            _release_fifo_readers(path, seconds=10)  # so the server can stop
            pytest.fail("a request hung on a FIFO in the KV disk tier")
        assert again["output_ids"] == first["output_ids"]
        assert again["meta_info"]["cached_tokens"] == 2 * CHUNK_TOKENS
        assert not os.path.lexists(path)
        assert _generate(server, prompt)["output_ids"] == first["output_ids"]  # still serving
