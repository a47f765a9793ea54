"""The FastAPI application: auth, error mapping, health and metrics; the native and OpenAI
routes live in their own modules.

Every error leaves as ``{"error": {...}}`` (see ``errors``) with its status: 400 for bad input
(naming the field), 401 without the API key, 404 unknown route or model, 413 oversized body,
503 when the scheduler is gone.
"""

from __future__ import annotations

import asyncio
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
from runtime.server import native_api, openai_api, responses_api
from runtime.server.errors import ApiError, ClientGone, error_body, error_response
from runtime.server.openapi import openapi_json
from runtime.server.state import ServerState, get_state

logger = logging.getLogger(__name__)

# Reachable without the API key: load balancers and scrapers probe these.
OPEN_PATHS = frozenset({"/health", "/metrics"})


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="Arbor", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.arbor = state
    if state.args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=state.args.api_key)
    _add_error_handlers(app)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.include_router(native_api.router)
    app.include_router(openai_api.router)
    app.include_router(responses_api.router)
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
    any case, RFC 7235), except OPEN_PATHS. Plain ASGI, so streaming responses and
    disconnects pass through untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.expected):
                body = error_body(401, "Incorrect or missing API key", code="invalid_api_key")
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


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
        return error_response(ApiError(400, str(exc)))

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
