"""Compilation off the scheduler's critical path: a thread pool, a bounded LRU cache, timeouts.

The scheduler ``submit``s a request's spec when the request arrives and ``poll``s the handle
once per loop iteration while the request waits in its grammar queue; neither call blocks. A
cached spec is ready at once. Requests that ask for a spec already compiling share that
compile. A request whose compile outlives ``compile_timeout`` gets GrammarCompileTimeout from
``poll``; the compile itself cannot be interrupted and finishes in the background (its result
is still cached, so a retry is instant).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from grammar.backend import CompiledGrammar, GrammarBackend, LoweredGrammar
from grammar.errors import GrammarCompileTimeout, GrammarError
from grammar.spec import GrammarSpec


@dataclass
class CompileHandle:
    """One request's pending compile; opaque to callers except for ``spec``."""

    spec: GrammarSpec
    deadline: float
    future: Future[CompiledGrammar] | None = None
    result: CompiledGrammar | None = None


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int
    size: int
    compiles_in_flight: int


class GrammarService:
    """Owns the backend, the compile cache (at most ``cache_size`` grammars, least recently
    used evicted first), ``workers`` compile threads, and the per-request compile timeout."""

    def __init__(
        self,
        backend: GrammarBackend,
        cache_size: int = 256,
        compile_timeout: float = 30.0,
        workers: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if cache_size < 1 or workers < 1 or compile_timeout <= 0:
            raise ValueError("cache_size and workers must be >= 1 and compile_timeout > 0")
        self.backend = backend
        self.cache_size = cache_size
        self.compile_timeout = compile_timeout
        self._clock = clock
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._in_flight: dict[GrammarSpec, Future[CompiledGrammar]] = {}
        self._hits = 0
        self._misses = 0

    def submit(self, spec: GrammarSpec) -> CompileHandle:
        """Start (or join, or skip when cached) the compile of ``spec``; never blocks."""
        return self._submit(spec, lambda: self.backend.compile(spec))

    def submit_lowered(self, lowered: LoweredGrammar) -> CompileHandle:
        """As ``submit`` for a spec the backend has lowered already (in a sandbox process):
        only ``GrammarBackend.compile_lowered`` runs on the compile threads."""
        return self._submit(lowered.spec, lambda: self.backend.compile_lowered(lowered))

    def _submit(self, spec: GrammarSpec, work: Callable[[], CompiledGrammar]) -> CompileHandle:
        handle = CompileHandle(spec, deadline=self._clock() + self.compile_timeout)
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
                self._hits += 1
                handle.result = cached
                return handle
            self._misses += 1
            future = self._in_flight.get(spec)
            started = future is None
            if future is None:
                future = self._pool.submit(work)
                self._in_flight[spec] = future
        if started:  # outside the lock: a compile already done runs the callback right here
            future.add_done_callback(lambda done: self._finished(spec, done))
        handle.future = future
        return handle

    def poll(self, handle: CompileHandle) -> CompiledGrammar | None:
        """The compiled grammar, or None while still compiling; never blocks.

        Raises GrammarError if the spec does not compile (for any reason: the error of a
        crashing backend is reported as a GrammarError too) or GrammarCompileTimeout once the
        handle's deadline has passed.
        """
        if handle.result is not None:
            return handle.result
        assert handle.future is not None
        if handle.future.done():
            handle.result = _result(handle.spec, handle.future)
            return handle.result
        if self._clock() >= handle.deadline:
            raise GrammarCompileTimeout(handle.spec.kind, self.compile_timeout)
        return None

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Blocking compile through the cache (offline use and tests), with the timeout."""
        handle = self.submit(spec)
        if handle.result is not None:
            return handle.result
        assert handle.future is not None
        try:
            handle.future.result(timeout=max(0.0, handle.deadline - self._clock()))
        except TimeoutError:
            raise GrammarCompileTimeout(spec.kind, self.compile_timeout) from None
        except Exception:
            pass  # reported by _result below
        return _result(spec, handle.future)

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self._hits, self._misses, len(self._cache), len(self._in_flight))

    def shutdown(self) -> None:
        """Stop accepting compiles; running ones finish in the background."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _finished(self, spec: GrammarSpec, future: Future[CompiledGrammar]) -> None:
        with self._lock:
            self._in_flight.pop(spec, None)
            if future.cancelled() or future.exception() is not None:
                return
            self._cache[spec] = future.result()
            self._cache.move_to_end(spec)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)


def _result(spec: GrammarSpec, future: Future[CompiledGrammar]) -> CompiledGrammar:
    exc = future.exception()
    if exc is None:
        return future.result()
    if isinstance(exc, GrammarError):
        raise exc
    raise GrammarError(f"cannot compile the {spec.kind} grammar: {exc}") from exc
