"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

One request is one generation, on the chat completions' path: the conversation
(``messages_input``) is rendered with the chat template and the tools (written into the
system turn under the ``generic`` format), tool calls are constrained and parsed in the
server's tool-call format, and with ``--reasoning-parser`` the thinking becomes a ``thinking``
block while a constraint (a forced tool call, ``output_config.format``) starts after it.
``tool_choice``: ``auto`` (the default with tools), ``any`` (some call, forced by grammar),
``tool`` (that one, forced), ``none`` (the tools are not shown); ``disable_parallel_tool_use``
allows one call. ``thinking: {"type": "disabled"}`` sets the template's ``enable_thinking`` to
false. The ``anthropic-version`` header is accepted and ignored; errors on these routes are in
Anthropic's shape (``errors``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from runtime.chat.generic_tools import ReplyEnvelope, reply_envelope
from runtime.chat.reasoning import make_reasoning_parser
from runtime.chat.tool_call_formats import GENERIC_FORMAT
from runtime.chat.tool_calls import make_tool_parser, turn_constraint
from runtime.generate_input import SubRequest
from runtime.request_checks import check_output_room
from runtime.sampling_params import SamplingParams
from runtime.server.errors import ApiError
from runtime.server.messages_input import chat_messages
from runtime.server.messages_protocol import (
    CountTokensRequest,
    MessagesRequest,
    PromptRequest,
    ThinkingDisabled,
    ThinkingEnabled,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
)
from runtime.server.messages_run import MessageRun, new_message, run_message, stream_message
from runtime.server.openai_api import (
    SHARED_SAMPLING_FIELDS,
    after_reasoning,
    checked_sampling,
    given_fields,
    read_request,
    render_prompt,
    template_variables,
)
from runtime.server.openai_protocol import FunctionDefinition
from runtime.server.state import ServerState, open_streams
from runtime.server.streams import merge_streams, primed
from runtime.server.tracing import trace_request

router = APIRouter(prefix="/v1")

# Sampling params as this API names them, for error messages (also the runtime's: http_app).
PARAM_NAMES = {
    "max_new_tokens": "max_tokens",
    "stop": "stop_sequences",
    "structural_tag": "tool_choice",
    "json_schema": "output_config.format",
}
# Request field -> sampling param, copied when set: the OpenAI-style APIs' shared fields, with
# Anthropic's name for the stop strings.
_SAMPLING_FIELDS = {name: name for name in SHARED_SAMPLING_FIELDS if name != "stop"} | {
    "stop_sequences": "stop"
}


@dataclass(frozen=True)
class _Turn:
    """A request's prompt and its tools: ``mode`` none, auto, required or named."""

    text: str
    ids: list[int]
    functions: list[dict[str, Any]]
    mode: str
    names: set[str]
    envelope: ReplyEnvelope | None = None  # the generic format's reply envelope (auto)


@router.post("/messages")
async def create_message(request: Request) -> Response:
    state, body = await read_request(request, MessagesRequest)
    turn = await _prompt(state, body)
    check_output_room(len(turn.ids), body.max_tokens, state.context_length, "max_tokens")
    parallel = not _parallel_disabled(body)
    answer = _answer_format(body)
    callable_tools = [f for f in turn.functions if f["name"] in turn.names]
    name = next(iter(turn.names)) if turn.mode == "named" else None
    fmt = state.tool_call_format
    envelope = turn.envelope is not None and turn.envelope.constrained
    constraints = turn_constraint(callable_tools, turn.mode, name, parallel, fmt, answer, envelope)
    sampling = _sampling(state, body, constraints)
    if envelope and turn.envelope is not None:  # the server decides call or answer
        names = [f["name"] for f in callable_tools]
        branch = await state.tool_decider.decide(
            state, turn.ids, names, turn.envelope, body.cache_salt
        )
        if branch is not None:
            decided = turn_constraint(
                callable_tools, turn.mode, name, parallel, fmt, answer, envelope, branch
            )
            sampling = dataclasses.replace(sampling, structural_tag=decided["structural_tag"])
    run = MessageRun(new_message(state.args.model_name), list(body.stop_sequences or []))
    if turn.mode != "none" and turn.functions:
        forced = turn.mode in ("required", "named")
        max_calls = None if parallel else 1
        run.tools = make_tool_parser(fmt, turn.names, max_calls, forced)
        run.generated_turns = state.generated_turns
    reasoning = state.args.reasoning_parser
    if reasoning is not None:
        sampling = after_reasoning(state, reasoning, sampling, "output_config.format")
        run.reasoning = make_reasoning_parser(reasoning, turn.text)
    msg_id, model = run.message["id"], run.message["model"]
    trace_request(request, "chat", model=model, sampling=sampling, response_id=msg_id)
    streams = open_streams(state, [SubRequest(turn.ids, sampling, cache_salt=body.cache_salt)])
    if not body.stream:
        await run_message(run, merge_streams(request, streams))
        return JSONResponse(run.message)
    events = await primed(merge_streams(request, streams))
    return StreamingResponse(stream_message(run, events), media_type="text/event-stream")


@router.post("/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    """The prompt's length in tokens, as ``POST /v1/messages`` would render it."""
    state, body = await read_request(request, CountTokensRequest)
    turn = await _prompt(state, body)
    return JSONResponse({"input_tokens": len(turn.ids)})


async def _prompt(state: ServerState, body: PromptRequest) -> _Turn:
    reasoning = state.args.reasoning_parser is not None
    if isinstance(body.thinking, ThinkingEnabled) and not reasoning:
        raise ApiError(
            400, "thinking: this server was started without --reasoning-parser", "thinking"
        )
    turns = state.generated_turns
    messages = chat_messages(body.system, body.messages, reasoning, turns.arguments_text)
    functions = [
        FunctionDefinition(
            name=tool.name, description=tool.description, parameters=tool.input_schema
        ).model_dump(exclude_none=True)
        for tool in body.tools or []
    ]
    mode, names = _tool_choice(body, functions)
    variables = template_variables(state.tokenizer, body.chat_template_kwargs)
    if isinstance(body.thinking, ThinkingDisabled):
        variables.setdefault("enable_thinking", False)  # Qwen3-style templates read it
    tools = None
    envelope = None
    if functions and mode != "none":
        tools = [{"type": "function", "function": f} for f in functions]
        if mode == "auto" and state.tool_call_format == GENERIC_FORMAT:
            # The generic format's reply envelope: a call or an answer (as chat's auto).
            parallel = not _parallel_disabled(body)
            text_answer = not _answer_format(body)
            mode_asked = getattr(body, "reply_envelope", None)  # count_tokens: the same prompt
            envelope = reply_envelope(parallel, text_answer, mode_asked)
    text, ids = await render_prompt(state, messages, tools, variables, envelope)
    return _Turn(text, ids, functions, mode, names, envelope)


def _answer_format(body: PromptRequest) -> dict[str, Any]:
    """The answer's constraint from ``output_config.format`` (empty: free text)."""
    config = getattr(body, "output_config", None)
    if config is not None and config.format is not None:
        return {"json_schema": config.format.schema_}
    return {}


def _tool_choice(body: PromptRequest, functions: list[dict[str, Any]]) -> tuple[str, set[str]]:
    """(mode, names of the callable tools)."""
    names = {f["name"] for f in functions}
    choice = body.tool_choice
    if choice is None:
        return ("auto" if functions else "none"), names
    if isinstance(choice, ToolChoiceNone):
        return "none", names
    if not functions:
        raise ApiError(400, f"tool_choice: {choice.type} needs tools", param="tool_choice")
    if isinstance(choice, ToolChoiceTool):
        if choice.name not in names:
            raise ApiError(
                400, f"tool_choice.name: unknown tool {choice.name!r}", "tool_choice.name"
            )
        return "named", {choice.name}
    return ("required" if isinstance(choice, ToolChoiceAny) else "auto"), names


def _parallel_disabled(body: PromptRequest) -> bool:
    choice = body.tool_choice
    return choice is not None and getattr(choice, "disable_parallel_tool_use", False)


def _sampling(
    state: ServerState, body: MessagesRequest, constraints: dict[str, Any]
) -> SamplingParams:
    params = {"max_new_tokens": body.max_tokens} | given_fields(body, _SAMPLING_FIELDS)
    return checked_sampling(state, params | constraints, PARAM_NAMES)
