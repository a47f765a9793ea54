"""GrammarService: cached compiles return at once, compiles run off-thread, timeouts isolate."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from grammar import (
    CompiledGrammar,
    GrammarBackend,
    GrammarCompileTimeout,
    GrammarError,
    GrammarService,
    GrammarSpec,
)

SLOW = GrammarSpec.for_regex("slow[0-9]")


class SlowBackend(GrammarBackend):
    """Delegates to a real backend, but compiling SLOW blocks until released."""

    def __init__(self, inner: GrammarBackend) -> None:
        super().__init__(inner.tokenizer, inner.vocab_size, inner.stop_token_ids)
        self.inner = inner
        self.release = threading.Event()
        self.compiles = 0

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        self.compiles += 1
        if spec == SLOW:
            self.release.wait(timeout=30)
        return self.inner.compile(spec)


@pytest.fixture
def slow_backend(backend: GrammarBackend) -> Iterator[SlowBackend]:
    slow = SlowBackend(backend)
    yield slow
    slow.release.set()


def _wait(service: GrammarService, handle: object, seconds: float = 20.0) -> CompiledGrammar:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        result = service.poll(handle)  # type: ignore[arg-type]
        if result is not None:
            return result
        time.sleep(0.005)
    raise AssertionError("compile did not finish")


def test_cache_hit_is_immediate_and_counted(slow_backend: SlowBackend) -> None:
    service = GrammarService(slow_backend)
    spec = GrammarSpec.for_json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    first = _wait(service, service.submit(spec))
    handle = service.submit(
        GrammarSpec.for_json_schema('{"properties": {"a": {"type": "integer"}}, "type": "object"}')
    )
    assert service.poll(handle) is first
    stats = service.stats()
    assert (stats.hits, stats.misses, stats.size, slow_backend.compiles) == (1, 1, 1, 1)
    service.shutdown()


def test_concurrent_requests_share_one_compile(slow_backend: SlowBackend) -> None:
    service = GrammarService(slow_backend)
    handles = [service.submit(SLOW) for _ in range(3)]
    assert all(service.poll(h) is None for h in handles)  # pending, and poll did not block
    slow_backend.release.set()
    results = {id(_wait(service, h)) for h in handles}
    assert len(results) == 1 and slow_backend.compiles == 1
    service.shutdown()


def test_timeout_fails_that_request_only(slow_backend: SlowBackend) -> None:
    service = GrammarService(slow_backend, compile_timeout=0.2)
    slow = service.submit(SLOW)
    fast = service.submit(GrammarSpec.for_regex("[a-z]{3}"))
    assert _wait(service, fast) is not None
    time.sleep(0.25)
    with pytest.raises(GrammarCompileTimeout, match="longer than 0.2 s") as info:
        service.poll(slow)
    assert isinstance(info.value, GrammarError) and isinstance(info.value, ValueError)
    assert _wait(service, service.submit(GrammarSpec.for_choice(["x", "y"]))) is not None
    slow_backend.release.set()  # the abandoned compile finishes in the background and is cached
    deadline = time.monotonic() + 20
    while service.stats().compiles_in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert service.poll(service.submit(SLOW)) is not None
    service.shutdown()


def test_blocking_compile_times_out(slow_backend: SlowBackend) -> None:
    service = GrammarService(slow_backend, compile_timeout=0.1)
    with pytest.raises(GrammarCompileTimeout):
        service.compile(SLOW)
    service.shutdown()


def test_bad_spec_errors_through_poll_only_for_it(backend: GrammarBackend) -> None:
    service = GrammarService(backend)
    bad = service.submit(GrammarSpec("json_schema", '{"type": "integer", "minimum": 1e30}'))
    good = service.submit(GrammarSpec.for_regex("ok"))
    with pytest.raises(GrammarError, match="leaves no 64-bit integer"):
        _wait(service, bad)
    assert _wait(service, good) is not None
    assert service.stats().size == 1
    service.shutdown()


def test_lru_eviction(backend: GrammarBackend) -> None:
    service = GrammarService(backend, cache_size=2)
    specs = [GrammarSpec.for_regex(f"x{i}") for i in range(3)]
    for spec in specs[:2]:
        service.compile(spec)
    service.compile(specs[0])  # touch: specs[1] becomes least recently used
    service.compile(specs[2])
    assert service.stats().size == 2
    hits = service.stats().hits
    service.compile(specs[0])
    assert service.stats().hits == hits + 1
    service.compile(specs[1])
    assert service.stats().hits == hits + 1  # evicted, compiled again
    service.shutdown()
