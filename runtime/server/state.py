"""What every HTTP handler of one server shares, and how it runs the sub-requests it makes.

A handler turns its body into ``SubRequest``s (one per prompt and per sample of ``n``,
``runtime/generate_input.py``) and runs them with ``open_streams``; every sub-request goes
through the metrics.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from runtime.api_keys import tenant_cache_salt
from runtime.chat.generated_turns import GeneratedTurns
from runtime.chat.generic_tools import template_renders_tools
from runtime.chat.tool_call_formats import resolve_format
from runtime.chat.tool_decision import ToolDecider
from runtime.generate_input import SubRequest
from runtime.heartbeat import Heartbeat
from runtime.program.executor import ProgramRunner
from runtime.request_checks import check_cache_salt
from runtime.role_blocks import role_blocks_or_why
from runtime.server.errors import ApiError
from runtime.server.metrics import ServerMetrics
from runtime.server.request_body import read_json
from runtime.server.responses_store import ResponseStore
from runtime.server.token_text import TokenText
from runtime.server.tracing import SpanSink, open_span_sink
from runtime.server_args import ServerArgs
from runtime.tokenizer_manager import RequestOutput, TokenizerManager
from runtime.validate_retry import ValidatedGeneration

Body = TypeVar("Body", bound=BaseModel)


@dataclass
class ServerState:
    args: ServerArgs
    tokenizer: Any
    tokenizer_manager: TokenizerManager
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    # Process facts for /get_server_info: scheduler_pid, detokenizer_pid, ipc_dir.
    process_info: dict[str, Any] = field(default_factory=dict)
    # The scheduler process's heartbeat (/health); None where no scheduler runs in a process
    # of this server's own (a routed server's replicas).
    scheduler_heartbeat: Heartbeat | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.token_text = TokenText(self.tokenizer)
        self.responses = ResponseStore(self.args.responses_store_size)
        # The tool-call format of chat completions and responses (hermes, llama3, mistral or
        # generic), resolved once: --tool-call-parser, else generic for a template that does
        # not render tools, else what the chat template writes.
        self.tool_call_format = resolve_format(
            self.args.tool_call_parser,
            getattr(self.tokenizer, "chat_template", None),
            self.args.tool_call_parser is not None or template_renders_tools(self.tokenizer),
        )
        # Generated ids of tool-calling turns, spliced into prompts that re-send them.
        self.generated_turns = GeneratedTurns(self.tokenizer)
        self._role_blocks: dict[str, Any] | None = None
        self.generation = ValidatedGeneration(self.tokenizer_manager, self.args)
        # The generic format's call-or-answer decision under auto (calibrated on first use).
        self.tool_decider = ToolDecider()
        # Where request spans go with --otlp-traces-endpoint (None: tracing is off).
        self.tracing: SpanSink | None = open_span_sink(self.args.otlp_traces_endpoint)
        self.programs = ProgramRunner(
            self.generation, self.args.program_pin_timeout_s, self.args.max_programs_per_tenant
        )

    def close(self) -> None:
        """At shutdown: stop validate-and-retry's workers and send the spans still queued."""
        self.generation.close()
        if self.tracing is not None:
            self.tracing.shutdown()

    def role_blocks(self) -> dict[str, Any]:
        """For /get_model_info: the chat template's role blocks, which DSL clients render role
        blocks with (``chat_template_blocks``), or why there are none (``chat_template_error``).
        Derived once (a few renders of the template)."""
        if self._role_blocks is None:
            blocks = role_blocks_or_why(self.tokenizer)
            self._role_blocks = (
                {"chat_template_error": blocks}
                if isinstance(blocks, str)
                else {"chat_template_blocks": blocks.to_json()}
            )
        return self._role_blocks

    @property
    def context_length(self) -> int:
        """Known once the scheduler is ready (its SchedulerReady carries it)."""
        return int(self.tokenizer_manager.server_info.get("context_length", 0))

    async def read_body(self, request: Request) -> Any:
        """The request's JSON body under this server's size, time and nesting limits."""
        return await read_json(request, self.args.max_request_bytes, self.args.body_timeout_s)

    def require_ready(self) -> None:
        """ApiError 503 until the scheduler has loaded the model (as /health reports)."""
        if not self.tokenizer_manager.ready.is_set():
            raise ApiError(503, "the model is still loading; wait for /health to answer 200")


def get_state(request: Request) -> ServerState:
    return request.app.state.arbor


# Set in each HTTP scope by the API key middleware (runtime/server/http_app.py): whether the
# caller holds the admin key. Without --admin-api-key nobody is set apart and every caller the
# API key lets in is the admin, as when no middleware runs.
ADMIN_SCOPE_KEY = "arbor.admin"


def caller_is_admin(request: Request) -> bool:
    """Whether the caller may see what ``--admin-api-key`` guards."""
    return bool(request.scope.get(ADMIN_SCOPE_KEY, True))


# Set in each HTTP scope by the API key middleware: the caller's tenant with --api-keys-file
# (None for the admin key, and on a server without a keys file, where callers have no tenant).
TENANT_SCOPE_KEY = "arbor.tenant"


def tenant_of(request: Request) -> str | None:
    """The caller's tenant (``ServerArgs.tenant_keys``); None where it has none."""
    tenant = request.scope.get(TENANT_SCOPE_KEY)
    return tenant if isinstance(tenant, str) else None


def caller_of(request: Request) -> str:
    """Which key the caller holds, as far as what it owns goes: programs, request ids and stored
    responses belong to a caller and a cache salt, and no other caller or salt finds them.
    With ``--api-keys-file`` each tenant is a caller of its own. With ``--admin-api-key`` the
    admin and everyone else are apart; otherwise every caller the API key lets in is one."""
    tenant = tenant_of(request)
    if tenant is not None:
        return f"tenant:{tenant}"
    return "admin" if caller_is_admin(request) else "api-key"


def tenant_salt(request: Request, salt: str | None) -> str | None:
    """The cache salt the scheduler sees for the caller's ``salt`` (checked already): the salt
    itself for a caller without a tenant; for a tenant's, ``tenant_cache_salt`` (the tenant's
    label and a hash of the tenant and the salt), so that tenants never share cached KV or
    request ids, whatever salts they send."""
    tenant = tenant_of(request)
    return salt if tenant is None else tenant_cache_salt(tenant, salt)


def tenant_body(request: Request, body: Body) -> Body:
    """``body`` with its ``cache_salt`` field (if it has one) as ``tenant_salt`` gives it."""
    if tenant_of(request) is None or "cache_salt" not in type(body).model_fields:
        return body
    salt = getattr(body, "cache_salt", None)  # a field of some bodies, not of every Body
    return body.model_copy(update={"cache_salt": tenant_salt(request, salt)})


def query_salt(request: Request) -> str | None:
    """The caller's ``cache_salt`` query parameter of a GET or DELETE (its body-less routes),
    checked as the body field is (InvalidRequestValue, a 400 naming it), as ``tenant_salt``
    gives it to the scheduler."""
    salt = request.query_params.get("cache_salt")
    check_cache_salt(salt)
    return tenant_salt(request, salt)


def open_streams(
    state: ServerState, subs: list[SubRequest], request: Request
) -> list[AsyncIterator[RequestOutput]]:
    """One result stream per sub-request, each yielding a chunk per output step (so the metrics
    see time to first token and inter-token latency even for non-streaming clients), counted
    for the caller's tenant too."""
    tenant = tenant_of(request)
    return [state.metrics.observe(sub.run(state.generation, stream=True), tenant) for sub in subs]
