"""The native API, with SGLang's field names: ``/generate`` and the server-control endpoints.

``POST /generate`` takes ``text`` or ``input_ids`` (one prompt or a batch) and answers one
result ``{"text", "output_ids", "meta_info"}`` for one prompt with n == 1, else a list
(prompt-major, n results per prompt). With ``stream`` it answers server-sent events, one
cumulative result per output step (``index`` names the prompt/sample when there are several),
then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, cast

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from runtime.errors import RequestError, SchedulerDied
from runtime.sampling_params import SamplingParams, SamplingParamsInput
from runtime.server.errors import ApiError, ClientGone, error_body
from runtime.server.protocol import AbortReqInput, GenerateReqInput
from runtime.server.request_body import parse_model
from runtime.server.state import (
    ServerState,
    SubRequest,
    expand_samples,
    get_state,
    open_streams,
)
from runtime.server.streams import (
    SSE_DONE,
    Events,
    collect_finals,
    merge_streams,
    primed,
    sse_event,
)

router = APIRouter()

_LOGPROB_KEYS = ("input_token_logprobs", "output_token_logprobs")
_TOP_LOGPROB_KEYS = ("input_top_logprobs", "output_top_logprobs")


@router.post("/generate")
async def generate(request: Request) -> Response:
    state = get_state(request)
    state.require_ready()
    body = parse_model(GenerateReqInput, await state.read_body(request))
    subs = await _sub_requests(state, body)
    streams = open_streams(state, subs)
    several = body.is_batch or len(subs) > 1
    if body.stream:
        events = await primed(merge_streams(request, streams))
        return StreamingResponse(
            _event_stream(state, body, events, several), media_type="text/event-stream"
        )
    results = [_result(state, body, chunk) for chunk in await collect_finals(request, streams)]
    return JSONResponse(results if several else results[0])


async def _event_stream(
    state: ServerState,
    body: GenerateReqInput,
    events: Events,
    several: bool,
) -> AsyncIterator[bytes]:
    try:
        async for index, chunk in events:
            result = _result(state, body, chunk)
            result["delta"] = chunk["delta"]
            if several:
                result["index"] = index
            yield sse_event(result)
    except ClientGone:
        return
    except (RequestError, SchedulerDied) as exc:
        status = exc.status_code if isinstance(exc, RequestError) else 503
        yield sse_event(error_body(status, str(exc)))
    yield SSE_DONE


async def _sub_requests(state: ServerState, body: GenerateReqInput) -> list[SubRequest]:
    """Validate everything (sampling params, token ids, rids) before tokenizing anything."""
    if (body.text is None) == (body.input_ids is None):
        raise ApiError(400, "pass exactly one of text and input_ids", param="text")
    manager = state.tokenizer_manager
    count = len(body.text) if isinstance(body.text, list) else 1
    if body.input_ids is not None:
        id_lists = body.input_ids if body.is_batch else [body.input_ids]
        count = len(id_lists)
    if count == 0:
        raise ApiError(400, "the batch is empty", param="text")
    limits = manager.limits
    if isinstance(body.sampling_params, list):
        if len(body.sampling_params) != count:
            raise ApiError(
                400,
                f"{len(body.sampling_params)} sampling_params for {count} prompts",
                param="sampling_params",
            )
        params = [SamplingParams.from_dict(_given(p), limits) for p in body.sampling_params]
    else:
        params = [SamplingParams.from_dict(_given(body.sampling_params), limits)] * count
    rids = _rids(body.rid, count, body.is_batch)
    if body.text is not None:
        texts = body.text if isinstance(body.text, list) else [body.text]
        prompts = [await manager.tokenize(text) for text in texts]
    else:
        prompts = cast(list[list[int]], id_lists)
        for i, ids in enumerate(prompts):
            manager.check_input_ids(ids, f"input_ids.{i}" if body.is_batch else "input_ids")
    options = {
        "return_logprob": body.return_logprob,
        "logprob_start_len": body.logprob_start_len,
        "top_logprobs_num": body.top_logprobs_num,
    }
    subs: list[SubRequest] = []
    for ids, sampling, rid in zip(prompts, params, rids, strict=True):
        subs += expand_samples(list(ids), sampling, rid, **options)
    return subs


def _given(params: SamplingParamsInput | None) -> dict[str, Any] | None:
    """The fields the client set (the rest keep SamplingParams' defaults)."""
    return None if params is None else params.model_dump(exclude_unset=True)


def _rids(rid: str | list[str] | None, count: int, batch: bool) -> list[str | None]:
    if rid is None:
        return [None] * count
    if isinstance(rid, list):
        if len(rid) != count:
            raise ApiError(400, f"{len(rid)} rids for {count} prompts", param="rid")
        return list(rid)
    return [f"{rid}-{i}" for i in range(count)] if batch else [rid]


def _result(state: ServerState, body: GenerateReqInput, chunk: dict[str, Any]) -> dict[str, Any]:
    meta = dict(chunk["meta_info"])
    if body.return_text_in_logprobs:
        text = state.token_text.text
        for key in _LOGPROB_KEYS:
            if key in meta:
                meta[key] = [(lp, t, text(t)) for lp, t in meta[key]]
        for key in _TOP_LOGPROB_KEYS:
            if key in meta:
                meta[key] = [[(lp, t, text(t)) for lp, t in top] for top in meta[key]]
    return {"text": chunk["text"], "output_ids": chunk["output_ids"], "meta_info": meta}


@router.get("/get_model_info")
async def get_model_info(request: Request) -> Response:
    state = get_state(request)
    args = state.args
    return JSONResponse(
        {
            "model_path": args.model_path,
            "tokenizer_path": args.tokenizer_path or args.model_path,
            "served_model_name": args.model_name,
            "is_generation": True,
            "context_length": state.context_length,
        }
    )


@router.get("/get_server_info")
async def get_server_info(request: Request) -> Response:
    """The server arguments as the scheduler runs them (device defaults filled in, without the
    API key), the tool-call format in use, the scheduler's live statistics (KV usage, cache hit
    rate, running/queued requests, throughput) and the child processes."""
    state = get_state(request)
    scheduler_info = await _control(state, "server_info")
    tool_call_format = {"tool_call_format": state.tool_call_format}
    return JSONResponse({**scheduler_info, **tool_call_format, **state.process_info})


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    """Drop every cached prefix; 400 while requests are running (their KV is in use)."""
    reply = await _control(get_state(request), "flush_cache")
    if not reply.get("success"):
        raise ApiError(400, "the cache cannot be flushed while requests are running")
    return JSONResponse({"success": True, "message": "Cache flushed."})


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    state = get_state(request)
    body = parse_model(AbortReqInput, await state.read_body(request))
    await state.tokenizer_manager.abort(body.rid)
    return JSONResponse({"success": True})


async def _control(state: ServerState, command: str) -> dict[str, Any]:
    try:
        return await state.tokenizer_manager.control(command, timeout=10.0)
    except asyncio.TimeoutError:
        raise ApiError(503, f"the scheduler did not answer {command!r} in time") from None
