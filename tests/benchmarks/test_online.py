"""Online mode against a real ``arbor serve`` on loopback: Poisson arrivals, streamed
tokens, goodput, the deadline, and the server always stopped."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.suite.online import OnlineConfig, drive, poisson_arrivals, summarize_online
from benchmarks.suite.systems.arbor import Request
from runtime.cli import main
from runtime.server import ServerProcess


def test_poisson_arrivals() -> None:
    times = poisson_arrivals(4000, rate=5.0, seed=1)
    assert times == sorted(times) and times[0] > 0
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert statistics.mean(gaps) == pytest.approx(1 / 5.0, rel=0.1)
    assert statistics.stdev(gaps) == pytest.approx(1 / 5.0, rel=0.1)  # exponential: sd = mean
    assert poisson_arrivals(10, 5.0, seed=1) == times[:10]
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(3, 0.0, seed=1)


def test_streaming_clients_measure_every_token(server: ServerProcess) -> None:
    requests = [Request((10 + i, 20, 30, 40), 3 + i, group=i) for i in range(3)]
    config = OnlineConfig(rate=50.0, max_seconds=60.0, slo_ttft_s=30.0, slo_itl_ms=10_000.0)
    results = asyncio.run(drive(server.url, requests, config))
    assert [r.request for r in results] == requests  # sent in arrival order
    assert all(r.completed and r.error is None for r in results)
    assert [len(r.output_ids) for r in results] == [3, 4, 5]
    assert all(len(r.timing.token_times) == len(r.output_ids) for r in results)
    summary = summarize_online(results, config, None)
    assert (summary["sent"], summary["completed"], summary["failed"]) == (3, 3, 0)
    assert summary["goodput"] == 1.0 and summary["output_tokens"] == 12
    strict = summarize_online(results, OnlineConfig(rate=50.0, slo_ttft_s=0.0), None)
    assert strict["goodput"] == 0.0  # no request has a TTFT of 0


def test_deadline_cancels_and_the_server_aborts(server: ServerProcess) -> None:
    requests = [Request((10, 11, 12), 4000, group=i) for i in range(2)]
    results = asyncio.run(drive(server.url, requests, OnlineConfig(rate=100.0, max_seconds=1.0)))
    summary = summarize_online(results, OnlineConfig(rate=100.0), None)
    assert summary["failed"] == 2 and summary["goodput"] == 0.0
    assert "deadline" in summary["errors"][0]
    for _ in range(50):  # the disconnects abort the requests
        info = httpx.get(f"{server.url}/get_server_info", timeout=10.0).json()
        if info["num_running_reqs"] == 0:
            break
        time.sleep(0.1)
    assert info["num_running_reqs"] == 0


def test_arbor_bench_serve(tiny_model_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--rate", "20", "--requests", "3", "--quick",
            "--model-path", str(tiny_model_path), "--max-total-tokens", "8192",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    (summary,) = json.loads(out.read_text())["systems"]
    assert (summary["sent"], summary["completed"]) == (3, 3)
    assert summary["ttft_p50_s"] > 0 and 0 <= summary["goodput"] <= 1
