"""A server's cold start (runtime/server/warm_up.py): the warm-up and the tool calibration run
before /health says ready, their thresholds are kept in the cache folder and read back by the
next start, the startup phases are logged, and grammar compile times reach /metrics."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from runtime.server import ServerProcess
from tests.server.server_process import POOL
from tests.tool_fixtures import function_tool

pytestmark = pytest.mark.timeout(300)

# The generic format: the one whose tool_choice "auto" is decided by the calibrated threshold.
# With the whole warm-up (POOL skips its chat and grammar requests).
WARM = ("--max-total-tokens", "8192")
SERVE = (*WARM, "--tool-call-parser", "generic", "--log-level", "info")
TOOL = function_tool(
    "get_weather", {"city": {"type": "string"}}, "Get the current weather in a city.", closed=False
)


def _metrics(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10.0).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def _tools_auto(server: ServerProcess, question: str) -> None:
    model = httpx.get(f"{server.url}/v1/models", timeout=10.0).json()["data"][0]["id"]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "tools": [TOOL],
        "tool_choice": "auto",
        "max_tokens": 8,
    }
    httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60.0).raise_for_status()


def test_calibration_at_startup_kept_and_read_back(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("ARBOR_CACHE_DIR", str(tmp_path))  # a cache folder of its own
    calibrated = 'arbor_tool_thresholds_total{source="startup"}'
    read_back = 'arbor_tool_thresholds_total{source="cache"}'
    on_demand = 'arbor_tool_thresholds_total{source="request"}'
    compiles = "arbor_grammar_compile_seconds_count"
    with ServerProcess(tiny_model_path, *SERVE) as server:
        log = server.log_path.read_text()
        before = _metrics(server)
        assert before[calibrated] == 2  # both envelope shapes, before /health said ready
        assert before[compiles] >= 1  # the warm-up's grammar
        _tools_auto(server, "What is the weather in Oslo?")
        after = _metrics(server)
        assert after[calibrated] == 2 and on_demand not in after  # the request calibrated none
        assert after[compiles] == before[compiles] + 1  # its own grammar, timed
        seconds = "arbor_grammar_compile_seconds_sum"
        assert after[seconds] > before[seconds]
    for phase in ("load model", "cache pool", "warm-up: chat", "tool calibration", "total"):
        assert f"startup: {phase}" in log or f"startup: scheduler: {phase}" in log, phase
    kept = sorted(p.name for p in (tmp_path / "tool_thresholds").iterdir())
    assert len(kept) == 2
    assert kept[0].endswith("-one-call.json") and kept[1].endswith("-parallel.json")

    with ServerProcess(tiny_model_path, *SERVE) as server:
        restarted = _metrics(server)
        assert restarted[read_back] == 2 and calibrated not in restarted
        _tools_auto(server, "Is it raining in Lima?")
        assert on_demand not in _metrics(server)


def test_skip_server_warmup_says_ready_without_the_warm_up_requests(tiny_model_path: Path):
    """--skip-server-warmup (every other test server's): no warm-up chat or grammar request
    ran before ready, and the first request still works."""
    assert "--skip-server-warmup" in POOL
    with ServerProcess(tiny_model_path, *POOL, "--log-level", "info") as server:
        compiles = _metrics(server)["arbor_grammar_compile_seconds_count"]
        body = {"text": "Hello", "sampling_params": {"max_new_tokens": 2, "regex": "[a-z]+"}}
        httpx.post(f"{server.url}/generate", json=body, timeout=60.0).raise_for_status()
        log = server.log_path.read_text()
        assert _metrics(server)["arbor_grammar_compile_seconds_count"] == compiles + 1
    assert compiles == 0
    assert "startup: warm-up" not in log and "startup: total" in log
