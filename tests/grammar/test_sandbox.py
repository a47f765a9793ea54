"""CompileSandbox: constraints prepared in worker processes under a hard deadline.

A bomb is killed at the deadline and fails alone; the next constraint gets a fresh worker; a
crashed worker fails its job alone; results and failures are cached; prepared constraints
compile and match in the serving process like directly compiled ones.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterator
from typing import Any

import pytest

import grammar.sandbox as sandbox_module
from grammar import (
    CompileSandbox,
    GrammarBackend,
    GrammarCompileTimeout,
    GrammarError,
    StopRegex,
)

pytestmark = pytest.mark.timeout(180)

# A DFA of 2^17 states: building it takes minutes; the backend never needs it, stop regexes do.
AUTOMATON_BOMB = "[ab]*a[ab]{16}"


@pytest.fixture(scope="module")
def sandbox(backend: GrammarBackend) -> Iterator[CompileSandbox]:
    args = ("xgrammar", backend.tokenizer, backend.vocab_size, backend.stop_token_ids)
    box = CompileSandbox(args, workers=1, timeout=3.0)
    yield box
    box.shutdown()


def _prepare(sandbox: CompileSandbox, request: dict[str, Any], within: float = 60.0) -> Any:
    return sandbox.submit(request).result(timeout=within)


def test_prepared_constraint_matches_a_direct_compile(
    sandbox: CompileSandbox, backend: GrammarBackend
):
    prepared = _prepare(sandbox, {"regex": "(yes|no)", "stop_regex": ["ab+c"]})
    compiled = backend.compile_lowered(prepared.lowered)
    matcher = compiled.new_matcher()
    for token in backend.tokenizer.encode("yes", add_special_tokens=False):
        assert matcher.accept_token(token)
    stop = pickle.loads(prepared.stop_regex)
    assert isinstance(stop, StopRegex) and stop.feed("xxabbbc") == (2, 7)
    assert _prepare(sandbox, {"stop_regex": ["q"]}).lowered is None


def test_a_bomb_is_killed_at_the_deadline_and_the_next_job_runs(sandbox: CompileSandbox):
    started = time.monotonic()
    with pytest.raises(GrammarCompileTimeout):
        _prepare(sandbox, {"stop_regex": [AUTOMATON_BOMB]})
    assert time.monotonic() - started < 3.0 + 30.0  # the deadline, plus a worker start
    assert _prepare(sandbox, {"regex": "[0-9]{3}"}).lowered is not None
    # The failure is remembered: the same bomb is refused without taking a worker again.
    started = time.monotonic()
    with pytest.raises(GrammarCompileTimeout):
        _prepare(sandbox, {"stop_regex": [AUTOMATON_BOMB]})
    assert time.monotonic() - started < 0.5


def test_a_crashed_worker_fails_its_job_alone(sandbox: CompileSandbox):
    _prepare(sandbox, {"regex": "warm"})
    future = sandbox.submit({"stop_regex": ["[xy]*x[xy]{18}"]})
    deadline = time.monotonic() + 30
    while not sandbox._processes and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)  # the worker is now inside the job
    for worker in list(sandbox._processes):
        worker.process.kill()
    with pytest.raises(GrammarError, match="crashed"):
        future.result(timeout=30)
    assert _prepare(sandbox, {"regex": "[a-c]+"}).lowered is not None


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        ({"json_schema": {"$ref": "#"}}, "cycle of references that only refer"),
        ({"json_schema": {"anyOf": [{"$ref": "#"}]}}, "a loop no validator finishes"),
        ({"ebnf": "root ::= root"}, "admits no output"),
        ({"regex": "a{200000}"}, "too large"),
        ({"stop_regex": ["a{3000}"]}, "too large"),
        ({"regex": "(?<=a)b"}, "lookbehind"),
        ({"json_schema": {"type": "strin"}}, "strin"),
    ],
)
def test_invalid_constraints_fail_with_a_message(
    sandbox: CompileSandbox, request_: dict[str, Any], message: str
):
    with pytest.raises(GrammarError, match=message):
        _prepare(sandbox, request_)


def test_deep_schemas_are_refused_by_nesting_not_recursion(sandbox: CompileSandbox):
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(100):
        schema = {"type": "object", "properties": {"a": schema}}
    with pytest.raises(GrammarError, match="nests deeper than"):
        _prepare(sandbox, {"json_schema": schema})


def test_shutdown_aborts_a_worker_still_starting(
    backend: GrammarBackend, monkeypatch: pytest.MonkeyPatch
):
    """A server stopped while its grammar worker starts (seconds: it imports its backend) must
    not wait for the start: the starting worker is killed and its slot gives up at once."""
    monkeypatch.setattr(sandbox_module, "_WORKER_CODE", "import time; time.sleep(600)")
    args = ("xgrammar", backend.tokenizer, backend.vocab_size, backend.stop_token_ids)
    box = CompileSandbox(args, workers=1, timeout=3.0)
    box.prestart()
    threads = list(box._threads)
    deadline = time.monotonic() + 30.0
    while not box._starting and time.monotonic() < deadline:
        time.sleep(0.01)
    starting = list(box._starting)
    assert starting, "the prestarted worker never spawned"
    box.shutdown()
    # Before the abort, the slot's thread sat in the worker's 120 s ready wait past the
    # shutdown's join, and the never-ready process lived on.
    assert not any(thread.is_alive() for thread in threads)
    assert not any(worker.alive for worker in starting)
