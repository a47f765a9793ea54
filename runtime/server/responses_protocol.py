"""Request bodies of the Responses API (``POST /v1/responses``).

``input`` is a string or a list of items: messages (``{"role", "content"}``, with or without
``"type": "message"``), ``function_call``, ``function_call_output``, ``reasoning`` and
``item_reference``. Items are kept as dicts here and checked one by one when they are turned
into chat messages (``responses_input``), so an error names the item's index.

Fields the runtime cannot honour (``background``, ``conversation``, ``prompt``,
``context_management``) are refused by name; the caller's fields (``ClientFields``:
``metadata``, ``prompt_cache_key``, ``safety_identifier``, ...) are checked as chat checks them,
accepted and echoed, as are ``include`` values other than logprobs; an ``include`` value
OpenAI does not define is refused. ``prompt_cache_retention`` pins the prompt's KV as in chat
completions (``openai_protocol``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from runtime.request_checks import INT64_MAX, CacheSalt
from runtime.server.openai_protocol import (
    ClientFields,
    OpenAIModel,
    PromptCacheRetention,
    ReasoningEffort,
    ReplyEnvelopeMode,
    SamplingExtensions,
    TemplateKwargs,
    ToolName,
    UniqueToolNames,
    Verbosity,
)

MAX_INPUT_ITEMS = 4096
# What ``include`` may ask for (OpenAI's values). Only the logprobs change what this server
# answers; the others name outputs of hosted tools or encrypted reasoning, which it has none of.
IncludeValue = Literal[
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "code_interpreter_call.outputs",
]


class FunctionTool(OpenAIModel):
    """A function the model may call. Other tool types (web_search, file_search, mcp, ...)
    are hosted tools this server does not run; they are refused by ``type``."""

    type: str
    name: ToolName | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(OpenAIModel):
    type: Literal["function"]
    name: str


class AllowedToolsChoice(OpenAIModel):
    """Restrict the model to some of the tools, in ``auto`` or ``required`` mode."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]]


class TextFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIModel):
    format: TextFormat | None = None
    verbosity: Verbosity | None = None  # accepted and echoed: the length is not graded


class ReasoningConfig(OpenAIModel):
    effort: ReasoningEffort | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponseStreamOptions(OpenAIModel):
    include_obfuscation: bool | None = None  # nothing to obfuscate: accepted and ignored


class ResponsesRequest(OpenAIModel, ClientFields, SamplingExtensions):
    model: str
    input: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_INPUT_ITEMS)]
    instructions: str | None = None
    tools: Annotated[list[FunctionTool] | None, UniqueToolNames] = None
    tool_choice: (
        Literal["none", "auto", "required"] | FunctionToolChoice | AllowedToolsChoice | None
    ) = None
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = Field(None, ge=1, le=INT64_MAX)
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    stream_options: ResponseStreamOptions | None = None
    include: list[IncludeValue] | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["disabled", "auto"] | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    # Pins the prompt's KV in the radix cache: in-memory for 5 minutes, 24h for a day.
    prompt_cache_retention: PromptCacheRetention | None = None
    # Accepted and ignored.
    prompt_cache_options: dict[str, Any] | None = None
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    stop: str | list[str] | None = None
    # How tool_choice "auto" replies in the generic tool format (ReplyEnvelopeMode).
    reply_envelope: ReplyEnvelopeMode | None = None
    # Extra variables for the chat template, e.g. {"enable_thinking": false}.
    chat_template_kwargs: TemplateKwargs | None = None


class InputItemsQuery(BaseModel):
    """Query parameters of ``GET /v1/responses/{id}/input_items``."""

    model_config = ConfigDict(extra="forbid")

    limit: int = Field(20, ge=1, le=100)
    order: Literal["asc", "desc"] = "desc"
    after: str | None = None
    cache_salt: CacheSalt | None = None  # whose response (runtime.server.state.query_salt)
