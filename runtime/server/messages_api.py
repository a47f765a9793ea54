"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

One request is one generation, on the chat completions' path: the conversation
(``messages_input``) is rendered with the chat template and the tools (written into the
system turn under the ``generic`` format), tool calls are constrained and parsed in the
server's tool-call format, and with ``--reasoning-parser`` the thinking becomes a ``thinking``
block while a constraint (a forced tool call, ``output_config.format``) starts after it.
``tool_choice``: ``auto`` (the default with tools), ``any`` (some call, forced by grammar),
``tool`` (that one, forced), ``none`` (the tools are not shown); ``disable_parallel_tool_use``
allows one call. ``thinking: {"type": "disabled"}`` sets the template's ``enable_thinking`` to
false. A last assistant turn is a prefill the reply continues (``runtime.chat.continuation``:
the content holds the continuation alone; a constraint covers prefill and reply). The
``anthropic-version`` header is accepted and ignored; errors on these routes are in
Anthropic's shape (``errors``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from runtime.chat.plan import plan_turn, turn_envelope
from runtime.chat.turn_spec import ToolChoice, TurnSpec
from runtime.generate_input import SubRequest
from runtime.server.errors import ApiError
from runtime.server.messages_input import chat_messages
from runtime.server.messages_output import tool_use_id
from runtime.server.messages_protocol import (
    CountTokensRequest,
    MessagesRequest,
    PromptRequest,
    ThinkingDisabled,
    ThinkingEnabled,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    cache_pin_seconds,
)
from runtime.server.messages_run import MessageRun, new_message, stream_message
from runtime.server.messages_usage import breakpoint_tokens
from runtime.server.openai_api import (
    SHARED_SAMPLING_FIELDS,
    chat_render,
    given_fields,
    read_request,
    template_variables,
)
from runtime.server.state import ServerState, open_streams
from runtime.server.streams import merge_streams, primed, run_whole
from runtime.server.tracing import trace_request

router = APIRouter(prefix="/v1")

# Sampling params as this API names them, for error messages (also the runtime's: http_app).
PARAM_NAMES = {
    "max_new_tokens": "max_tokens",
    "stop": "stop_sequences",
    "structural_tag": "tools",  # built from the tools' input schemas
    "json_schema": "output_config.format",
    "grammar_prefix_len": "messages",  # a prefill the constraint refuses
}
# Request field -> sampling param, copied when set: the OpenAI-style APIs' shared fields, with
# Anthropic's name for the stop strings.
_SAMPLING_FIELDS = {name: name for name in SHARED_SAMPLING_FIELDS if name != "stop"} | {
    "stop_sequences": "stop"
}


@router.post("/messages")
async def create_message(request: Request) -> Response:
    state, body = await read_request(request, MessagesRequest)
    spec = _turn(state, body)
    plan = await plan_turn(spec, state, chat_render(state, spec))
    marked = 0
    if spec.pin_ttl_s is not None:  # some part has cache_control
        prompt = plan.prompt
        marked = breakpoint_tokens(body, prompt.text, len(prompt.ids), state.tokenizer)
    run = MessageRun(new_message(state.args.model_name), plan.reader(tool_use_id), marked)
    msg_id, model = run.message["id"], run.message["model"]
    trace_request(request, "chat", model=model, sampling=plan.sampling, response_id=msg_id)
    sub = SubRequest(plan.prompt.ids, plan.sampling, cache_salt=spec.cache_salt, pin=plan.pin)
    streams = open_streams(state, [sub], request)
    if not body.stream:
        await run_whole(run, merge_streams(request, streams))
        return JSONResponse(run.message)
    events = await primed(merge_streams(request, streams))
    return StreamingResponse(stream_message(run, events), media_type="text/event-stream")


@router.post("/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    """The prompt's length in tokens, as ``POST /v1/messages`` would render it."""
    state, body = await read_request(request, CountTokensRequest)
    spec = _turn(state, body)
    tools = spec.tools if spec.tools_on else None
    prompt = await chat_render(state, spec)(tools, turn_envelope(spec, state.tool_call_format))
    return JSONResponse({"input_tokens": len(prompt.ids)})


def _turn(state: ServerState, body: PromptRequest) -> TurnSpec:
    """The request as a turn (``count_tokens``: its prompt alone, no sampling)."""
    reasoning = state.args.reasoning_parser is not None
    if isinstance(body.thinking, ThinkingEnabled) and not reasoning:
        raise ApiError(
            400, "thinking: this server was started without --reasoning-parser", "thinking"
        )
    turns = state.generated_turns
    # The tools in the function shape the turn pipeline reads (Anthropic's bounds were checked
    # at the edge: not OpenAI's, whose names are shorter).
    functions = [
        {"name": tool.name, "parameters": tool.input_schema}
        | ({"description": tool.description} if tool.description is not None else {})
        for tool in body.tools or []
    ]
    variables = template_variables(state.tokenizer, body.chat_template_kwargs)
    if isinstance(body.thinking, ThinkingDisabled):
        variables.setdefault("enable_thinking", False)  # Qwen3-style templates read it
    sampling: dict[str, Any] = {}
    if isinstance(body, MessagesRequest):
        sampling = {"max_new_tokens": body.max_tokens} | given_fields(body, _SAMPLING_FIELDS)
    return TurnSpec(
        messages=chat_messages(body.system, body.messages, reasoning, turns.arguments_text),
        tools=functions,
        tool_choice=_tool_choice(body, functions),
        sampling=sampling,
        answer=_answer_format(body),
        max_tool_calls=1 if _parallel_disabled(body) else None,
        output_limit=body.max_tokens if isinstance(body, MessagesRequest) else None,
        cache_salt=getattr(body, "cache_salt", None),
        reply_envelope=getattr(body, "reply_envelope", None),
        template_variables=variables,
        param_names=PARAM_NAMES | {"answer": "output_config.format"},
        continue_final=body.messages[-1].role == "assistant",
        pin_ttl_s=cache_pin_seconds(body),
    )


def _answer_format(body: PromptRequest) -> dict[str, Any]:
    """The answer's constraint from ``output_config.format`` (empty: free text)."""
    config = getattr(body, "output_config", None)
    if config is not None and config.format is not None:
        return {"json_schema": config.format.schema_}
    return {}


def _tool_choice(body: PromptRequest, functions: list[dict[str, Any]]) -> ToolChoice:
    names = frozenset(f["name"] for f in functions)
    choice = body.tool_choice
    if choice is None:
        return ToolChoice("auto" if functions else "none", names)
    if isinstance(choice, ToolChoiceNone):
        return ToolChoice("none", names)
    if not functions:
        raise ApiError(400, f"tool_choice: {choice.type} needs tools", param="tool_choice")
    if isinstance(choice, ToolChoiceTool):
        if choice.name not in names:
            raise ApiError(
                400, f"tool_choice.name: unknown tool {choice.name!r}", "tool_choice.name"
            )
        return ToolChoice("named", frozenset({choice.name}))
    return ToolChoice("required" if isinstance(choice, ToolChoiceAny) else "auto", names)


def _parallel_disabled(body: PromptRequest) -> bool:
    choice = body.tool_choice
    return choice is not None and getattr(choice, "disable_parallel_tool_use", False)
