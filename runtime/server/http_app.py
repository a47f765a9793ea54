"""The FastAPI application: auth, error mapping, health and metrics; the native and OpenAI
routes live in their own modules.

Every error leaves as ``{"error": {...}}`` (see ``errors``) with its status: 400 for bad input
(naming the field), 401 without the API key, 404 unknown route or model, 413 oversized body,
503 when the scheduler is gone.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.errors import RequestError, SchedulerDied
from runtime.request_checks import InvalidRequestValue
from runtime.sampling_params import InvalidSamplingParams
from runtime.server import (
    cache_tree,
    dashboard,
    native_api,
    openai_api,
    program_api,
    responses_api,
)
from runtime.server.errors import ApiError, ClientGone, error_body, error_response
from runtime.server.openapi import openapi_json
from runtime.server.state import ServerState, get_state

logger = logging.getLogger(__name__)

# Reachable without the API key: load balancers and scrapers probe these.
OPEN_PATHS = frozenset({"/health", "/metrics"})
# Read-only pages a browser opens, which also take the API key as the password of HTTP Basic
# credentials (any user name): a browser cannot add a Bearer header to a page it navigates
# to, but it asks for Basic credentials and sends them on by itself. GET only, so a site that
# makes a browser send them (the browser does so for any site) can change nothing.
BROWSER_PATH_PREFIXES = ("/dashboard", "/cache_tree")


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="Arbor", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.arbor = state
    if state.args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=state.args.api_key)
    _add_error_handlers(app)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.include_router(native_api.router)
    app.include_router(program_api.router)
    app.include_router(openai_api.router)
    app.include_router(responses_api.router)
    app.include_router(cache_tree.router)
    app.include_router(dashboard.router)
    app.state.dashboard_feed = dashboard.DashboardFeed(state)
    app.add_api_route("/openapi.json", openapi_json, methods=["GET"], include_in_schema=False)
    return app


async def health(request: Request) -> Response:
    """200 once the scheduler has loaded the model and is running; 503 before and after."""
    manager = get_state(request).tokenizer_manager
    if manager.dead:
        return JSONResponse({"status": "dead", "error": manager.dead}, status_code=503)
    if not manager.ready.is_set():
        return JSONResponse({"status": "starting"}, status_code=503)
    if not manager.serving:  # a routed server whose replicas are all down (restarting)
        return JSONResponse({"status": "no replica serving"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    state = get_state(request)
    scheduler_info: dict[str, Any] | None = None
    if state.tokenizer_manager.ready.is_set() and not state.tokenizer_manager.dead:
        try:
            scheduler_info = await state.tokenizer_manager.control("server_info", timeout=5.0)
        except (asyncio.TimeoutError, SchedulerDied):
            scheduler_info = None
    return PlainTextResponse(
        state.metrics.render(scheduler_info), media_type="text/plain; version=0.0.4"
    )


class ApiKeyMiddleware:
    """Refuse (401) every request without ``Authorization: Bearer <api_key>`` (the scheme in
    any case, RFC 7235), except OPEN_PATHS; GETs of BROWSER_PATH_PREFIXES also take
    ``Authorization: Basic`` with the key as password, and their 401 asks a browser for it.
    Plain ASGI, so streaming responses and disconnects pass through untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            browser = scope["method"] == "GET" and _is_browser_path(scope["path"])
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            scheme = scheme.lower()
            if scheme == b"basic" and browser:
                given = _basic_password(given.strip())
            elif scheme != b"bearer":
                given = b""
            if not given or not hmac.compare_digest(given.strip(), self.expected):
                body = error_body(401, "Incorrect or missing API key", code="invalid_api_key")
                challenge = {"WWW-Authenticate": 'Basic realm="Arbor", charset="UTF-8"'}
                headers = challenge if browser else None
                await JSONResponse(body, status_code=401, headers=headers)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _is_browser_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in BROWSER_PATH_PREFIXES)


def _basic_password(credentials: bytes) -> bytes:
    """The password of ``base64(user:password)``; empty if malformed."""
    try:
        decoded = base64.b64decode(credentials, validate=True)
    except (binascii.Error, ValueError):
        return b""
    return decoded.partition(b":")[2]


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> Response:
        return error_response(exc)

    @app.exception_handler(InvalidSamplingParams)
    async def _invalid_params(_: Request, exc: InvalidSamplingParams) -> Response:
        return error_response(ApiError(400, str(exc), param=f"sampling_params.{exc.field}"))

    @app.exception_handler(InvalidRequestValue)
    async def _invalid_value(_: Request, exc: InvalidRequestValue) -> Response:
        return error_response(ApiError(400, str(exc), param=exc.field or None))

    @app.exception_handler(RequestError)
    async def _refused(request: Request, exc: RequestError) -> Response:
        param = None if exc.param is None else _param_name(request.url.path, exc.param)
        return error_response(ApiError(exc.status_code, str(exc), param=param))

    @app.exception_handler(SchedulerDied)
    async def _dead(_: Request, exc: SchedulerDied) -> Response:
        return error_response(ApiError(503, str(exc)))

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the client closed the connection

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        return error_response(ApiError(exc.status_code, str(exc.detail)))

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        # A bad query or path parameter (bodies are parsed by the handlers): name it.
        errors = exc.errors()
        fields = [".".join(str(part) for part in error["loc"][1:]) for error in errors]
        message = "; ".join(f"{f}: {error['msg']}" for f, error in zip(fields, errors, strict=True))
        return error_response(
            ApiError(400, message or str(exc), param=fields[0] if fields else None)
        )

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in a request handler")
        return error_response(ApiError(500, "internal error; the server log has details"))


def _param_name(path: str, param: str) -> str:
    """The request field a runtime error about sampling parameter ``param`` names, as the
    route's API spells it."""
    if path.startswith("/v1/responses"):
        return responses_api.PARAM_NAMES.get(param, param)
    if path.startswith("/v1/"):
        return openai_api.PARAM_NAMES.get(param, param)
    return f"sampling_params.{param}"
