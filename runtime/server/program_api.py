"""``POST /program``: run a segment of a compiled DSL program next to the KV cache
(``runtime/program``; the request's shape is in ``runtime/program/spec.py``).

Answers server-sent events (``"stream": true``, or ``Accept: text/event-stream``), one per
program event, then ``data: [DONE]``; otherwise one JSON object ``{"program_id", "events"}``.
``DELETE /program/{program_id}?cache_salt=...`` ends a program (unpins its KV) without running
anything; a segment it was running ends with a 409 (an SSE error event once streaming).

A program belongs to the caller's key and salt (``runtime/program/executor.py``): for anybody
else its id is unknown. An unknown ``program_id`` is a 404, one that ended recently a 410 whose
``code`` says why (``program_deleted``, ``program_expired``, ``program_evicted``, ...).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from runtime.program.events import ProgramEvent, ProgramStarted
from runtime.program.executor import ProgramGone
from runtime.program.spec import parse_program
from runtime.server.errors import ApiError
from runtime.server.state import caller_of, get_state, query_salt, tenant_salt
from runtime.server.streams import guarded_sse, sse_event
from runtime.server.tracing import trace_request

router = APIRouter()


@router.post("/program")
async def run_program(request: Request) -> Response:
    state = get_state(request)
    state.require_ready()
    body = await state.read_body(request)
    parsed = parse_program(body, state.tokenizer_manager.limits)
    parsed = dataclasses.replace(parsed, cache_salt=tenant_salt(request, parsed.cache_salt))
    events = state.programs.run(parsed, caller_of(request))
    try:
        first = await events.__anext__()  # refusals (unknown branch, busy program) raise here
    except ProgramGone as exc:
        raise _gone(exc) from None
    trace = trace_request(request, "text_completion", model=state.args.model_name)
    if trace is not None and isinstance(first, ProgramStarted):
        trace.program_id = first.program_id
    wants_sse = parsed.stream or "text/event-stream" in request.headers.get("accept", "")
    if wants_sse:
        return StreamingResponse(guarded_sse(_sse(first, events)), media_type="text/event-stream")
    collected = [first]
    try:
        async for event in events:
            collected.append(event)
    finally:
        await events.aclose()
    assert isinstance(first, ProgramStarted)
    return JSONResponse(
        {"program_id": first.program_id, "events": [e.to_dict() for e in collected]}
    )


async def _sse(
    first: ProgramEvent, rest: AsyncGenerator[ProgramEvent, None]
) -> AsyncIterator[bytes]:
    try:
        yield sse_event(first.to_dict())
        async for event in rest:
            yield sse_event(event.to_dict())
    finally:
        await rest.aclose()


@router.delete("/program/{program_id}")
async def end_program(program_id: str, request: Request) -> Response:
    state = get_state(request)
    salt, caller = query_salt(request), caller_of(request)
    if not state.programs.end(program_id, salt, caller):
        raise _gone(state.programs.gone(program_id, salt, caller))
    return JSONResponse({"success": True})


def _gone(exc: ProgramGone) -> ApiError:
    code = "program_not_found" if exc.reason is None else f"program_{exc.reason}"
    return ApiError(exc.status_code, str(exc), param="program_id", code=code)
