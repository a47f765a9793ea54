"""``runtime.Engine``: the scheduler, detokenizer and tokenizer manager in one process.

The same three components ``arbor serve`` runs as processes, here on threads connected by
queues: the scheduler thread owns the model, the detokenizer thread turns tokens into text,
and the tokenizer manager runs on a private asyncio loop that the sync and async APIs drive.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any

from transformers import AutoTokenizer

from runtime.channels import QueueChannel
from runtime.detokenizer import DetokenizerManager
from runtime.errors import RequestError, SchedulerDied
from runtime.request_checks import check_text
from runtime.sampling_params import SamplingParams
from runtime.scheduler.scheduler import Scheduler
from runtime.server_args import ServerArgs
from runtime.tokenizer_manager import TokenizerManager

Prompt = str | list[str] | None
Params = dict[str, Any] | list[dict[str, Any]] | None


class Engine:
    """In-process inference. ``Engine(model_path, max_total_tokens=2048, page_size=4, ...)``
    takes any ServerArgs field as a keyword argument."""

    def __init__(self, model_path: str | os.PathLike[str], **server_args: Any) -> None:
        self.args = ServerArgs.from_kwargs(str(model_path), **server_args)
        to_scheduler, to_detokenizer, to_tokenizer = QueueChannel(), QueueChannel(), QueueChannel()
        self._channels = (to_scheduler, to_detokenizer, to_tokenizer)
        self.scheduler = Scheduler(self.args, to_scheduler, to_detokenizer, to_tokenizer)
        tokenizer = AutoTokenizer.from_pretrained(self.args.tokenizer_path or self.args.model_path)
        self.tokenizer = tokenizer
        self.detokenizer = DetokenizerManager(tokenizer)
        self.tokenizer_manager = TokenizerManager(tokenizer, to_scheduler, max_n=self.args.max_n)
        self._loop = asyncio.new_event_loop()
        self._threads = [
            threading.Thread(target=self._run_scheduler, name="scheduler", daemon=True),
            threading.Thread(
                target=self.detokenizer.event_loop,
                args=(to_detokenizer, to_tokenizer),
                name="detokenizer",
                daemon=True,
            ),
            threading.Thread(target=self._loop.run_forever, name="tokenizer-manager", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        self.tokenizer_manager.start_receiver(to_tokenizer, self._loop)
        self.tokenizer_manager.ready.wait()
        if self.tokenizer_manager.dead:
            raise SchedulerDied(self.tokenizer_manager.dead)

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
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        stream: bool = False,
        rid: str | None = None,
    ) -> Any:
        """Generate for one prompt (a dict result), a batch (a list, in input order), or with
        ``stream`` an iterator of chunk dicts (single prompt only). ``n`` > 1 in the sampling
        params gives a list of n results per prompt. Results follow SGLang's native API:
        ``{"text", "output_ids", "meta_info": {"prompt_tokens", "completion_tokens",
        "cached_tokens", "finish_reason", ...}}``."""
        options = (return_logprob, top_logprobs_num, logprob_start_len)
        if stream:
            return self._iterate(self._stream(prompt, sampling_params, input_ids, options, rid))
        return self._call(self._collect(prompt, sampling_params, input_ids, options, rid))

    async def async_generate(
        self,
        prompt: Prompt = None,
        sampling_params: Params = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        stream: bool = False,
        rid: str | None = None,
    ) -> Any:
        """As ``generate``, awaitable; with ``stream`` an async iterator of chunk dicts."""
        options = (return_logprob, top_logprobs_num, logprob_start_len)
        if stream:
            return self._aiterate(self._stream(prompt, sampling_params, input_ids, options, rid))
        future = asyncio.run_coroutine_threadsafe(
            self._collect(prompt, sampling_params, input_ids, options, rid), self._loop
        )
        return await asyncio.wrap_future(future)

    async def _collect(
        self,
        prompt: Prompt,
        params: Params,
        input_ids: Any,
        options: tuple[int, ...],
        rid: str | None,
    ) -> Any:
        requests = await self._expand(prompt, params, input_ids)
        batched = isinstance(prompt, list) or (input_ids is not None and _is_batch(input_ids))
        tasks = []
        for i, (ids, sampling) in enumerate(requests):
            copies = []
            for j in range(sampling.n):  # n samples: n requests, the prompt's KV shared
                sub_rid = rid
                if rid is not None and (len(requests) > 1 or sampling.n > 1):
                    sub_rid = f"{rid}-{i}-{j}"
                copies.append(self._one(ids, sampling.for_sample(j), sub_rid, options))
            tasks.append(asyncio.gather(*copies))
        results = [r[0] if len(r) == 1 else r for r in await asyncio.gather(*tasks)]
        return results if batched else results[0]

    async def _one(
        self, ids: list[int], sampling: SamplingParams, rid: str | None, options: tuple[int, ...]
    ) -> dict[str, Any]:
        return_logprob, top_logprobs_num, logprob_start_len = options
        result: dict[str, Any] = {}
        async for chunk in self.tokenizer_manager.generate(
            ids, sampling, rid, bool(return_logprob), logprob_start_len, top_logprobs_num
        ):
            result = chunk
        result.pop("delta", None)
        return result

    async def _stream(
        self,
        prompt: Prompt,
        params: Params,
        input_ids: Any,
        options: tuple[int, ...],
        rid: str | None,
    ) -> AsyncIterator[dict[str, Any]]:
        requests = await self._expand(prompt, params, input_ids)
        if len(requests) != 1 or requests[0][1].n != 1:
            raise ValueError("stream=True takes a single prompt with n=1")
        ids, sampling = requests[0]
        return_logprob, top_logprobs_num, logprob_start_len = options
        async for chunk in self.tokenizer_manager.generate(
            ids,
            sampling,
            rid,
            bool(return_logprob),
            logprob_start_len,
            top_logprobs_num,
            stream=True,
        ):
            yield chunk

    async def _expand(
        self, prompt: Prompt, params: Params, input_ids: Any
    ) -> list[tuple[list[int], SamplingParams]]:
        """(input ids, parsed sampling params) per prompt, everything validated (as the HTTP
        APIs do) before anything is tokenized. Raises ValueError subclasses naming the field."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt and input_ids")
        manager = self.tokenizer_manager
        prompts = prompt if isinstance(prompt, list) else [prompt]
        count = len(prompts)
        if input_ids is not None:
            count = len(input_ids) if _is_batch(input_ids) else 1
        if isinstance(params, list):
            if len(params) != count:
                raise ValueError(f"{len(params)} sampling_params for {count} prompts")
            parsed = [SamplingParams.from_dict(p, manager.limits) for p in params]
        else:
            parsed = [SamplingParams.from_dict(params, manager.limits)] * count
        if prompt is not None:
            for i, text in enumerate(prompts):
                if not isinstance(text, str):
                    raise RequestError(f"prompt: expected text, got {type(text).__name__}")
                check_text(text, f"prompt.{i}" if isinstance(prompt, list) else "prompt")
            ids_list = [await manager.tokenize(str(p), "prompt") for p in prompts]
        else:
            ids_list = [list(ids) for ids in (input_ids if _is_batch(input_ids) else [input_ids])]
        return list(zip(ids_list, parsed, strict=True))

    # ---- control ------------------------------------------------------------------------

    def flush_cache(self) -> bool:
        """Drop all cached prefixes; False while requests are running."""
        return bool(self._call(self.tokenizer_manager.control("flush_cache"))["success"])

    def get_server_info(self) -> dict[str, Any]:
        """The server args as the scheduler runs them (device defaults filled in), KV usage,
        cache hit rate, running/queued counts and throughput."""
        return self._call(self.tokenizer_manager.control("server_info"))

    def check_invariants(self) -> None:
        """Raise AssertionError unless the scheduler's KV accounting is exact right now."""
        report = self._call(self.tokenizer_manager.control("check_invariants"))
        if not report["ok"]:
            raise AssertionError(report["error"])

    def abort(self, rid: str) -> None:
        self._call(self.tokenizer_manager.abort(rid))

    def shutdown(self) -> None:
        """Stop the threads. The engine cannot be used afterwards."""
        if not self._loop.is_running():
            return
        self.scheduler.stop()
        to_scheduler, to_detokenizer, to_tokenizer = self._channels
        to_detokenizer.send(None)
        to_tokenizer.send(None)
        self._loop.call_soon_threadsafe(self._loop.stop)
        for thread in self._threads:
            thread.join(timeout=10)

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


def _is_batch(input_ids: Any) -> bool:
    return bool(input_ids) and isinstance(input_ids[0], list)
