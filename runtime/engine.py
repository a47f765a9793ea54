"""``runtime.Engine``: the scheduler, detokenizer and tokenizer manager in one process.

The same three components ``arbor serve`` runs as processes, here on threads connected by
queues: the scheduler thread owns the model, the detokenizer thread turns tokens into text,
and the tokenizer manager runs on a private asyncio loop that the sync and async APIs drive.
"""

from __future__ import annotations

import asyncio
import functools
import os
import queue
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any, TypedDict

from runtime.channels import QueueChannel
from runtime.chat.plan import require_reasoning
from runtime.chat.turn_reader import TurnReader, native_result
from runtime.components import Channels, build_components
from runtime.errors import SchedulerDied
from runtime.generate_input import GenerateInput, LogprobOptions, SubRequest
from runtime.heap import freeze_startup_heap, unfreeze_heap
from runtime.ipc import ControlCommand
from runtime.model_files import locate_model
from runtime.program.executor import ProgramRunner
from runtime.role_blocks import ChatTemplateError, RoleBlocks, role_blocks_or_why
from runtime.server_args import ServerArgs
from runtime.tokenizer_manager import final_output
from runtime.validate_retry import ValidatedGeneration

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11

Prompt = str | list[str] | None
Params = dict[str, Any] | list[dict[str, Any]] | None


class GenerateOptions(TypedDict, total=False):
    """The keyword options of ``Engine.generate`` and ``Engine.async_generate``; absent ones
    take the defaults written here."""

    input_ids: list[int] | list[list[int]] | None  # the prompt(s) as token ids (None)
    return_logprob: bool  # False
    top_logprobs_num: int  # 0
    logprob_start_len: int  # -1: no prompt logprobs
    stream: bool  # False
    rid: str | list[str] | None  # None: generated ids
    cache_salt: str | None  # None
    pin_ttl_s: float | None  # None: keep no KV past LRU; seconds to pin prompt and output
    require_reasoning: bool  # False: constraints after the reasoning, split off (generate)


class Engine:
    """In-process inference. ``Engine(model_path, max_total_tokens=2048, page_size=4, ...)``
    takes any ServerArgs field as a keyword argument; ``model_path`` is a GGUF file or a
    Hugging Face folder, None the built-in model. A model that cannot be loaded raises
    ``ModelLoadError`` naming the file and the problem. With ``tp_size=N`` this process is rank
    0 of a tensor-parallel group and starts N - 1 worker processes, stopped by ``shutdown``
    (docs/scale-out.md); a process runs one tensor-parallel engine at a time."""

    def __init__(
        self, model_path: str | os.PathLike[str] | None = None, **server_args: Any
    ) -> None:
        self.args = ServerArgs.from_kwargs(
            os.fspath(model_path) if model_path else None, **server_args
        )
        locate_model(self.args.model_path)  # a bad path fails here, before threads start
        if self.args.dp_size > 1:
            raise ValueError(
                "dp_size: the in-process Engine runs one replica; serve replicas with "
                "`arbor serve --dp N` and use fl.RuntimeEndpoint or HTTP clients against it"
            )
        # The scheduler's, the detokenizer's and the tokenizer manager's inboxes.
        self._queues = queues = (QueueChannel(), QueueChannel(), QueueChannel())
        parts = build_components(self.args, Channels(*queues, *queues))
        assert parts.scheduler and parts.detokenizer and parts.tokenizer_manager
        self.scheduler, self.detokenizer = parts.scheduler, parts.detokenizer
        self.tokenizer_manager, self.tokenizer = parts.tokenizer_manager, parts.tokenizer
        self._role_blocks: RoleBlocks | str | None = None  # str: why there are none
        self.generation = ValidatedGeneration(self.tokenizer_manager, self.args)
        self.programs = ProgramRunner(
            self.generation, self.args.program_pin_timeout_s, self.args.max_programs_per_tenant
        )
        self._loop = asyncio.new_event_loop()
        self._threads = parts.start_threads(self._run_scheduler)
        loop_thread = threading.Thread(
            target=self._loop.run_forever, name="tokenizer-manager", daemon=True
        )
        loop_thread.start()
        self._threads.append(loop_thread)
        self.tokenizer_manager.start_receiver(queues[2], self._loop)
        self.tokenizer_manager.ready.wait()
        if self.tokenizer_manager.dead:
            raise SchedulerDied(self.tokenizer_manager.dead)
        self._frozen = freeze_startup_heap("engine", self.args)

    def _run_scheduler(self) -> None:
        try:
            self.scheduler.event_loop()
        except Exception:  # already reported to the tokenizer manager as SchedulerFailed
            pass

    # ---- generation ---------------------------------------------------------------------

    def generate(
        self,
        prompt: Prompt = None,
        sampling_params: Params = None,
        **options: Unpack[GenerateOptions],
    ) -> Any:
        """Generate for one prompt (a dict result), a batch (a list, in input order), or with
        ``stream`` an iterator of chunk dicts (single prompt only). ``n`` > 1 in the sampling
        params gives a list of n results per prompt. Results follow SGLang's native API:
        ``{"text", "output_ids", "meta_info": {"id", "prompt_tokens", "completion_tokens",
        "cached_tokens", "finish_reason", ...}}``. ``rid`` (one id, or one per prompt of a
        batch) names the sub-requests as the HTTP API does (``runtime/generate_input.py``):
        ``rid``, ``{rid}-{j}`` for sample j, ``{rid}-{i}`` for prompt i of a batch,
        ``{rid}-{i}-{j}`` for both. ``cache_salt`` (1..256 printable ASCII characters): reuse
        cached KV only of requests with the same salt (docs/serving.md, "Multi-tenant
        serving"). ``pin_ttl_s``: keep each request's prompt and output cached that many
        seconds after it finishes, whatever other traffic comes (capped by
        ``max_pin_seconds``; docs/radix_cache.md, "Pins"). ``require_reasoning`` (with
        ``reasoning_parser`` set): a constraint starts after the reasoning, and each result's
        ``text`` is the answer with the thinking in ``reasoning_content`` (streamed: ``delta``
        and ``reasoning_delta``), as the server's ``/generate`` does. Bad arguments raise
        ValueError subclasses naming the field (``InvalidRequestValue``,
        ``InvalidSamplingParams``), before anything is tokenized."""
        parse = self._parser(prompt, sampling_params, options)
        reasoning = bool(options.get("require_reasoning"))
        if options.get("stream"):
            return self._iterate(self._stream(parse, reasoning))
        return self._call(self._collect(parse, reasoning))

    async def async_generate(
        self,
        prompt: Prompt = None,
        sampling_params: Params = None,
        **options: Unpack[GenerateOptions],
    ) -> Any:
        """As ``generate``, awaitable; with ``stream`` an async iterator of chunk dicts."""
        parse = self._parser(prompt, sampling_params, options)
        reasoning = bool(options.get("require_reasoning"))
        if options.get("stream"):
            return self._aiterate(self._stream(parse, reasoning))
        future = asyncio.run_coroutine_threadsafe(self._collect(parse, reasoning), self._loop)
        return await asyncio.wrap_future(future)

    def _parser(
        self, prompt: Prompt, params: Params, options: GenerateOptions
    ) -> Callable[[], GenerateInput]:
        """The call's parse, run on the private loop when the work starts (a stream raises
        when iterated); TypeError now for an option ``generate`` does not take."""
        unknown = options.keys() - GenerateOptions.__optional_keys__
        if unknown:
            raise TypeError(f"unexpected keyword arguments: {', '.join(sorted(unknown))}")
        return functools.partial(self._parse, prompt, params, options)

    def _parse(self, prompt: Prompt, params: Params, options: GenerateOptions) -> GenerateInput:
        logprobs = LogprobOptions(
            bool(options.get("return_logprob")),
            options.get("logprob_start_len", -1),
            options.get("top_logprobs_num", 0),
        )
        return GenerateInput.parse(
            prompt,
            options.get("input_ids"),
            params,
            options.get("rid"),
            logprobs,
            self.tokenizer_manager.limits,
            "prompt",
            options.get("cache_salt"),
            options.get("pin_ttl_s"),
        )

    async def _collect(self, parse: Callable[[], GenerateInput], reasoning: bool) -> Any:
        request = parse()
        subs = await request.sub_requests(self.tokenizer_manager.tokenize)
        splits = self._require_reasoning(subs) if reasoning else None
        results = await asyncio.gather(*(self._one(sub) for sub in subs))
        if splits is not None:
            for split, result in zip(splits, results, strict=True):
                native_result(split, result, result["text"], final=True)
        per_prompt: list[list[dict[str, Any]]] = [[] for _ in request.prompts]
        for sub, result in zip(subs, results, strict=True):
            per_prompt[sub.prompt_index].append(result)
        shaped = [samples[0] if len(samples) == 1 else samples for samples in per_prompt]
        return shaped if request.is_batch else shaped[0]

    async def _one(self, sub: SubRequest) -> dict[str, Any]:
        return (await final_output(sub.run(self.generation))).to_dict()

    async def _stream(
        self, parse: Callable[[], GenerateInput], reasoning: bool
    ) -> AsyncIterator[dict[str, Any]]:
        subs = await parse().sub_requests(self.tokenizer_manager.tokenize)
        if len(subs) != 1:
            raise ValueError("stream=True takes a single prompt with n=1")
        splits = self._require_reasoning(subs) if reasoning else None
        async for chunk in subs[0].run(self.generation, stream=True):
            result = chunk.to_dict(with_delta=True)
            if splits is not None:
                native_result(splits[0], result, chunk.delta, chunk.finish_reason is not None)
            yield result

    def _require_reasoning(self, subs: list[SubRequest]) -> list[TurnReader]:
        return require_reasoning(self.args.reasoning_parser, self.tokenizer, subs)

    # ---- compiled programs ----------------------------------------------------------------

    def run_program(self, request: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Run one segment of a compiled DSL program (``runtime/program/spec.py`` has the
        request's shape, ``runtime/program/executor.py`` the events): an iterator of its
        events, the same as ``POST /program`` streams. A bad request raises RequestError when
        iterated; stopping early ends the program."""

        async def events() -> AsyncIterator[dict[str, Any]]:
            from runtime.program.spec import parse_program

            parsed = parse_program(request, self.tokenizer_manager.limits)
            async for event in self.programs.run(parsed):
                yield event.to_dict()

        return self._iterate(events())

    def end_program(self, program_id: str, cache_salt: str | None = None) -> bool:
        """Forget a compiled program and unpin its KV; False if no program of ``cache_salt``
        (the salt its segments carry) has this id."""

        async def end() -> bool:
            return bool(self.programs.end(program_id, cache_salt))

        return bool(self._call(end()))

    # ---- control ------------------------------------------------------------------------

    def flush_cache(self, disk: bool = False) -> bool:
        """Drop all cached prefixes, with ``disk`` also the disk tier's (``--kv-disk-path``);
        False while requests are running."""
        control = self.tokenizer_manager.control(ControlCommand.FLUSH_CACHE, args={"disk": disk})
        return bool(self._call(control)["success"])

    def role_blocks(self) -> RoleBlocks:
        """The chat template's per-role headers and footers (``runtime/role_blocks.py``), which
        DSL programs render role blocks with; derived once. Raises ChatTemplateError when the
        template cannot be split into them."""
        if self._role_blocks is None:  # two first callers at once both derive: same result
            self._role_blocks = role_blocks_or_why(self.tokenizer)
        if isinstance(self._role_blocks, str):
            raise ChatTemplateError(self._role_blocks)
        return self._role_blocks

    def get_server_info(self) -> dict[str, Any]:
        """The server args as the scheduler runs them (device defaults filled in), KV usage,
        cache hit rate, running/queued counts and throughput."""
        return self._call(self.tokenizer_manager.control(ControlCommand.SERVER_INFO))

    def check_invariants(self) -> None:
        """Raise AssertionError unless the scheduler's KV accounting is exact right now."""
        report = self._call(self.tokenizer_manager.control(ControlCommand.CHECK_INVARIANTS))
        if not report["ok"]:
            raise AssertionError(report["error"])

    def abort(self, rid: str, cache_salt: str | None = None) -> bool:
        """Abort the running request ``rid`` of ``cache_salt``; False if none is running."""
        return bool(self._call(self.tokenizer_manager.abort(rid, cache_salt)))

    def shutdown(self) -> None:
        """Stop the threads. The engine cannot be used afterwards."""
        if not self._loop.is_running():
            return
        self.scheduler.stop()
        for inbox in self._queues[1:]:  # the detokenizer's and the tokenizer manager's
            inbox.send(None)
        self._loop.call_soon_threadsafe(self._loop.stop)
        for thread in self._threads:
            thread.join(timeout=10)
        self.generation.close()
        if self._frozen:
            unfreeze_heap()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- bridging the private loop -----------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _iterate(self, agen: AsyncIterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        """A sync iterator over an async generator running on the private loop."""
        items: queue.Queue[Any] = queue.Queue()
        done = object()

        async def pump() -> None:
            try:
                async for item in agen:
                    items.put(item)
            except Exception as exc:
                items.put(exc)
            items.put(done)

        future = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := items.get()) is not done:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            if not future.done():  # the caller stopped early: abort the request
                self._loop.call_soon_threadsafe(future.cancel)

    async def _aiterate(self, agen: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        """An async iterator, on the caller's loop, over an async generator on the private loop."""
        caller = asyncio.get_running_loop()
        items: asyncio.Queue[Any] = asyncio.Queue()
        done = object()

        async def pump() -> None:
            try:
                async for item in agen:
                    caller.call_soon_threadsafe(items.put_nowait, item)
            except Exception as exc:
                caller.call_soon_threadsafe(items.put_nowait, exc)
            caller.call_soon_threadsafe(items.put_nowait, done)

        future = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := await items.get()) is not done:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            if not future.done():
                self._loop.call_soon_threadsafe(future.cancel)
