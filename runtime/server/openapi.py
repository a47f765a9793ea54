"""The OpenAPI 3.1 document served at ``GET /openapi.json``.

Handlers read their bodies by hand (``read_json`` + ``parse_model``) so every failure keeps the
API's status and error shape; FastAPI therefore knows the paths but not the bodies. This adds
them: a required ``application/json`` request body from each request model's JSON schema (the
models' definitions under ``components/schemas``) and the responses, 200 or the error body of
``errors.error_body``. Fuzzers (schemathesis) generate requests from it, so it must say exactly
what the server accepts.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from runtime.server.errors import is_messages_api
from runtime.server.messages_protocol import CountTokensRequest, MessagesRequest
from runtime.server.openai_protocol import ChatCompletionRequest, CompletionRequest, OpenAIModel
from runtime.server.protocol import AbortReqInput, GenerateReqInput
from runtime.server.responses_protocol import ResponsesRequest
from runtime.server.state import ServerState

REF_TEMPLATE = "#/components/schemas/{model}"
ERROR_SCHEMA = "Error"
ANTHROPIC_ERROR_SCHEMA = "AnthropicError"  # the Messages API's routes
# POST path -> the model its body must validate against.
REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/generate": GenerateReqInput,
    "/abort_request": AbortReqInput,
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
}
# Routes that answer server-sent events when the body asks for ``stream``.
STREAMING_PATHS = frozenset(
    {"/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"}
)
METRICS = {"type": "string", "description": "Prometheus text format 0.0.4"}
ERROR_STATUSES = {
    "400": "Invalid request: malformed JSON, a bad field (named in 'param'), a bad value",
    "404": "Unknown model",
    "408": "The request body did not arrive within --body-timeout-s",
    "413": "The request body is larger than --max-request-bytes",
}


async def openapi_json(request: Request) -> JSONResponse:
    """``GET /openapi.json``."""
    return JSONResponse(openapi_document(request.app))


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI document, built on first use and cached on ``app.openapi_schema``.
    Precondition: every route is mounted."""
    if app.openapi_schema is None:
        app.openapi_schema = _build(app)
    return app.openapi_schema


def _build(app: FastAPI) -> dict[str, Any]:
    with warnings.catch_warnings():
        # GET and POST /flush_cache share a handler, hence an operationId; renamed below.
        warnings.filterwarnings("ignore", "Duplicate Operation ID", UserWarning)
        document = get_openapi(title=app.title, version=app.version, routes=app.routes)
    served = _served_models(app)
    document.setdefault("components", {})["schemas"] = _schemas(served)
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            _describe(path, method, operation, served)
    return document


def _schemas(served: dict[str, Any]) -> dict[str, Any]:
    """The request models and the error body. FastAPI's own (HTTPValidationError, for a bad
    path parameter's 422) are dropped: the server answers those with 400."""
    schemas = _request_schemas()
    schemas[ERROR_SCHEMA] = _error_schema()
    schemas[ANTHROPIC_ERROR_SCHEMA] = _anthropic_error_schema()
    # The handler's own check (native_api): exactly one of text and input_ids, not null.
    schemas[GenerateReqInput.__name__]["oneOf"] = [
        {"required": [name], "properties": {name: {"not": {"type": "null"}}}}
        for name in ("text", "input_ids")
    ]
    for model in (
        CompletionRequest,
        ChatCompletionRequest,
        ResponsesRequest,
        MessagesRequest,
        CountTokensRequest,
    ):
        schemas[model.__name__]["properties"]["model"] = served
    return schemas


def _describe(path: str, method: str, operation: dict[str, Any], served: dict[str, Any]) -> None:
    """Complete one operation of FastAPI's document in place."""
    operation["operationId"] = f"{method}_{_slug(path)}"
    operation["responses"].pop("422", None)
    for parameter in operation.get("parameters", ()):
        if parameter["name"] == "model":  # GET /v1/models/{model}
            parameter["schema"] = served
    if path == "/metrics":
        operation["responses"]["200"]["content"] = {"text/plain": {"schema": METRICS}}
    model = REQUEST_BODIES.get(path) if method == "post" else None
    if model is not None:
        operation["requestBody"] = _request_body(model)
        error = ANTHROPIC_ERROR_SCHEMA if is_messages_api(path) else ERROR_SCHEMA
        operation["responses"] = _responses(path in STREAMING_PATHS, error)


def _served_models(app: FastAPI) -> dict[str, Any]:
    """The ``model`` values the OpenAI routes accept (any other is a 404)."""
    state: ServerState = app.state.arbor
    args = state.args
    names = list(dict.fromkeys([args.model_name, args.model_path]))
    return {"type": "string", "enum": names, "description": "The served model's name or path"}


def _request_schemas() -> dict[str, Any]:
    """Each request model's JSON schema and the definitions they use, keyed by name."""
    models: list[tuple[type[BaseModel], JsonSchemaMode]] = [
        (model, "validation") for model in REQUEST_BODIES.values()
    ]
    _, top = models_json_schema(models, ref_template=REF_TEMPLATE)
    schemas: dict[str, Any] = top.get("$defs", {})
    for name, schema in schemas.items():
        if _null_means_default(name):
            _admit_null_for_defaults(schema)
    return schemas


def _null_means_default(name: str) -> bool:
    """True for the OpenAI models, which read ``null`` in a field with a default as the
    default (as OpenAI's API does)."""
    pending: list[type[BaseModel]] = [OpenAIModel]
    while pending:
        model = pending.pop()
        if model.__name__ == name:
            return hasattr(model, "_null_is_default")
        pending.extend(model.__subclasses__())
    return False


def _admit_null_for_defaults(schema: dict[str, Any]) -> None:
    required = set(schema.get("required", ()))
    properties: dict[str, Any] = schema.get("properties", {})
    for name, prop in properties.items():
        if name not in required and not _admits_null(prop):
            properties[name] = {"anyOf": [prop, {"type": "null"}]}


def _admits_null(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    if kind == "null" or (isinstance(kind, list) and "null" in kind):
        return True
    return any(_admits_null(option) for option in schema.get("anyOf", ()))


def _request_body(model: type[BaseModel]) -> dict[str, Any]:
    reference = {"$ref": REF_TEMPLATE.format(model=model.__name__)}
    return {"required": True, "content": {"application/json": {"schema": reference}}}


def _responses(streaming: bool, error_schema: str) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": {}}}
    if streaming:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    responses: dict[str, Any] = {"200": {"description": "Successful Response", "content": content}}
    error = {"schema": {"$ref": REF_TEMPLATE.format(model=error_schema)}}
    for status, description in ERROR_STATUSES.items():
        responses[status] = {"description": description, "content": {"application/json": error}}
    return responses


def _error_schema() -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``, as ``errors.error_body`` writes."""
    nullable_string = {"type": ["string", "null"]}
    detail = {
        "type": "object",
        "properties": {
            "message": {"type": "string", "minLength": 1},
            "type": {"type": "string"},
            "param": nullable_string,
            "code": nullable_string,
        },
        "required": ["message", "type", "param", "code"],
    }
    return {
        "title": ERROR_SCHEMA,
        "type": "object",
        "properties": {"error": detail},
        "required": ["error"],
    }


def _anthropic_error_schema() -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}``, as
    ``errors.anthropic_error_body`` writes."""
    detail = {
        "type": "object",
        "properties": {
            "type": {"type": "string"},
            "message": {"type": "string", "minLength": 1},
        },
        "required": ["type", "message"],
    }
    return {
        "title": ANTHROPIC_ERROR_SCHEMA,
        "type": "object",
        "properties": {"type": {"const": "error"}, "error": detail},
        "required": ["type", "error"],
    }


def _slug(path: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", path).strip("_")
