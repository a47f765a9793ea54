"""The FastAPI application: auth, error mapping, health and metrics; the native and OpenAI
routes live in their own modules.

Every error leaves as ``{"error": {...}}`` (on the Messages API's routes, Anthropic's
``{"type": "error", "error": {...}}``; see ``errors``) with its status: 400 for bad input
(naming the field), 401 without the API key, 403 for the API key on an admin route (with
``--admin-api-key``), 404 unknown route or model, 413 oversized body, 503 when the scheduler is
gone. /health is in ``health``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.errors import RequestError, SchedulerDied
from runtime.ipc import ControlCommand
from runtime.request_checks import InvalidRequestValue
from runtime.sampling_params import InvalidSamplingParams
from runtime.server import (
    cache_tree,
    dashboard,
    health,
    messages_api,
    native_api,
    openai_api,
    program_api,
    responses_api,
)
from runtime.server.errors import (
    ApiError,
    ClientGone,
    error_body_for,
    error_response,
    is_messages_api,
)
from runtime.server.openapi import openapi_json
from runtime.server.state import ADMIN_SCOPE_KEY, TENANT_SCOPE_KEY, ServerState, get_state
from runtime.server.tracing import TracingMiddleware

logger = logging.getLogger(__name__)

# Reachable without the API key: load balancers and scrapers probe these.
OPEN_PATHS = frozenset({"/health", "/metrics"})
# Read-only pages a browser opens, which also take the API key as the password of HTTP Basic
# credentials (any user name): a browser cannot add a Bearer header to a page it navigates
# to, but it asks for Basic credentials and sends them on by itself. GET only, so a site that
# makes a browser send them (the browser does so for any site) can change nothing.
BROWSER_PATH_PREFIXES = ("/dashboard", "/cache_tree")
# Routes that show cached prompt text (which holds every tenant's prompts) or change the cache
# for everyone: with --admin-api-key only that key opens them. /get_server_info is open to the
# API key but shows its process details only to the admin (native_api.get_server_info).
ADMIN_PATH_PREFIXES = ("/dashboard", "/cache_tree", "/flush_cache")


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="Arbor", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.arbor = state
    if state.args.api_key or state.args.admin_api_key or state.args.api_keys_file:
        app.add_middleware(
            ApiKeyMiddleware,
            api_key=state.args.api_key,
            admin_api_key=state.args.admin_api_key,
            tenant_keys=state.args.tenant_keys(),
        )
    if state.tracing is not None:  # outermost: the span covers the whole exchange
        app.add_middleware(TracingMiddleware, sink=state.tracing)
    _add_error_handlers(app)
    app.add_api_route("/health", health.health, methods=["GET"])
    app.state.deep_probe = health.DeepProbe()
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.include_router(native_api.router)
    app.include_router(program_api.router)
    app.include_router(openai_api.router)
    app.include_router(responses_api.router)
    app.include_router(messages_api.router)
    app.include_router(cache_tree.router)
    app.include_router(dashboard.router)
    app.state.dashboard_feed = dashboard.DashboardFeed(state)
    app.add_api_route("/openapi.json", openapi_json, methods=["GET"], include_in_schema=False)
    return app


async def metrics(request: Request) -> Response:
    state = get_state(request)
    scheduler_info: dict[str, Any] | None = None
    if state.tokenizer_manager.ready.is_set() and not state.tokenizer_manager.dead:
        try:
            scheduler_info = await state.tokenizer_manager.control(
                ControlCommand.SERVER_INFO, timeout=5.0
            )
        except (asyncio.TimeoutError, SchedulerDied):
            scheduler_info = None
    text = state.metrics.render(scheduler_info, state.tool_decider.sources)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


class ApiKeyMiddleware:
    """Refuse (401) every request without ``Authorization: Bearer <key>`` (the scheme in any
    case, RFC 7235) or ``x-api-key: <key>``, except OPEN_PATHS; GETs of
    BROWSER_PATH_PREFIXES also take ``Authorization: Basic`` with the key as password, and
    their 401 asks a browser for it.

    Keys: ``api_key`` opens every route (none: they are open); ``tenant_keys``
    (``{key: tenant}``, ``ServerArgs.tenant_keys``), when given, are the API keys instead, and
    no API key is then the admin. ``admin_api_key``, when given, opens every route too and is
    the only key that opens ADMIN_PATH_PREFIXES: an API key gets a 403 there, as it does with
    ``tenant_keys`` and no admin key. Each HTTP scope gets ADMIN_SCOPE_KEY and TENANT_SCOPE_KEY
    (the caller's tenant; None for the admin and on a server without tenants). Plain ASGI, so
    streaming responses and disconnects pass through untouched."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        admin_api_key: str | None,
        tenant_keys: Mapping[str, str] | None = None,
    ) -> None:
        self.app = app
        keys: Mapping[str, str | None] = {api_key: None} if api_key else {}
        if tenant_keys is not None:
            keys = tenant_keys
        # By the key's SHA-256: a dict lookup then tells a timing observer nothing of the key.
        self.tenant_of = {_digest(key.encode()): tenant for key, tenant in keys.items()}
        self.admin_key = admin_api_key.encode() if admin_api_key else None
        self.admin_routes_guarded = self.admin_key is not None or tenant_keys is not None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        browser = scope["method"] == "GET" and _is_path_under(path, BROWSER_PATH_PREFIXES)
        given = _credential(scope, browser)
        has_admin_key = self.admin_key is not None and _matches(given, self.admin_key)
        digest = _digest(given) if given else b""
        has_api_key = digest in self.tenant_of
        allowed = has_admin_key or has_api_key or not self.tenant_of
        scope[ADMIN_SCOPE_KEY] = has_admin_key or (not self.admin_routes_guarded and allowed)
        scope[TENANT_SCOPE_KEY] = self.tenant_of.get(digest) if has_api_key else None
        if path in OPEN_PATHS:
            await self.app(scope, receive, send)
        elif (
            self.admin_routes_guarded
            and not has_admin_key
            and _is_path_under(path, ADMIN_PATH_PREFIXES)
        ):
            if has_api_key:
                message = "this route needs the admin key"
                body = error_body_for(path, 403, message, code="admin_key_required")
                await JSONResponse(body, status_code=403)(scope, receive, send)
            else:
                await _refuse(scope, receive, send, browser)
        elif not allowed:
            await _refuse(scope, receive, send, browser)
        else:
            await self.app(scope, receive, send)


async def _refuse(scope: Scope, receive: Receive, send: Send, browser: bool) -> None:
    """401; a browser's page is asked for Basic credentials."""
    message = "Incorrect or missing API key"
    body = error_body_for(scope["path"], 401, message, code="invalid_api_key")
    challenge = {"WWW-Authenticate": 'Basic realm="Arbor", charset="UTF-8"'}
    await JSONResponse(body, status_code=401, headers=challenge if browser else None)(
        scope, receive, send
    )


def _credential(scope: Scope, browser: bool) -> bytes:
    """The key the request gives: a Bearer token, else the ``x-api-key`` header (Anthropic's
    clients send it), or on a browser path the password of Basic credentials; empty if
    none."""
    headers = dict(scope["headers"])
    scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
    scheme = scheme.lower()
    if scheme == b"basic" and browser:
        return _basic_password(given.strip())
    if scheme == b"bearer":
        return given.strip()
    return headers.get(b"x-api-key", b"").strip()


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def _matches(given: bytes, key: bytes) -> bool:
    return bool(given) and hmac.compare_digest(given, key)


def _is_path_under(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path == p or path.startswith(p + "/") for p in prefixes)


def _basic_password(credentials: bytes) -> bytes:
    """The password of ``base64(user:password)``; empty if malformed."""
    try:
        decoded = base64.b64decode(credentials, validate=True)
    except (binascii.Error, ValueError):
        return b""
    return decoded.partition(b":")[2]


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return error_response(exc, request.url.path)

    @app.exception_handler(InvalidSamplingParams)
    async def _invalid_params(request: Request, exc: InvalidSamplingParams) -> Response:
        error = ApiError(400, str(exc), param=f"sampling_params.{exc.field}")
        return error_response(error, request.url.path)

    @app.exception_handler(InvalidRequestValue)
    async def _invalid_value(request: Request, exc: InvalidRequestValue) -> Response:
        return error_response(ApiError(400, str(exc), param=exc.field or None), request.url.path)

    @app.exception_handler(RequestError)
    async def _refused(request: Request, exc: RequestError) -> Response:
        path = request.url.path
        param = None if exc.param is None else _param_name(path, exc.param)
        message = str(exc)
        if is_messages_api(path) and param is not None and param not in message:
            message = f"{param}: {message}"  # Anthropic's errors name the field in the message
        return error_response(ApiError(exc.status_code, message, param=param), path)

    @app.exception_handler(SchedulerDied)
    async def _dead(request: Request, exc: SchedulerDied) -> Response:
        return error_response(ApiError(503, str(exc)), request.url.path)

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the client closed the connection

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(ApiError(exc.status_code, str(exc.detail)), request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        # A bad query or path parameter (bodies are parsed by the handlers): name it.
        errors = exc.errors()
        fields = [".".join(str(part) for part in error["loc"][1:]) for error in errors]
        message = "; ".join(f"{f}: {error['msg']}" for f, error in zip(fields, errors, strict=True))
        error = ApiError(400, message or str(exc), param=fields[0] if fields else None)
        return error_response(error, request.url.path)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in a request handler")
        error = ApiError(500, "internal error; the server log has details")
        return error_response(error, request.url.path)


def _param_name(path: str, param: str) -> str:
    """The request field a runtime error about sampling parameter ``param`` names, as the
    route's API spells it."""
    if path.startswith("/v1/responses"):
        return responses_api.PARAM_NAMES.get(param, param)
    if is_messages_api(path):
        return messages_api.PARAM_NAMES.get(param, param)
    if path.startswith("/v1/"):
        return openai_api.PARAM_NAMES.get(param, param)
    return f"sampling_params.{param}"
