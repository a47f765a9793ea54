"""``cache_salt`` on the DSL's backends (fl.Engine, fl.RuntimeEndpoint): every call and program
segment of a salted backend carries its salt, so programs of different tenants share no KV,
interpreted or compiled (issue 41)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import frontend_lang as fl
from runtime.request_checks import InvalidRequestValue

HEADER = "Tenant program header, the same words for every tenant who runs it. " * 6


class SaltedEngine(fl.Engine):
    """fl.Engine over the session's runtime.Engine, with a salt of its own."""

    def __init__(self, shared: fl.Engine, cache_salt: str | None) -> None:
        super(fl.Engine, self).__init__(shared.chat_template, cache_salt)
        self.engine = shared.engine


@fl.function
def note(s: fl.ProgramState, topic: str) -> None:
    s += HEADER + topic
    s += fl.gen("a", max_tokens=2, temperature=0)
    s += " and then"
    s += fl.gen("b", max_tokens=2, temperature=0)


def _salted(kind: str, salt: str, engine_backend: fl.Engine, server_url: str) -> fl.Backend:
    if kind == "engine":
        return SaltedEngine(engine_backend, salt)
    return fl.RuntimeEndpoint(server_url, cache_salt=salt)


@pytest.mark.parametrize("compile", [True, False], ids=["compiled", "interpreted"])
@pytest.mark.parametrize("kind", ["engine", "server"])
def test_programs_of_different_salts_share_no_kv(
    kind: str, compile: bool, engine_backend: fl.Engine, server_url: str, request
) -> None:
    salt = f"{request.node.name}-"  # salts of this test alone: no earlier test warmed them
    first, other, again = (_salted(kind, salt + s, engine_backend, server_url) for s in "aba")
    runs = [note.run(backend=b, compile=compile, topic="caches") for b in (first, other, again)]
    cached = [state.get_meta_info("a")["cached_tokens"] for state in runs]
    assert cached[0] == cached[1] == 0  # each tenant's first run computes the header
    assert cached[2] > 0  # the first tenant's second run reuses its own
    for state in runs:  # within a run, the second gen continues the first's KV
        assert state.get_meta_info("b")["cached_tokens"] > 0
    assert runs[0]["a"] == runs[1]["a"] == runs[2]["a"]  # the salt changes no output
    for backend in (first, other, again):
        if isinstance(backend, fl.RuntimeEndpoint):
            backend.shutdown()


def test_a_bad_salt_fails_when_the_backend_is_made(tiny_model_path: Path) -> None:
    with pytest.raises(InvalidRequestValue, match="cache_salt"):
        fl.RuntimeEndpoint("http://127.0.0.1:9", cache_salt="")
    with pytest.raises(InvalidRequestValue, match="cache_salt"):  # before the model loads
        fl.Engine(tiny_model_path, cache_salt="new\nline")


@fl.function
def read_then_fail(s: fl.ProgramState, topic: str) -> None:
    s += HEADER + topic
    s += fl.gen("a", max_tokens=2, temperature=0)
    if s["a"] is not None:  # read: the segment ran and the runtime holds the program
        raise RuntimeError("the program's own code fails between segments")


@pytest.mark.parametrize("kind", ["engine", "server"])
def test_a_salted_program_that_stops_early_is_ended_under_its_salt(
    kind: str, engine_backend: fl.Engine, server_url: str, server: Any, request
) -> None:
    """The backend ends the program it leaves open (``DELETE /program/{id}``, or the engine's
    ``end_program``) under its salt: the runtime knows the program under that salt alone."""

    def pinned() -> int:
        if kind == "engine":
            info = engine_backend.engine.get_server_info()
        else:
            info = server.server_info()
        return int(info["num_pinned_programs"])

    backend = _salted(kind, f"{request.node.name}-salt", engine_backend, server_url)
    before = pinned()
    with pytest.raises(RuntimeError, match="own code fails"):
        read_then_fail.run(backend=backend, compile=True, topic="caches")
    assert pinned() == before
    if isinstance(backend, fl.RuntimeEndpoint):
        backend.shutdown()
