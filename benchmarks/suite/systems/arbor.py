"""Arbor, in process: the workloads' calls sent to a ``runtime.Engine`` as streams, timed by
the client as each chunk arrives."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from benchmarks.suite.trace import Call, Clock, SystemRun, Timing
from runtime import Engine


@dataclass(frozen=True)
class Request:
    """A call whose prompt is known up front. ``sampling`` adds to (or overrides) the greedy,
    fixed-length defaults: ``max_new_tokens`` tokens at temperature 0 with EOS ignored."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: dict[str, Any] = field(default_factory=dict)
    group: int = 0

    @property
    def sampling_params(self) -> dict[str, Any]:
        base = {"max_new_tokens": self.max_new_tokens, "temperature": 0.0, "ignore_eos": True}
        return {**base, **self.sampling}

    @property
    def constrained(self) -> bool:
        return any(k in self.sampling for k in ("json_schema", "regex", "ebnf"))


@dataclass
class Traced:
    """A finished call with its timing and the runtime's cached-token count."""

    call: Call
    timing: Timing
    cached_tokens: int


async def stream_call(
    engine: Engine, clock: Clock, prompt_ids: tuple[int, ...], sampling: dict[str, Any]
) -> tuple[tuple[int, ...], Timing, int]:
    """Send one streamed request; every token of a chunk gets the chunk's arrival time.
    Returns (output ids, timing, cached tokens)."""
    timing = Timing(arrival=clock())
    output: list[int] = []
    cached = 0
    chunks = await engine.async_generate(
        input_ids=list(prompt_ids), sampling_params=sampling, stream=True
    )
    async for chunk in chunks:
        now = clock()
        timing.token_times.extend([now] * (len(chunk["output_ids"]) - len(output)))
        output = chunk["output_ids"]
        cached = chunk["meta_info"]["cached_tokens"]
    timing.finish = clock()
    return tuple(output), timing, cached


def run_requests(engine: Engine, requests: list[Request], note: str = "") -> SystemRun:
    """Send every request at once (offline: all arrive at t=0) and time each."""

    async def one(request: Request, clock: Clock, bar: tqdm) -> list[Traced]:
        sampling = request.sampling_params
        output, timing, cached = await stream_call(engine, clock, request.prompt_ids, sampling)
        bar.update(1)
        call = Call(request.prompt_ids, output, request.group, 0, request.constrained)
        return [Traced(call, timing, cached)]

    def start(clock: Clock, bar: tqdm) -> list[Awaitable[list[Traced]]]:
        return [one(r, clock, bar) for r in requests]

    return measure(engine, start, len(requests), note)


def measure(
    engine: Engine,
    start: Callable[[Clock, tqdm], list[Awaitable[list[Traced]]]],
    total: int,
    note: str = "",
) -> SystemRun:
    """Run the coroutines ``start(clock, bar)`` makes (each one client: a request, or a
    session of dependent requests) concurrently on a fresh cache. ``total`` sizes the progress
    bar, which the coroutines advance. The cache hit rate is the engine's cached over prompt
    tokens during the run."""
    warm_up(engine)
    before = engine.get_server_info()

    async def gather() -> tuple[list[Traced], float]:
        clock = Clock()
        with tqdm(total=total, desc="arbor", unit="req", leave=False) as bar:
            clients = await asyncio.gather(*start(clock, bar))
        return [t for client in clients for t in client], clock()

    traced, wall = asyncio.run(gather())
    return finish_run(engine, traced, wall, before, note)


def finish_run(
    engine: Engine, traced: list[Traced], wall: float, before: dict[str, Any], note: str
) -> SystemRun:
    """A SystemRun from traced calls, sorted into sending order."""
    after = engine.get_server_info()
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_tokens"] - before["cached_tokens"]
    traced = sorted(traced, key=lambda t: t.timing.arrival)
    return SystemRun(
        system="arbor",
        calls=[t.call for t in traced],
        timings=[t.timing for t in traced],
        outputs=[t.call.output_ids for t in traced],
        wall_s=wall,
        cache_hit_rate=cached / prompt if prompt else None,
        note=note,
    )


def warm_up(engine: Engine) -> None:
    """One short request and one constrained one (first-call costs, such as starting the
    grammar worker process, stay out of the numbers), then an empty cache."""
    engine.generate(input_ids=[10, 11, 12, 13], sampling_params={"max_new_tokens": 2})
    engine.generate(
        input_ids=[10, 11, 12, 13], sampling_params={"max_new_tokens": 2, "regex": "a+"}
    )
    if not engine.flush_cache():
        raise RuntimeError("the engine is still running requests; cannot flush its cache")
