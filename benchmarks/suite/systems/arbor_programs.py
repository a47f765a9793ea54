"""Arbor running DSL programs: every native call a program makes is traced (prompt tokens,
output tokens, timing) so that baselines can replay the same calls.

Interpreted (the baselines replay these calls) or compiled (``compile=True``: each program
segment is one program request; its gens and selects are traced from the runtime's events,
with token counts but not token ids, so they are reported, not replayed).
"""

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
        self.segments = 0  # compiled program requests sent
        self._ready: dict[int, dict[str, float]] = {}  # group -> branch -> its last op's end
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

    def traced_program(self, request: dict[str, Any], group: int) -> Iterator[dict[str, Any]]:
        """A compiled program segment, streamed so that each gen's tokens are timed as they
        arrive. Each gen is traced as a call whose arrival is when its branch could start it
        (the segment was sent, or the branch's previous op, or its parent's, or, after a
        join, its branches' last op ended); each select choice as a prefill-only call."""
        with self._lock:
            self.segments += 1
            ready = self._ready.setdefault(group, {})
        sent = self.clock()
        tokens: dict[str, list[float]] = {}
        for event in super().run_program({**request, "stream": True}):
            now = self.clock()
            kind, key = event.get("type"), str(event.get("branch"))
            if kind == "delta":
                times = tokens.setdefault(key, [])
                times.extend([now] * (event["completion_tokens"] - len(times)))
                if not request.get("stream"):
                    continue  # streamed for the timing only
            elif kind in ("gen", "select"):
                arrival = max(sent, _ready_at(ready, key))
                ready[key] = now
                self._record_op(event, group, Timing(arrival, tokens.pop(key, []), now))
            yield event

    def _record_op(self, event: dict[str, Any], group: int, timing: Timing) -> None:
        if event["type"] == "gen":
            meta = event["meta_info"]
            count = meta["completion_tokens"]
            timing.token_times = timing.token_times[:count]
            timing.token_times += [timing.finish] * (count - len(timing.token_times))
            ops = [(meta["prompt_tokens"], count, meta["cached_tokens"])]
        else:
            ops = [(m["prompt_tokens"], 0, m.get("cached_tokens", 0)) for m in event["meta"]]
        with self._lock:
            for prompt, output, cached in ops:
                # Token counts only: the runtime tokenized the text (nothing replays it).
                call = Call((0,) * prompt, (0,) * output, group)
                self.traced.append(Traced(call, timing, cached))

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
    the expression, and the traced native request is made on that same thread). With
    ``compiled`` it runs program segments (their events are read on another thread, so the
    group is passed along instead)."""

    def __init__(self, tracer: TracingEngine, group: int, compiled: bool = False) -> None:
        self.tracer = tracer
        self.group = group
        self.compiled = compiled

    @property
    def supports_programs(self) -> bool:
        return self.compiled

    def run_program(self, request: dict[str, Any]) -> Iterator[dict[str, Any]]:
        return self.tracer.traced_program(request, self.group)

    def end_program(self, program_id: str) -> None:
        self.tracer.end_program(program_id)

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
    engine: Engine,
    program: fl.Function,
    arguments: list[dict[str, Any]],
    note: str = "",
    compiled: bool = False,
) -> SystemRun:
    """Run ``program`` once per argument dict, all at once (one thread per program, as
    ``run_batch`` does), on a fresh cache; every call is traced and given its wave. With
    ``compiled`` the run is the ``arbor-compiled`` system (its calls are not for replay)."""
    warm_up(engine)
    before = engine.get_server_info()
    clock = Clock()
    tracer = TracingEngine(engine, clock)
    with (
        ThreadPoolExecutor(max(1, min(len(arguments), 64))) as pool,
        tqdm(total=len(arguments), desc="arbor", unit="program", leave=False) as bar,
    ):
        futures = [
            pool.submit(
                program.run, backend=ProgramBackend(tracer, i, compiled), compile=compiled, **args
            )
            for i, args in enumerate(arguments)
        ]
        for future in as_completed(futures):
            future.result()
            bar.update(1)
    wall = clock()
    if compiled:
        trips = tracer.segments / max(len(arguments), 1)
        note = "; ".join(filter(None, [note, f"{trips:.1f} program requests per program"]))
    run = finish_run(engine, tracer.traced, wall, before, note)
    run.calls = assign_waves(run.calls, run.timings)
    if compiled:
        run.system = "arbor-compiled"
    return run


def _ready_at(ready: dict[str, float], key: str) -> float:
    """When branch ``key`` could start its next op: after its own and its branches' (joined)
    last ops, else after its nearest ancestor's; 0 when none has run."""
    own = [t for k, t in ready.items() if k == key or k.startswith(key + "/")]
    if own:
        return max(own)
    while "/" in key:
        key = key.rsplit("/", 1)[0]
        if key in ready:
            return ready[key]
    return 0.0
