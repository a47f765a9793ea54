"""The KV disk tier through ``arbor serve`` (issue 40): SIGTERM saves what the pool holds, a
server restarted on the folder serves it from disk, /metrics and /get_server_info count it,
and ``/flush_cache?disk=true`` empties it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

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
