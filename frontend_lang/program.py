"""``@fl.function``: a Python function over a state becomes a program you can run, run in a
batch, or stream, on any backend."""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from tqdm.auto import tqdm

from frontend_lang.backends.base import Backend, Prompt
from frontend_lang.state import ProgramState, RunContext
from frontend_lang.trace import ProgramGraph, trace_program

# A shared prefix shorter than this is not worth a prefetch request.
MIN_PREFETCH_CHARS = 64

_default_backend: Backend | None = None


def set_default_backend(backend: Backend | None) -> None:
    """The backend programs run on when ``run`` gets none."""
    global _default_backend
    _default_backend = backend


def get_default_backend() -> Backend | None:
    return _default_backend


class Function:
    """A program: ``func(s, **args)`` appends to the state ``s``. Calling the Function with a
    state runs its body on that state (programs compose); ``run`` starts a fresh state."""

    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func
        self.name = func.__name__
        self.__doc__ = func.__doc__
        parameters = list(inspect.signature(func).parameters.values())
        if not parameters or parameters[0].kind not in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            raise TypeError(f"@function {self.name}: the first parameter must be the state `s`")
        self._signature = inspect.Signature(parameters[1:])

    def __call__(self, s: ProgramState, *args: Any, **kwargs: Any) -> Any:
        return self.func(s, *args, **kwargs)

    def run(
        self,
        *args: Any,
        backend: Backend | None = None,
        stream: bool = False,
        compile: bool | None = None,
        **kwargs: Any,
    ) -> ProgramState:
        """Run on a fresh state and return it when the program is done. With ``stream`` return
        at once: read ``s.text_iter()`` (or ``async for`` over ``s.text_async_iter()``) while
        the program runs on a thread; reading a variable waits for the end. Errors in the
        program raise here (streamed: from the iterator or the read) as ProgramError.

        ``compile``: run the program's straight-line segments next to the runtime's KV cache
        (``frontend_lang/compiled.py``); the default where the backend supports it (Arbor's
        Engine and RuntimeEndpoint). False: the interpreter, one backend call per gen."""
        bound = self._bind(args, kwargs)
        chosen = _resolve(backend, self.name)
        compiled = chosen.supports_programs if compile is None else compile
        if compiled and not chosen.supports_programs:
            raise ValueError(
                f"program {self.name!r}: {type(chosen).__name__} cannot run compiled programs; "
                "pass compile=False"
            )
        run = RunContext(self.name, chosen, compiled=compiled)
        run.streaming = stream
        state = ProgramState(run, stream=stream)
        body = lambda: self.func(state, *bound.args, **bound.kwargs)  # noqa: E731
        if not stream:
            run.execute(body)
            return state

        def in_thread() -> None:
            try:
                run.execute(body)
            except BaseException as exc:  # noqa: BLE001 - handed to the reader
                run.error = exc
            finally:
                state._finish_stream()
                run.done.set()

        threading.Thread(target=in_thread, name=f"program-{self.name}", daemon=True).start()
        return state

    def run_batch(
        self,
        batch: list[dict[str, Any]],
        backend: Backend | None = None,
        num_threads: int | str = "auto",
        progress_bar: bool = True,
        compile: bool | None = None,
        prefetch: bool = True,
    ) -> list[ProgramState]:
        """Run once per argument dict, ``num_threads`` at a time (auto: one per program, up to
        64) so the runtime batches their calls; return the states in input order. Every run
        finishes before the first failure (in input order) is raised.

        ``prefetch`` (compiled runs): trace every program first, and prefill the longest
        static prefix they all share once before they start, so they do not race to compute
        the same header."""
        resolved = _resolve(backend, self.name)
        for args in batch:
            self._bind((), args)
        compiled = resolved.supports_programs if compile is None else compile
        if compiled and prefetch and len(batch) > 1:
            self.prefetch_common_prefix(batch, resolved)
        threads = min(len(batch), 64) if num_threads == "auto" else int(num_threads)
        states: list[ProgramState] = []
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix=self.name) as pool:
            futures = [
                pool.submit(self.run, backend=resolved, compile=compiled, **args) for args in batch
            ]
            with tqdm(total=len(batch), desc=self.name, disable=not progress_bar) as bar:
                for _ in as_completed(futures):
                    bar.update(1)
            for future in futures:
                states.append(future.result())
        return states

    def trace(self, *args: Any, backend: Backend | None = None, **kwargs: Any) -> ProgramGraph:
        """Run the program without a model and return its graph (``frontend_lang/trace.py``):
        text, gen, select, fork, join and role nodes, up to the first point where the program
        reads a generated value (marked dynamic: what follows depends on it). ``backend``
        (default: the default backend, if set) gives the chat template role nodes render."""
        chosen = backend or _default_backend
        return trace_program(self, args, kwargs, chosen)

    def prefetch_common_prefix(self, batch: list[dict[str, Any]], backend: Backend) -> str:
        """Prefill, once, the longest static text every program of ``batch`` starts with (as
        traced); return it ("" when they share none worth it, or tracing failed)."""
        try:
            prefixes = [
                self.trace(backend=backend, **args).static_prefix(backend.chat_template)
                for args in batch
            ]
        except Exception:  # noqa: BLE001 - a program that cannot be traced just runs
            return ""
        common = os.path.commonprefix(prefixes)
        if len(common) < MIN_PREFETCH_CHARS:
            return ""
        backend.cache_prefix(Prompt(common))
        return common

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> inspect.BoundArguments:
        try:
            return self._signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"program {self.name!r}: {exc}") from None


def function(func: Callable[..., Any]) -> Function:
    """Decorator: ``@fl.function def program(s, question): s += ...``."""
    return Function(func)


def _resolve(backend: Backend | None, program: str) -> Backend:
    chosen = backend or _default_backend
    if chosen is None:
        raise ValueError(
            f"program {program!r} has no backend: pass backend=... or call fl.set_default_backend"
        )
    return chosen
