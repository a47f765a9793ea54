"""The OpenAI-compatible API: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

Each request becomes one sub-request per prompt and per sample of ``n`` (choice i * n + j,
``runtime.generate_input.expand``), run like native requests. Constraints:
``response_format`` json_object / json_schema, ``tool_choice`` "required" or a named function
(a ``structural_tag`` over the tools), and the ``regex`` / ``ebnf`` / ``json_schema``
extensions; at most one per request. Errors use
OpenAI's names for the fields (``max_tokens`` rather than ``max_new_tokens``). The legacy
``functions`` / ``function_call`` are tools and tool_choice with one call at most, answered in
their own shape (``message.function_call``, finish_reason "function_call").
"""

from __future__ import annotations

import contextlib
import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from inspect import signature
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from runtime.chat.continuation import prefill_text, prompt_head
from runtime.chat.generic_tools import ReplyEnvelope, generic_messages
from runtime.chat.plan import Prompt, Render, plan_turn, sampling_params
from runtime.chat.tool_call_events import ToolCall
from runtime.chat.tool_call_formats import GENERIC_FORMAT
from runtime.chat.turn_spec import ToolChoice, TurnSpec
from runtime.chat_templates import NO_TEMPLATE, has_chat_template
from runtime.errors import RequestError
from runtime.generate_input import LogprobOptions, SubRequest, expand
from runtime.request_checks import check_output_room
from runtime.server.errors import ApiError
from runtime.server.messages_protocol import CountTokensRequest, MessagesRequest
from runtime.server.openai_format import ResponseContext, chat_response, completion_response
from runtime.server.openai_protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    FunctionName,
    NamedToolChoice,
    SamplingRequest,
    retention_seconds,
    served_tier,
)
from runtime.server.openai_stream import chat_stream, completion_stream
from runtime.server.request_body import parse_model
from runtime.server.responses_protocol import ResponsesRequest
from runtime.server.state import ServerState, get_state, open_streams, tenant_body
from runtime.server.streams import Events, collect_finals, guarded_sse, merge_streams, primed
from runtime.server.tracing import trace_request
from runtime.tokenizer_manager import RequestOutput

router = APIRouter(prefix="/v1")
Body = TypeVar(
    "Body",
    CompletionRequest,
    ChatCompletionRequest,
    ResponsesRequest,
    MessagesRequest,
    CountTokensRequest,
)

# Sampling-param names as the OpenAI request spells them, for error messages (also those
# the runtime raises: http_app).
PARAM_NAMES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "structural_tag": "tools",  # built from the tools' parameter schemas
    "json_object": "response_format",
    "grammar_prefix_len": "messages",  # a continued final message the constraint refuses
}
# Request fields both OpenAI-style APIs (here and the Responses API) copy, when set, into the
# sampling param of the same name.
SHARED_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "seed",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "stop",
    "ignore_eos",
    "no_speculation",
    "strict_mode",
    "validation_attempts",
    "json_format",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "dry_sequence_breakers",
    "dry_output_only",
)
# Completions and chat: request field -> sampling param, copied when set.
_PASSTHROUGH = {
    name: name
    for name in SHARED_SAMPLING_FIELDS
    + ("skip_special_tokens", "no_stop_trim", "stop_token_ids", "regex", "ebnf", "json_schema")
} | {"min_tokens": "min_new_tokens"}


@router.get("/models")
async def list_models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(get_state(request))]})


@router.get("/models/{model:path}")
async def retrieve_model(request: Request, model: str) -> Response:
    state = get_state(request)
    check_model(state, model)
    return JSONResponse(_model_card(state))


@router.post("/completions")
async def completions(request: Request) -> Response:
    state, body = await read_request(request, CompletionRequest)
    if body.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    if body.best_of not in (None, body.n):
        raise ApiError(400, "best_of must be equal to n", param="best_of")
    max_tokens = body.max_tokens if body.max_tokens is not None else state.context_length
    params = {"max_new_tokens": max_tokens, "n": body.n} | given_fields(body, _PASSTHROUGH)
    sampling = sampling_params(params, state.tokenizer_manager, PARAM_NAMES)
    prompts, texts = await _completion_prompts(state, body.prompt)
    if "max_tokens" in body.model_fields_set and body.max_tokens is not None:
        for ids in prompts:
            check_output_room(len(ids), body.max_tokens, state.context_length, "max_tokens")
    want_logprobs = body.logprobs is not None
    logprobs = LogprobOptions(
        return_logprob=want_logprobs,
        logprob_start_len=0 if body.echo and want_logprobs else -1,
        top_logprobs_num=body.logprobs or 0,
    )
    subs = expand(
        prompts,
        [sampling] * len(prompts),
        logprobs=logprobs,
        cache_salt=body.cache_salt,
        routing_key=body.prompt_cache_key,
    )
    ctx = _context(state, body, "cmpl", sampling.n)
    ctx.echo_texts = texts if body.echo else []
    trace_request(
        request, "text_completion", model=ctx.model, sampling=sampling, response_id=ctx.request_id
    )
    return await _respond(
        request,
        state,
        subs,
        ctx,
        body.stream,
        want_logprobs,
        completion_stream,
        completion_response,
    )


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    state, body = await read_request(request, ChatCompletionRequest)
    if body.top_logprobs and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    spec = _chat_turn(state, body)
    plan = await plan_turn(spec, state, chat_render(state, spec))
    ctx = _context(state, body, "chatcmpl", plan.sampling.n)
    ctx.reader = plan.reader
    ctx.legacy_functions = body.functions is not None
    logprobs = LogprobOptions(body.logprobs, top_logprobs_num=body.top_logprobs or 0)
    subs = plan.sub_requests(logprobs)
    trace_request(
        request, "chat", model=ctx.model, sampling=plan.sampling, response_id=ctx.request_id
    )
    with request_fields(spec.param_names):
        return await _respond(
            request, state, subs, ctx, body.stream, body.logprobs, chat_stream, chat_response
        )


def _chat_turn(state: ServerState, body: ChatCompletionRequest) -> TurnSpec:
    """The chat completion request as a turn."""
    legacy = body.functions is not None
    functions, tool_choice = _legacy_functions(body) if legacy else _chat_tools(body)
    variables = template_variables(state.tokenizer, body.chat_template_kwargs)
    variables = reasoning_variables(state, body.reasoning_effort, "reasoning_effort", variables)
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    asked = getattr(body, field)
    sampling = {"max_new_tokens": asked if asked is not None else state.context_length}
    sampling |= {"n": body.n} | given_fields(body, _PASSTHROUGH)
    if body.continue_final_message and body.add_generation_prompt:
        raise ApiError(
            400,
            "continue_final_message needs add_generation_prompt false (as in vLLM)",
            param="continue_final_message",
        )
    return TurnSpec(
        messages=_chat_messages(body.messages),
        tools=functions,
        tool_choice=tool_choice,
        sampling=sampling,
        answer=_format_constraint(body),
        max_tool_calls=1 if legacy or not body.parallel_tool_calls else None,
        output_limit=asked,
        cache_salt=body.cache_salt,
        routing_key=body.prompt_cache_key,
        reply_envelope=body.reply_envelope,
        template_variables=variables,
        pin_ttl_s=retention_seconds(body.prompt_cache_retention),
        param_names=PARAM_NAMES
        | {"max_new_tokens": field, "answer": "response_format"}
        | ({"structural_tag": "functions"} if legacy else {}),
        continue_final=body.continue_final_message,
        generation_prompt=body.add_generation_prompt,
    )


def _chat_tools(body: ChatCompletionRequest) -> tuple[list[dict[str, Any]], ToolChoice]:
    """The request's tools (function definitions) and tool choice."""
    if body.function_call is not None:
        raise ApiError(400, "function_call needs functions", param="function_call")
    functions = [tool.function.model_dump(exclude_none=True) for tool in body.tools or []]
    choice = body.tool_choice or ("auto" if functions else "none")
    names = frozenset(f["name"] for f in functions)
    if isinstance(choice, NamedToolChoice):
        if not functions:
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        if choice.function.name not in names:
            raise ApiError(
                400, f"tool_choice names an unknown tool {choice.function.name!r}", "tool_choice"
            )
        return functions, ToolChoice("named", frozenset({choice.function.name}))
    if choice == "required" and not functions:
        raise ApiError(400, "tool_choice needs tools", param="tool_choice")
    return functions, ToolChoice(choice, names)


def _legacy_functions(body: ChatCompletionRequest) -> tuple[list[dict[str, Any]], ToolChoice]:
    """``functions`` and ``function_call`` (OpenAI's deprecated tools and tool_choice) as
    tools and a tool choice; never beside tools or tool_choice."""
    if body.tools is not None:
        message = "functions and tools cannot both be set (functions is the deprecated form)"
        raise ApiError(400, message, param="functions")
    if body.tool_choice is not None:
        message = "tool_choice goes with tools; with functions, function_call"
        raise ApiError(400, message, param="tool_choice")
    functions = [function.model_dump(exclude_none=True) for function in body.functions or []]
    names = frozenset(f["name"] for f in functions)
    choice = body.function_call or ("auto" if functions else "none")
    if not isinstance(choice, FunctionName):
        return functions, ToolChoice(choice, names)
    if choice.name not in names:
        message = f"function_call names an unknown function {choice.name!r}"
        raise ApiError(400, message, param="function_call")
    return functions, ToolChoice("named", frozenset({choice.name}))


def reasoning_variables(
    state: ServerState, effort: str | None, param: str, variables: dict[str, Any]
) -> dict[str, Any]:
    """The template ``variables`` of a turn asking OpenAI's reasoning ``effort`` (in request
    field ``param``). Without a reasoning parser the model does not reason: OpenAI's 400.
    "none" turns the thinking off (``enable_thinking: false``, which Qwen3-style templates
    read; a 400 where the template has no such switch; ``chat_template_kwargs`` win); the
    other efforts leave it on, not graded."""
    if effort is None:
        return variables
    if state.args.reasoning_parser is None:
        message = f"Unsupported parameter: '{param}' is not supported with this model."
        raise ApiError(400, message, param=param, code="unsupported_parameter")
    if effort != "none":
        return variables
    if "enable_thinking" not in str(state.tokenizer.chat_template or ""):
        message = f"{param}: this model's chat template has no enable_thinking switch to turn off"
        raise ApiError(400, message, param=param)
    return {"enable_thinking": False} | variables


@contextlib.contextmanager
def request_fields(names: Mapping[str, str]) -> Iterator[None]:
    """Re-raise a runtime error about sampling param ``p`` naming request field ``names[p]``
    (the route's names, ``PARAM_NAMES``, cannot know a request's own, e.g. functions)."""
    try:
        yield
    except RequestError as exc:
        if exc.param is None or exc.param not in names:
            raise
        raise RequestError(str(exc), exc.status_code, names[exc.param]) from None


def chat_render(state: ServerState, spec: TurnSpec) -> Render[Prompt]:
    """How a turn of chat messages (chat completions, Messages) renders its prompt."""

    async def render(
        functions: list[dict[str, Any]] | None, envelope: ReplyEnvelope | None
    ) -> Prompt:
        tools = (
            None if functions is None else [{"type": "function", "function": f} for f in functions]
        )
        variables = spec.template_variables
        messages, wants = spec.messages, spec.generation_prompt
        text, ids = await render_prompt(
            state, messages, tools, variables, envelope, wants, spec.continue_final
        )
        if not spec.continue_final:
            return Prompt(text, ids)
        prefill = prefill_text(messages)
        tokenizer = state.tokenizer
        prefill_ids = await state.tokenizer_manager.run_tokenizer(
            lambda: list(tokenizer(prefill, add_special_tokens=False).input_ids), "messages"
        )
        return Prompt(text + prefill, ids + prefill_ids, len(prefill_ids))

    return render


async def _respond(
    request: Request,
    state: ServerState,
    subs: list[SubRequest],
    ctx: ResponseContext,
    stream: bool,
    want_logprobs: bool,
    stream_body: Callable[[ResponseContext, Events, int, bool], AsyncIterator[bytes]],
    full_body: Callable[[ResponseContext, list[RequestOutput], bool], dict[str, Any]],
) -> Response:
    streams = open_streams(state, subs, request)
    if not stream:
        finals = await collect_finals(request, streams)
        return JSONResponse(full_body(ctx, finals, want_logprobs))
    events = await primed(merge_streams(request, streams))
    body = guarded_sse(stream_body(ctx, events, len(subs), want_logprobs))
    return StreamingResponse(body, media_type="text/event-stream")


def _context(state: ServerState, body: SamplingRequest, prefix: str, n: int) -> ResponseContext:
    return ResponseContext(
        request_id=f"{prefix}-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=state.args.model_name,
        n=n,
        token_text=state.token_text,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        tier=served_tier(body.service_tier),
    )


def _model_card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.args.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "arbor",
        "root": state.args.model_path,
        "max_model_len": state.context_length,
    }


async def read_request(request: Request, model: type[Body]) -> tuple[ServerState, Body]:
    """The server state and the request's validated body (its ``cache_salt`` the caller's
    tenant's, ``tenant_salt``): 503 before the server is ready, 400 for a bad body, 404 for a
    model this server does not serve."""
    state = get_state(request)
    state.require_ready()
    body = parse_model(model, await state.read_body(request))
    check_model(state, body.model)
    return state, tenant_body(request, body)


def check_model(state: ServerState, model: str) -> None:
    if model not in (state.args.model_name, state.args.model_path):
        raise ApiError(
            404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
        )


def given_fields(body: Any, fields: Mapping[str, str]) -> dict[str, Any]:
    """``{sampling param: value}`` for each request field of ``fields`` that ``body`` sets."""
    values = {name: getattr(body, field) for field, name in fields.items()}
    return {name: value for name, value in values.items() if value is not None}


async def _completion_prompts(
    state: ServerState, prompt: str | list[str] | list[int] | list[list[int]]
) -> tuple[list[list[int]], list[str]]:
    """(token ids, text) of each prompt; token-id prompts are checked against the vocabulary
    before anything decodes them."""
    items: list[Any] = [prompt] if isinstance(prompt, str) else list(prompt)
    if not items:
        raise ApiError(400, "prompt is empty", param="prompt")
    if isinstance(items[0], int):
        items = [items]
    manager = state.tokenizer_manager
    decode = state.tokenizer.decode
    ids: list[list[int]] = []
    texts: list[str] = []
    for item in items:
        if isinstance(item, str):
            ids.append(await manager.tokenize(item, "prompt"))
            texts.append(item)
            continue
        try:
            manager.check_input_ids(item, "prompt")
        except RequestError as exc:
            raise ApiError(400, str(exc), param="prompt") from None
        ids.append(list(item))
        texts.append(await manager.run_tokenizer(functools.partial(decode, item), "prompt"))
    return ids, texts


def _format_constraint(body: ChatCompletionRequest) -> dict[str, Any]:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return {}
    if fmt.type == "json_schema" and fmt.json_schema and fmt.json_schema.schema_ is not None:
        return {"json_schema": fmt.json_schema.schema_}
    return {"json_object": True}


def _chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The chat messages as the template reads them (developer is system; text parts joined;
    a legacy ``function_call`` is a tool call, and the ``function`` message after it, named
    as it, that call's result)."""
    rendered = []
    call_ids: dict[str, str] = {}  # function name -> the id given to its last legacy call
    for index, message in enumerate(messages):
        turn: dict[str, Any] = message.model_dump(exclude_none=True)
        turn["content"] = _text_content(message.content, index)
        if turn["role"] == "developer":
            turn["role"] = "system"
        if message.function_call is not None:
            call = ToolCall(message.function_call.name, message.function_call.arguments)
            call_ids[call.name] = call.id
            turn["tool_calls"] = [*turn.get("tool_calls", []), call.to_openai()]
            del turn["function_call"]
        if turn["role"] == "function":
            name = turn.get("name")
            if not isinstance(name, str) or name not in call_ids:
                message_text = "a function message needs the name of a function_call before it"
                raise ApiError(400, f"messages.{index}: {message_text}", f"messages.{index}.name")
            turn["role"], turn["tool_call_id"] = "tool", call_ids[name]
        rendered.append(turn)
    return rendered


async def render_prompt(
    state: ServerState,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    variables: dict[str, Any],
    envelope: ReplyEnvelope | None = None,
    generation_prompt: bool = True,
    continue_final: bool = False,
) -> tuple[str, list[int]]:
    """(prompt text, token ids) of chat ``messages`` (``render_chat``, errors naming
    ``messages``), tokenized with the generated ids of the tool-calling turns they re-send.
    ``envelope``: the generic format's reply envelope (tool_choice auto), which the prompt
    describes; ``continue_final``: the prompt up to the final message's content."""
    text = await render_chat(
        state, messages, tools, variables, "messages", None, envelope, generation_prompt,
        continue_final,
    )  # fmt: skip
    ids = await state.tokenizer_manager.run_tokenizer(
        lambda: state.generated_turns.prompt_ids(text, messages), "messages"
    )
    return text, ids


async def render_chat(
    state: ServerState,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    variables: dict[str, Any],
    param: str,
    known_calls: dict[str, str] | None = None,
    envelope: ReplyEnvelope | None = None,
    generation_prompt: bool = True,
    continue_final: bool = False,
) -> str:
    """The chat template's text for ``messages`` (and ``tools``, and extra template
    ``variables``) with the generation prompt (unless not ``generation_prompt``; with
    ``continue_final``, up to where the final message's content starts:
    ``runtime.chat.continuation``), rendered on a tokenizer thread; ApiError 400 naming
    ``param`` when the template fails. Under the generic tool-call format the tools,
    earlier calls and tool results are written into the messages instead
    (``generic_messages``; ``known_calls``: tool names by call id for results whose calls
    ``messages`` leave out; ``envelope``: the reply envelope of tool_choice auto)."""
    tokenizer = state.tokenizer
    if not has_chat_template(tokenizer):
        raise ApiError(400, NO_TEMPLATE, param=param)
    if state.tool_call_format == GENERIC_FORMAT:
        messages, tools = generic_messages(messages, tools, known_calls, envelope), None

    def apply(chat: list[dict[str, Any]], generation: bool) -> str:
        return tokenizer.apply_chat_template(
            chat, tools=tools, add_generation_prompt=generation, tokenize=False, **variables
        )

    def render() -> str:
        if continue_final:
            return prompt_head(lambda marked: apply(marked, False), messages)
        return apply(messages, generation_prompt)

    try:
        return await state.tokenizer_manager.run_tokenizer(render, param)
    except RequestError as exc:
        raise ApiError(400, str(exc), param=param) from None
    except Exception as exc:  # jinja errors, or a tokenizer without a template
        raise ApiError(400, f"the chat template failed: {exc}", param=param) from None


def template_variables(tokenizer: Any, given: dict[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` as extra template variables; ApiError 400 for a name that is
    one of the template call's own arguments (tokenize, tools, ...)."""
    extra = dict(given or {})
    taken = sorted(
        set(extra) & ({"messages"} | set(signature(tokenizer.apply_chat_template).parameters))
    )
    if taken:
        raise ApiError(
            400,
            f"chat_template_kwargs: {taken[0]!r} is not a template variable one may set",
            param="chat_template_kwargs",
        )
    return extra


def _text_content(content: str | list[dict[str, Any]] | None, index: int) -> str | None:
    if not isinstance(content, list):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(
                400, "only text content parts are supported", param=f"messages.{index}.content"
            )
        parts.append(part["text"])
    return "".join(parts)
