"""The front of the runtime: tokenizes requests, sends them to the scheduler, and turns the
detokenizer's outputs into results and streams. Runs on an asyncio loop (uvicorn's in serve mode,
a private thread's in the Engine); messages arrive from a receiver thread.

Request ids: the scheduler and the detokenizer know each request by an id of its own, unique
for the life of the process, which is released only once the request's final output has come
back (its KV freed, its decoder dropped). The caller's ``rid`` is a label: it must be unique
among the requests its callers are still waiting for, and can be reused as soon as its caller
stops waiting (a disconnect), since nothing of the old request can reach the new one.

Tokenization and chat templates run on a small thread pool (the fast tokenizers release the
GIL), so a huge prompt never stalls the event loop that serves health checks and streams.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from runtime.channels import Receiver, Sender
from runtime.errors import RequestError, SchedulerDied
from runtime.generation_log import current_generation_log
from runtime.ipc import (
    AbortRequest,
    CachePin,
    ControlCommand,
    ControlReply,
    ControlRequest,
    FinishReason,
    GenerateRequest,
    PhaseTimes,
    PinPrefix,
    ProgramRelease,
    ProgramStep,
    SchedulerFailed,
    SchedulerReady,
    SpeculationStats,
    TextOutput,
    TextOutputBatch,
)
from runtime.request_checks import InvalidRequestValue, check_cache_salt, check_token_ids
from runtime.sampling_params import DEFAULT_MAX_N, RequestLimits, SamplingParams

Result = TypeVar("Result")

# Threads that tokenize prompts and render chat templates.
TOKENIZE_THREADS = 2
# Tokenizer work this small (characters or tokens) runs on the event loop: tens of
# microseconds, less than handing it to a tokenizer thread and back.
INLINE_TOKENIZE_SIZE = 2048
# Callers' rids remembered after their requests end (the dashboard lists recent requests).
RECENT_LABELS = 256


# (logprob, token id, [(logprob, token id), ...] top alternatives) of one position; the
# first prompt token's logprob is None.
LogprobEntry = tuple[Any, int, list[Any]]
TokenLogprob = tuple[float | None, int]


@dataclass
class RequestOutput:
    """What ``generate`` yields for one request: the text and output ids so far (``delta``:
    the text new in this chunk), token counts, why it finished (None while it runs), the
    seconds since it arrived, logprob entries (``input_logprobs`` None unless asked for),
    speculation numbers, and the outputs validate-and-retry drew. ``to_dict`` renders the
    native API's ``{"text", "output_ids", "meta_info"}``."""

    rid: str
    text: str
    delta: str
    output_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: FinishReason | None
    e2e_latency: float
    input_logprobs: list[LogprobEntry] | None = None
    output_logprobs: list[LogprobEntry] = field(default_factory=list)
    spec: SpeculationStats | None = None
    validation_attempts: int | None = None
    grammar_notes: tuple[str, ...] = ()
    times: PhaseTimes | None = None  # the scheduler's queue/prefill/decode split, at the end

    @property
    def ends_with_stop_token(self) -> bool:
        """Whether the last output id is the stop token that ended the output."""
        reason = self.finish_reason
        return reason is not None and self.output_ids[-1:] == [reason.matched]

    def logprobs(
        self, prompt: bool = False, start: int = 0
    ) -> tuple[list[TokenLogprob], list[list[TokenLogprob]]]:
        """(logprob, token id) of the output's positions (the prompt's) from ``start`` on, and
        the top alternatives of each."""
        entries = (self.input_logprobs or [] if prompt else self.output_logprobs)[start:]
        return [(lp, t) for lp, t, _ in entries], [top for _, _, top in entries]

    def to_dict(self, with_delta: bool = False) -> dict[str, Any]:
        """The native API's result (``meta_info`` as SGLang's)."""
        meta: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason and self.finish_reason.to_dict(),
            "e2e_latency": self.e2e_latency,
        }
        if self.spec is not None:
            meta.update(self.spec.to_meta(self.completion_tokens))
        if self.times is not None:
            meta.update(self.times.to_meta())
        if self.input_logprobs is not None or self.output_logprobs:
            meta["input_token_logprobs"], meta["input_top_logprobs"] = self.logprobs(prompt=True)
            meta["output_token_logprobs"], meta["output_top_logprobs"] = self.logprobs()
        if self.validation_attempts is not None:
            meta["validation_attempts"] = self.validation_attempts
        if self.grammar_notes:
            meta["grammar_notes"] = list(self.grammar_notes)
        delta = {"delta": self.delta} if with_delta else {}
        return {"text": self.text, **delta, "output_ids": self.output_ids, "meta_info": meta}


@dataclass
class _RequestState:
    queue: asyncio.Queue[TextOutput | Exception]
    created: float
    label: str  # the id the caller knows (its rid, or the internal id when it gave none)
    draining: bool = False  # the caller is gone; waiting for the final output to release it
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[Any] = field(default_factory=list)
    input_logprobs: list[Any] | None = None

    def add(self, out: TextOutput) -> None:
        """Take in one output chunk."""
        self.text += out.text_delta
        self.output_ids.extend(out.new_token_ids)
        self.output_logprobs.extend(out.output_logprobs)
        if out.input_logprobs is not None:
            self.input_logprobs = out.input_logprobs

    def output(self, out: TextOutput) -> RequestOutput:
        """What the caller gets with ``out``, the last chunk taken in (built only for a chunk
        the caller gets: every chunk of a stream, else only the last)."""
        return RequestOutput(
            self.label, self.text, out.text_delta, list(self.output_ids), out.prompt_tokens,
            out.completion_tokens, out.cached_tokens, out.finished_reason,
            time.monotonic() - self.created, self.input_logprobs,
            list(self.output_logprobs), out.spec, grammar_notes=out.grammar_notes,
            times=out.times,
        )  # fmt: skip


class TokenizerManager:
    def __init__(self, tokenizer: Any, to_scheduler: Sender, max_n: int = DEFAULT_MAX_N) -> None:
        self.tokenizer = tokenizer
        self.to_scheduler = to_scheduler
        self.max_n = max_n
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ready = threading.Event()
        self.server_info: dict[str, Any] = {}
        self.dead: str | None = None
        self._requests: dict[str, _RequestState] = {}  # by internal id
        # (cache salt, caller's rid) -> internal id, while it waits: a rid is its salt's alone.
        self._labels: dict[tuple[str | None, str], str] = {}
        # internal id -> caller's rid of the last requests that had one (for the dashboard)
        self._recent_labels: OrderedDict[str, str] = OrderedDict()
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:12]
        self._controls: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tokenize")

    def pin_prefix(self, pin: PinPrefix) -> None:
        """Pin a cached prefix in the scheduler (``PinPrefix``: a turn waiting on tools)."""
        if not self.dead:
            self.to_scheduler.send(pin)

    def release_program(self, release: ProgramRelease) -> None:
        """Unpin a compiled program's KV in the scheduler (its branches joined, or it ended)."""
        if not self.dead:
            self.to_scheduler.send(release)

    @property
    def limits(self) -> RequestLimits:
        """What requests are checked against (the vocabulary is known once the scheduler is
        ready; before, the tokenizer's length stands in)."""
        vocab = int(self.server_info.get("vocab_size") or len(self.tokenizer))
        return RequestLimits(vocab_size=vocab, max_n=self.max_n)

    def label_of(self, internal: str) -> str:
        """The caller's rid of a recent request known by its internal id (the internal id
        when the caller gave none, or when it is no longer remembered)."""
        return self._recent_labels.get(internal, internal)

    @property
    def serving(self) -> bool:
        """Whether requests can be served now (what /health reports)."""
        return self.ready.is_set() and not self.dead

    @property
    def num_tracked(self) -> int:
        """Requests whose final output has not come back yet (callers waiting or gone)."""
        return len(self._requests)

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
                self._observe(out)
                state = self._requests.get(out.rid)
                if state is None:
                    continue
                if state.draining:
                    if out.finished_reason is not None:
                        del self._requests[out.rid]  # gone from scheduler and detokenizer
                else:
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

    def _observe(self, out: TextOutput) -> None:
        """Called with every output as it arrives, before it goes to its caller (if any)."""

    def fail_all(self, error: str) -> None:
        """The scheduler is gone: every pending request and control call fails with ``error``."""
        self.dead = error
        self.ready.set()
        for state in self._requests.values():
            state.queue.put_nowait(SchedulerDied(f"the scheduler stopped: {error}"))
        self._requests = {rid: s for rid, s in self._requests.items() if not s.draining}
        for future in self._controls.values():
            if not future.done():
                future.set_exception(SchedulerDied(f"the scheduler stopped: {error}"))

    # ---- requests ----------------------------------------------------------------------

    async def tokenize(self, text: str, field: str = "text") -> list[int]:
        """Token ids of ``text`` (special tokens added as the tokenizer does), computed on the
        tokenizer threads (on the loop when short). RequestError 400 naming ``field`` if the
        tokenizer refuses it."""
        return await self.run_tokenizer(
            lambda: self.tokenizer(text).input_ids, field, size=len(text)
        )

    async def run_tokenizer(
        self, work: Callable[[], Result], field: str, size: int | None = None
    ) -> Result:
        """Run ``work`` (tokenizing, rendering a template) on the tokenizer threads; on the
        event loop itself when the caller says it is small (``size``, characters or tokens, at
        most INLINE_TOKENIZE_SIZE), where the hop to a thread costs more than the work."""
        assert self.loop is not None
        try:
            if size is not None and size <= INLINE_TOKENIZE_SIZE:
                return work()
            return await self.loop.run_in_executor(self._pool, work)
        except (ValueError, TypeError, OverflowError, UnicodeError) as exc:
            raise RequestError(f"{field}: the tokenizer refused it: {exc}") from None

    def check_input_ids(self, ids: list[int], field: str = "input_ids") -> None:
        """RequestError 400 unless every id is in the vocabulary."""
        try:
            check_token_ids(ids, self.limits.vocab_size, field)
        except InvalidRequestValue as exc:
            raise RequestError(str(exc)) from None

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: SamplingParams,
        rid: str | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        stream: bool = False,
        program: ProgramStep | None = None,
        cache_salt: str | None = None,
        routing_key: str | None = None,
        pin: CachePin | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield RequestOutputs: with ``stream`` one per output chunk, else one at the end.
        ``program``: the request is a step of a compiled program (``runtime.program``).
        ``cache_salt``: the request reuses cached KV only of requests with the same salt
        (InvalidRequestValue unless None or 1..256 printable ASCII characters).
        ``routing_key``: the client's cache-affinity key (``GenerateRequest.routing_key``).
        ``pin``: keep its KV cached for a while after it finishes (``GenerateRequest.pin``).

        A request refused or failed by the runtime raises RequestError (status_code 4xx/5xx).
        If the consumer stops early (client disconnect), the request is aborted.
        Validate-and-retry is a wrapper around this (``runtime/validate_retry.py``).
        """
        # Checked here too, whatever the caller checked: every request to the scheduler passes
        # this point, and nothing about a salt may fail there.
        check_cache_salt(cache_salt)
        if self.dead:
            raise SchedulerDied(f"the scheduler stopped: {self.dead}")
        if not input_ids:
            raise RequestError("the prompt is empty")
        context = int(self.server_info.get("context_length") or 0)
        if context and len(input_ids) >= context:  # before any per-token work
            raise RequestError(
                f"the prompt has {len(input_ids)} tokens; the context length is {context}"
            )
        self.check_input_ids(input_ids)
        input_ids = list(map(int, input_ids))
        if rid is not None and (cache_salt, rid) in self._labels:
            raise RequestError(f"request id {rid!r} is already in use")
        internal = f"{self._prefix}-{next(self._ids)}"
        label = rid if rid is not None else internal
        state = _RequestState(asyncio.Queue(), time.monotonic(), label)
        self._requests[internal] = state
        if rid is not None:
            self._labels[cache_salt, rid] = internal
            self._recent_labels[internal] = rid
            if len(self._recent_labels) > RECENT_LABELS:
                self._recent_labels.popitem(last=False)
        self.to_scheduler.send(
            GenerateRequest(
                internal,
                input_ids,
                sampling_params,
                return_logprob,
                logprob_start_len,
                top_logprobs_num,
                stream,
                program,
                cache_salt,
                routing_key,
                pin,
            )
        )
        finished = False
        try:
            while not finished:
                out = await state.queue.get()
                if isinstance(out, Exception):
                    finished = True  # the scheduler is gone: nothing left to wait for
                    raise out
                if out.detokenizer_failed:  # the scheduler still runs it: abort and drain
                    message = out.finished_reason and out.finished_reason.message
                    raise RequestError(message or "detokenizing failed", 500)
                finished = out.finished_reason is not None
                reason = out.finished_reason
                if reason is not None and reason.status_code is not None:
                    raise RequestError(reason.message or "", reason.status_code, reason.param)
                state.add(out)
                if finished and (log := current_generation_log()) is not None:
                    log.add(out, state.label)
                if stream or finished:
                    yield state.output(out)
        finally:
            if rid is not None and self._labels.get((cache_salt, rid)) == internal:
                del self._labels[cache_salt, rid]
            if finished:
                self._requests.pop(internal, None)
            else:
                state.draining = True  # released when its final output comes back
                self.to_scheduler.send(AbortRequest(internal))

    async def abort(self, rid: str, cache_salt: str | None = None) -> bool:
        """Abort the request of ``cache_salt`` the caller knows as ``rid``; False (nothing
        done) if none is running under that salt."""
        internal = self._labels.get((cache_salt, rid))
        if internal is not None:
            self.to_scheduler.send(AbortRequest(internal))
        return internal is not None

    async def control(
        self, command: ControlCommand, timeout: float = 60.0, args: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Ask the scheduler (``ControlRequest``) and wait for its reply."""
        if self.dead:
            raise SchedulerDied(f"the scheduler stopped: {self.dead}")
        assert self.loop is not None
        request_id = uuid.uuid4().hex
        future: asyncio.Future[dict[str, Any]] = self.loop.create_future()
        self._controls[request_id] = future
        self.to_scheduler.send(ControlRequest(request_id, command, args or {}))
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self._controls.pop(request_id, None)


async def final_output(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """A request's final output (the only one when it does not stream)."""
    return [output async for output in outputs][-1]
