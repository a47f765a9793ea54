"""The native API, with SGLang's field names: ``/generate`` and the server-control endpoints.

``POST /generate`` takes ``text`` or ``input_ids`` (one prompt or a batch) and answers one
result ``{"text", "output_ids", "meta_info"}`` for one prompt with n == 1, else a list
(prompt-major, n results per prompt). With ``stream`` it answers server-sent events, one
cumulative result per output step (``index`` names the prompt/sample when there are several),
then ``data: [DONE]``. The body is validated and expanded as the Engine's arguments are
(``runtime/generate_input.py``, which also says how ``rid`` names each sub-request).

``require_reasoning`` (SGLang's name; needs ``--reasoning-parser``): a constraint in the
sampling params starts after the reasoning, and each result's ``text`` is the answer alone,
with the thinking in ``reasoning_content`` (streamed: ``delta`` and ``reasoning_delta``), as
chat completions split them (``runtime.chat.reasoning``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from runtime.chat.plan import require_reasoning
from runtime.chat.turn_reader import TurnReader, native_result
from runtime.generate_input import GenerateInput, LogprobOptions, SubRequest
from runtime.ipc import ControlCommand
from runtime.request_checks import check_output_room
from runtime.sampling_params import SamplingParamsInput
from runtime.server.errors import ApiError
from runtime.server.protocol import AbortReqInput, GenerateReqInput
from runtime.server.request_body import parse_model
from runtime.server.state import (
    ServerState,
    caller_is_admin,
    get_state,
    open_streams,
    tenant_body,
)
from runtime.server.streams import (
    Events,
    collect_finals,
    guarded_sse,
    merge_streams,
    primed,
    sse_event,
)
from runtime.server.tracing import trace_request
from runtime.tokenizer_manager import RequestOutput

router = APIRouter()

# /get_server_info entries only the admin sees (with --admin-api-key): where the processes run
# and how to reach them, where the model, the disk tier and the keys file lie on the host, where
# the server listens and sends its traces, and a routed server's per-replica rows (pids,
# addresses, last errors) and router state. The process facts (``ServerState.process_info``)
# are the admin's too.
ADMIN_ONLY_INFO = frozenset(
    {
        "tp_worker_pids",
        "replicas",
        "router",
        "model_path",
        "tokenizer_path",
        "speculative_draft_model_path",
        "kv_disk_path",
        "api_keys_file",
        "host",
        "otlp_traces_endpoint",
        "ray_address",
    }
)
_LOGPROB_KEYS = ("input_token_logprobs", "output_token_logprobs")
_TOP_LOGPROB_KEYS = ("input_top_logprobs", "output_top_logprobs")


@router.post("/generate")
async def generate(request: Request) -> Response:
    state = get_state(request)
    state.require_ready()
    body = tenant_body(request, parse_model(GenerateReqInput, await state.read_body(request)))
    generate_input = _generate_input(state, body)
    subs = await generate_input.sub_requests(state.tokenizer_manager.tokenize)
    _check_room(state, body, subs)
    splits = None
    if body.require_reasoning:
        splits = require_reasoning(state.args.reasoning_parser, state.tokenizer, subs)
    sampling = subs[0].sampling if subs else None
    trace_request(request, "text_completion", model=state.args.model_name, sampling=sampling)
    streams = open_streams(state, subs, request)
    several = generate_input.is_batch or len(subs) > 1
    if body.stream:
        events = await primed(merge_streams(request, streams))
        return StreamingResponse(
            guarded_sse(_event_stream(state, body, events, several, splits)),
            media_type="text/event-stream",
        )
    results = []
    for index, chunk in enumerate(await collect_finals(request, streams)):
        result = _result(state, body, chunk)
        if splits is not None:
            native_result(splits[index], result, chunk.text, final=True)
        results.append(result)
    return JSONResponse(results if several else results[0])


async def _event_stream(
    state: ServerState,
    body: GenerateReqInput,
    events: Events,
    several: bool,
    splits: list[TurnReader] | None,
) -> AsyncIterator[bytes]:
    async for index, chunk in events:
        result = _result(state, body, chunk)
        result["delta"] = chunk.delta
        if splits is not None:
            native_result(splits[index], result, chunk.delta, chunk.finish_reason is not None)
        if several:
            result["index"] = index
        yield sse_event(result)


def _generate_input(state: ServerState, body: GenerateReqInput) -> GenerateInput:
    logprobs = LogprobOptions(body.return_logprob, body.logprob_start_len, body.top_logprobs_num)
    params = body.sampling_params
    given = [_given(p) for p in params] if isinstance(params, list) else _given(params)
    limits = state.tokenizer_manager.limits
    return GenerateInput.parse(
        body.text, body.input_ids, given, body.rid, logprobs, limits, cache_salt=body.cache_salt
    )


def _given(params: SamplingParamsInput | None) -> dict[str, Any] | None:
    """The fields the client set (the rest keep SamplingParams' defaults)."""
    return None if params is None else params.model_dump(exclude_unset=True)


def _check_room(state: ServerState, body: GenerateReqInput, subs: list[SubRequest]) -> None:
    """A 400 for a prompt whose ``max_new_tokens``, where the request sets them, do not fit
    beside it in the context (where it does not, the scheduler cuts the default to the room)."""
    params = body.sampling_params
    for sub in subs:
        given = params[sub.prompt_index] if isinstance(params, list) else params
        if given is not None and "max_new_tokens" in given.model_fields_set:
            check_output_room(
                len(sub.input_ids),
                sub.sampling.max_new_tokens,
                state.context_length,
                "sampling_params.max_new_tokens",
            )


def _result(state: ServerState, body: GenerateReqInput, chunk: RequestOutput) -> dict[str, Any]:
    result = chunk.to_dict()
    meta = result["meta_info"]
    if body.return_text_in_logprobs:
        text = state.token_text.text
        for key in _LOGPROB_KEYS:
            if key in meta:
                meta[key] = [(lp, t, text(t)) for lp, t in meta[key]]
        for key in _TOP_LOGPROB_KEYS:
            if key in meta:
                meta[key] = [[(lp, t, text(t)) for lp, t in top] for top in meta[key]]
    return result


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
            # Role blocks for DSL clients (fl.RuntimeEndpoint), so they need no model folder.
            **(await asyncio.to_thread(state.role_blocks)),
        }
    )


@router.get("/get_server_info")
async def get_server_info(request: Request) -> Response:
    """The server arguments as the scheduler runs them (device defaults filled in, without the
    API keys), the tool-call format in use and the scheduler's live statistics (KV usage, cache
    hit rate, running/queued requests, throughput); for the admin (any caller without
    ``--admin-api-key``) also the processes, and a routed server's replicas and router."""
    state = get_state(request)
    scheduler_info = await _control(state, ControlCommand.SERVER_INFO)
    info = {**scheduler_info, "tool_call_format": state.tool_call_format}
    if not caller_is_admin(request):
        return JSONResponse({k: v for k, v in info.items() if k not in ADMIN_ONLY_INFO})
    return JSONResponse({**info, **state.process_info})


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    """Drop every cached prefix, with ``?disk=true`` also the disk tier's; 400 while requests
    are running (their KV is in use)."""
    disk = request.query_params.get("disk", "false").lower() in ("1", "true", "yes")
    reply = await _control(get_state(request), ControlCommand.FLUSH_CACHE, {"disk": disk})
    if not reply.get("success"):
        raise ApiError(400, "the cache cannot be flushed while requests are running")
    return JSONResponse({"success": True, "message": "Cache flushed."})


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    state = get_state(request)
    body = tenant_body(request, parse_model(AbortReqInput, await state.read_body(request)))
    if not await state.tokenizer_manager.abort(body.rid, body.cache_salt):
        # The same answer for a finished request, one never sent, and another salt's.
        raise ApiError(404, f"no request {body.rid!r} is running", param="rid")
    return JSONResponse({"success": True})


async def _control(
    state: ServerState, command: ControlCommand, args: dict[str, Any] | None = None
) -> dict[str, Any]:
    try:
        return await state.tokenizer_manager.control(command, timeout=10.0, args=args)
    except asyncio.TimeoutError:
        raise ApiError(503, f"the scheduler did not answer {command!r} in time") from None
