"""A chat turn as every API asks for it: what each API's adapter builds from its request."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

ToolMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolChoice:
    """How the turn may call tools: ``mode`` none (the tools are not shown), auto (calls or
    an answer), required (some call) or named (that one); ``names``: the tools it may call
    (named: the one)."""

    mode: ToolMode
    names: frozenset[str] = frozenset()

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


@dataclass(frozen=True)
class TurnSpec:
    """One turn, API-neutral.

    ``messages``: chat messages as the template reads them; ``tools``: function definitions
    (``{"name", "description", "parameters"}``); ``answer``: the answer format's sampling
    params (``json_schema`` / ``json_object``; empty: text); ``sampling``: the request's own
    sampling params (by SamplingParams' names, ``max_new_tokens`` included);
    ``output_limit``: the output tokens the client asked for (checked against the room the
    prompt leaves; None: not asked); ``routing_key``: the client's cache-affinity key
    (OpenAI's ``prompt_cache_key``: a ``--dp`` router keeps one key's turns on one replica);
    ``reply_envelope``: the generic format's auto mode
    (``runtime.chat.generic_tools.reply_envelope``); ``template_variables``: extra chat
    template variables; ``param_names``: sampling param (and ``answer``) -> the API's name for
    the field, for errors; ``continue_final``: the reply continues the final message, an
    assistant turn (``runtime.chat.continuation``); ``generation_prompt``: the prompt ends with
    the template's generation prompt (False: vLLM's ``add_generation_prompt: false``);
    ``pin_ttl_s``: the client's prompt-caching hint (Anthropic's ``cache_control``, OpenAI's
    ``prompt_cache_retention``) as seconds to keep the prompt's KV cached after the turn (None:
    no hint, plain LRU).
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    tool_choice: ToolChoice
    sampling: dict[str, Any]
    answer: dict[str, Any] = field(default_factory=dict)
    max_tool_calls: int | None = None  # 1: no parallel calls
    output_limit: int | None = None
    cache_salt: str | None = None
    routing_key: str | None = None
    reply_envelope: str | None = None
    template_variables: dict[str, Any] = field(default_factory=dict)
    param_names: Mapping[str, str] = field(default_factory=dict)
    continue_final: bool = False
    generation_prompt: bool = True
    pin_ttl_s: float | None = None

    @property
    def tools_on(self) -> bool:
        return bool(self.tools) and self.tool_choice.mode != "none"

    @property
    def parallel(self) -> bool:
        return self.max_tool_calls != 1

    @property
    def callable_tools(self) -> list[dict[str, Any]]:
        return [tool for tool in self.tools if tool["name"] in self.tool_choice.names]

    def param(self, name: str) -> str:
        """The API's name for sampling param (or turn field) ``name``."""
        return self.param_names.get(name, name)
