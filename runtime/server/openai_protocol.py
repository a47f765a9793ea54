"""Request bodies of the OpenAI-compatible API.

Unknown top-level fields are refused with OpenAI's own "Unrecognized request argument" 400:
silently ignoring one could change what the client gets (a constraint or a penalty it
believes is applied). The fields OpenAI's clients send about the caller rather than the
output (``ClientFields``: ``user``, ``safety_identifier``, ``metadata``, ``service_tier``,
``prompt_cache_key``) are checked as OpenAI checks them and accepted; ``prompt_cache_key`` is
the ``--dp`` router's cache-affinity key. ``prompt_cache_retention`` (chat completions and
Responses: ``in-memory``, 5 minutes, or ``24h``) pins the prompt's KV in the radix cache that
long, capped by ``--max-pin-seconds``. Extensions beyond OpenAI's fields use
SGLang/vLLM names (``top_k``, ``min_p``, ``regex``, ``ebnf``, ``json_schema``, ...); the
``openai`` client sends them through ``extra_body``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    model_validator,
)
from pydantic_core import PydanticCustomError

from runtime.request_checks import INT64_MAX, INT64_MIN, CacheSalt
from runtime.sampling_params import (
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_VALIDATION_ATTEMPTS,
    DryBreakers,
)

StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_LENGTH)]
JsonFormat = Literal["aligned", "compact"]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
MaxTokens = Annotated[int, Field(ge=0, le=INT64_MAX)]
# Chat completions generate at least one token (0 is completions' prompt-scoring request).
ChatMaxTokens = Annotated[int, Field(ge=1, le=INT64_MAX)]
# chat_template_kwargs: variables the chat template reads (enable_thinking, ...), bounded.
MAX_TEMPLATE_KWARGS = 64
MAX_TEMPLATE_KWARGS_BYTES = 64 * 1024
TemplateVariable = Annotated[str, StringConstraints(min_length=1, max_length=256)]


def _bounded_kwargs(value: dict[str, Any]) -> dict[str, Any]:
    if len(json.dumps(value)) > MAX_TEMPLATE_KWARGS_BYTES:
        raise ValueError(f"must be at most {MAX_TEMPLATE_KWARGS_BYTES} bytes of JSON")
    return value


TemplateKwargs = Annotated[
    dict[TemplateVariable, Any],
    Field(max_length=MAX_TEMPLATE_KWARGS),
    AfterValidator(_bounded_kwargs),
]


def check_unique_tool_names(names: Sequence[str | None]) -> None:
    """Raise a validation error (on the ``tools`` field of every API) if two tools share a
    name: a call names the tool it calls, so which one it meant would be a guess."""
    first: dict[str, int] = {}
    for index, name in enumerate(names):
        if name is None:
            continue
        if name in first:
            raise PydanticCustomError(
                "duplicate_tool_name",
                "tool names must be unique; tools.{first} and tools.{second} are both {name}",
                {"first": first[name], "second": index, "name": repr(name)},
            )
        first[name] = index


def _unique_names(tools: list[Any] | None) -> list[Any] | None:
    """``tools`` (or legacy ``functions``) unless two share a name: a chat tool names its
    ``function``; a Responses or Messages tool and a legacy function name themselves."""
    check_unique_tool_names([getattr(tool, "function", tool).name for tool in tools or []])
    return tools


# The validator every API's ``tools`` field carries (``Annotated[list[...] | None, ...]``).
UniqueToolNames = AfterValidator(_unique_names)


# Strict types (no "no" for false, no 1.0 for 1), finite numbers, no unknown fields: every
# API's request models.
STRICT_MODEL = ConfigDict(extra="forbid", populate_by_name=True, strict=True, allow_inf_nan=False)
# tool_choice "auto" in the generic tool format (chat, Responses, Messages): "constrained" (the
# default: a grammar holds the reply to the envelope its prompt describes) or "free" (the same
# prompt, no constraint; the reply is read as an envelope where it is one).
ReplyEnvelopeMode = Literal["scored", "constrained", "free"]


class DryFields(BaseModel):
    """DRY, the sequence repetition penalty, as llama.cpp names it (docs/serving.md): the
    extension fields every API's request takes."""

    model_config = STRICT_MODEL

    dry_multiplier: float | None = Field(None, ge=0.0, le=1e3)
    dry_base: float | None = Field(None, ge=1.0, le=1e3)
    dry_allowed_length: int | None = Field(None, ge=1, le=INT64_MAX)
    dry_penalty_last_n: int | None = Field(None, ge=-1, le=INT64_MAX)
    dry_sequence_breakers: DryBreakers | None = None
    dry_output_only: bool | None = None


class SamplingExtensions(DryFields):
    """The sampling fields every chat API's request takes beyond its own (the OpenAI client's
    ``extra_body``), declared once; each maps to the sampling param of the same name."""

    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0**16)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = None
    no_speculation: bool | None = None
    strict_mode: Literal["exact", "validate"] | None = None
    validation_attempts: int | None = Field(None, ge=1, le=MAX_VALIDATION_ATTEMPTS)
    # JSON output (response_format, json_schema, tool-call arguments): "aligned" (the default:
    # the whitespace a pretty-printer writes, bounded) or "compact".
    json_format: JsonFormat | None = None
    # Extension (vLLM's name): share cached KV only with requests of the same salt.
    cache_salt: CacheSalt | None = None


# OpenAI's API reference (2026-12): metadata is up to 16 pairs, keys up to 64 characters,
# values up to 512. The caller's labels are bounded by this server (the router remembers keys).
MAX_METADATA_PAIRS = 16
MetadataKey = Annotated[str, StringConstraints(max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]
Metadata = Annotated[dict[MetadataKey, MetadataValue], Field(max_length=MAX_METADATA_PAIRS)]
CallerLabel = Annotated[str, StringConstraints(max_length=512)]
ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]
Verbosity = Literal["low", "medium", "high"]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


# OpenAI's prompt_cache_retention, as seconds the prompt's KV stays pinned (the server caps it
# at --max-pin-seconds).
PromptCacheRetention = Literal["in-memory", "24h"]
RETENTION_SECONDS = {"in-memory": 300.0, "24h": 86400.0}


def retention_seconds(retention: PromptCacheRetention | None) -> float | None:
    return None if retention is None else RETENTION_SECONDS[retention]


class ClientFields(BaseModel):
    """What OpenAI's clients send about the caller rather than the output, in chat
    completions, completions and Responses alike: accepted (``docs/serving.md``).
    ``prompt_cache_key`` routes (``SubRequest.routing_key``); ``service_tier`` is answered
    with the tier that served the request (``served_tier``)."""

    model_config = STRICT_MODEL

    user: CallerLabel | None = None
    safety_identifier: CallerLabel | None = None
    prompt_cache_key: CallerLabel | None = None
    metadata: Metadata | None = None
    service_tier: ServiceTier | None = None


def served_tier(asked: ServiceTier | None) -> dict[str, str]:
    """The ``service_tier`` field of a response: absent when not asked, else the tier asked for,
    echoed (this server has one tier, so every named tier is the one that served it), with
    ``auto`` resolved to ``default`` as OpenAI resolves it."""
    if asked is None:
        return {}
    return {"service_tier": "default" if asked == "auto" else asked}


class OpenAIModel(BaseModel):
    """Strict types (no "no" for false, no 1.0 for 1), finite numbers; ``null`` means the
    field's default, as OpenAI's API treats it."""

    model_config = STRICT_MODEL

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        return {k: v for k, v in data.items() if v is not None or k not in known}


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class SamplingRequest(OpenAIModel, ClientFields, SamplingExtensions):
    """Fields shared by completions and chat completions."""

    model: str
    n: int = Field(1, ge=1, le=INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    store: bool | None = None  # accepted: nothing is stored (Responses stores)
    # Extensions.
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_tokens: int | None = Field(None, ge=0, le=INT64_MAX)
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: dict[str, Any] | str | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: MaxTokens | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class LegacyCall(OpenAIModel):
    """A legacy ``function_call`` the assistant made, as the client sends it back."""

    name: str
    arguments: str


class ChatMessage(BaseModel):
    """One message; extra fields (e.g. ``name``) pass through to the chat template."""

    model_config = ConfigDict(extra="allow", strict=True)

    # "function": the legacy tool result (``name``, ``content``), answering ``function_call``.
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | Annotated[list[dict[str, Any]], Field(min_length=1)] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    function_call: LegacyCall | None = None  # the legacy call of an assistant turn


# A function's name as OpenAI bounds it (tools, Responses tools and the legacy functions).
ToolName = Annotated[str, Field(min_length=1, max_length=64)]


class FunctionDefinition(OpenAIModel):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionName


class JsonSchemaFormat(OpenAIModel):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: ChatMaxTokens | None = None
    max_completion_tokens: ChatMaxTokens | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool] | None, UniqueToolNames] = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # Deprecated by OpenAI, still sent by clients: one function call at most, answered as
    # ``message.function_call`` (openai_api.legacy_functions).
    functions: Annotated[list[FunctionDefinition] | None, UniqueToolNames] = None
    function_call: Literal["none", "auto"] | FunctionName | None = None
    reasoning_effort: ReasoningEffort | None = None
    verbosity: Verbosity | None = None  # accepted: the length of the answer is not graded
    # Extension: how tool_choice "auto" replies in the generic tool format (ReplyEnvelopeMode).
    reply_envelope: ReplyEnvelopeMode | None = None
    # Extension (SGLang/vLLM): extra variables for the chat template, e.g.
    # {"enable_thinking": false}.
    chat_template_kwargs: TemplateKwargs | None = None
    # Extensions (vLLM): the reply continues the final assistant message (its prefill), and
    # the prompt without the template's generation prompt (runtime.chat.continuation).
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    # Pins the prompt's KV in the radix cache: in-memory for 5 minutes, 24h for a day.
    prompt_cache_retention: PromptCacheRetention | None = None
