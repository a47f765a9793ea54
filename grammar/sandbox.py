"""Constraint preparation in worker processes that are killed when they overrun their deadline.

Turning a request's constraint into something a matcher can run is the one place where user
input decides how much work the server does: schema checks and lowering, regex analysis, the
backend's compile, and the automata of stop regexes can each take exponential time or memory
on a few hundred bytes of input, often inside native code that no thread can interrupt. So
each request's constraint is *prepared* in a worker process: built, analysed, compiled once as
a trial (which proves it compiles, and in time), and checked to admit some output. What comes
back is small and cheap to use: the backend's lowered form (compiled again in the serving
process, where the compile itself releases the GIL) and the stop-regex matcher, pickled.

A worker that overruns ``timeout`` is killed and replaced; a worker that crashes fails its job
alone. Results, failures included, are cached by the constraint's canonical text, so a repeated
bomb is refused at once instead of taking a worker for another ``timeout``.

Workers are plain ``python -c`` subprocesses talking pickles over their stdin and stdout (not
multiprocessing's spawn, which would re-run the user's main module in every worker).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from grammar.errors import GrammarCompileTimeout, GrammarError

logger = logging.getLogger(__name__)

# How long a new worker may take to import its libraries and build its backend.
STARTUP_TIMEOUT_S = 120.0
_WORKER_CODE = "from grammar.sandbox import worker_main; worker_main()"
# Workers yield the CPU to the forward: a bomb burning a core until its deadline must not slow
# the requests being served.
WORKER_NICENESS = 10


@dataclass(frozen=True)
class Prepared:
    """A prepared constraint: ``lowered`` for ``GrammarBackend.compile_lowered`` (None without
    a grammar), ``stop_regex`` a pickled ``StopRegex`` at its start (None without patterns)."""

    lowered: Any
    stop_regex: bytes | None


@dataclass
class _Job:
    request: dict[str, Any]
    future: Future[Prepared]


class CompileSandbox:
    """``workers`` worker processes (started on first use) that prepare constraints.

    ``submit(request)`` takes the constraint fields of a request's sampling params (the grammar
    kind, its options, ``stop_regex``) and returns a Future that resolves to a ``Prepared`` or
    fails with a GrammarError (a compile error, an overrun of ``timeout``, a crashed worker).
    The backend is rebuilt in each worker from ``backend_args`` = (name, tokenizer, vocab_size,
    stop_token_ids), which must pickle.
    """

    def __init__(
        self,
        backend_args: tuple[str, Any, int, Sequence[int]],
        workers: int = 2,
        timeout: float = 30.0,
        cache_size: int = 1024,
    ) -> None:
        if workers < 1 or timeout <= 0 or cache_size < 1:
            raise ValueError("workers and cache_size must be >= 1 and timeout > 0")
        self.timeout = timeout
        self.cache_size = cache_size
        self._backend_args = backend_args
        self._workers = workers
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Prepared | GrammarError] = OrderedDict()
        self._in_flight: dict[str, Future[Prepared]] = {}
        self._threads: list[threading.Thread] = []
        self._processes: set[WorkerProcess] = set()
        self._starting: set[WorkerProcess] = set()  # spawned, not yet ready: shutdown aborts them
        self._queued = 0  # jobs submitted and not yet taken by a slot
        self._busy = 0  # slots working on a job
        self._closed = False

    def submit(self, request: Mapping[str, Any]) -> Future[Prepared]:
        """Prepare ``request`` (JSON-like values only); never blocks."""
        key = json.dumps(request, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        with self._lock:
            if self._closed:
                raise RuntimeError("the compile sandbox is shut down")
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return _done(cached)
            future = self._in_flight.get(key)
            if future is not None:
                return future
            future = Future()
            self._in_flight[key] = future
            self._queued += 1
            # A slot (thread + worker) starts only when every started one is busy: a worker's
            # start costs seconds, a queued job behind a fast compile only milliseconds.
            if (
                self._queued > len(self._threads) - self._busy
                and len(self._threads) < self._workers
            ):
                self._start_thread()
        future.add_done_callback(lambda done: self._finished(key, done))
        self._jobs.put(_Job(dict(request), future))
        return future

    def prestart(self) -> None:
        """Start the first worker now, in the background, so the first constraint does not
        wait for it (a long-running server wants this; a short script does not)."""
        with self._lock:
            if not self._threads and not self._closed:
                self._start_thread(prestart=True)

    def shutdown(self) -> None:
        """Fail queued jobs, stop the threads and kill the workers."""
        with self._lock:
            self._closed = True
            threads, self._threads = self._threads, []
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None and job.future.set_running_or_notify_cancel():
                job.future.set_exception(GrammarError("the server is shutting down"))
        for _ in threads:
            self._jobs.put(None)
        with self._lock:
            starting = list(self._starting)
        for worker in starting:
            worker.abort()  # its slot's thread sees the pipe close and gives up at once
        for worker in list(self._processes):
            worker.kill()
        for thread in threads:
            thread.join(timeout=5.0)

    def _start_thread(self, prestart: bool = False) -> None:
        name = f"grammar-sandbox-{len(self._threads)}"
        thread = threading.Thread(target=self._serve, args=(prestart,), name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _finished(self, key: str, future: Future[Prepared]) -> None:
        with self._lock:
            self._in_flight.pop(key, None)
            if future.cancelled():
                return
            error = future.exception()
            if error is not None and not isinstance(error, GrammarError):
                return  # not the constraint's fault (e.g. shutdown): do not remember it
            self._cache[key] = error if isinstance(error, GrammarError) else future.result()
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    # ---- one thread per worker slot ----------------------------------------------------

    def _serve(self, prestart: bool) -> None:
        worker = self._replace(None) if prestart else None
        try:
            while (job := self._jobs.get()) is not None:
                with self._lock:
                    self._queued -= 1
                    self._busy += 1
                try:
                    worker = self._handle(job, worker)
                except Exception:
                    logger.exception("the grammar sandbox failed a job")
                    if not job.future.done():
                        job.future.set_exception(GrammarError("compiling the constraint failed"))
                finally:
                    with self._lock:
                        self._busy -= 1
        finally:
            self._replace(worker, start=False)

    def _handle(self, job: _Job, worker: WorkerProcess | None) -> WorkerProcess | None:
        """Run ``job`` on ``worker`` (started or replaced as needed); the worker to keep."""
        if not job.future.set_running_or_notify_cancel():
            return worker
        if worker is None or not worker.alive:
            worker = self._replace(worker)
            if worker is None:
                job.future.set_exception(
                    GrammarError("the grammar worker failed to start; see the server log")
                )
                return None
        try:
            status, payload = worker.run(job.request, self.timeout)
        except WorkerOverrun:
            logger.warning("a constraint overran %.3g s; killing its worker", self.timeout)
            job.future.set_exception(GrammarCompileTimeout("constraint", self.timeout))
            return self._replace(worker, start=False)
        except WorkerDied:
            job.future.set_exception(
                GrammarError(
                    "compiling the constraint crashed the compiler process; simplify the constraint"
                )
            )
            return self._replace(worker, start=False)
        if status == "ok":
            job.future.set_result(payload)
        else:
            job.future.set_exception(GrammarError(payload))
        return worker

    def _replace(self, worker: WorkerProcess | None, start: bool = True) -> WorkerProcess | None:
        """Kill ``worker`` (if any) and, with ``start``, start a new one (None if it fails)."""
        if worker is not None:
            worker.kill()
            self._processes.discard(worker)
        if not start or self._closed:
            return None
        try:
            worker = WorkerProcess(
                [_WORKER_CODE], self._backend_args, on_spawn=self._spawned, on_ready=self._ready
            )
        except Exception:
            if not self._closed:  # a start aborted by shutdown is no failure
                logger.exception("the grammar worker failed to start")
            return None
        self._processes.add(worker)
        return worker

    def _spawned(self, worker: WorkerProcess) -> None:
        with self._lock:
            self._starting.add(worker)
            closed = self._closed
        if closed:  # shut down while this slot was spawning it
            worker.abort()

    def _ready(self, worker: WorkerProcess) -> None:
        with self._lock:
            self._starting.discard(worker)


class WorkerOverrun(Exception):
    """A worker did not answer within the deadline (it has been killed)."""


class WorkerDied(Exception):
    """A worker's process ended (or its pipe broke) before it answered."""


class WorkerProcess:
    """One worker subprocess (``python -c code *args``, the package on its path) and the two
    pipes to it. The worker reads ``init`` first and answers ("ready", None) when it can serve;
    then one reply per message."""

    def __init__(
        self,
        argv: Sequence[str],
        init: Any,
        on_spawn: Callable[[WorkerProcess], None] | None = None,
        on_ready: Callable[[WorkerProcess], None] | None = None,
    ) -> None:
        """``on_spawn`` is called once the process exists, before waiting for it to be ready
        (seconds: it imports its backend), so an owner can ``abort()`` a start; ``on_ready``
        when the wait is over, ready or not."""
        package_root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        self.killed = False
        self._kill_lock = threading.Lock()
        self.process = subprocess.Popen(
            [sys.executable, "-c", *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self._to = Connection(os.dup(self.process.stdin.fileno()), readable=False)
        self._from = Connection(os.dup(self.process.stdout.fileno()), writable=False)
        self.process.stdin.close()
        self.process.stdout.close()
        if on_spawn is not None:
            on_spawn(self)
        try:
            self._to.send(init)
            ready = self._from.poll(STARTUP_TIMEOUT_S) and self._from.recv() == ("ready", None)
        except (EOFError, OSError):
            ready = False
        finally:
            if on_ready is not None:
                on_ready(self)
        if not ready:
            self.kill()
            raise RuntimeError(f"worker process {self.process.pid} did not start")

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def run(self, message: Any, timeout: float) -> tuple[str, Any]:
        """The worker's reply to ``message``: ("ok", payload) or ("error", text). Raises
        WorkerOverrun past ``timeout`` (killing the worker), WorkerDied if it died."""
        try:
            self._to.send(message)
            if not self._from.poll(timeout):
                self.kill()
                raise WorkerOverrun(f"no answer within {timeout:g} s")
            status, payload = self._from.recv()
        except (EOFError, OSError) as exc:
            if not self.killed:
                logger.error("the worker process %s died (%r)", self.process.pid, exc)
            raise WorkerDied(str(exc)) from None
        return status, payload

    def abort(self) -> None:
        """Kill the process only (no wait, pipes left open): safe while another thread waits
        on the pipes, which then read end-of-file."""
        if self.alive:
            self.process.kill()

    def kill(self) -> None:
        """Kill the process and close the pipes; idempotent, and safe from two threads (a
        slot giving its worker up while the sandbox shuts down)."""
        with self._kill_lock:
            if self.killed:
                return
            self.killed = True
        if self.alive:
            self.process.kill()
        self.process.wait(timeout=5.0)
        self._to.close()
        self._from.close()


def _done(outcome: Prepared | GrammarError) -> Future[Prepared]:
    future: Future[Prepared] = Future()
    if isinstance(outcome, GrammarError):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
    return future


# ---- the worker process ------------------------------------------------------------------


def worker_main() -> None:
    """A worker's life: read the backend's arguments, build it, then answer ("ok", Prepared)
    or ("error", message) per request until the serving process closes the pipe. Messages go
    over fd 0 and a private copy of fd 1; fd 1 itself then points at stderr, so whatever a
    library prints cannot corrupt them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the serving process decides when to stop
    os.nice(WORKER_NICENESS)
    inbox = Connection(0, writable=False)
    conn = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)
    from grammar.backend import create_backend

    try:
        name, tokenizer, vocab_size, stop_token_ids = inbox.recv()
    except (EOFError, OSError):
        return
    backend = create_backend(name, tokenizer, vocab_size, stop_token_ids)
    conn.send(("ready", None))
    while True:
        try:
            request = inbox.recv()
        except (EOFError, OSError):
            return
        try:
            reply: tuple[str, Any] = ("ok", prepare(backend, request))
        except GrammarError as exc:
            reply = ("error", str(exc))
        except RecursionError:
            reply = ("error", "the constraint nests too deeply to compile")
        except MemoryError:
            reply = ("error", "compiling the constraint needs more memory than allowed")
        except Exception as exc:  # a backend failing on odd input: the request's problem
            reply = ("error", f"cannot compile the constraint: {exc}")
        conn.send(reply)


def prepare(backend: Any, request: Mapping[str, Any]) -> Prepared:
    """What a worker does for one request (also usable in-process, without a deadline)."""
    from grammar.spec import GrammarSpec
    from grammar.stop_regex import StopRegex

    spec = GrammarSpec.from_sampling_params(request)
    lowered = None
    if spec is not None:
        lowered = backend.lower(spec)
        compiled = backend.compile_lowered(lowered)  # the trial: it compiles, and in time
        if not compiled.admits_output(backend.vocab_size):
            raise GrammarError(
                f"the {spec.kind} constraint admits no output at all (e.g. a rule or $ref "
                "that only refers to itself)"
            )
    patterns = request.get("stop_regex") or ()
    stop = pickle.dumps(StopRegex(patterns)) if patterns else None
    return Prepared(lowered, stop)
