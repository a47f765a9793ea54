"""The front of the runtime: tokenizes requests, sends them to the scheduler, and turns the
detokenizer's outputs into results and streams. Runs on an asyncio loop (uvicorn's in serve mode,
a private thread's in the Engine); messages arrive from a receiver thread."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from runtime.channels import Receiver, Sender
from runtime.errors import RequestError, SchedulerDied
from runtime.ipc import (
    AbortRequest,
    ControlReply,
    ControlRequest,
    GenerateRequest,
    SchedulerFailed,
    SchedulerReady,
    TextOutput,
    TextOutputBatch,
)
from runtime.sampling_params import SamplingParams


@dataclass
class _RequestState:
    queue: asyncio.Queue[TextOutput | Exception]
    created: float
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[Any] = field(default_factory=list)
    input_logprobs: list[Any] | None = None


class TokenizerManager:
    def __init__(self, tokenizer: Any, to_scheduler: Sender) -> None:
        self.tokenizer = tokenizer
        self.to_scheduler = to_scheduler
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ready = threading.Event()
        self.server_info: dict[str, Any] = {}
        self.dead: str | None = None
        self._requests: dict[str, _RequestState] = {}
        self._controls: dict[str, asyncio.Future[dict[str, Any]]] = {}

    # ---- receiving (from a background thread) -------------------------------------------

    def start_receiver(self, inbox: Receiver, loop: asyncio.AbstractEventLoop) -> threading.Thread:
        """Read ``inbox`` on a daemon thread, handing each message to ``loop``."""
        self.loop = loop

        def pump() -> None:
            while True:
                message = inbox.recv(timeout=None)
                if message is None:
                    return
                loop.call_soon_threadsafe(self._dispatch, message)

        thread = threading.Thread(target=pump, name="tokenizer-manager-recv", daemon=True)
        thread.start()
        return thread

    def _dispatch(self, message: Any) -> None:
        if isinstance(message, TextOutputBatch):
            for out in message.outputs:
                state = self._requests.get(out.rid)
                if state is not None:
                    state.queue.put_nowait(out)
        elif isinstance(message, ControlReply):
            future = self._controls.pop(message.request_id, None)
            if future is not None and not future.done():
                future.set_result(message.payload)
        elif isinstance(message, SchedulerReady):
            self.server_info = message.info
            self.ready.set()
        elif isinstance(message, SchedulerFailed):
            self.fail_all(message.error)

    def fail_all(self, error: str) -> None:
        """The scheduler is gone: every pending request and control call fails with ``error``."""
        self.dead = error
        self.ready.set()
        for state in self._requests.values():
            state.queue.put_nowait(SchedulerDied(f"the scheduler stopped: {error}"))
        for future in self._controls.values():
            if not future.done():
                future.set_exception(SchedulerDied(f"the scheduler stopped: {error}"))

    # ---- requests ----------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text).input_ids

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: SamplingParams,
        rid: str | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        stream: bool = False,
    ) -> AsyncIterator[dict[str, Any]]:
        """Yield result dicts: with ``stream`` one per output chunk, else one at the end.

        A request refused or failed by the runtime raises RequestError (status_code 4xx/5xx).
        If the consumer stops early (client disconnect), the request is aborted.
        """
        if self.dead:
            raise SchedulerDied(f"the scheduler stopped: {self.dead}")
        rid = rid or uuid.uuid4().hex
        if rid in self._requests:
            raise RequestError(f"request id {rid!r} is already in use")
        state = _RequestState(asyncio.Queue(), time.monotonic())
        self._requests[rid] = state
        self.to_scheduler.send(
            GenerateRequest(
                rid,
                input_ids,
                sampling_params,
                return_logprob,
                logprob_start_len,
                top_logprobs_num,
                stream,
            )
        )
        finished = False
        try:
            while not finished:
                out = await state.queue.get()
                if isinstance(out, Exception):
                    raise out
                finished = out.finished_reason is not None
                reason = out.finished_reason or {}
                if reason.get("type") == "abort" and "status_code" in reason:
                    raise RequestError(reason["message"], reason["status_code"])
                chunk = self._accumulate(rid, state, out)
                if stream or finished:
                    yield chunk
        finally:
            self._requests.pop(rid, None)
            if not finished:
                self.to_scheduler.send(AbortRequest(rid))

    @staticmethod
    def _accumulate(rid: str, state: _RequestState, out: TextOutput) -> dict[str, Any]:
        state.text += out.text_delta
        state.output_ids.extend(out.new_token_ids)
        state.output_logprobs.extend(out.output_logprobs)
        if out.input_logprobs is not None:
            state.input_logprobs = out.input_logprobs
        meta: dict[str, Any] = {
            "id": rid,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "cached_tokens": out.cached_tokens,
            "finish_reason": out.finished_reason,
            "e2e_latency": time.monotonic() - state.created,
        }
        if state.input_logprobs is not None or state.output_logprobs:
            meta["input_token_logprobs"] = [(lp, t) for lp, t, _ in state.input_logprobs or []]
            meta["input_top_logprobs"] = [top for _, _, top in state.input_logprobs or []]
            meta["output_token_logprobs"] = [(lp, t) for lp, t, _ in state.output_logprobs]
            meta["output_top_logprobs"] = [top for _, _, top in state.output_logprobs]
        return {
            "text": state.text,
            "delta": out.text_delta,
            "output_ids": list(state.output_ids),
            "meta_info": meta,
        }

    async def abort(self, rid: str) -> None:
        self.to_scheduler.send(AbortRequest(rid))

    async def control(self, command: str, timeout: float = 60.0) -> dict[str, Any]:
        """Ask the scheduler (flush_cache, server_info) and wait for its reply."""
        if self.dead:
            raise SchedulerDied(f"the scheduler stopped: {self.dead}")
        assert self.loop is not None
        request_id = uuid.uuid4().hex
        future: asyncio.Future[dict[str, Any]] = self.loop.create_future()
        self._controls[request_id] = future
        self.to_scheduler.send(ControlRequest(request_id, command))
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self._controls.pop(request_id, None)
