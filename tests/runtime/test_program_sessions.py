"""The compiled programs' session table (``runtime/program/executor.py``, issue 51): a
continuation never starts afresh, a program is its tenant's alone, and a flood of programs
evicts the flooding tenant's own first, each ending reported with why. No model: segments
here run no ops."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from runtime.ipc import ProgramRelease
from runtime.program import executor
from runtime.program.executor import ProgramGone, ProgramRunner
from runtime.program.spec import ProgramRequest


class _Manager:
    """The tokenizer manager as far as sessions go: it records the releases."""

    tokenizer = None

    def __init__(self) -> None:
        self.released: list[str] = []

    def release_program(self, release: ProgramRelease) -> None:
        self.released.append(release.program)


def _runner(ttl_s: float = 600.0, max_per_tenant: int = 8) -> ProgramRunner:
    generation: Any = SimpleNamespace(manager=_Manager(), generate=None)
    return ProgramRunner(generation, ttl_s, max_per_tenant)


def _segment(
    runner: ProgramRunner,
    program_id: str | None,
    salt: str | None = None,
    caller: str = "",
    end: bool = False,
) -> list[dict[str, Any]]:
    """Run one empty segment; its events."""

    async def run() -> list[dict[str, Any]]:
        request = ProgramRequest(program_id, {}, False, end, salt)
        return [event.to_dict() async for event in runner.run(request, caller)]

    return asyncio.run(run())


def _start(runner: ProgramRunner, salt: str | None = None, caller: str = "") -> str:
    return str(_segment(runner, None, salt, caller)[0]["program_id"])


def _refusal(runner: ProgramRunner, program_id: str, salt: str | None = None) -> ProgramGone:
    with pytest.raises(ProgramGone) as refused:
        _segment(runner, program_id, salt)
    assert program_id in str(refused.value)
    return refused.value


def test_an_unknown_program_id_is_a_404_and_starts_nothing() -> None:
    runner = _runner()
    refused = _refusal(runner, "never-started")
    assert refused.status_code == 404 and refused.reason is None
    assert not runner.sessions
    program_id = _start(runner)  # no program_id: the one way to start a program
    assert _segment(runner, program_id)[0]["program_id"] == program_id


@pytest.mark.parametrize("reason", ["deleted", "ended"])
def test_an_ended_program_is_a_410_saying_why(reason: str) -> None:
    runner = _runner()
    program_id = _start(runner, "salt-a")
    if reason == "deleted":
        assert runner.end(program_id, "salt-a")
    else:
        _segment(runner, program_id, "salt-a", end=True)
    assert program_id in runner.tm.released
    refused = _refusal(runner, program_id, "salt-a")
    assert (refused.status_code, refused.reason) == (410, reason)
    assert not runner.end(program_id, "salt-a")
    assert runner.gone(program_id, "salt-a").reason == reason


def test_an_idle_program_expires_after_the_pin_timeout() -> None:
    runner = _runner(ttl_s=0.05)
    program_id = _start(runner)
    time.sleep(0.1)
    refused = _refusal(runner, program_id)
    assert (refused.status_code, refused.reason) == (410, "expired")
    assert "--program-pin-timeout-s" in str(refused)


def test_another_tenant_finds_nothing_under_the_id() -> None:
    runner = _runner()
    program_id = _start(runner, "victim", caller="api-key")
    for salt, caller in (("attacker", "api-key"), (None, "api-key"), ("victim", "admin")):
        with pytest.raises(ProgramGone) as refused:
            _segment(runner, program_id, salt, caller)
        assert refused.value.status_code == 404 and refused.value.reason is None
        assert not runner.end(program_id, salt, caller)
        assert runner.gone(program_id, salt, caller).reason is None
    assert _segment(runner, program_id, "victim", "api-key")[-1]["type"] == "done"


def test_a_flood_evicts_the_flooding_tenants_own_programs_first() -> None:
    runner = _runner(max_per_tenant=4)
    victim = _start(runner, "victim")
    flood = [_start(runner, "flood") for _ in range(10)]
    assert _segment(runner, victim, "victim")[-1]["type"] == "done"
    for program_id in flood[:6]:
        refused = _refusal(runner, program_id, "flood")
        assert (refused.status_code, refused.reason) == (410, "evicted")
    for program_id in flood[6:]:
        assert _segment(runner, program_id, "flood")[-1]["type"] == "done"


def test_the_servers_bound_evicts_the_longest_idle_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(executor, "MAX_SESSIONS", 3)
    runner = _runner()
    first = _start(runner, "a")
    for salt in ("b", "c", "d"):
        _start(runner, salt)
    assert len(runner.sessions) == 3
    refused = _refusal(runner, first, "a")
    assert (refused.status_code, refused.reason) == (410, "evicted")


def test_the_record_of_ended_programs_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(executor, "RECENTLY_ENDED", 2)
    runner = _runner()
    ids = [_start(runner) for _ in range(3)]
    for program_id in ids:
        runner.end(program_id)
    assert len(runner.ended) == 2
    assert _refusal(runner, ids[0]).status_code == 404  # forgotten: unknown
    assert _refusal(runner, ids[2]).status_code == 410
