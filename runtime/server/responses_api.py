"""The OpenAI Responses API: ``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``
and ``GET /v1/responses/{id}/input_items``.

One request is one generation. The conversation (the stored turns of ``previous_response_id``,
then this turn's input) is rendered with the chat template behind ``instructions`` as a system
message; with a previous turn the prompt reuses that turn's exact prompt and output tokens and
only the new text is tokenized (``responses_prompt``), so the turn continues from the KV the
radix cache holds for them (``usage.input_tokens_details.cached_tokens`` shows it).
Constraints: ``text.format`` (json_schema / json_object) and ``tool_choice`` required / named /
allowed_tools, as in chat completions. Responses made with ``store`` (the default) are kept in
a bounded in-memory store (``--responses-store-size``). ``chat_template_kwargs`` (extension)
and ``reasoning.effort`` (``reasoning_variables``: "none" is ``enable_thinking: false``) reach
the chat template; ``prompt_cache_key`` is the ``--dp`` router's cache-affinity key.

A stored response belongs to the caller's key and ``cache_salt`` (``responses_store.Owner``);
the body-less routes take the salt as a ``cache_salt`` query parameter. To anybody else the id
is unknown: a 404, as for an id never stored (so is an unknown ``previous_response_id``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from runtime.chat.plan import plan_turn
from runtime.chat.turn_spec import ToolChoice, TurnSpec
from runtime.generate_input import LogprobOptions
from runtime.server.errors import ApiError
from runtime.server.openai_api import (
    SHARED_SAMPLING_FIELDS,
    given_fields,
    read_request,
    reasoning_variables,
    template_variables,
)
from runtime.server.openai_protocol import FunctionDefinition, retention_seconds
from runtime.server.request_body import parse_model
from runtime.server.responses_input import input_items, items_to_messages, output_to_items
from runtime.server.responses_output import new_id
from runtime.server.responses_prompt import TurnPrompt, conversation_prompt, stored_turn
from runtime.server.responses_protocol import InputItemsQuery, ResponsesRequest
from runtime.server.responses_run import ResponseRun, new_response, stream_response
from runtime.server.responses_store import Owner, StoredResponse
from runtime.server.state import ServerState, caller_of, get_state, open_streams, query_salt
from runtime.server.streams import merge_streams, primed, run_whole
from runtime.server.tracing import trace_request
from runtime.tokenizer_manager import RequestOutput

router = APIRouter(prefix="/v1")

_ITEM_ID_PREFIXES = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}
_REFUSED = ("background", "conversation", "prompt", "context_management")
PARAM_NAMES = {
    "max_new_tokens": "max_output_tokens",
    "structural_tag": "tools",  # built from the tools' parameter schemas
    "json_object": "text.format",
    "json_schema": "text.format",
}


@router.post("/responses")
async def create_response(request: Request) -> Response:
    state, body = await read_request(request, ResponsesRequest)
    for name in _REFUSED:
        if getattr(body, name) not in (None, False):
            raise ApiError(400, f"{name} is not supported by this server", param=name)
    owner = (caller_of(request), body.cache_salt)
    previous = _previous(state, body.previous_response_id, owner)
    items = input_items(body.input)
    for item in items:  # ids, so input_items can list them and later turns reference them
        prefix = (
            _ITEM_ID_PREFIXES.get(item.get("type", "message")) if isinstance(item, dict) else None
        )
        if prefix is not None:
            item.setdefault("id", new_id(prefix))
    earlier = previous.messages if previous else []
    messages = items_to_messages(
        items, lambda item_id: state.responses.item(item_id, owner), earlier=earlier
    )
    history = earlier + messages
    spec = _turn(state, body, history)

    async def render(functions: list[dict[str, Any]] | None, envelope: Any) -> TurnPrompt:
        instructions, variables = body.instructions, spec.template_variables
        return await conversation_prompt(
            state, instructions, history, functions, previous, variables, envelope
        )

    plan = await plan_turn(spec, state, render)
    logprobs = body.top_logprobs is not None or "message.output_text.logprobs" in (
        body.include or []
    )
    run = ResponseRun(
        new_response(body, state.args.model_name), state.token_text, plan.reader(), logprobs
    )
    options = LogprobOptions(logprobs, top_logprobs_num=body.top_logprobs or 0)
    [sub] = plan.sub_requests(options)
    trace_request(
        request, "chat", model=state.args.model_name, sampling=plan.sampling,
        response_id=run.response["id"],
    )  # fmt: skip
    streams = open_streams(state, [sub], request)

    def store(final: RequestOutput) -> None:
        if body.store:
            answer = items_to_messages(output_to_items(run.response["output"]), _no_references)
            turn = stored_turn(run.response, items, history, answer, plan.prompt, final)
            state.responses.put(dataclasses.replace(turn, owner=owner))

    if not body.stream:
        await run_whole(run, merge_streams(request, streams))
        if run.final:
            store(run.final)
        return JSONResponse(run.response)
    events = await primed(merge_streams(request, streams))
    return StreamingResponse(stream_response(run, events, store), media_type="text/event-stream")


def _turn(state: ServerState, body: ResponsesRequest, history: list[dict[str, Any]]) -> TurnSpec:
    """The request as a turn (``history``: the conversation, previous turns first)."""
    functions = _functions(body)
    choice = _tool_choice(body, functions)
    variables = template_variables(state.tokenizer, body.chat_template_kwargs)
    effort = body.reasoning.effort if body.reasoning else None
    variables = reasoning_variables(state, effort, "reasoning.effort", variables)
    sampling = {"max_new_tokens": body.max_output_tokens or state.context_length}
    sampling |= given_fields(body, {name: name for name in SHARED_SAMPLING_FIELDS})
    return TurnSpec(
        messages=history,
        tools=functions,
        tool_choice=choice,
        sampling=sampling,
        answer={} if choice.forced else _answer_format(body),
        max_tool_calls=_max_calls(body),
        output_limit=body.max_output_tokens,
        cache_salt=body.cache_salt,
        routing_key=body.prompt_cache_key,
        reply_envelope=body.reply_envelope,
        template_variables=variables,
        pin_ttl_s=retention_seconds(body.prompt_cache_retention),
        param_names=PARAM_NAMES | {"answer": "text.format"},
    )


@router.get("/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str) -> Response:
    return JSONResponse(_stored(request, response_id).response)


@router.delete("/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> Response:
    _stored(request, response_id)
    get_state(request).responses.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.get("/responses/{response_id}/input_items")
async def list_input_items(request: Request, response_id: str) -> Response:
    stored = _stored(request, response_id)
    query = parse_model(InputItemsQuery, dict(request.query_params))
    items = list(stored.input_items)
    if query.order == "desc":
        items.reverse()
    if query.after is not None:
        ids = [item.get("id") for item in items]
        if query.after not in ids:
            raise ApiError(400, f"after: no input item with id {query.after!r}", param="after")
        items = items[ids.index(query.after) + 1 :]
    page = items[: query.limit]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0].get("id") if page else None,
            "last_id": page[-1].get("id") if page else None,
            "has_more": len(items) > len(page),
        }
    )


def _no_references(item_id: str) -> None:
    """Output items hold no item references."""
    return None


def _stored(request: Request, response_id: str) -> StoredResponse:
    """The caller's stored response ``response_id`` (its salt: the ``cache_salt`` query
    parameter)."""
    owner = (caller_of(request), query_salt(request))
    return _lookup(
        get_state(request), response_id, owner, "No response", "response_id", "not_found"
    )


def _previous(state: ServerState, response_id: str | None, owner: Owner) -> StoredResponse | None:
    if response_id is None:
        return None
    return _lookup(
        state,
        response_id,
        owner,
        "Previous response",
        "previous_response_id",
        "previous_response_not_found",
    )


def _lookup(
    state: ServerState, response_id: str, owner: Owner, what: str, param: str, code: str
) -> StoredResponse:
    """``owner``'s stored response ``response_id``; ApiError 404 naming it where none is (never
    stored, dropped from the store, deleted, or another owner's)."""
    stored = state.responses.get(response_id, owner)
    if stored is None:
        message = f"{what} with id '{response_id}' not found."
        raise ApiError(404, message, param=param, code=code)
    return stored


def _functions(body: ResponsesRequest) -> list[dict[str, Any]]:
    functions = []
    for i, tool in enumerate(body.tools or []):
        if tool.type != "function":
            raise ApiError(
                400,
                f"tools.{i}.type: {tool.type!r} tools are not supported; only functions",
                f"tools.{i}.type",
            )
        if not tool.name:
            raise ApiError(400, f"tools.{i}.name: a function tool needs a name", f"tools.{i}.name")
        definition = FunctionDefinition(
            name=tool.name,
            description=tool.description,
            parameters=tool.parameters,
            strict=tool.strict,
        )
        functions.append(definition.model_dump(exclude_none=True))
    return functions


def _tool_choice(body: ResponsesRequest, functions: list[dict[str, Any]]) -> ToolChoice:
    names = frozenset(f["name"] for f in functions)
    choice = body.tool_choice or ("auto" if functions else "none")
    if isinstance(choice, str):
        if choice == "required" and not functions:
            raise ApiError(400, "tool_choice: required needs tools", param="tool_choice")
        return ToolChoice(choice, names)
    if choice.type == "function":
        if choice.name not in names:
            raise ApiError(400, f"tool_choice: unknown tool {choice.name!r}", param="tool_choice")
        return ToolChoice("named", frozenset({choice.name}))
    allowed = {tool.get("name") for tool in choice.tools if isinstance(tool, dict)}
    unknown = allowed - names
    if unknown or not allowed:
        raise ApiError(
            400,
            f"tool_choice.tools: unknown tools {sorted(map(str, unknown))}",
            "tool_choice.tools",
        )
    return ToolChoice(choice.mode, frozenset(name for name in allowed if isinstance(name, str)))


def _answer_format(body: ResponsesRequest) -> dict[str, Any]:
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise ApiError(
                400, "text.format.schema: a json_schema format needs a schema", "text.format.schema"
            )
        return {"json_schema": fmt.schema_}
    if fmt is not None and fmt.type == "json_object":
        return {"json_object": True}
    return {}


def _max_calls(body: ResponsesRequest) -> int | None:
    if not body.parallel_tool_calls:
        return 1
    return body.max_tool_calls
