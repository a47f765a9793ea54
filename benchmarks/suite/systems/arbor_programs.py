"""Arbor running DSL programs: every native call a program makes is traced (prompt tokens,
output tokens, timing) so that baselines can replay the same calls."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from tqdm import tqdm

import frontend_lang as fl
from benchmarks.suite.systems.arbor import Traced, finish_run, warm_up
from benchmarks.suite.trace import Call, Clock, SystemRun, Timing, assign_waves
from frontend_lang.backends.base import ChoiceLogprobs, GenOutput, Prompt
from runtime import Engine

CONSTRAINTS = ("json_schema", "regex", "ebnf")


class TracingEngine(fl.Engine):
    """``fl.Engine`` over an existing ``runtime.Engine``, recording each native request.

    Generating requests are always streamed (tokens are timed as they arrive; the result is
    the stream's last chunk, which equals the unstreamed result). Prefill-only requests
    (``select``'s scoring, fork's prefix caching) are timed as a whole. The group of a call is
    the program instance ``ProgramBackend`` sets on the calling thread."""

    def __init__(self, engine: Engine, clock: Clock) -> None:
        # Skip fl.Engine.__init__, which would start a second runtime: share ``engine``.
        super(fl.Engine, self).__init__(None)
        self.engine = engine
        self.clock = clock
        self.traced: list[Traced] = []
        self.current_group = threading.local()
        self._lock = threading.Lock()

    def _call(self, payload: dict[str, Any]) -> Any:
        params = payload.get("sampling_params") or {}
        if isinstance(payload["text"], str) and params.get("max_new_tokens", 1) != 0:
            final: dict[str, Any] = {}
            for chunk in self._stream(payload):
                final = chunk
            final.pop("delta", None)
            return final
        arrival = self.clock()
        results = super()._call(payload)
        finish = self.clock()
        texts = payload["text"] if isinstance(payload["text"], list) else [payload["text"]]
        many = results if isinstance(results, list) else [results]
        for text, result in zip(texts, many, strict=True):
            timing = Timing(arrival, [finish] * len(result["output_ids"]), finish)
            self._record(text, result, params, timing)
        return results

    def _stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        timing = Timing(arrival=self.clock())
        chunk: dict[str, Any] = {"output_ids": []}
        for chunk in super()._stream(payload):
            now = self.clock()
            timing.token_times.extend([now] * (len(chunk["output_ids"]) - len(timing.token_times)))
            yield chunk
        timing.finish = self.clock()
        self._record(payload["text"], chunk, payload.get("sampling_params") or {}, timing)

    def _record(
        self, text: str, result: dict[str, Any], params: dict[str, Any], timing: Timing
    ) -> None:
        call = Call(
            prompt_ids=tuple(self.engine.tokenizer(text).input_ids),
            output_ids=tuple(result["output_ids"]),
            group=self.current_group.value,
            constrained=any(params.get(k) is not None for k in CONSTRAINTS),
        )
        with self._lock:
            self.traced.append(Traced(call, timing, result["meta_info"]["cached_tokens"]))


class ProgramBackend(fl.Backend):
    """One program instance's view of a shared TracingEngine: marks the calling thread with
    the instance's group before each call (the DSL calls the backend on the thread that runs
    the expression, and the traced native request is made on that same thread)."""

    def __init__(self, tracer: TracingEngine, group: int) -> None:
        self.tracer = tracer
        self.group = group

    @property
    def chat_template(self) -> fl.ChatTemplate:
        return self.tracer.chat_template

    def generate(
        self,
        prompt: Prompt,
        sampling_params: dict[str, Any],
        on_delta: Callable[[str], None] | None = None,
    ) -> GenOutput:
        self.tracer.current_group.value = self.group
        return self.tracer.generate(prompt, sampling_params, on_delta)

    def choice_logprobs(self, prompt: Prompt, choices: list[str]) -> ChoiceLogprobs:
        self.tracer.current_group.value = self.group
        return self.tracer.choice_logprobs(prompt, choices)

    def unconditional_logprobs(self, choices: list[str]) -> list[list[float]]:
        self.tracer.current_group.value = self.group
        return self.tracer.unconditional_logprobs(choices)

    def cache_prefix(self, prompt: Prompt) -> None:
        self.tracer.current_group.value = self.group
        self.tracer.cache_prefix(prompt)


def run_programs(
    engine: Engine, program: fl.Function, arguments: list[dict[str, Any]], note: str = ""
) -> SystemRun:
    """Run ``program`` once per argument dict, all at once (one thread per program, as
    ``run_batch`` does), on a fresh cache; every native call is traced and given its wave."""
    warm_up(engine)
    before = engine.get_server_info()
    clock = Clock()
    tracer = TracingEngine(engine, clock)
    with (
        ThreadPoolExecutor(max(1, min(len(arguments), 64))) as pool,
        tqdm(total=len(arguments), desc="arbor", unit="program", leave=False) as bar,
    ):
        futures = [
            pool.submit(program.run, backend=ProgramBackend(tracer, i), **args)
            for i, args in enumerate(arguments)
        ]
        for future in as_completed(futures):
            future.result()
            bar.update(1)
    wall = clock()
    run = finish_run(engine, tracer.traced, wall, before, note)
    run.calls = assign_waves(run.calls, run.timings)
    return run
