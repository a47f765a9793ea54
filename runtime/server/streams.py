"""Running a handler's generation streams: merged, aborted when the client leaves, as SSE.

Every request a handler makes to the tokenizer manager is one async generator of result
chunks. ``merge_streams`` pumps each on its own task and yields ``(index, chunk)`` as they
arrive. Cancelling a pump task closes its generator, which sends the scheduler an
AbortRequest, so every way a handler can end early (an error in one stream, the client
disconnecting, the response being cancelled) aborts the rest and frees their KV at once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, Protocol

from fastapi import Request

from runtime.errors import RequestError, SchedulerDied
from runtime.server.errors import ClientGone, error_body
from runtime.tokenizer_manager import RequestOutput

_DONE = object()
SSE_DONE = b"data: [DONE]\n\n"


Events = AsyncGenerator[tuple[int, RequestOutput], None]


class _EventBuilder(Protocol):
    def take_events(self) -> Any: ...


class FedRun(Protocol):
    """A Responses or Messages run: fed each output, building the reply and its events."""

    @property
    def builder(self) -> _EventBuilder: ...

    def feed(self, chunk: RequestOutput) -> None: ...


async def run_whole(run: FedRun, events: Events) -> None:
    """Generate the whole reply into ``run``, dropping the events a stream would send (errors
    propagate to the HTTP error handlers)."""
    async for _, chunk in events:
        run.feed(chunk)
        run.builder.take_events()


async def merge_streams(
    request: Request, streams: Sequence[AsyncIterator[RequestOutput]]
) -> Events:
    """Yield ``(index into streams, chunk)`` until every stream ends.

    Precondition: the request body has been read (the watcher's ``receive`` then only sees
    the disconnect). Raises the first exception of any stream, or ClientGone once the client
    disconnects; in both cases every unfinished stream has been aborted. Closing this
    generator early aborts them too.
    """
    events: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for chunk in stream:
                events.put_nowait((index, chunk))
            events.put_nowait((index, _DONE))
        except Exception as exc:
            events.put_nowait((index, exc))

    pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        for task in pumps:  # abort now: the consumer may be suspended at a yield
            task.cancel()
        events.put_nowait((-1, ClientGone()))

    watcher = asyncio.create_task(watch())
    remaining = len(streams)
    try:
        while remaining:
            index, item = await events.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in (*pumps, watcher):
            task.cancel()
        await asyncio.gather(*pumps, watcher, return_exceptions=True)


async def collect_finals(
    request: Request, streams: Sequence[AsyncIterator[RequestOutput]]
) -> list[RequestOutput]:
    """The last output of every stream, in stream order (each stream's final result)."""
    finals: dict[int, RequestOutput] = {}
    async for index, chunk in merge_streams(request, streams):
        finals[index] = chunk
    return [finals[i] for i in range(len(streams))]


def sse_event(payload: Any) -> bytes:
    """One server-sent event carrying ``payload`` as JSON."""
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


async def primed(events: Events) -> Events:
    """Wait for the first event before returning, so a request the runtime refuses raises here
    (and becomes a 4xx response) instead of after the 200 headers of a stream are sent.

    The returned iterator yields that first event, then the rest.
    """
    try:
        first = await events.__anext__()
    except StopAsyncIteration:
        return _empty()
    return _prepend(first, events)


async def _empty() -> Events:
    return
    yield


async def _prepend(first: tuple[int, RequestOutput], rest: Events) -> Events:
    try:
        yield first
        async for event in rest:
            yield event
    finally:
        await rest.aclose()


async def guarded_sse(body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``body`` (server-sent events) ended properly whatever happens to the generation: a
    client that left ends it silently; a failed request sends an ``{"error": ...}`` event;
    then ``data: [DONE]``."""
    try:
        async for data in body:
            yield data
    except ClientGone:
        return
    except (RequestError, SchedulerDied) as exc:
        status = exc.status_code if isinstance(exc, RequestError) else 503
        yield sse_event(error_body(status, str(exc)))
    yield SSE_DONE
