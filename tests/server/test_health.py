"""/health as Kubernetes probes it: the plain probe reports a stalled scheduler (a live
process whose loop does not turn), the deep probe runs a token through every process."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from runtime.heartbeat import Heartbeat
from runtime.server import ServerProcess
from tests.server.server_process import POOL

pytestmark = pytest.mark.timeout(300)

STALL_BOUND_S = 2.0


def test_the_bound_grows_with_the_longest_forward_step() -> None:
    heartbeat = Heartbeat.shared()
    assert heartbeat.bound(30.0) == 30.0
    heartbeat.observe_step(12.0)  # a long prefill chunk on a loaded machine
    assert heartbeat.bound(30.0) == 48.0
    assert heartbeat.stalled_for(30.0) is None


def test_a_silence_past_the_bound_is_a_stall_and_a_beat_ends_it() -> None:
    heartbeat = Heartbeat.shared()
    time.sleep(0.05)
    silence = heartbeat.stalled_for(0.01)
    assert silence is not None and silence >= 0.05
    heartbeat.beat()
    assert heartbeat.stalled_for(0.01) is None


@pytest.fixture(scope="module")
def stall_server(tiny_model_path: Path) -> Iterator[ServerProcess]:
    """A server whose /health reports a stall after STALL_BOUND_S seconds."""
    args = ("--health-stall-timeout-s", str(STALL_BOUND_S))
    with ServerProcess(tiny_model_path, *POOL, *args) as process:
        yield process


def _health(server: ServerProcess, deep: bool = False) -> httpx.Response:
    return httpx.get(f"{server.url}/health", params={"deep": "1"} if deep else {}, timeout=30)


def _wait_for_status(server: ServerProcess, status: int, within_s: float) -> httpx.Response:
    deadline = time.monotonic() + within_s
    while True:
        response = _health(server)
        if response.status_code == status or time.monotonic() > deadline:
            return response
        time.sleep(0.2)


def test_health_reports_a_stopped_scheduler_and_its_recovery(stall_server: ServerProcess):
    assert _health(stall_server).json() == {"status": "ok"}
    scheduler_pid = int(stall_server.server_info()["scheduler_pid"])
    # Idle for longer than the bound: the idle loop beats, so no stall is reported.
    time.sleep(STALL_BOUND_S + 1)
    assert _health(stall_server).status_code == 200
    os.kill(scheduler_pid, signal.SIGSTOP)  # alive, but its loop does not turn
    try:
        stalled = _wait_for_status(stall_server, 503, within_s=STALL_BOUND_S + 10)
        assert stalled.status_code == 503, stalled.text
        assert stalled.json()["status"] == "stalled"
        assert "loop iteration" in stalled.json()["error"]
        probe = _health(stall_server, deep=True)  # no deeper probe runs past a failing one
        assert probe.status_code == 503 and probe.json()["status"] == "stalled"
    finally:
        os.kill(scheduler_pid, signal.SIGCONT)
    recovered = _wait_for_status(stall_server, 200, within_s=10)
    assert recovered.status_code == 200, recovered.text


def test_the_deep_probe_runs_a_token_through_every_process(stall_server: ServerProcess):
    assert _health(stall_server, deep=True).json() == {"status": "ok"}
    detokenizer_pid = int(stall_server.server_info()["detokenizer_pid"])
    # A stopped detokenizer leaves the scheduler turning (the plain probe passes) but no
    # output comes back: the deep probe fails within the bound.
    os.kill(detokenizer_pid, signal.SIGSTOP)
    try:
        assert _health(stall_server).status_code == 200
        started = time.monotonic()
        probe = _health(stall_server, deep=True)
        assert probe.status_code == 503, probe.text
        assert probe.json()["status"] == "probe failed"
        assert "did not come back" in probe.json()["error"]
        assert time.monotonic() - started < STALL_BOUND_S + 10
    finally:
        os.kill(detokenizer_pid, signal.SIGCONT)
    assert _health(stall_server, deep=True).json() == {"status": "ok"}
