"""Request bodies of Anthropic's Messages API (``POST /v1/messages`` and
``/v1/messages/count_tokens``).

Content blocks are typed by ``type``: text, tool_use, tool_result, thinking and
redacted_thinking are read; image, document, search_result and server-tool blocks parse (so the
error can name them) and are refused with a 400 when the messages are turned into chat messages
(``messages_input``), as is a block in the wrong role's turn. The fields follow the request
params of the ``anthropic`` SDK 2.17 (2026-12), so a client's own dump of a response block
(``block.model_dump()``: ``caller`` and ``toolset_name`` on tool_use, ``citations`` on text, as
null or set) comes back as input. Unknown fields are refused by name ("Extra inputs"); fields
that do not change the output (``metadata``, ``service_tier``, ``citations``, a tool_use's
``caller``, a tool's ``strict`` and loading hints) are accepted and ignored. ``cache_control``
(on the system's, messages' and tool results' text blocks, tool_use and tool_result blocks and
tools; a ``ttl`` of ``5m``, the default, or ``1h``) pins the prompt's KV in the radix cache for
the longest ``ttl`` given (``cache_pin_seconds``). Extensions, as in the OpenAI API and sent
by the ``anthropic`` client through ``extra_body``: ``seed``, ``min_p``, penalties,
``json_format``, ``chat_template_kwargs``, ``cache_salt``, ...
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from runtime.request_checks import INT64_MAX
from runtime.sampling_params import MAX_STOP_STRINGS
from runtime.server.openai_protocol import (
    ReplyEnvelopeMode,
    SamplingExtensions,
    StopString,
    TemplateKwargs,
    UniqueToolNames,
)

MAX_MESSAGES = 4096


class AnthropicModel(BaseModel):
    """Strict types (no "1" for 1), finite numbers, no unknown fields."""

    model_config = ConfigDict(
        extra="forbid", populate_by_name=True, strict=True, allow_inf_nan=False
    )


CACHE_TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}


class CacheControl(AnthropicModel):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class TextBlock(AnthropicModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None


class UnsupportedBlock(BaseModel):
    """A block this server cannot read (no vision, no documents): refused by its type."""

    model_config = ConfigDict(extra="allow")

    type: Literal[
        "image",
        "document",
        "search_result",
        "container_upload",
        "server_tool_use",
        "web_search_tool_result",
        "web_fetch_tool_result",
        "code_execution_tool_result",
        "bash_code_execution_tool_result",
        "text_editor_code_execution_tool_result",
        "tool_search_tool_result",
    ]


class Caller(AnthropicModel):
    """Who made a tool call: ``direct`` (the model), or a server tool (its ``tool_id``)."""

    type: str
    tool_id: str | None = None


class ToolUseBlock(AnthropicModel):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: Caller | None = None
    toolset_name: str | None = None


ToolResultContent = Annotated[TextBlock | UnsupportedBlock, Field(discriminator="type")]


class ToolResultBlock(AnthropicModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[ToolResultContent] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None
    toolset_name: str | None = None


class ThinkingBlock(AnthropicModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None  # this server signs nothing: accepted as given


class RedactedThinkingBlock(AnthropicModel):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock
    | UnsupportedBlock,
    Field(discriminator="type"),
]


class Message(AnthropicModel):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[ContentBlock], Field(min_length=1)]


class Tool(AnthropicModel):
    """A client tool. Server tools (web search, code execution, ...) have a ``type`` and are
    not run by this server: an unknown field refuses them."""

    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None
    # Calls are always held to the schema; the rest are hosted-tool hints: accepted, ignored.
    strict: bool | None = None
    allowed_callers: list[str] | None = None
    defer_loading: bool | None = None
    eager_input_streaming: bool | None = None
    input_examples: list[dict[str, Any]] | None = None


class ToolChoiceAuto(AnthropicModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(AnthropicModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(AnthropicModel):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(AnthropicModel):
    type: Literal["none"]


ToolChoice = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")
]


class ThinkingEnabled(AnthropicModel):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1, le=INT64_MAX)  # not enforced: max_tokens bounds the output


class ThinkingDisabled(AnthropicModel):
    type: Literal["disabled"]


ThinkingConfig = Annotated[ThinkingEnabled | ThinkingDisabled, Field(discriminator="type")]


class JsonOutputFormat(AnthropicModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(AnthropicModel):
    format: JsonOutputFormat | None = None
    effort: str | None = None  # accepted and ignored


class Metadata(AnthropicModel):
    user_id: str | None = None


class PromptRequest(AnthropicModel):
    """What a prompt is rendered from: the fields ``count_tokens`` takes too."""

    model: str
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[TextBlock] | None = None
    tools: Annotated[list[Tool] | None, UniqueToolNames] = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    # Extension: extra variables for the chat template, e.g. {"enable_thinking": false}.
    chat_template_kwargs: TemplateKwargs | None = None


def cache_pin_seconds(body: PromptRequest) -> float | None:
    """The longest ``cache_control`` TTL anywhere in the request, in seconds (None: no
    ``cache_control``): how long its prompt's KV stays pinned."""
    marks: list[CacheControl | None] = [tool.cache_control for tool in body.tools or []]
    if isinstance(body.system, list):
        marks += [block.cache_control for block in body.system]
    for message in body.messages:
        for block in message.content if isinstance(message.content, list) else []:
            marks.append(getattr(block, "cache_control", None))
            if isinstance(block, ToolResultBlock) and isinstance(block.content, list):
                marks += [getattr(part, "cache_control", None) for part in block.content]
    ttls = [CACHE_TTL_SECONDS[mark.ttl] for mark in marks if mark is not None]
    return max(ttls) if ttls else None


class CountTokensRequest(PromptRequest):
    pass


class MessagesRequest(PromptRequest, SamplingExtensions):
    max_tokens: int = Field(ge=1, le=INT64_MAX)
    stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1, le=INT64_MAX)
    stream: bool = False
    output_config: OutputConfig | None = None
    # Accepted and ignored: they do not change the output.
    metadata: Metadata | None = None
    service_tier: str | None = None
    # How tool_choice "auto" replies in the generic tool format (ReplyEnvelopeMode).
    reply_envelope: ReplyEnvelopeMode | None = None
